"""The benchmark's models: random-weight Llama-3.2-1B and Llama-3-8B shapes (and a tiny one), the MoE shapes of
OLMoE-1B-7B ("olmoe") and Qwen3-30B-A3B ("qwen3moe"), DeepSeek-V2-Lite ("v2lite"), their HF checkpoints and the bundles
built from them.

Qwen3-30B-A3B's 48 layers are 61 GB of bf16 weights, more than the GPU machine's disk holds twice (checkpoint
and bundle): "qwen3moe" has its first 16 layers (a third of the model; per-layer figures are the model's,
whole-model ones a third), "qwen3moe48" all of them for a machine with the room, "qwen3moe4" four (profiles);
"olmoe4" is OLMoE's first four layers, for the same.

A shape name may carry build variants after its base: "-kv8" / "-kvfp8" build with --kv-cache int8 / fp8,
"-fp8" with --quant fp8 (W8A8 projections); these share the base shape's checkpoint. "-int4" is a random
AutoAWQ-GEMM int4 g128 checkpoint of that shape (its own folder; an MoE shape's experts per expert, as AWQ
MoE checkpoints have them), which `engc build` repacks as it would a real one; "-int4-qhead" has its lm_head in
int4 too (as `engc quantize --lm-head` writes it). "-32k" raises max_position_embeddings for a 32,768-token prompt
and its decode steps (gpu_bench's long-context figures); its folder links the base checkpoint's weights. "-tp2"
(any "-tp<N>") builds with --tp N and runs its ranks on N GPUs.
"""
from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, vocab_size=512),
    # mixture-of-experts: hf_config adds each family's config keys (MOE_FAMILY)
    "olmoe": dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=16, head_dim=128, tie_word_embeddings=False, vocab_size=50304,
                  num_experts=64, num_experts_per_tok=8),
    "qwen3moe": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                     vocab_size=151936, num_experts=128, num_experts_per_tok=8),
    "qwen3moe48": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                       vocab_size=151936, num_experts=128, num_experts_per_tok=8),
}
MOE_FAMILY = {   # shape -> the family's own config keys
    "olmoe": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", norm_topk_prob=False,
                  rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  bos_token_id=None, eos_token_id=50279),
    "qwen3moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", norm_topk_prob=True,
                     rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=8192, rms_norm_eps=1e-6,
                     decoder_sparse_step=1, mlp_only_layers=[], bos_token_id=None, eos_token_id=151645),
}
# four layers: per-layer kernel profiles and tile A/B runs without a 20 GB (or 13 GB) checkpoint
SHAPES["qwen3moe4"] = dict(SHAPES["qwen3moe"], num_hidden_layers=4)
SHAPES["olmoe4"] = dict(SHAPES["olmoe"], num_hidden_layers=4)
MOE_FAMILY["qwen3moe48"] = MOE_FAMILY["qwen3moe4"] = MOE_FAMILY["qwen3moe"]
MOE_FAMILY["olmoe4"] = MOE_FAMILY["olmoe"]
KV_VARIANTS = {"kv8": "int8", "kvfp8": "fp8"}   # shape suffix -> --kv-cache
INT4_GROUP = 128
LONG_CONTEXT = {"32k": 32768}   # shape suffix -> the long-context figures' prompt tokens


def base_shape(shape: str) -> str:
    return shape.split("-")[0]


def _variants(shape: str) -> list[str]:
    return shape.split("-")[1:]


def kv_cache_of(shape: str) -> str:
    return next((KV_VARIANTS[v] for v in _variants(shape) if v in KV_VARIANTS), "auto")


def is_int4(shape: str) -> bool:
    """An "-int4" variant: its checkpoint is AutoAWQ GEMM int4, group size INT4_GROUP."""
    return "int4" in _variants(shape)


def is_int4_head(shape: str) -> bool:
    """An "-int4-qhead" variant: the int4 checkpoint's lm_head is int4 too (GPTQModel's lm_head quantization)."""
    return is_int4(shape) and "qhead" in _variants(shape)


def quant_of(shape: str) -> str:
    """--quant of a shape: "fp8" for an "-fp8" variant (W8A8 projections), else "auto"."""
    return "fp8" if "fp8" in _variants(shape) else "auto"


def tp_of(shape: str) -> int:
    """The tensor-parallel ranks of a "-tp<N>" variant, else 1."""
    return next((int(v[2:]) for v in _variants(shape) if v.startswith("tp") and v[2:].isdigit()), 1)


def long_context_of(shape: str) -> int:
    """The prompt tokens of a long-context variant ("-32k"), else 0."""
    return next((LONG_CONTEXT[v] for v in _variants(shape) if v in LONG_CONTEXT), 0)


def is_variant(shape: str) -> bool:
    """Built differently from its base shape (another KV cache, quantization, checkpoint or context)."""
    return (kv_cache_of(shape) != "auto" or quant_of(shape) != "auto" or is_int4(shape) or bool(long_context_of(shape))
            or tp_of(shape) > 1)


def is_deepseek(shape: str) -> bool:
    """"v2lite": DeepSeek-V2-Lite, all 27 layers; "v2lite<N>": its first N layers (a smaller disk)."""
    return base_shape(shape).startswith("v2lite")


def _deepseek_layers(shape: str) -> int:
    return int(base_shape(shape)[len("v2lite"):] or DEEPSEEK_V2_LITE["num_hidden_layers"])


def hf_config(shape: str) -> dict:
    if is_deepseek(shape):
        return dict(DEEPSEEK_V2_LITE, num_hidden_layers=_deepseek_layers(shape))
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
               bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg.update(SHAPES[base_shape(shape)])
    cfg.update(MOE_FAMILY.get(base_shape(shape), {}))
    if long_context_of(shape):   # the prompt, the decode steps after it, and a block's slack
        cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], long_context_of(shape) + 1024)
    return cfg


def is_moe(shape: str) -> bool:
    return base_shape(shape) in MOE_FAMILY


def model_config(shape: str):
    from engc.compiler.frontend.decoder import resolve_config
    return resolve_config(hf_config(shape))


def dtype_of(shape: str):
    import torch
    return torch.float32 if base_shape(shape) == "tiny" else torch.bfloat16


def checkpoint_dir(work: Path, shape: str) -> Path:
    """One checkpoint per base shape and weight format: '-int4' and '-int4-qhead' have their own, and a long-context
    variant its own config.json."""
    return work / (f"ckpt-{base_shape(shape)}{'-int4' if is_int4(shape) else ''}{'-qhead' if is_int4_head(shape) else ''}"
                   f"{''.join('-' + v for v in _variants(shape) if v in LONG_CONTEXT)}")


def plain_bundle(shape: str, work: str, cache: str) -> Path:
    """work/bundle-<shape>: the shape's random checkpoint built for sm90 with the kernel cache, each made only
    where missing, so a script run after gpu_bench on the same machine reuses its checkpoints and bundles."""
    from engc.compiler.build import BuildOptions, build
    ckpt, bundle = checkpoint_dir(Path(work), shape), Path(work) / f"bundle-{shape}"
    if not (ckpt / "config.json").exists():
        make_checkpoint(shape, ckpt)
    if not (bundle / "manifest.json").exists():
        build(str(ckpt), bundle, BuildOptions(archs=("sm90",), dtype="bfloat16", kernel_cache=cache,
                                              kv_cache=kv_cache_of(shape), quant=quant_of(shape), tp=tp_of(shape)))
    return bundle


def make_checkpoint(shape: str, folder: Path) -> None:
    """A sharded HF folder of the shape: seed-0 random weights (on the GPU, for speed), unit norms, and a
    word-level tokenizer whose tokens are 't<id>'."""
    from safetensors.torch import save_file
    if long_context_of(shape):
        return _long_context_checkpoint(shape, folder)
    if is_deepseek(shape):
        return make_deepseek_v2_lite(folder, _deepseek_layers(shape))
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    if is_int4(shape):
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP,
                                      "version": "gemm", "zero_point": True}
    if is_int4_head(shape):   # an int4 head is its own tensor, tied or not (as engc quantize --lm-head writes it)
        cfg["tie_word_embeddings"] = False
        cfg["quantization_config"]["lm_head"] = True   # GPTQModel's key
    (folder / "config.json").write_text(json.dumps(cfg))
    _write_tokenizer(folder, cfg["vocab_size"])
    weights = _RandomWeights(dtype_of(shape), is_int4(shape))
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    tensors = {"model.embed_tokens.weight": weights.rand(cfg["vocab_size"], h), "model.norm.weight": weights.ones(h)}
    if is_int4_head(shape):
        tensors.update(weights.proj("lm_head", cfg["vocab_size"], h))
    elif not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = weights.rand(cfg["vocab_size"], h)
    save_file(tensors, str(folder / "model-embed.safetensors"))
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": weights.ones(h), p + "post_attention_layernorm.weight": weights.ones(h),
             **weights.proj(p + "self_attn.q_proj", q, h), **weights.proj(p + "self_attn.k_proj", kv, h),
             **weights.proj(p + "self_attn.v_proj", kv, h), **weights.proj(p + "self_attn.o_proj", h, q)}
        if is_moe(shape):
            t.update(_moe_layer(cfg, p, weights))
        else:
            t.update({**weights.proj(p + "mlp.gate_proj", i, h), **weights.proj(p + "mlp.up_proj", i, h),
                      **weights.proj(p + "mlp.down_proj", h, i)})
        save_file(t, str(folder / f"model-layer{layer:03d}.safetensors"))
    _write_index(folder)


def _long_context_checkpoint(shape: str, folder: Path) -> None:
    """The base shape's checkpoint (made where missing) under a config.json with room for the long prompt: its
    weight files linked, not copied (an 8B checkpoint is 16 GB of the GPU machine's 64 GB disk)."""
    short = "-".join(v for v in shape.split("-") if v not in LONG_CONTEXT)
    base = checkpoint_dir(folder.parent, short)
    if not (base / "config.json").exists():
        make_checkpoint(short, base)
    folder.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f.resolve())
    cfg = json.loads((base / "config.json").read_text())
    cfg["max_position_embeddings"] = hf_config(shape)["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(cfg))


def _moe_layer(cfg: dict, p: str, weights) -> dict:
    """A layer's router and experts, one tensor per expert and projection (transformers' per-expert layout),
    and its q/k norms: OLMoE's over the whole projection, Qwen3's a head."""
    h, e = cfg["hidden_size"], cfg["num_experts"]
    i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    t = {p + "mlp.gate.weight": weights.rand(e, h)}
    for x in range(e):
        t.update({**weights.proj(f"{p}mlp.experts.{x}.gate_proj", i, h), **weights.proj(f"{p}mlp.experts.{x}.up_proj", i, h),
                  **weights.proj(f"{p}mlp.experts.{x}.down_proj", h, i)})
    whole = cfg["model_type"] == "olmoe"
    d = cfg["head_dim"]
    t[p + "self_attn.q_norm.weight"] = weights.ones(cfg["num_attention_heads"] * d if whole else d)
    t[p + "self_attn.k_norm.weight"] = weights.ones(cfg["num_key_value_heads"] * d if whole else d)
    return t


class _RandomWeights:
    """Seeded random tensors of a checkpoint: bf16 (float32 for tiny) weights, or AutoAWQ GEMM int4
    projections (random codes and zeros; scales that give weights about the float checkpoint's spread)."""

    def __init__(self, dtype, int4: bool):
        import torch
        self.torch, self.dtype, self.int4 = torch, dtype, int4
        self.g = torch.Generator(device="cuda").manual_seed(0)

    def rand(self, *shape, std=0.02):
        t = self.torch
        return (t.randn(*shape, generator=self.g, device="cuda", dtype=t.float32) * std).to(self.dtype).cpu()

    def ones(self, n: int):
        return self.torch.ones(n, dtype=self.dtype)

    def proj(self, name: str, out_f: int, in_f: int) -> dict:
        if not self.int4:
            return {name + ".weight": self.rand(out_f, in_f)}
        t = self.torch
        scales = t.rand(in_f // INT4_GROUP, out_f, generator=self.g, device="cuda") * 0.002 + 0.002
        return {name + ".qweight": self._words(in_f, out_f), name + ".qzeros": self._words(in_f // INT4_GROUP, out_f),
                name + ".scales": scales.to(t.float16).cpu()}

    def _words(self, rows: int, out_f: int):
        t = self.torch
        return t.randint(-2**31, 2**31 - 1, (rows, out_f // 8), generator=self.g, device="cuda", dtype=t.int32).cpu()


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t128001"}))


def _write_index(folder: Path) -> None:
    """The index HF transformers needs to read a sharded folder (engc reads any *.safetensors)."""
    from safetensors import safe_open
    weight_map = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            weight_map.update({name: shard.name for name in f.keys()})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(200, vocab - 200, (n, length), generator=g).tolist()


def weight_bytes(cfg, projection_bytes: float = 2, head_bytes: float = 2) -> tuple[int, int]:
    """(bytes a batch-1 decode step reads, parameters a token uses): bf16 weights, or 1-byte projections (fp8),
    or int4 ones (and an int4 lm_head: head_bytes); of an MoE model, its active weights (the top-k experts)."""
    if cfg.kv_lora_rank:
        return _mla_weight_bytes(cfg, projection_bytes, head_bytes)
    h, i, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    if cfg.num_experts:   # the experts a token reads (top-k of them) and the router: a batch-1 step's weights
        i = cfg.moe_intermediate_size * cfg.num_experts_per_tok
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i + h * cfg.num_experts
    params = L * per_layer + V * h  # lm_head counts: it is read every step (tied or not)
    return int(projection_bytes * L * per_layer + head_bytes * V * h), params


def _mla_weight_bytes(cfg, projection_bytes: float, head_bytes: float) -> tuple[int, int]:
    """weight_bytes of a DeepSeek model: MLA's projections (the latent's up-projection read whole, absorbed or
    not), the leading dense MLP layers, and in the others the top-k routed experts, the shared ones and the
    router. The number of dense layers is not in ModelConfig: V2-Lite's one (bench's only DeepSeek shape)."""
    h, L, V, heads = cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.num_heads
    r, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * (nope + rope)) if cfg.q_lora_rank else h * heads * (nope + rope)
    attn = q + h * (r + rope) + r * heads * (nope + v) + heads * v * h
    dense_layers = DEEPSEEK_V2_LITE["first_k_dense_replace"]
    routed = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    moe = routed + 3 * h * cfg.shared_expert_intermediate_size + h * cfg.num_experts
    per_model = L * attn + dense_layers * 3 * h * cfg.intermediate_size + (L - dense_layers) * moe
    return int(projection_bytes * per_model + head_bytes * V * h), per_model + V * h


INT4_BYTES = 0.5 + 3 / INT4_GROUP   # int4 bytes a weight: codes, and a bf16 scale and u8 zero a group


def step_weight_bytes(shape: str, cfg) -> tuple[int, int]:
    """weight_bytes for the shape's weight format."""
    proj = 1 if quant_of(shape) == "fp8" else INT4_BYTES if is_int4(shape) else 2
    return weight_bytes(cfg, proj, INT4_BYTES if is_int4_head(shape) else 2)


# DeepSeek-V2-Lite (16B total, 2.4B active: MLA with kv_lora_rank 512, 64 routed experts of which 6 a token, two
# shared ones): the latent-attention shape that fits one GPU. Not one of SHAPES (whose checkpoints and weight
# bytes are Llama's): make_deepseek_v2_lite writes its random checkpoint, `engc build` builds it as any other.
# Its bf16 checkpoint is about 31 GB and the bundle as much again: on a 64 GB disk, build fewer layers.
DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
    scoring_func="softmax", rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=163840,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001, torch_dtype="bfloat16",
    # the released config's keys of its remote code, which LMDeploy's model reads (engc and transformers do not)
    moe_layer_freq=1, ep_size=1, aux_loss_alpha=0.001, seq_aux=True)


def make_deepseek_v2_lite(folder: Path, layers: int = 27) -> None:
    """A sharded random DeepSeek-V2-Lite checkpoint of `layers` layers (seed 0, on the GPU), per-expert tensors
    as transformers writes them, and the word-level tokenizer of the other shapes."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(DEEPSEEK_V2_LITE, num_hidden_layers=layers)
    (folder / "config.json").write_text(json.dumps(cfg))
    _write_tokenizer(folder, cfg["vocab_size"])
    w = _RandomWeights(dtype_of("deepseek"), False)
    h, heads, r = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v, mi = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["moe_intermediate_size"]
    save_file({"model.embed_tokens.weight": w.rand(cfg["vocab_size"], h), "model.norm.weight": w.ones(h),
               "lm_head.weight": w.rand(cfg["vocab_size"], h)}, str(folder / "model-embed.safetensors"))
    for layer in range(layers):
        p, a = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
        t = {p + "input_layernorm.weight": w.ones(h), p + "post_attention_layernorm.weight": w.ones(h),
             a + "q_proj.weight": w.rand(heads * (nope + rope), h), a + "kv_a_proj_with_mqa.weight": w.rand(r + rope, h),
             a + "kv_a_layernorm.weight": w.ones(r), a + "kv_b_proj.weight": w.rand(heads * (nope + v), r),
             a + "o_proj.weight": w.rand(h, heads * v)}
        if layer < cfg["first_k_dense_replace"]:
            i = cfg["intermediate_size"]
            t.update({p + "mlp.gate_proj.weight": w.rand(i, h), p + "mlp.up_proj.weight": w.rand(i, h),
                      p + "mlp.down_proj.weight": w.rand(h, i)})
        else:
            s = mi * cfg["n_shared_experts"]
            t.update({p + "mlp.gate.weight": w.rand(cfg["n_routed_experts"], h),
                      p + "mlp.shared_experts.gate_proj.weight": w.rand(s, h),
                      p + "mlp.shared_experts.up_proj.weight": w.rand(s, h),
                      p + "mlp.shared_experts.down_proj.weight": w.rand(h, s)})
            for e in range(cfg["n_routed_experts"]):
                x = f"{p}mlp.experts.{e}."
                t.update({x + "gate_proj.weight": w.rand(mi, h), x + "up_proj.weight": w.rand(mi, h),
                          x + "down_proj.weight": w.rand(h, mi)})
        save_file(t, str(folder / f"model-layer{layer:03d}.safetensors"))
    _write_index(folder)
