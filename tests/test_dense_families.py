"""Gemma 2, Gemma 3 (text, and the text part of a gemma3 checkpoint), Phi-3, InternLM3, InternLM2, SmolLM3 and
Granite against an oracle in float32 on the CPU: greedy tokens identical, log-probabilities within 1e-4
(SmolLM3's and Granite's in test_hf_parity, beside Llama's).

transformers has Gemma 2, Gemma 3 and Phi-3 classes: they are the oracle. It has none for InternLM2/3
(their modeling code ships with the checkpoints). Their published modeling code is Llama's math under
other names: InternLM3 is Llama with a bias on q, k and v alone (config `qkv_bias`; `bias` puts one on
o_proj and the MLP, which engc refuses), which is exactly HF's Qwen2 network; InternLM2 is Llama with q, k
and v fused into `attention.wqkv`, grouped per KV head as [the group's q heads, k, v] (its
rearrange "(h gs d)"), w1/w3/w2 for gate/up/down and attention_norm/ffn_norm for the two norms. So the
tests write a tiny HF Qwen2 / Llama checkpoint, re-lay it as the InternLM checkpoint would hold it, and
compare the InternLM bundle with HF's Qwen2 / Llama on the original.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engc.compiler.build import BuildOptions, build
from engc.errors import UserError
from engc.runtime.engine import Engine
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams
from gguf_writer import GLOBALS, add_hparams
from test_hf_parity import NEW_TOKENS, PROMPTS, hf_greedy

transformers = pytest.importorskip("transformers")


def greedy_matches(bundle, oracle_folder):
    model = load(bundle)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    engine = Engine(model)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(ids, greedy) for ids in prompts]   # batched, continuously scheduled
    engine.run_to_completion()
    for ids, seq in zip(prompts, seqs):
        expected, hf_logits = hf_greedy(oracle_folder, ids, NEW_TOKENS)
        assert seq.output_ids == expected
        ours = torch.tensor([s.logprob for s in seq.logprobs])
        theirs = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0]
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3"])
def test_greedy_matches_hf(family, tiny_dir, tiny_bundle):
    greedy_matches(tiny_bundle(family), tiny_dir(family))


def test_program_carries_the_layer_facts(tiny_bundle):
    """Gemma 3's local and global layers: their windows and rope tables are per-node facts."""
    from engc.bundle.program import parse_program
    from engc.bundle.reader import open_bundle
    bundle = open_bundle(tiny_bundle("gemma3_text"))
    program = parse_program(bundle.read(bundle.manifest["program"]))
    attn = [n for n in program.nodes if n.op in ("PagedAttention", "RotaryPagedAttention")]
    assert [n.attrs["sliding_window"] for n in attn] == [8, 0, 8]
    assert [n.inputs[2] for n in attn] == ["rope.local.inv_freq", "rope.inv_freq", "rope.local.inv_freq"]
    assert all(abs(n.attrs["scale"] - 24 ** -0.5) < 1e-6 for n in attn)


def test_smollm3_nope_layers_rotate_by_a_zero_table(tiny_dir, tiny_bundle):
    """SmolLM3's NoPE layers (here every second, config.json's no_rope_layers) read a rope table of zeros, which
    leaves q and k as they are, and their attention scale leaves out YaRN's attention factor, which only the
    rotated layers' q and k carry; a window (use_sliding_window) lands on the layers layer_types names."""
    from engc.bundle.program import parse_program
    from engc.bundle.reader import open_bundle
    from engc.runtime.loader import load
    bundle = open_bundle(tiny_bundle("smollm3"))
    program = parse_program(bundle.read(bundle.manifest["program"]))
    rot = [n for n in program.nodes if n.op.startswith("Rotary")]
    assert [n.inputs[2] for n in rot] == ["rope.inv_freq", "rope.none.inv_freq"] * 2
    attn = [n for n in program.nodes if n.op in ("PagedAttention", "RotaryPagedAttention")]
    factor = load(tiny_bundle("smollm3")).config.rope_attention_factor
    assert factor > 1.1
    scales = [n.attrs["scale"] for n in attn]
    head = 16 ** -0.5   # hidden 64, 4 heads
    assert scales[1] == scales[3] == head and scales[0] == scales[2] == pytest.approx(head * factor ** 2)
    windowed = open_bundle(tiny_bundle("smollm3", use_sliding_window=True, sliding_window=8))
    nodes = parse_program(windowed.read(windowed.manifest["program"])).nodes
    windows = [n.attrs["sliding_window"] for n in nodes if n.op in ("PagedAttention", "RotaryPagedAttention")]
    assert windows == [0, 8] * 2


def _relaid(src, dst, config: dict, rename) -> None:
    """src's HF checkpoint as another family would hold it: config.json replaced, tensors renamed/fused."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    save_file(rename(tensors), str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))


_MISTRAL3 = ("mistral3", "Mistral3ForConditionalGeneration", "pixtral",
             lambda k: k if k.startswith("lm_head.") else "model.language_model." + k[len("model."):],
             {"model.vision_tower.ln_pre.weight": (8,), "model.multi_modal_projector.linear_1.weight": (8, 8)})
# test id -> (the wrapper's model_type, architecture, vision_config model_type, its text model's tensor names in
# the wrapper, vision tensors beside them; its text model's family)
MULTIMODAL = {
    # gemma3: transformers 4's language_model.* names, a vision tower
    "gemma3": ("gemma3", "Gemma3ForConditionalGeneration", "siglip_vision_model", lambda k: "language_model." + k,
               {"vision_tower.vision_model.post_layernorm.weight": (8,)}, "gemma3_text"),
    # mistral3 (Mistral Small 3.x, Ministral 3): transformers 5's model.language_model.* names and its own
    # lm_head, a vision tower and a projector
    "mistral3-mistral": (*_MISTRAL3, "mistral"),
    "mistral3-ministral3": (*_MISTRAL3, "ministral3"),
}


@pytest.mark.parametrize("case", MULTIMODAL)
def test_multimodal_text_part(case, tiny_dir, tmp_path):
    """A multimodal checkpoint (text_config, the text model's tensors under the wrapper's names, vision tensors
    beside them) builds its text model, which decodes as that text model."""
    wrapper, arch, vision, name, extra, family = MULTIMODAL[case]
    src = tiny_dir(family)
    text = json.loads((src / "config.json").read_text())

    def rename(t):
        out = {name(k): v for k, v in t.items()}
        out.update({k: torch.ones(shape) for k, shape in extra.items()})
        return out
    _relaid(src, tmp_path / "mm", {"model_type": wrapper, "architectures": [arch],
                                   "text_config": {k: v for k, v in text.items() if k != "architectures"},
                                   "vision_config": {"model_type": vision}}, rename)
    build(str(tmp_path / "mm"), tmp_path / "b", BuildOptions())
    greedy_matches(tmp_path / "b", src)


def test_ministral3_context_stops_where_the_query_temperature_starts(tiny_dir, tiny_bundle):
    """Ministral 3's Llama 4 query temperature (1 + beta * log(1 + floor(position / original length))) is 1 up to
    YaRN's original length and is not computed: the bundle's context ends there, not at max_position_embeddings."""
    from engc.runtime.loader import load
    cfg = json.loads((tiny_dir("ministral3") / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 512 and cfg["rope_parameters"]["llama_4_scaling_beta"] == 0.1
    assert load(tiny_bundle("ministral3")).config.max_position_embeddings == 128


@pytest.fixture(scope="module")
def qwen2_src(tmp_path_factory):
    from tiny_models import make_tiny
    return make_tiny("qwen2", tmp_path_factory.mktemp("qwen2_src"), seed=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory):
    from tiny_models import make_tiny
    return make_tiny("llama", tmp_path_factory.mktemp("llama_src"), seed=4, num_key_value_heads=1,
                     rope_scaling=None)


def test_internlm3(qwen2_src, tmp_path):
    cfg = json.loads((qwen2_src / "config.json").read_text())
    cfg.update(model_type="internlm3", architectures=["InternLM3ForCausalLM"], qkv_bias=True, bias=False,
               rope_scaling={"rope_type": "dynamic", "factor": 6.0})
    _relaid(qwen2_src, tmp_path / "internlm3", cfg, lambda t: t)
    build(str(tmp_path / "internlm3"), tmp_path / "b", BuildOptions())
    greedy_matches(tmp_path / "b", qwen2_src)


def _internlm2_tensors(t: dict, heads: int, kv_heads: int, head_dim: int) -> dict:
    names = {"self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
             "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
             "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    out = {"model.tok_embeddings.weight": t["model.embed_tokens.weight"], "model.norm.weight": t["model.norm.weight"]}
    if "lm_head.weight" in t:
        out["output.weight"] = t["lm_head.weight"]
    layers = {k.split(".")[2] for k in t if k.startswith("model.layers.")}
    group = heads // kv_heads
    for i in layers:
        p = f"model.layers.{i}."
        for hf, ours in names.items():
            out[f"{p}{ours}.weight"] = t[f"{p}{hf}.weight"]
        q, k, v = (t[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
        hidden = q.shape[1]
        rows = torch.cat([q.reshape(kv_heads, group, head_dim, hidden), k.reshape(kv_heads, 1, head_dim, hidden),
                          v.reshape(kv_heads, 1, head_dim, hidden)], dim=1)
        out[f"{p}attention.wqkv.weight"] = rows.reshape(-1, hidden).contiguous()
    return out


def internlm2_config(cfg: dict) -> dict:
    """The config.json of an InternLM2 model computing what the HF Llama model of config cfg computes."""
    internlm2 = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                     "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id")}
    internlm2.update(model_type="internlm2", architectures=["InternLM2ForCausalLM"], bias=False, hidden_act="silu",
                     rope_theta=cfg["rope_parameters"]["rope_theta"], rope_scaling=None)
    return internlm2


def test_internlm2(llama_src, tmp_path):
    cfg = json.loads((llama_src / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    _relaid(llama_src, tmp_path / "internlm2", internlm2_config(cfg),
            lambda t: _internlm2_tensors(t, heads, kv, cfg["hidden_size"] // heads))
    build(str(tmp_path / "internlm2"), tmp_path / "b", BuildOptions())
    greedy_matches(tmp_path / "b", llama_src)


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "xpos", "factor": 4.0}}, "unsupported rope scaling 'xpos'"),
    ({"hidden_act": "relu"}, "hidden activation 'relu' is not supported"),
    ({"bias": True}, "sets bias: true"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor 0.1"),
    ({"num_attention_heads": None}, "lacks num_attention_heads"),
], ids=["rope-type", "activation", "bias", "rotary-width", "missing-key"])
def test_unsupported_variant_refused(qwen2_src, tmp_path, change, message):
    cfg = json.loads((qwen2_src / "config.json").read_text())
    cfg.update(model_type="internlm3", qkv_bias=True)
    cfg.pop("rope_parameters", None)
    for key, value in change.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    _relaid(qwen2_src, tmp_path / "m", cfg, lambda t: t)
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as e:
        build(str(tmp_path / "m"), tmp_path / "b", BuildOptions())
    assert "\n" not in str(e.value)


def test_gemma2_gpu_bundle_caps_attention_in_its_kernels(tiny_dir, tmp_path):
    """Gemma 2's score cap is a specialization of the attention kernels (SOFTCAP), and no CUDA decode
    template, which lacks it, is in the bundle."""
    from engc.bundle.reader import open_bundle
    build(str(tiny_dir("gemma2")), tmp_path / "b", BuildOptions(archs=("cpu", "sm90"), dtype="bfloat16"))
    kernels = [k for k in open_bundle(tmp_path / "b").manifest["kernels"] if k["op"] == "paged_attention"]
    assert {k["variant"] for k in kernels} == {"decode", "decode_rotary", "prefill"}
    assert all(k["constexprs"]["SOFTCAP"] == 0.5 for k in kernels)


def test_gemma3_gpu_bundle_has_its_kernels(tiny_dir, tmp_path):
    """A bfloat16 Gemma 3 bundle for sm90 (built with no GPU) carries the GELU-tanh GLU and the (1 + weight)
    norm kernels its program's nodes need."""
    from engc.bundle.program import parse_program
    from engc.bundle.reader import open_bundle
    build(str(tiny_dir("gemma3_text")), tmp_path / "b", BuildOptions(archs=("cpu", "sm90"), dtype="bfloat16"))
    bundle = open_bundle(tmp_path / "b")
    kernels = {(k["op"], k["variant"]) for k in bundle.manifest["kernels"]}
    assert {("silu_mul", "gelu_tanh"), ("rms_norm", "rms_norm_unit_offset"), ("rms_norm", "add_rms_norm_unit_offset"),
            ("qk_norm", "unit_offset")} <= kernels
    ops = {n.op for n in parse_program(bundle.read(bundle.manifest["program"])).nodes}
    assert {"GeluTanhMul", "RMSNormUnitOffset", "AddRMSNormUnitOffset", "QKNormUnitOffset"} <= ops


@pytest.mark.parametrize("change,message", [
    ({"attention_bias": True}, "sets attention_bias: true"),
    ({"mlp_bias": True}, "sets mlp_bias: true"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers must give 0 or 1 for each of the 4 layers"),
    ({"model_type": "granite", "attention_bias": True}, "sets attention_bias: true for a granite model"),
    ({"model_type": "cohere", "attention_bias": True}, "sets attention_bias: true for a cohere model"),
], ids=["attention-bias", "mlp-bias", "short-no-rope-layers", "granite-bias", "cohere-bias"])
def test_unsupported_variant_of_a_family_refused(tiny_dir, tmp_path, change, message):
    src = tiny_dir(change.get("model_type", "smollm3"))
    cfg = {**json.loads((src / "config.json").read_text()), **change}
    _relaid(src, tmp_path / "m", cfg, lambda t: t)
    with pytest.raises(UserError, match=message) as e:
        build(str(tmp_path / "m"), tmp_path / "b", BuildOptions())
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3", "internlm3", "smollm3", "granite", "olmo2",
                                    "olmo3", "glm4", "ernie4_5", "exaone4", "cohere", "cohere2",
                                    "ministral3", "seed_oss"])
def test_gpu_greedy_matches_cpu(family, tiny_dir, qwen2_src, tmp_path):
    """On a GPU: the float32 bundle's greedy tokens on the GPU (CUDA graphs on and off) are the CPU's."""
    from test_gpu import greedy, gpu_ready, sm_arch
    if not gpu_ready():
        pytest.skip("needs engc._native")
    src = tiny_dir(family) if family != "internlm3" else qwen2_src
    if family == "internlm3":
        cfg = json.loads((qwen2_src / "config.json").read_text())
        cfg.update(model_type="internlm3", qkv_bias=True, bias=False)
        _relaid(qwen2_src, tmp_path / "src", cfg, lambda t: t)
        src = tmp_path / "src"
    build(str(src), tmp_path / "b", BuildOptions(archs=("cpu", sm_arch()), dtype="float32",
                                              kernel_cache=os.environ.get("ENGC_KERNEL_CACHE")))
    cpu = greedy(tmp_path / "b", "cpu")
    assert greedy(tmp_path / "b", "cuda") == cpu
    assert greedy(tmp_path / "b", "cuda", graphs=False) == cpu


# HF tensor -> llama.cpp's name, as its converter writes Gemma 2/3 and Phi-3 (no q/k row permutation there)
_GGUF_STEMS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "mlp.up_proj": "ffn_up",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _write_gguf(path, arch: str, model, cfg: dict, gemma: bool):
    """model as llama.cpp's converter writes it: Gemma's norms with their +1, Phi-3's fused tensors as they are."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    w = gguf.GGUFWriter(str(path), arch)
    add_hparams(w, cfg, rope_dims=int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0)))
    if "sliding_window" in cfg:
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([bytes_to_unicode()[b] for b in range(cfg["vocab_size"] - 1)] + ["ab"])
    w.add_token_merges(["a b"])
    w.add_token_types([1] * cfg["vocab_size"])
    w.add_eos_token_id(1)
    w.add_pad_token_id(1)
    for name, tensor in model.state_dict().items():
        module, suffix = name.rsplit(".", 1)
        if module == "lm_head" and cfg["tie_word_embeddings"]:
            continue
        sub = module.split(".", 3)[-1]
        stem = GLOBALS.get(module) or "blk.{}.{}".format(module.split(".")[2], "ffn_norm" if (
            sub == "post_attention_layernorm" and not gemma) else _GGUF_STEMS[sub])
        array = tensor.float().numpy() + (1.0 if gemma and name.endswith("norm.weight") else 0.0)
        w.add_tensor(f"{stem}.{suffix}", np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# transformers' GGUF reader assumes query_pre_attn_scalar 256 (Gemma's real value, where it is head_dim),
# Gemma 2's soft-caps 50 and 30, and for Phi-3 head_dim = hidden / heads and a whole-head rotary (it reads no
# key_length or rope.dimension_count there), so the tiny models are shaped so
@pytest.mark.parametrize("arch,model_type,extra", [
    ("gemma2", "gemma2", dict(head_dim=256, sliding_window=8, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0, query_pre_attn_scalar=256, tie_word_embeddings=True)),
    ("gemma3", "gemma3_text", dict(head_dim=256, sliding_window=8, query_pre_attn_scalar=256,
                                   sliding_window_pattern=2, tie_word_embeddings=True)),
    ("phi3", "phi3", dict(head_dim=32, pad_token_id=1, eos_token_id=1, tie_word_embeddings=False)),
])
def test_gguf_matches_transformers(tmp_path, arch, model_type, extra):
    """A tiny GGUF as llama.cpp writes the family: our checkpoint holds the tensors transformers' GGUF reader
    gives, and the bundle decodes greedily as HF does on that reading."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from engc.compiler.frontend.gguf import read_gguf
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
               num_key_value_heads=1, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **cfg))
    with torch.no_grad():   # random norms (HF makes them 0 or 1), so the +1 convention is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if arch.startswith("gemma") else 1.0))
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, arch, model, cfg, gemma=arch.startswith("gemma"))

    ckpt = read_gguf(path)
    assert ckpt.hf_config["model_type"] == model_type
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    for name, expected in ref.state_dict().items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        assert torch.equal(ckpt.get(name), expected), name
    build(str(path), tmp_path / "b", BuildOptions())
    ids = list(range(3, 40, 3))
    engine = Engine(load(tmp_path / "b"))
    seq = engine.add_request(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0))
    engine.run_to_completion()
    expected, hf_logits = list(ids), []   # the oracle: transformers' reading of the GGUF, a full forward a token
    with torch.no_grad():
        for _ in range(24):
            hf_logits.append(ref(torch.tensor([expected])).logits[0, -1])
            expected.append(int(hf_logits[-1].argmax()))
    expected, hf_logits = expected[len(ids):], torch.stack(hf_logits)
    assert seq.output_ids == expected
    theirs = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([s.logprob for s in seq.logprobs]), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3", "smollm3", "granite", "olmo2", "glm4",
                                    "ernie4_5", "exaone4", "cohere", "cohere2", "olmo3", "seed_oss", "ministral3"])
def test_bfloat16_matches_hf(family, tiny_dir, tmp_path):
    """A bfloat16 bundle on the CPU against HF in bfloat16, as tests/test_bf16_cpu.py checks the others: the
    same greedy tokens, the prompt's logits within a few bfloat16 ulps of the largest. Covers the (1 + weight)
    norms in float32 (the *UnitOffset ops), Gemma 2's soft-capped eager attention and the embedding scale
    rounded to bfloat16, and Granite's multipliers where bfloat16 holds them exactly (powers of two, as the
    released models' embedding and logits ones are: the residual one folded into o and down is then exact
    too). (The prompts avoid "The quick brown fox", where this tiny Gemma 3 meets an exact bfloat16 tie
    between two tokens at its 14th step.)"""
    from test_bf16_cpu import engine_greedy, hf_greedy as hf_cached_greedy, one_ulp
    exact = dict(embedding_multiplier=4.0, attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=2.0)
    # Cohere with Command R+'s per-head q/k LayerNorm (test_hf_parity checks it in float32 too)
    src = tiny_dir(family, **{"granite": exact, "cohere": {"use_qk_norm": True}}.get(family, {}))
    build(str(src), tmp_path / "b", BuildOptions(dtype="bfloat16"))
    model = load(tmp_path / "b")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    for text in ["Paris is the capital of", "Hello, world! How"]:
        ids = model.tokenizer.encode(text)
        ours, our_logits = engine_greedy(model, ids, 16)
        theirs, their_logits = hf_cached_greedy(hf, ids, 16)
        assert ours == theirs, text
        # one ulp here; up to three on a CPU whose bfloat16 GEMM kernels (chosen by its instruction set)
        # accumulate HF's eager soft-capped attention in another order (Gemma 2 on the H200 machine's CPU)
        assert float((our_logits - their_logits).abs().max()) < 4 * one_ulp(their_logits)


def test_gelu_tanh_mul_compiles_for_gpus(tiny_dir):
    """Gemma's GLU is silu_mul's 'gelu_tanh' variant: in a Gemma build's specs (and in no Llama one's), compiled
    for sm80 and sm90 with no GPU, its launch rule passing the kernel's runtime parameters."""
    from engc.compiler.codegen.aot import compile_spec
    from engc.compiler.codegen.specs import model_specs
    from engc.compiler.frontend.decoder import resolve_config
    from engc.kernels import silu_mul
    gemma = resolve_config(json.loads((tiny_dir("gemma3_text") / "config.json").read_text()))
    llama = resolve_config(json.loads((tiny_dir("llama") / "config.json").read_text()))
    assert [s.variant for s in model_specs(llama, torch.bfloat16, "sm90", 16) if s.op == "silu_mul"] == ["default"]
    for arch in ("sm80", "sm90"):
        (spec,) = [s for s in model_specs(gemma, torch.bfloat16, arch, 16) if s.variant == "gelu_tanh"]
        cubin, ptx, meta = compile_spec(spec)
        assert cubin[:4] == b"\x7fELF" and f".entry {meta['name']}(" in ptx
        (variant, grid, args), = silu_mul.launch(torch.empty(3, 2 * gemma.intermediate_size),
                                                 torch.empty(3, gemma.intermediate_size),
                                                 {"gelu_tanh": spec.launch}, "gelu_tanh")
        assert variant == spec.variant and grid[0] == 3
        assert len(args) - 2 == len([t for t in spec.signature().values() if t != "constexpr"])


def test_gemma_bundles_start_with_bos(tiny_bundle):
    """Gemma's tokenizer always adds BOS (as transformers' Gemma tokenizer does), even where tokenizer.json's
    post-processor does not (these tiny tokenizers have none); other families encode as tokenizer.json says."""
    for family in ("gemma2", "gemma3_text"):
        tok = load(tiny_bundle(family)).tokenizer
        assert tok.encode("Paris is")[0] == 0 and tok.encode("Paris is", add_special_tokens=False)[0] != 0
    assert load(tiny_bundle("phi3")).tokenizer.encode("Paris is")[0] != 0


def test_cohere_qk_layer_norm_needs_no_qk_norm_kernel(tiny_dir):
    """Command R+'s per-head q/k LayerNorm is a QKLayerNorm node (layer_norm's reference on every device):
    a GPU build compiles no qk_norm kernel for it, which would serve no node."""
    from engc.compiler.codegen.specs import model_specs
    from engc.compiler.frontend.decoder import resolve_config
    cfg = resolve_config(json.loads((tiny_dir("cohere", use_qk_norm=True) / "config.json").read_text()))
    assert cfg.qk_norm and cfg.layer_norm
    assert not [s for s in model_specs(cfg, torch.bfloat16, "sm90", 16) if s.op == "qk_norm"]


@pytest.mark.parametrize("extra,refused", [
    ("self_attn.o_proj.bias", True),     # Llama's attention_bias puts one on o_proj too: not computed
    ("mlp.down_proj.bias", True),        # mlp_bias
    ("self_attn.o_proj.bias", False),    # all zeros: computes nothing, builds
    ("self_attn.rotary_emb.inv_freq", False),   # a rotary table older checkpoints saved
], ids=["o-bias", "mlp-bias", "zero-bias", "rotary-table"])
def test_layer_tensor_the_model_does_not_compute_is_refused(tiny_dir, tmp_path, extra, refused):
    """A checkpoint tensor of a decoder layer that the lowering never reads is a part of the network engc
    would leave out: the build refuses it in one line, naming it, rather than build another model."""
    src = tiny_dir("llama")
    cfg = json.loads((src / "config.json").read_text())
    name = f"model.layers.1.{extra}"

    def add(t):
        t[name] = (torch.ones if refused else torch.zeros)(cfg["hidden_size"] if "bias" in extra else 8)
        return t
    _relaid(src, tmp_path / "m", cfg, add)
    if not refused:
        build(str(tmp_path / "m"), tmp_path / "b", BuildOptions())
        return
    with pytest.raises(UserError, match=f"has tensor '{name}'.*does not compute") as e:
        build(str(tmp_path / "m"), tmp_path / "b", BuildOptions())
    assert "\n" not in str(e.value)
