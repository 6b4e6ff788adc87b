"""Residual add + RMSNorm + linear in one launch (kernels/norm_linear) and the pass that makes its node
(passes/fuse_norm_linear): the Triton kernel under TRITON_INTERPRET=1 against the op's reference (ragged M,
N and K, bf16 and fp16, the new residual stored once), its launch and pick rules, the specs (only where the
tune entry is enabled, only for dense layer projections), its sm80/sm90 compilation, gpu_ops' binding
(the fused kernel, else the norm kernel then the GEMM), and the pass on a graph and on a built bundle."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from interpreted import interpreted_report

ROOT = Path(__file__).resolve().parents[1]
# name: (M, N, K, dtype, BLOCK_M, BLOCK_N, BLOCK_K)
CASES = {
    "m9_bf16_ragged_n": (9, 80, 256, torch.bfloat16, 16, 64, 64),
    "m20_bf16_ragged_k": (20, 72, 200, torch.bfloat16, 32, 64, 64),
    "m32_fp16_two_n_tiles": (32, 128, 192, torch.float16, 32, 64, 64),
    "m3_bf16_one_k_tile": (3, 40, 64, torch.bfloat16, 16, 64, 64),
}


def _consts(k, block_m, block_n, min_m=1):
    return dict(K=k, min_m=min_m, max_m=block_m, BLOCK_N=block_n)


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    return interpreted_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_norm_linear_kernel_matches_reference(report, case):
    assert report[case]["ok"], report[case]


def test_launch_rule_and_pick():
    from engc.kernels.norm_linear import launch, pick, variant_table
    consts = {"k4096_m16": _consts(4096, 16, 64, min_m=9), "k4096_m32": _consts(4096, 32, 64, min_m=17)}
    table = variant_table(consts)
    assert [pick(table, 4096, m) for m in (8, 9, 16, 17, 32, 33)] == [None, "k4096_m16", "k4096_m16", "k4096_m32",
                                                                      "k4096_m32", None]
    assert pick(table, 2048, 16) is None
    x, r, r_out = (torch.zeros(20, 4096, dtype=torch.bfloat16) for _ in range(3))
    w, out = torch.zeros(6144, 4096, dtype=torch.bfloat16), torch.zeros(20, 6144, dtype=torch.bfloat16)
    nw = torch.ones(4096, dtype=torch.bfloat16)
    (variant, grid, args), = launch(x, r, nw, w, 1e-5, out, r_out, "k4096_m32", consts["k4096_m32"])
    assert variant == "k4096_m32" and grid == (96, 1, 1) and args[6:9] == [20, 6144, 1e-5]
    with pytest.raises(AssertionError):   # 9 rows are not the 32-row class's
        launch(x[:9], r[:9], nw, w, 1e-5, out[:9], r_out[:9], "k4096_m32", consts["k4096_m32"])


def _llama8b():
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=8192, tie_word_embeddings=False)


def test_specs_only_where_enabled_and_for_dense_layers():
    from engc.compiler.codegen import tune
    from engc.compiler.codegen.specs import model_specs

    def fused(**kw):
        return {s.variant: s for s in model_specs(_llama8b(), torch.bfloat16, "sm90", 16, **kw)
                if s.op == "norm_linear"}

    assert not any(tune.TUNE[f"sm90/norm_linear/*/{c}"]["enabled"] for c in tune.NORM_LINEAR_M_CLASSES)
    assert not fused()
    with tune.overridden({f"sm90/norm_linear/*/{c}": {"enabled": True} for c in tune.NORM_LINEAR_M_CLASSES}):
        specs = fused()
        assert set(specs) == {"k4096_m16", "k4096_m32"}
        launch = specs["k4096_m32"].launch
        assert (launch["K"], launch["min_m"], launch["max_m"], launch["BLOCK_N"], launch["PDL"]) == (4096, 17, 32, 64, 1)
        assert specs["k4096_m16"].constexprs["BLOCK_M"] == 16
        assert not fused(quant="fp8") and not fused(int4_group_sizes=(128,))   # no dense layer projections
        assert not [s for s in model_specs(_llama8b(), torch.float32, "sm90", 16) if s.op == "norm_linear"]


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_compiles_for_sm80_and_sm90(arch):
    pytest.importorskip("triton")
    from engc.compiler.codegen.decode_gemm_specs import norm_linear_specs
    from engc.compiler.codegen.record import compile_specs
    result = compile_specs(norm_linear_specs(_llama8b(), "bf16", arch, classes=("m<=32",), enabled_only=False), jobs=1)
    (r,) = result.records
    ptx = result.files[r["ptx"]].decode()
    assert r["variant"] == "k4096_m32" and "prefetch.global.L2" in ptx
    assert r["shared_mem"] <= (227 if arch == "sm90" else 163) * 1024
    assert [a["name"] for a in r["args"][:9]] == ["x_ptr", "residual_ptr", "norm_w_ptr", "w_ptr", "out_ptr",
                                                  "residual_out_ptr", "M", "N", "eps"]
    if arch == "sm90":   # swap AB: W rows on wgmma's 64-row side, the 32 tokens its N
        assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx and "griddepcontrol.wait" in ptx
    else:
        assert "mma.sync.aligned.m16n8k16" in ptx and "griddepcontrol" not in ptx


def test_gpu_binding_fuses_where_a_kernel_serves_else_norm_then_gemm():
    """gpu_ops' AddRMSNormLinear on the CPU with the kernels replaced by their references: the fused kernel
    for the rows its classes hold, else the rms_norm kernel and then the GEMM path (here cuBLAS: F.linear)."""
    from engc.bundle.program import ENGC_DOMAIN
    from engc.kernels.norm_linear import add_rms_norm_linear
    from engc.kernels.rms_norm import add_rms_norm
    from engc.runtime.gpu_ops import StepFacts, gpu_ops

    class ReferenceKernels:
        consts = {"norm_linear": {"k64_m16": _consts(64, 16, 64, min_m=9)}}
        ran: list = []

        def run(self, op, launches):
            for variant, _grid, args in launches:
                self.ran.append(f"{op}.{variant}")
                if op == "rms_norm":
                    x, r, w, out, r_out, eps = args[:6]
                    y, s = add_rms_norm(x, r, w, eps)
                    out.copy_(y)
                    r_out.copy_(s)
                    continue
                x, r, nw, w, out, r_out, _m, _n, eps = args[:9]
                y, s = add_rms_norm_linear(x, r, nw, w, eps)
                out.copy_(y)
                r_out.copy_(s)

    k = ReferenceKernels()
    op = gpu_ops(k, StepFacts())[(ENGC_DOMAIN, "AddRMSNormLinear")]
    g = torch.Generator().manual_seed(0)
    w, nw = torch.randn(48, 64, generator=g), torch.rand(64, generator=g) + 0.5
    for rows, expect in ((9, ["norm_linear.k64_m16"]), (17, ["rms_norm.add_rms_norm"])):
        k.ran.clear()
        x, r = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
        y, s = op(x, r, nw, w, 1e-5)
        ref_y, ref_s = add_rms_norm_linear(x, r, nw, w, 1e-5)
        assert k.ran == expect and torch.allclose(y, ref_y, atol=1e-5) and torch.equal(s, ref_s)


def test_pass_fuses_each_norm_before_a_plain_projection_only():
    from engc.compiler.ir import Graph
    from engc.compiler.passes.fuse_norm_linear import fuse_norm_linear
    g = Graph()
    g.add("AddRMSNorm", ["x", "r", "n1"], ["h", "r1"], eps=1e-5)
    g.onnx_op("Gemm", ["h", "w1"], "y1", transB=1)
    g.add("AddRMSNorm", ["y1", "r1", "n2"], ["h2", "r2"], eps=1e-5)   # read twice: stays
    g.onnx_op("Gemm", ["h2", "w2"], "y2", transB=1)
    g.onnx_op("Gemm", ["h2", "w3"], "y3", transB=1)
    g.add("AddRMSNorm", ["y2", "r2", "n3"], ["h3", "r3"], eps=1e-5)   # a Gemm with a bias: stays
    g.onnx_op("Gemm", ["h3", "w4", "b4"], "y4", transB=1)
    fuse_norm_linear(g)
    assert [(n.op, n.inputs, n.outputs, n.attrs) for n in g.nodes][:1] == [
        ("AddRMSNormLinear", ["x", "r", "n1", "w1"], ["y1", "r1"], {"eps": 1e-5})]
    assert [n.op for n in g.nodes] == ["AddRMSNormLinear", "AddRMSNorm", "Gemm", "Gemm", "AddRMSNorm", "Gemm"]


def test_pass_on_a_bundle_keeps_the_logits(tiny_dir, tiny_bundle, tmp_path, monkeypatch):
    """A tiny Llama built with the pass (the default) and without it: every AddRMSNorm that feeds a projection
    became one node, and the CPU path's greedy tokens and logprobs are the same."""
    from test_fuse_silu_mul_linear import _greedy

    from engc.bundle.program import ENGC_DOMAIN
    from engc.compiler import build as build_mod
    from engc.compiler.passes import PASSES
    fused_ops, fused_ids, fused_lp = _greedy(tiny_bundle("llama"), "The quick brown fox")
    monkeypatch.setattr(build_mod, "PASSES", [p for p in PASSES if p.__name__ != "fuse_norm_linear"])
    plain = tmp_path / "plain"
    build_mod.build(str(tiny_dir("llama")), plain, build_mod.BuildOptions())
    plain_ops, plain_ids, plain_lp = _greedy(plain, "The quick brown fox")
    norms = plain_ops.count((ENGC_DOMAIN, "AddRMSNorm"))
    fused = fused_ops.count((ENGC_DOMAIN, "AddRMSNormLinear"))
    # per layer: the norm before gate_up and (from the second layer on) the one before qkv; the final norm
    # reaches the lm_head through the gather of the sampled rows and stays
    assert fused >= 1 and fused == norms - 1 and fused_ops.count((ENGC_DOMAIN, "AddRMSNorm")) == 1
    assert fused_ops.count(("", "Gemm")) == plain_ops.count(("", "Gemm")) - fused
    assert fused_ids == plain_ids and torch.allclose(fused_lp, plain_lp, atol=1e-5)


def main():
    from test_kernels import _patch_interpreter_bf16_dot

    from engc.kernels.norm_linear import add_rms_norm_linear, launch
    from engc.kernels.norm_linear.triton import norm_linear_kernel
    _patch_interpreter_bf16_dot()
    # relative to the largest output, as tests/test_skinny_gemm.py (the interpreter's float32 -> bfloat16
    # rounding); the kernel also rounds once fewer than the reference (triton.py)
    TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
    g = torch.Generator().manual_seed(0)
    report = {}
    for name, (m, n, k, dtype, block_m, block_n, block_k) in CASES.items():
        x = torch.randn(m, k, generator=g).to(dtype)
        r = (torch.randn(m, k, generator=g) * 3).to(dtype)
        nw = (torch.rand(k, generator=g) + 0.5).to(dtype)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        r_out = torch.full((m, k), float("nan"), dtype=dtype)
        (_, grid, args), = launch(x, r, nw, w, 1e-5, out, r_out, "v", _consts(k, block_m, block_n))
        norm_linear_kernel[grid](*args[:9], K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH_K=128,
                                 PDL=0)
        ref_y, _ = add_rms_norm_linear(x.float(), r.float(), nw.float(), w.float(), 1e-5)
        # the stored sum is the exact sum rounded to the storage dtype: to nearest on the GPU (tests/test_gpu.py
        # checks it bit for bit), while the interpreter's float32 -> bfloat16 conversion may land one ulp off
        s = x.float() + r.float()
        ulp = s.abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 10)   # one ulp or more at that magnitude
        within_ulp = bool(((r_out.float() - s).abs() <= ulp).all())
        err = float((out.float() - ref_y).abs().max() / ref_y.abs().max())
        report[name] = {"ok": err < TOL[dtype] and within_ulp, "err": err, "n_tiles": grid[0],
                        "residual_within_one_ulp": within_ulp}
    print(json.dumps(report))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    main()
