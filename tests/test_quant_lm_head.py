"""engc quantize --lm-head: an int4 lm_head in GPTQModel's form (`lm_head: true`, lm_head.qweight/qzeros/scales
[/g_idx]) -> engc build lowers it to the same QLinear as the projections -> the bundle's logits.

The oracle is transformers' float model with every weight, the head included, dequantized from our files
by test_quant_e2e's own unpacking code. transformers loads a GPTQ checkpoint (and so a quantized head)
only through gptqmodel, which is not installed here (docs/quantization.md).
"""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from engc.bundle.program import parse_program
from engc.cli import main
from engc.compiler.build import BuildOptions, build
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.stream import quantize_checkpoint
from tests.test_quant_e2e import CALIB, bundle_logits, dequant_awq, dequant_gptq, float_model_of

transformers = pytest.importorskip("transformers")


def tensors_of(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("family,method,extra", [
    ("llama", "gptq", {}), ("llama", "awq", {}), ("llama", "rtn", {}),
    ("qwen2", "gptq", {"act_order": True, "static_groups": False}), ("mistral", "awq", {}),
], ids=["llama-tied-gptq", "llama-tied-awq", "llama-tied-rtn", "qwen2-gptq-act-order", "mistral-awq"])
def test_quantized_lm_head_bundle_matches_dequantized_hf(family, method, extra, tiny_dir, tmp_path):
    src = tiny_dir(family)
    src_cfg = json.loads((src / "config.json").read_text())
    ckpt = tmp_path / "q"
    summary = quantize_checkpoint(str(src), ckpt, QuantOptions(method=method, group_size=32, lm_head=True,
                                                               **CALIB, **extra))
    assert summary["lm_head"]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["lm_head"] is True and cfg["tie_word_embeddings"] is False
    if method != "awq":
        assert json.loads((ckpt / "quantize_config.json").read_text())["lm_head"] is True
    t = tensors_of(ckpt)
    vocab, hidden = src_cfg["vocab_size"], src_cfg["hidden_size"]
    assert "lm_head.weight" not in t and "model.embed_tokens.weight" in t   # the embedding stays float
    assert t["model.embed_tokens.weight"].dtype == torch.float32
    same = tensors_of(src)
    assert torch.equal(t["model.embed_tokens.weight"], same["model.embed_tokens.weight"])
    if method == "awq":
        assert t["lm_head.qweight"].shape == (hidden, vocab // 8)
    else:
        assert t["lm_head.qweight"].shape == (hidden // 8, vocab) and t["lm_head.g_idx"].shape == (hidden,)
    assert t["lm_head.scales"].shape == (hidden // 32, vocab) and t["lm_head.qzeros"].shape == (hidden // 32, vocab // 8)
    # the head is an int4 approximation of the source's head (the embedding where tied), not something else
    head = dequant_awq(t, "lm_head.", 32) if method == "awq" else dequant_gptq(t, "lm_head.")
    source_head = same.get("lm_head.weight", same["model.embed_tokens.weight"])
    if method == "awq":  # the AWQ scales sit in the final norm: compare the products
        head = head * t["model.norm.weight"].float()
        source_head = source_head * same["model.norm.weight"].float()
    rel = (head - source_head).norm() / source_head.norm()
    assert rel < 0.15, rel

    build(str(ckpt), tmp_path / "b", BuildOptions())
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["quantization"]["lm_head"] is True and manifest["model"]["tie_word_embeddings"] is False
    program = parse_program((tmp_path / "b" / "program.onnx").read_bytes())
    # the step form's nodes (the decode form repeats the head over every row: passes/decode_form)
    ops = [n.op for n in program.nodes if not n.outputs[0].endswith(".decode")]
    assert [n.op for n in program.nodes if n.outputs[0] == "logits.decode"] == ["QLinear"]
    # qkv, and gate_up with its SiLU (QLinearSiluMul), act-order or not (its parts share one permutation); o
    # and down with the norm after each (QLinearAddRMSNorm), but act-order's, which stay QLinears
    assert "Gemm" not in ops and ops.count("QLinear") == (3 if extra else 1) * 2 + 1
    assert ops.count("QLinearSiluMul") == 2
    assert ops.count("QLinearAddRMSNorm") == (0 if extra else 2 * 2)
    last = next(n for n in program.nodes if n.op == "QLinear" and n.inputs[1] == "lm_head.qweight")
    assert last.inputs[0] == "h.sampled"
    ids = list(range(3, 40))
    ours = bundle_logits(tmp_path / "b", ids)
    with torch.no_grad():
        theirs = float_model_of(ckpt, 32)(torch.tensor([ids])).logits[0]
    assert ours.shape == (len(ids), vocab)
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_without_lm_head_flag_the_head_stays_float(tiny_dir, tmp_path):
    quantize_checkpoint(str(tiny_dir("mistral")), tmp_path / "q", QuantOptions(method="rtn", group_size=32))
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["lm_head"] is False
    t = tensors_of(tmp_path / "q")
    assert "lm_head.weight" in t and "lm_head.qweight" not in t


def test_quantized_head_bundle_bf16_logits_close_to_float_head(tiny_dir, tmp_path):
    """The CPU path of a bf16 bundle (the GPU's dtype): the int4 head's logits stay close to the float-head
    bundle's of the same quantized layers, and greedy tokens mostly agree."""
    src = str(tiny_dir("llama"))
    quantize_checkpoint(src, tmp_path / "q", QuantOptions(method="rtn", group_size=32))
    quantize_checkpoint(src, tmp_path / "qh", QuantOptions(method="rtn", group_size=32, lm_head=True))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions(dtype="bfloat16"))
    build(str(tmp_path / "qh"), tmp_path / "bh", BuildOptions(dtype="bfloat16"))
    ids = list(range(3, 60))
    a, b = bundle_logits(tmp_path / "b", ids), bundle_logits(tmp_path / "bh", ids)
    assert b.dtype == torch.float32
    assert ((a - b).norm() / a.norm()) < 0.2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.7


def test_lm_head_cli_and_vocab_not_multiple_of_8(tiny_dir, tmp_path):
    out = CliRunner().invoke(main, ["quantize", str(tiny_dir("llama")), "-o", str(tmp_path / "o"), "--method", "rtn",
                                    "--group-size", "32", "--lm-head", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["lm_head"] is True
    odd = tiny_dir("mistral", vocab_size=321)
    out = CliRunner().invoke(main, ["quantize", str(odd), "-o", str(tmp_path / "o2"), "--method", "rtn",
                                    "--group-size", "32", "--lm-head"])
    assert out.exit_code == 1, out.output
    assert out.output.count("\n") == 1 and out.output.startswith("engc: error: --lm-head: vocab_size 321")
    assert not (tmp_path / "o2").exists()


def test_int4_lm_head_program_builds_no_dense_gemv(tiny_dir, tmp_path):
    """With the head int4 too, no dense Gemm is left: a GPU build (Triton AOT for sm90, no GPU needed)
    compiles int4_linear but no gemv / skinny_gemm, and engc tune has no GEMV to tune."""
    from engc.compiler.tune import plan
    from engc.compiler.tune.plan import model_config
    quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(method="rtn", group_size=32,
                                                                            lm_head=True))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions(archs=("sm90",), dtype="bfloat16"))
    ops = {k["op"] for k in json.loads((tmp_path / "b" / "manifest.json").read_text())["kernels"]}
    assert "int4_linear" in ops and "argmax" in ops and not ops & {"gemv", "skinny_gemm"}
    cfg = model_config(json.loads((tmp_path / "q" / "config.json").read_text()))
    assert plan.model_shapes(cfg, ("gemv", "silu_gemv"), int4=True, int4_lm_head=True) == []
    assert [s.name for s in plan.model_shapes(cfg, ("gemv",), int4=True)] == ["lm_head"]


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_head_quantized_in_chunks_of_rows_as_if_whole(method, monkeypatch):
    """The head is never float32 all at once (one chunk of rows at a time): the chunks give the head the
    whole matrix would have."""
    from engc.compiler.quantize import head
    from engc.compiler.quantize.formats import to_awq, to_gptq
    torch.manual_seed(0)
    w, norm = torch.randn(96, 64).to(torch.bfloat16), 1 + 0.1 * torch.randn(64)
    x = torch.randn(2, 16, 64) * torch.linspace(0.2, 3, 64)   # a few loud channels, as AWQ expects
    opts = QuantOptions(method=method, group_size=32, lm_head=True, awq_grid=10)
    pack = to_awq if method == "awq" else to_gptq
    whole = head.quantize_head(w, norm, x, 1e-5, opts, pack)
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", 16 * 64)    # 16 rows a chunk: 6 chunks
    assert head.chunk_rows(64) == 16
    chunked = head.quantize_head(w, norm, x, 1e-5, opts, pack)
    assert whole.keys() == chunked.keys()
    for k in whole:
        assert torch.equal(whole[k], chunked[k]), k


def test_calibrated_head_is_gptq_and_beats_rtn_on_its_inputs():
    """AWQ and GPTQ runs quantize the head by GPTQ on the final norm's outputs: the same codes in either
    layout, and a smaller output error on those inputs than round-to-nearest."""
    from engc.compiler.quantize import head
    from engc.compiler.quantize.formats import to_awq, to_gptq
    from tests.test_quant_e2e import dequant_awq, dequant_gptq
    torch.manual_seed(0)
    w, norm = torch.randn(96, 64), 1 + 0.1 * torch.randn(64)
    x = torch.randn(4, 32, 16) @ torch.randn(16, 64) + 0.1 * torch.randn(4, 32, 64)  # correlated inputs
    heads = {}
    for method, pack, unpack in (("gptq", to_gptq, dequant_gptq), ("awq", to_awq, lambda t, p: dequant_awq(t, p, 32)),
                                 ("rtn", to_gptq, dequant_gptq)):
        t = head.quantize_head(w, norm, x, 1e-5, QuantOptions(method=method, group_size=32, lm_head=True), pack)
        heads[method] = unpack({"h." + k: v for k, v in t.items()}, "h.")
    assert torch.equal(heads["gptq"], heads["awq"])
    h = torch.nn.functional.rms_norm(x, (64,), norm, 1e-5).reshape(-1, 64)
    err = {m: ((h @ (q - w).T).norm() / (h @ w.T).norm()).item() for m, q in heads.items()}
    assert err["gptq"] < 0.8 * err["rtn"], err


def _gpu_ready() -> bool:
    from engc.cuda.cubin import cuda_available
    return torch.cuda.is_available() and cuda_available()


@pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA device and engc._native")
def test_gpu_int4_lm_head_vocab_sized(tiny_dir, tmp_path):
    """On the GPU: an int4-head bundle's logits against the CPU path of the same bundle, and its QLinear
    kernels (the runtime's launch rule) on a Llama-3-sized head, N = 128256, K = 4096, against float64."""
    import os
    from engc.bundle.reader import open_bundle
    from engc.kernels import int4_linear as op
    from engc.runtime.gpu_ops import BundleKernels
    from engc.runtime.loader import load
    from test_gpu import sm_arch
    quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(method="rtn", group_size=32,
                                                                            lm_head=True))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions(archs=("cpu", sm_arch()), dtype="bfloat16",
                                                            kernel_cache=os.environ.get("ENGC_KERNEL_CACHE")))
    ids = list(range(3, 60))
    from engc.runtime.eval import _forward
    from engc.runtime.kv_cache import KVCache
    logits = {}
    for device in ("cpu", "cuda"):
        model = load(tmp_path / "b", device=device)
        kv = KVCache(model.config, 8, model.block_size, model.dtype, device=model.device)
        logits[device] = _forward(model, kv, ids).float().cpu()
    a, b = logits["cpu"], logits["cuda"]
    assert ((a - b).norm() / a.norm()) < 2e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9

    kernels = BundleKernels(open_bundle(tmp_path / "b"), sm_arch())
    consts = kernels.consts["int4_linear"]
    gen = torch.Generator().manual_seed(0)
    n, k = 128256, 4096
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 32), generator=gen).to(torch.uint8)
    w = [t.cuda() for t in (op.pack_int4(q), scales, zeros)]
    del q
    ref_w = op.dequantize(*w, 32).float()
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    for rows in (1, 4, 8, 64):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
        y = op.run_quantized_linear(x, *w, None, group_size=32, consts=consts,
                                    run=lambda launches: kernels.run("int4_linear", launches), counters=counters)
        ref = (x.double() @ ref_w.t().double())
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (rows, err)
        assert counters.eq(0).all(), rows
