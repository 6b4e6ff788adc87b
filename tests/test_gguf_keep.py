"""engc build x.gguf --quant keep: Q4_0 / Q4_1 / Q4_K projections kept 4-bit (frontend/gguf_quant.py), against
transformers' model loaded from the same GGUF (which dequantizes it): the kept weights are exact, so logits
agree to float rounding."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from test_gguf import _write_tiny_gguf  # noqa: E402
from test_gpu import gpu_ready, sm_arch  # noqa: E402

from engc.compiler.build import BuildOptions, build  # noqa: E402
from engc.compiler.frontend.gguf import read_gguf  # noqa: E402
from engc.kernels import int4_linear  # noqa: E402
from engc.kernels.int4_linear import dequantize  # noqa: E402
from engc.runtime.engine import Engine  # noqa: E402
from engc.runtime.loader import load  # noqa: E402
from engc.runtime.sampling import SamplingParams  # noqa: E402

# Layer 0 mixes every kept type (its qkv and gate_up stay unfused); layer 1 is all Q4_1, as in the default
# model (fused qkv and gate_up with offsets); the untied head is Q4_0 (an int4 lm_head); the embedding is
# Q8_0, which is dequantized.
TYPES = {"blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q4_1", "blk.0.attn_v": "Q4_K", "blk.0.attn_output": "Q4_K",
         "blk.0.ffn_gate": "Q4_0", "blk.0.ffn_up": "Q4_1", "blk.0.ffn_down": "Q4_K", "output": "Q4_0",
         "token_embd": "Q8_0", **{f"blk.1.{p}": "Q4_1" for p in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                  "ffn_gate", "ffn_up", "ffn_down")}}
CFG = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=256,
           tie_word_embeddings=False)


def _q4_k_blocks(rows: int, inputs: int, rng) -> np.ndarray:
    """Random Q4_K super-blocks (gguf-py has no Q4_K quantizer): fp16 d and dmin, 12 bytes of 6-bit
    scales and mins, 128 bytes of codes, 144 bytes a 256 inputs."""
    blocks = rows * inputs // 256
    half = lambda: rng.uniform(1e-4, 3e-4, (blocks, 1)).astype(np.float16).view(np.uint8)  # noqa: E731
    raw = np.concatenate([half(), half(), rng.integers(0, 256, (blocks, 140), dtype=np.uint8)], axis=1)
    return raw.reshape(rows, inputs // 256 * 144)


def _encoder(seed: int = 0):
    import gguf
    rng = np.random.default_rng(seed)

    def encode(name: str, array: np.ndarray):
        kind = TYPES.get(name.rsplit(".", 1)[0])
        if kind is None or array.ndim != 2:
            return array, None
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "Q4_K":
            return _q4_k_blocks(*array.shape, rng), qtype
        return gguf.quants.quantize(array, qtype), qtype
    return encode


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **CFG))
    path = tmp_path_factory.mktemp("gguf_keep") / "tiny-q4.gguf"
    _write_tiny_gguf(path, "llama", model.state_dict(), CFG, encode=_encoder())
    return path


def _manifest(bundle) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def _last_logits(bundle, prompts):
    model = load(bundle)
    engine = Engine(model)
    out = []
    for ids in prompts:
        seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        inputs, _, _ = engine.runner.inputs(engine.scheduler.schedule())
        with torch.inference_mode():
            out.append(engine.runner.executor.forward(inputs, engine.kv.layers)[0])
        engine.abort(seq.request_id)
    return out


def _worst_relative_error(bundle, hf, prompts) -> float:
    worst = 0.0
    with torch.no_grad():
        for ids, ours in zip(prompts, _last_logits(bundle, prompts)):
            theirs = hf(torch.tensor([ids])).logits[0, -1]
            worst = max(worst, float((ours - theirs).abs().max() / theirs.abs().max()))
    return worst


def test_kept_parts_dequantize_as_gguf_does(tiny_gguf):
    """Every kept projection's engc int4 tensors dequantize to gguf-py's own float weights, bit for bit."""
    kept, floats = read_gguf(tiny_gguf, keep_quant=True), read_gguf(tiny_gguf)
    prefixes = sorted(n.removesuffix(".qweight") for n in kept.names() if n.endswith(".qweight"))
    assert len(prefixes) == 15   # 7 projections a layer and the head; the Q8_0 embedding is float
    for p in prefixes:
        offsets = kept.get(f"{p}.offsets") if kept.has(f"{p}.offsets") else None
        w = dequantize(kept.get(f"{p}.qweight"), kept.get(f"{p}.scales"), kept.get(f"{p}.zeros"), 32, offsets)
        assert torch.equal(w, floats.get(f"{p}.weight")), p
    assert not kept.has("model.layers.0.self_attn.q_proj.offsets")   # Q4_0: zero point 8, no offsets
    assert kept.hf_config["quantization_config"]["dequantized"] == {"token_embd.weight": "Q8_0"}


def test_kept_bundle_matches_transformers_and_is_smaller(tiny_gguf, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                           dtype=torch.float32).eval()
    build(str(tiny_gguf), tmp_path / "keep", BuildOptions(quant="keep"))
    summary = build(str(tiny_gguf), tmp_path / "float", BuildOptions())
    q = _manifest(tmp_path / "keep")["quantization"]
    assert (q["method"], q["bits"], q["group_size"], q["lm_head"]) == ("gguf-q4_0+q4_1+q4_k", 4, 32, True)
    assert q["layout"] == int4_linear.LAYOUT_WITH_OFFSETS
    assert q["kept"] == {"Q4_0": 3, "Q4_1": 9, "Q4_K": 3} and q["dequantized"] == {"token_embd.weight": "Q8_0"}
    assert _manifest(tmp_path / "float")["quantization"] is None
    kept_bytes = sum(f.stat().st_size for f in (tmp_path / "keep").rglob("*") if f.is_file())
    assert kept_bytes < summary["bytes"] / 2

    prompts = [[5, 17, 99, 3, 64, 12], list(range(1, 40, 3))]
    worst = _worst_relative_error(tmp_path / "keep", hf, prompts)
    print(f"max relative logit error: {worst:.3e}")
    assert worst < 1e-5, worst


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
def test_gpu_kept_bundle_matches_cpu_reference(tiny_gguf, tmp_path):
    """The GPU binding (the int4 kernels plus the offsets' term) against the CPU reference, in float32."""
    build(str(tiny_gguf), tmp_path / "b", BuildOptions(archs=("cpu", sm_arch()), dtype="float32", quant="keep",
                                                       kernel_cache=os.environ.get("ENGC_KERNEL_CACHE")))
    prompts = [[5, 17, 99, 3, 64, 12], list(range(1, 40, 3)), [7]]

    def greedy(device):
        engine = Engine(load(tmp_path / "b", device=device))
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run_to_completion()
        return [s.output_ids for s in seqs]
    assert greedy("cuda") == greedy("cpu")


def test_q4_0_alone_needs_no_offsets(tmp_path):
    """Q4_0 is the int4 layout as AWQ/GPTQ fill it (zero point 8): no offsets, the plain layout name."""
    transformers = pytest.importorskip("transformers")
    import gguf
    cfg = {**CFG, "hidden_size": 64, "intermediate_size": 96, "head_dim": 16}
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **cfg))
    path = tmp_path / "q4_0.gguf"
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    _write_tiny_gguf(path, "llama", model.state_dict(), cfg, encode=lambda name, a: (
        (gguf.quants.quantize(a, q4_0), q4_0) if a.ndim == 2 and name != "token_embd.weight" else (a, None)))
    build(str(path), tmp_path / "b", BuildOptions(quant="keep"))
    q = _manifest(tmp_path / "b")["quantization"]
    assert (q["method"], q["layout"], q["kept"]) == ("gguf-q4_0", int4_linear.LAYOUT, {"Q4_0": 15})
    assert b"has_offsets" not in (tmp_path / "b" / "program.onnx").read_bytes()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    assert _worst_relative_error(tmp_path / "b", hf, [[5, 17, 99, 3, 64, 12]]) < 1e-5


def test_quant_keep_of_a_float_gguf_keeps_nothing(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = {**CFG, "hidden_size": 64, "intermediate_size": 96, "head_dim": 16}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **cfg))
    path = tmp_path / "f32.gguf"
    _write_tiny_gguf(path, "llama", model.state_dict(), cfg)
    build(str(path), tmp_path / "b", BuildOptions(quant="keep"))
    assert _manifest(tmp_path / "b")["quantization"] is None


@pytest.fixture(scope="module")
def default_kept(tmp_path_factory):
    """The real SmolLM2-135M-Instruct Q4_1 GGUF built with its quantization kept."""
    from engc.compiler.frontend.default_model import default_gguf_path
    from engc.errors import UserError
    try:
        default_gguf_path()
    except UserError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("default_kept") / "smollm2-q4_1"
    build("default", out, BuildOptions(quant="keep"))
    return out


def test_default_model_kept_q4_1_matches_transformers(default_kept, default_bundle):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from engc.compiler.frontend.default_model import default_gguf_path
    path = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    model = load(default_kept)
    q = _manifest(default_kept)["quantization"]
    assert (q["method"], q["kept"], q["dequantized"]) == ("gguf-q4_1", {"Q4_1": 210}, {"token_embd.weight": "Q8_0"})
    chat = model.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    worst = _worst_relative_error(default_kept, hf, [chat, model.tokenizer.encode("def fibonacci(n):")])
    print(f"max relative logit error: {worst:.3e}")
    assert worst < 1e-5, worst

    kept_bytes = sum(f.stat().st_size for f in default_kept.rglob("*") if f.is_file())
    float_bytes = sum(f.stat().st_size for f in default_bundle.rglob("*") if f.is_file())
    assert kept_bytes < 0.45 * float_bytes, (kept_bytes, float_bytes)


def test_default_model_kept_answers_paris(default_kept):
    from engc.llm import LLM
    [done] = LLM(default_kept).generate("What is the capital of France?",
                                        SamplingParams(max_tokens=8, temperature=0), chat=True)
    assert done.text.startswith("The capital of France is Paris"), done.text
