"""passes/fuse_fp8_input_quant: an fp8 program's norms and SiLU-and-mul write their FP8Linear's input quantized.
The pass's rewrite, the fused program's logits bit-identical to the unfused one's (CPU reference path), and the
kernels (rms_norm's fp8 variants, fp8_quant's SILU variant) bit for bit against those references with
TRITON_INTERPRET=1 (this file's __main__ part, run as a child)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engc.runtime.eval import _forward
from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import load
from interpreted import interpreted_report

# name -> (op, dtype, row width, a zero row)
KERNEL_CASES = {"rms_norm_bf16_h96": ("rms_norm", "bf16", 96, False),
                "add_rms_norm_bf16_h96": ("add_rms_norm", "bf16", 96, False),
                "add_rms_norm_fp32_h200_zero_row": ("add_rms_norm", "fp32", 200, True),
                "silu_bf16_k96": ("silu", "bf16", 96, False),
                "silu_fp16_k300_zero_row": ("silu", "fp16", 300, True)}


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    return interpreted_report(__file__, timeout=600)


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_quantizing_kernels_match_references(report, case):
    assert report[case]["ok"], report[case]


def _build(tiny_dir, out, monkeypatch=None, fuse=True, family="llama"):
    from engc.compiler import build as build_module
    from engc.compiler.build import BuildOptions, build
    if not fuse:
        monkeypatch.setattr(build_module, "fuse_fp8_input_quant", lambda g: g)
    build(str(tiny_dir(family)), out, BuildOptions(quant="fp8", dtype="bfloat16"))
    if not fuse:
        monkeypatch.undo()
    return load(out)


@pytest.mark.parametrize("family", ["llama", "qwen2"])   # qwen2: biased qkv, FP8LinearQ carries the bias
def test_fused_program_gives_the_same_logits(tiny_dir, tmp_path, monkeypatch, family):
    fused = _build(tiny_dir, tmp_path / "fused", family=family)
    plain = _build(tiny_dir, tmp_path / "plain", monkeypatch, fuse=False, family=family)
    ops = [n.op for n in fused.executor.program.nodes]
    layers = fused.config.num_layers
    # layer 0's input norm has no residual; every other norm inside the layers adds one; o keeps FP8Linear
    assert (ops.count("RMSNormFP8"), ops.count("AddRMSNormFP8"), ops.count("SiluMulFP8")) == (1, 2 * layers - 1, layers)
    assert ops.count("FP8LinearQ") == 3 * layers and ops.count("FP8Linear") == layers
    assert "SiluMul" not in ops and ops.count("AddRMSNorm") == 1   # the final norm feeds the float lm_head
    assert "fuse_fp8_input_quant" in json.loads((tmp_path / "fused/manifest.json").read_text())["passes"]
    assert [n.op for n in plain.executor.program.nodes].count("FP8Linear") == 4 * layers
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = lambda m: KVCache(m.config, 8, m.block_size, m.dtype, m.device)  # noqa: E731
    a, b = _forward(fused, kv(fused), ids), _forward(plain, kv(plain), ids)
    assert fused.dtype == torch.bfloat16 and torch.equal(a, b)   # the same codes and scales: the same bits


def test_pass_leaves_other_readers_alone():
    """A norm output read by anything besides one FP8Linear (or a graph output) keeps its float value."""
    from engc.compiler.ir import Graph
    from engc.compiler.passes.fuse_fp8_input_quant import fuse_fp8_input_quant
    g = Graph(dtype="bfloat16")
    g.weights.update({n: (lambda: torch.zeros(1)) for n in ("w", "n", "s", "w2", "s2")})
    g.add("RMSNorm", ["input_ids", "n"], "h", eps=1e-6)
    g.add("FP8Linear", ["h", "w", "s"], "y", has_bias=False)
    g.add("FP8Linear", ["h", "w2", "s2"], "y2", has_bias=False)   # a second reader of h
    g.add("SiluMul", ["y"], "a")
    g.add("FP8Linear", ["a", "w", "s"], "logits", has_bias=False)
    fuse_fp8_input_quant(g)
    assert [n.op for n in g.nodes] == ["RMSNorm", "FP8Linear", "FP8Linear", "SiluMulFP8", "FP8LinearQ"]
    assert g.nodes[-1].inputs[:2] == ["a.fp8", "a.fp8_scale"] and g.nodes[-1].attrs["dtype"] == 16


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def _run_cases() -> dict:
    """Each fused kernel against the unfused pair it replaces: the norm's plain variant (or silu_mul_kernel),
    then the activation quant's reference (bit-exact with fp8_quant_kernel, tests/test_fp8.py). Not against
    torch's norm: the kernel's rstd differs from torch.rsqrt in the last bit, the same with or without fp8."""
    from engc.bundle.model_config import ModelConfig
    from engc.compiler.codegen.kernel_spec import TRITON_DTYPE, Build
    from engc.kernels.fp8_quant.specs import fp8_quant_specs
    from engc.kernels.rms_norm.specs import rms_norm_specs
    from engc.kernels.silu_mul import specs as silu_mul_kernels
    from engc.kernels import fp8_quant, rms_norm, silu_mul
    from engc.kernels.fp8_quant import quantize_rows
    from test_fp8 import _patch_interpreter_fp8_cast
    from test_kernels import _run
    _patch_interpreter_fp8_cast()
    out = {}
    for name, (op, dtype, width, zero_row) in KERNEL_CASES.items():
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
        t = TRITON_DTYPE[dtype]
        cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=width, intermediate_size=width, num_layers=1,
                          num_heads=1, num_kv_heads=1, head_dim=width, rms_norm_eps=1e-6, rope_theta=1e4,
                          max_position_embeddings=64, tie_word_embeddings=True)
        g = torch.Generator().manual_seed(width)
        rows = 5
        spread = torch.logspace(-3, 2, rows)[:, None]
        q = torch.full((rows, width), float("nan")).to(torch.float8_e4m3fn)   # poisoned: every code written
        scale = torch.full((rows,), float("nan"))
        x = (torch.randn(rows, 2 * width if op == "silu" else width, generator=g) * spread).to(dtype)
        if zero_row:
            x[1] = 0
        residual_ok = True
        if op == "silu":
            quant = {s.variant: s for s in fp8_quant_specs(cfg, t, "sm90")}
            plain = {s.variant: s for s in silu_mul_kernels.specs(Build(cfg=cfg, t=t, arch="sm90", block_size=16))}
            y = torch.empty(rows, width, dtype=dtype)
            _run(plain, silu_mul.launch(x, y, {v: s.launch for v, s in plain.items()}))
            launches = fp8_quant.launch(x, q, scale, silu=True)
            _run(quant, launches)
        else:
            specs = {s.variant: s for s in rms_norm_specs(cfg, t, "sm90", fp8=True)}
            w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
            y = torch.empty_like(x)
            if op == "add_rms_norm":
                r = torch.randn(rows, width, generator=g).to(dtype)
                r_plain, r_fused = torch.full_like(r, float("nan")), torch.full_like(r, float("nan"))
                _run(specs, rms_norm.launch(x, w, 1e-6, y, residual=r, residual_out=r_plain))
                launches = rms_norm.launch(x, w, 1e-6, q, residual=r, residual_out=r_fused, scale=scale)
                _run(specs, launches)
                residual_ok = torch.equal(r_fused, r_plain)
            else:
                _run(specs, rms_norm.launch(x, w, 1e-6, y))
                launches = rms_norm.launch(x, w, 1e-6, q, scale=scale)
                _run(specs, launches)
        ref_q, ref_scale = quantize_rows(y)
        codes = q.view(torch.uint8) != ref_q.view(torch.uint8)
        out[name] = {"ok": bool(residual_ok and torch.equal(scale, ref_scale) and not codes.any()),
                     "variant": launches[0][0], "residual_ok": bool(residual_ok),
                     "scale_max_diff": float((scale - ref_scale).abs().nan_to_num(1e9).max()),
                     "codes_differing": int(codes.sum())}
    return out


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_run_cases()))
