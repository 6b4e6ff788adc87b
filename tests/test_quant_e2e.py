"""engc quantize -> checkpoint in the AutoAWQ / GPTQ layouts -> engc build -> bundle, on tiny models.

The oracle is transformers' float model with weights dequantized from our checkpoint files by the
unpacking code below, written from the format descriptions independently of engc's own. (transformers
itself loads GPTQ only through gptqmodel, whose install replaces torch with a CUDA build; see
docs/quantization.md.)
"""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from engc.cli import main
from engc.compiler.build import BuildOptions, build
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.stream import quantize_checkpoint
from engc.runtime.eval import EvalOptions, _forward, perplexity
from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import load

transformers = pytest.importorskip("transformers")

CALIB = dict(calib_samples=8, calib_seqlen=32, awq_grid=10)


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., c] -> [..., c, 8], nibble i = bits 4i..4i+3."""
    return torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1)


def dequant_gptq(t: dict, p: str) -> torch.Tensor:
    q = nibbles(t[p + "qweight"]).permute(0, 2, 1).reshape(-1, t[p + "qweight"].shape[1])  # [in, out]
    z = (nibbles(t[p + "qzeros"]).reshape(t[p + "qzeros"].shape[0], -1) + 1) & 15
    g = t[p + "g_idx"].long()
    return ((q - z[g]).float() * t[p + "scales"].float()[g]).T


def dequant_awq(t: dict, p: str, group: int) -> torch.Tensor:
    undo = [0, 4, 1, 5, 2, 6, 3, 7]  # nibble i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]
    q = nibbles(t[p + "qweight"])[..., undo].reshape(t[p + "qweight"].shape[0], -1)
    z = nibbles(t[p + "qzeros"])[..., undo].reshape(t[p + "qzeros"].shape[0], -1)
    return ((q - z.repeat_interleave(group, 0)).float() * t[p + "scales"].float().repeat_interleave(group, 0)).T


def float_model_of(folder, group):
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    state = {k: v.float() for k, v in tensors.items() if not k.endswith(("qweight", "qzeros", "scales", "g_idx"))}
    for name in [k[:-len("qweight")] for k in tensors if k.endswith("qweight")]:
        w = dequant_awq(tensors, name, group) if qc["quant_method"] == "awq" else dequant_gptq(tensors, name)
        state[name + "weight"] = w
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    if missing:
        model.tie_weights()
    return model


def bundle_logits(bundle, ids):
    model = load(bundle)
    kv = KVCache(model.config, 8, model.block_size, model.dtype)
    return _forward(model, kv, ids)


@pytest.mark.parametrize("family,method,extra", [
    ("llama", "gptq", {}), ("llama", "awq", {}), ("qwen2", "gptq", {"act_order": True, "static_groups": False}),
    ("qwen2", "gptq", {"act_order": True}), ("qwen3", "awq", {}), ("mistral", "rtn", {}),
], ids=["llama-gptq", "llama-awq", "qwen2-gptq-act-order", "qwen2-gptq-act-order-static", "qwen3-awq", "mistral-rtn"])
def test_quantized_bundle_matches_dequantized_hf(family, method, extra, tiny_dir, tmp_path):
    src = tiny_dir(family)
    ckpt = tmp_path / "q"
    summary = quantize_checkpoint(str(src), ckpt, QuantOptions(method=method, group_size=32, **CALIB, **extra))
    assert summary["peak_rss_mb"] > 0
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == ("awq" if method == "awq" else "gptq")
    if method != "awq":
        # act-order: GPTQ's default, RTN's never
        assert json.loads((ckpt / "quantize_config.json").read_text())["desc_act"] == (method == "gptq")
    build(str(ckpt), tmp_path / "b", BuildOptions())
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["quantization"]["method"] == method and manifest["quantization"]["group_size"] == 32
    from engc.bundle.program import parse_program
    gathers = [n for n in parse_program((tmp_path / "b" / "program.onnx").read_bytes()).nodes if n.attrs.get("act_order")]
    # act-order's groups in their own order gather x at run time; static groups (the default) need nothing
    assert bool(gathers) == (extra.get("static_groups") is False)
    ids = list(range(3, 40))
    ours = bundle_logits(tmp_path / "b", ids)
    with torch.no_grad():
        theirs = float_model_of(ckpt, 32)(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_quantized_program_fuses_qkv_and_gate_up(tiny_dir, tmp_path):
    from engc.bundle.program import parse_program
    quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(method="rtn", group_size=32))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    program = parse_program((tmp_path / "b" / "program.onnx").read_bytes())
    ops = [n.op for n in program.nodes]
    # qkv per layer; gate_up with its SiLU-and-mul (passes/fuse_qlinear_silu_mul); o and down with the residual
    # add and norm after each (passes/fuse_qlinear_add_norm); the lm_head a Gemm
    assert ops.count("QLinear") == 2 and ops.count("QLinearSiluMul") == 2 and "SiluMul" not in ops
    assert ops.count("QLinearAddRMSNorm") == 2 * 2 and "AddRMSNorm" not in ops
    assert "Gemm" in ops and "Concat" not in ops


def test_act_order_projections_of_one_input_fuse_with_their_one_permutation(tiny_dir, tmp_path):
    """GPTQ act-order without static groups orders q, k and v's inputs (and gate and up's) by one Hessian: the
    parts fuse, keeping one perm (test_quantized_bundle_matches_dequantized_hf checks the numbers)."""
    from engc.bundle.program import parse_program
    quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(
        method="gptq", group_size=32, act_order=True, static_groups=False, **CALIB))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    program = parse_program((tmp_path / "b" / "program.onnx").read_bytes())
    assert "Concat" not in [n.op for n in program.nodes]
    perms = [w for n in program.nodes for w in n.inputs if w.endswith(".perm")]
    assert len(perms) == 2 * 4   # a layer's qkv, gate_up, o and down


def test_eval_reports_same_ppl_for_float_and_close_for_int4(tiny_dir, tiny_bundle, tmp_path):
    text = " ".join(["The quick brown fox jumps over the lazy dog. Paris is the capital of France."] * 8)
    quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(method="gptq", group_size=32, **CALIB))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    opts = EvalOptions(window=64, stride=32)
    fp = perplexity(load(tiny_bundle("llama")), text, opts)
    q = perplexity(load(tmp_path / "b"), text, opts)
    assert fp["scored"] == q["scored"] == fp["tokens"] - 1 and fp["windows"] > 2
    assert abs(q["ppl"] / fp["ppl"] - 1) < 0.5
    out = CliRunner().invoke(main, ["eval", str(tiny_bundle("llama")), "--ppl", str(_write(tmp_path, text)),
                                    "--window", "64", "--stride", "32", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["ppl"] == pytest.approx(fp["ppl"], rel=1e-6)
    for words, line in (("hi", "over 1 token (1 window of 64,"), (text, f"tokens ({fp['windows']} windows of 64,")):
        out = CliRunner().invoke(main, ["eval", str(tiny_bundle("llama")), "--ppl", str(_write(tmp_path, words)),
                                        "--window", "64", "--stride", "32"])
        assert out.exit_code == 0 and line in out.output, out.output


def _write(tmp_path, text, name="t.txt"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("args,message", [
    (["--method", "hqq"], "unknown quantization method 'hqq'"),
    (["--bits", "3"], "--bits 3 is not supported"),
    (["--group-size", "48"], "--group-size 48 is not supported"),
    (["--calib", "/nonexistent/calib.txt"], "no such file"),
    (["--calib", "SHORT"], "tokens; 64 samples of 256 tokens need"),
    (["--act-order"], "--act-order applies to --method gptq only"),
], ids=["method", "bits", "group-size", "calib-missing", "calib-short", "act-order"])
def test_bad_input_is_one_line(args, message, tiny_dir, tmp_path):
    args = [str(_write(tmp_path, "too short")) if a == "SHORT" else a for a in args]
    out = CliRunner().invoke(main, ["quantize", str(tiny_dir("llama")), "-o", str(tmp_path / "o"),
                                    "--group-size", "32", *args])
    assert out.exit_code == 1, out.output
    assert out.output.count("\n") == 1 and out.output.startswith("engc: error:") and message in out.output


def test_already_quantized_is_refused(tiny_dir, tmp_path):
    quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(method="rtn", group_size=32))
    out = CliRunner().invoke(main, ["quantize", str(tmp_path / "q"), "-o", str(tmp_path / "o2"), "--method", "rtn",
                                    "--group-size", "32"])
    assert out.exit_code == 1 and "already quantized (gptq)" in out.output and out.output.count("\n") == 1


def test_eval_forward_describes_its_prefill_to_gpu_kernels():
    """On a GPU model the kernels size their grids from host-side step facts; eval's prefill of one window
    must set them first (left at the defaults, a decode step, the attention wrote nothing for its rows)."""
    from types import SimpleNamespace
    from engc.runtime.gpu_ops import StepFacts
    seen = []
    facts = StepFacts()
    model = SimpleNamespace(device="cpu", block_size=16, step_facts=facts, executor=SimpleNamespace(
        forward=lambda inputs, layers: seen.append((facts.max_query_len, facts.max_context_len,
                                                    facts.has_decode_rows))))
    _forward(model, SimpleNamespace(layers=[]), list(range(40)))
    assert seen == [(40, 40, False)]
    _forward(model, SimpleNamespace(layers=[]), [7])
    assert seen[-1] == (1, 1, True)
