"""engc quantize of Gemma 2, Gemma 3, Phi-3 (partial rotary, LongRoPE) and InternLM2, and engc build of
pre-quantized fused (Phi-3) and grouped (InternLM2) checkpoints.

The oracle is transformers' float32 model with the weights dequantized from the written files by
test_quant_e2e's unpacking (written from the AWQ / GPTQ format descriptions, not from engc's code), in the
source family's own tensor names: a checkpoint that unpacks into the family's float checkpoint is one that
other tools read as that family's. transformers has no InternLM2 class; InternLM2 is Llama's network under a
grouped `wqkv` (test_dense_families), so its oracle is HF Llama on the ungrouped weights.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engc.compiler.build import BuildOptions, build
from engc.compiler.frontend.decoder import _rope_table, resolve_config
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.layer import DecoderLayer
from engc.compiler.quantize.stream import first_layer_input, llama_view, quantize_checkpoint
from test_dense_families import _internlm2_tensors, _relaid, internlm2_config
from test_quant_e2e import bundle_logits, dequant_awq, dequant_gptq

transformers = pytest.importorskip("transformers")

CALIB = dict(calib_samples=4, calib_seqlen=32, awq_grid=10)
IDS = list(range(3, 40))   # longer than the tiny models' sliding window of 8
PACKED = ("qweight", "qzeros", "scales", "g_idx")


@pytest.fixture(scope="module")
def internlm2_src(tmp_path_factory):
    """A tiny InternLM2 checkpoint (two q heads a KV head) and the HF Llama checkpoint it re-lays."""
    from tiny_models import make_tiny
    llama = make_tiny("llama", tmp_path_factory.mktemp("llama"), seed=5, rope_scaling=None)
    cfg = json.loads((llama / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    folder = tmp_path_factory.mktemp("internlm2") / "m"
    _relaid(llama, folder, internlm2_config(cfg),
            lambda t: _internlm2_tensors(t, heads, kv, cfg["hidden_size"] // heads))
    return folder, llama


# a family's variant under a name of its own: Command R+'s per-head q/k LayerNorm (its weights' dims in the
# interleaved rotary's permutation, put back on the way out)
VARIANTS = {"cohere-qk-norm": ("cohere", (("use_qk_norm", True),))}


def source_of(family, tiny_dir, internlm2_src):
    if family in VARIANTS:
        base, overrides = VARIANTS[family]
        return tiny_dir(base, **dict(overrides))
    return internlm2_src[0] if family == "internlm2" else tiny_dir(family)


def _llama_of_internlm2(state: dict, cfg: dict) -> dict:
    """An InternLM2 state dict under HF Llama's names, wqkv ungrouped (test_dense_families' re-lay, inverted)."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, group = cfg["hidden_size"] // heads, heads // kv
    names = {"attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    out = {}
    for k, v in state.items():
        k = k.replace("model.tok_embeddings.", "model.embed_tokens.").replace("output.", "lm_head.")
        for old, new in names.items():
            k = k.replace(f".{old}.", f".{new}.")
        if k.endswith("attention.wqkv.weight"):
            p = k[:-len("attention.wqkv.weight")]
            rows = v.reshape(kv, group + 2, hd, v.shape[-1])
            for n, part in (("q", rows[:, :group]), ("k", rows[:, group]), ("v", rows[:, group + 1])):
                out[f"{p}self_attn.{n}_proj.weight"] = part.reshape(-1, v.shape[-1]).contiguous()
        else:
            out[k] = v
    return out


def oracle_of(folder, internlm2_src, tmp_path):
    """The written checkpoint dequantized into a float HF checkpoint the oracle loads (InternLM2: HF Llama's)."""
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    state = {k: v.float() for k, v in tensors.items() if not k.endswith(PACKED)}
    for name in [k[:-len("qweight")] for k in tensors if k.endswith("qweight")]:
        w = dequant_awq(tensors, name, qc["group_size"]) if qc["quant_method"] == "awq" else dequant_gptq(tensors, name)
        state[name + "weight"] = w.contiguous()
    oracle = tmp_path / "oracle"
    oracle.mkdir()
    if cfg["model_type"] == "internlm2":
        state = _llama_of_internlm2(state, cfg)
        cfg = json.loads((internlm2_src[1] / "config.json").read_text())
    save_file(state, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    (oracle / "config.json").write_text(json.dumps(cfg))
    return oracle


def hf_logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def assert_bundle_matches(bundle, oracle):
    ours, theirs = bundle_logits(bundle, IDS), hf_logits(oracle)
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4), (ours - theirs).abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


FAMILIES = ("gemma2", "gemma3_text", "phi3", "internlm2", "smollm3", "granite", "olmo2", "glm4", "ernie4_5",
            "exaone4", "cohere", "cohere-qk-norm", "cohere2", "ministral3", "olmo3", "seed_oss")


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_family_builds_and_matches_its_dequantized_weights(family, method, tiny_dir, internlm2_src,
                                                                     tmp_path):
    """Each method writes the family's own checkpoint (fused and grouped projections quantized whole, phi3's
    GPTQ with its groups in act order, so the parts share a g_idx), engc build reads it, and the bundle's
    logits are the float model's of the dequantized weights."""
    src = source_of(family, tiny_dir, internlm2_src)
    extra = {"act_order": True, "static_groups": False} if (family, method) == ("phi3", "gptq") else {}
    quantize_checkpoint(str(src), tmp_path / "q", QuantOptions(method=method, group_size=32, **CALIB, **extra))
    written = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    fused = {"phi3": ("self_attn.qkv_proj", "mlp.gate_up_proj"), "internlm2": ("attention.wqkv", "feed_forward.w1"),
             "glm4": ("self_attn.q_proj", "mlp.gate_up_proj")}
    for name in fused.get(family, ("self_attn.q_proj", "mlp.gate_proj")):   # the source family's own names
        assert f"model.layers.0.{name}.qweight" in written and f"model.layers.0.{name}.weight" not in written
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    oracle = oracle_of(tmp_path / "q", internlm2_src, tmp_path)
    assert_bundle_matches(tmp_path / "b", oracle)
    if method == "rtn":   # no calibration moved the weights: each is its float source's, rounded, in its rows
        float_src = internlm2_src[1] if family == "internlm2" else src
        expected = {k: v for f in float_src.glob("*.safetensors") for k, v in load_file(str(f)).items()}
        dequantized = load_file(str(oracle / "model.safetensors"))
        for name, w in expected.items():
            if ".layers." in name and name.endswith("proj.weight"):
                err = (dequantized[name] - w).norm() / w.norm()
                assert err < 0.1, (name, err)   # g32 RTN of these weights: about 0.08
            elif ".layers." in name and "norm" in name:   # nothing to fold: the source's norms, in its order
                assert torch.equal(dequantized[name], w), name


def awq_pack(w: torch.Tensor, group: int) -> dict:
    """w [out, in] min/max-quantized per group and packed as AutoAWQ GEMM writes it (this file's own packing)."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    g = w.T.reshape(-1, group, w.shape[0])                          # [groups, group, out]
    lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(g / scales.float()[:, None] + zeros[:, None]).clamp(0, 15).reshape(w.shape[1], -1)

    def pack(codes):   # [rows, out] -> int32 [rows, out / 8], nibble i holding column order[i] of its 8
        codes = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)[..., order]
        return sum(codes[..., i] << (4 * i) for i in range(8)).to(torch.int32).contiguous()
    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales.contiguous()}


@pytest.mark.parametrize("family", ["phi3", "internlm2"])
def test_prequantized_fused_checkpoint_builds(family, tiny_dir, internlm2_src, tmp_path):
    """An AWQ checkpoint as AutoAWQ writes these families: phi3's qkv_proj and gate_up_proj, internlm2's
    grouped wqkv quantized whole."""
    src = source_of(family, tiny_dir, internlm2_src)
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    out = {}
    for k, v in tensors.items():
        if ".layers." in k and k.endswith(".weight") and v.dim() == 2:
            out.update({k[:-len("weight")] + part: t for part, t in awq_pack(v, 32).items()})
        else:
            out[k] = v
    assert "model.layers.0.self_attn.qkv_proj.qweight" in out or "model.layers.0.attention.wqkv.qweight" in out
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                  "version": "gemm"}
    _relaid(src, tmp_path / "q", cfg, lambda t: out)
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    assert_bundle_matches(tmp_path / "b", oracle_of(tmp_path / "q", internlm2_src, tmp_path))


def hf_layer_io(src, ids):
    """Each HF decoder layer's (input, output, its MLP's input) on ids (the MLP's input None for a layer whose
    MLP is not a module called `mlp` with one input)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    seen, mlp_in = [], {}
    hooks = [layer.register_forward_hook(
        lambda m, args, kwargs, out: seen.append((args[0] if args else kwargs["hidden_states"],
                                                  out[0] if isinstance(out, tuple) else out)), with_kwargs=True)
        for layer in model.model.layers]
    hooks += [layer.mlp.register_forward_pre_hook(lambda m, args, i=i: mlp_in.setdefault(i, args[0]))
              for i, layer in enumerate(model.model.layers) if hasattr(layer, "mlp")]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return [(x, out, mlp_in.get(i)) for i, (x, out) in enumerate(seen)]


def assert_layers_match_hf(src, ids, hf_src=None) -> list:
    """The quantizer's layers (stream.calibration_layer, on the build's view of the weights) against HF's decoder
    layers (of hf_src, default src) on ids: the first layer's input against HF's embedding output, then each layer
    on the input HF's layer saw. Returns the layers."""
    from engc.compiler.build import read_source
    from engc.compiler.quantize.stream import calibration_layer
    source = read_source(str(src))
    cfg = resolve_config(source.hf_config)
    view = llama_view(source, cfg)
    seen = hf_layer_io(hf_src or src, ids)
    assert torch.allclose(first_layer_input(view, cfg, ids), seen[0][0], atol=1e-6)
    rope = (_rope_table(cfg, cfg.rope_theta, cfg.rope_scaling),
            _rope_table(cfg, cfg.local_rope_theta, None) if cfg.local_rope_theta else None)
    layers = []
    for i, (x, expected, mlp_in) in enumerate(seen):
        prefix = f"model.layers.{i}."
        weights = {n[len(prefix):]: view.get(n).float() for n in view.names() if n.startswith(prefix)}
        layer, _ = calibration_layer(view.hf_config, cfg, rope, i, weights, {k: v.dtype for k, v in weights.items()})
        with torch.no_grad():
            ours = layer.forward(x)
            # what GPTQ's and AWQ's MLP stages calibrate on (a dense MLP's: an MoE layer's is experts.py's)
            if mlp_in is not None and layer.moe is None and not cfg.kv_lora_rank:
                assert torch.allclose(layer.mlp_input(x), mlp_in, atol=1e-5, rtol=1e-5), i
        assert torch.allclose(ours, expected, atol=1e-5, rtol=1e-5), (i, (ours - expected).abs().max())
        layers.append(layer)
    return layers


@pytest.mark.parametrize("family", FAMILIES)
def test_quantizer_layer_is_the_hf_layer(family, tiny_dir, internlm2_src):
    """Each layer of the quantizer (the build's view of the weights, the ModelConfig's facts) against the HF
    decoder layer's output on the same input, and the first layer's input against HF's embedding output."""
    assert_layers_match_hf(source_of(family, tiny_dir, internlm2_src), torch.tensor([IDS[:20]]),
                           internlm2_src[1] if family == "internlm2" else None)


@pytest.mark.parametrize("family", FAMILIES)
def test_awq_scales_fold_into_the_right_ops(family, tiny_dir, internlm2_src, monkeypatch):
    """AWQ's scales, folded into the op before each projection group (a (1 + w) norm as (1 + w) / s - 1, the
    MLP's input norm, v's and up's rows), leave the float layer's output as it was: the clipping search,
    which does change weights, is left out."""
    from engc.compiler.build import read_source
    from engc.compiler.quantize import awq
    monkeypatch.setattr(awq, "clip_weight", lambda w, *args: w)
    source = read_source(str(source_of(family, tiny_dir, internlm2_src)))
    cfg = resolve_config(source.hf_config)
    view = llama_view(source, cfg)
    rope = _rope_table(cfg, cfg.rope_theta, cfg.rope_scaling)
    local = _rope_table(cfg, cfg.local_rope_theta, None) if cfg.local_rope_theta else None
    weights = {n[len("model.layers.0."):]: view.get(n).float() for n in view.names() if n.startswith("model.layers.0.")}
    x = torch.randn(4, 20, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = DecoderLayer(cfg, dict(weights), rope, 0, local).forward(x)
        layer = DecoderLayer(cfg, dict(weights), rope, 0, local)
        awq.awq_layer(layer, x, 32, grid=4)
        changed = {k for k in weights if not torch.equal(layer.w[k], weights[k])}
        if cfg.pre_norms:
            assert any("norm" in k for k in changed)
        else:   # OLMo 2: no norm before q/k/v or gate/up to fold theirs into; down's still folds into up's rows
            assert not any("norm" in k for k in changed) and "mlp.up_proj.weight" in changed
        assert torch.allclose(layer.forward(x), expected, atol=1e-4, rtol=1e-4)


def test_multimodal_gemma3_quantizes_its_text_part(tiny_dir, internlm2_src, tmp_path):
    """A gemma3 checkpoint (text_config, language_model.* tensors, a vision tower) is written as one: its
    language model's layers and, with --lm-head, its head quantized under their own prefixes, the vision
    tower as it was, the text config untied."""
    src = tiny_dir("gemma3_text")
    text = json.loads((src / "config.json").read_text())
    vision = torch.ones(8)
    _relaid(src, tmp_path / "mm", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                                   "text_config": {k: v for k, v in text.items() if k != "architectures"},
                                   "vision_config": {"model_type": "siglip_vision_model"}},
            lambda t: {"language_model." + k: v for k, v in t.items()} | {"vision_tower.post_layernorm.weight": vision})
    quantize_checkpoint(str(tmp_path / "mm"), tmp_path / "q", QuantOptions(method="gptq", group_size=32, lm_head=True,
                                                                           **CALIB))
    tensors = {k: v for f in (tmp_path / "q").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert torch.equal(tensors["vision_tower.post_layernorm.weight"], vision)
    assert {"language_model.model.layers.0.self_attn.q_proj.qweight", "language_model.lm_head.qweight"} <= set(tensors)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["text_config"]["tie_word_embeddings"] is False
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    # the oracle: the text model of the dequantized weights
    text_only = tmp_path / "text"
    text_config = dict(text, tie_word_embeddings=False, quantization_config=config["quantization_config"])
    _relaid(tmp_path / "q", text_only, text_config,
            lambda t: {k[len("language_model."):]: v for k, v in tensors.items() if k.startswith("language_model.")})
    assert_bundle_matches(tmp_path / "b", oracle_of(text_only, internlm2_src, tmp_path))
