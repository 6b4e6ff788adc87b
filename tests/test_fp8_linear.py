"""The W8A8 FP8 GEMM (kernels/fp8_linear): the Triton kernel under TRITON_INTERPRET=1 against the op's
reference (fp8 x given, and x quantized in the kernel; split-K; bias; ragged N and K), its launch rule,
its sm90 compilation (fp8 wgmma in the PTX), and gpu_ops' FP8Linear choosing between it and _scaled_mm."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from interpreted import interpreted_report
from engc.kernels.fp8_linear import specs as fp8_linear_kernels

ROOT = Path(__file__).resolve().parents[1]
# name: (M, N, K, quant_x, bias, output dtype, split overrides). A float32 output isolates the GEMM's math
# from the bf16 rounding of the output (the kernel writes the pointer's dtype).
SPLIT = {"target_programs": 8, "min_split_k_tiles": 1}
CASES = {
    "m1_fp8x_bf16_out": (1, 80, 256, False, False, torch.bfloat16, {}),
    "m5_quant_x_bias": (5, 64, 384, True, True, torch.float32, {}),
    "m16_split_k": (16, 96, 512, False, False, torch.float32, SPLIT),
    "m3_quant_x_split_k_ragged_k": (3, 72, 208, True, False, torch.float32, SPLIT),
    "m16_quant_x_split_k_bias_bf16_out": (16, 64, 256, True, True, torch.bfloat16, SPLIT),
    # 7 K tiles over 3 splits (3, 3, 1): a split count that is no power of two, a short last split
    "m7_split_k_uneven": (7, 64, 448, False, False, torch.float32, {"target_programs": 3, "min_split_k_tiles": 1}),
}


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    return interpreted_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_linear_kernel_matches_reference(report, case):
    assert report[case]["ok"], report[case]


def test_launch_rule_splits_and_picks():
    from engc.kernels.fp8_linear import NUM_COUNTERS, launch, pick, split_count, variant_table
    consts = {"q_k4096_m16": dict(K=4096, QUANT_X=True, max_m=16, BLOCK_N=64, BLOCK_K=256, target_programs=132,
                                  max_splits=16, min_split_k_tiles=4),
              "k4096_m16": dict(K=4096, QUANT_X=False, max_m=16, BLOCK_N=64, BLOCK_K=256, target_programs=132,
                                max_splits=16, min_split_k_tiles=4),
              "k4096_m64": dict(K=4096, QUANT_X=False, max_m=64, BLOCK_N=128, BLOCK_K=128, target_programs=264,
                                max_splits=16, min_split_k_tiles=4)}
    table = variant_table(consts)
    assert pick(table, 4096, 1, True) == "q_k4096_m16" and pick(table, 4096, 17, True) is None
    assert pick(table, 4096, 17, False) == "k4096_m64" and pick(table, 4096, 65, False) is None
    assert pick(table, 14336, 1, False) is None
    counters = torch.zeros(NUM_COUNTERS, dtype=torch.int32)
    w, ws = torch.empty(6144, 4096, dtype=torch.float8_e4m3fn), torch.empty(6144)
    x, xs = torch.empty(64, 4096, dtype=torch.float8_e4m3fn), torch.empty(64)
    out = torch.empty(64, 6144, dtype=torch.bfloat16)
    (variant, grid, args), = launch(x, xs, w, ws, None, out, "k4096_m64", consts["k4096_m64"], counters)
    # 8B qkv at M=64: 48 N tiles, split 5 ways (240 programs, the most within 264), 7 K tiles of 128 each
    # (the last split 4)
    assert grid == (48, 5, 1) and args[-7:] == [64, 6144, 7, 5, 0, 0, 0] and args[7] is counters
    assert args[6].shape == (5, 64, 6144) and args[6].dtype == torch.float32
    assert split_count(448, 32, consts["k4096_m64"]) == (1, 32)     # gate_up: enough N tiles, no split
    assert split_count(32, 112, consts["k4096_m64"]) == (8, 14)     # down at BLOCK_N 128: 256 programs
    assert split_count(32, 8, consts["k4096_m64"]) == (2, 4)        # min_split_k_tiles bounds the split
    with pytest.raises(AssertionError):  # a QUANT_X variant takes bf16 x and no scales
        launch(x, xs, w, ws, None, out[:16], "q_k4096_m16", consts["q_k4096_m16"], counters)


def _llama8b():
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=512, hidden_size=4096, intermediate_size=14336, num_layers=1,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=256, tie_word_embeddings=False)


def test_fp8_linear_specs_only_in_fp8_builds():
    from engc.compiler import tune
    from engc.compiler.codegen.specs import model_specs
    specs = [s for s in model_specs(_llama8b(), torch.bfloat16, "sm90", 16, quant="fp8") if s.op == "fp8_linear"]
    fused = {s.variant for s in specs if s.constexprs["QUANT_X"]}
    # fused-quant variants only for classes whose tune entry asks (none since the H200 sweep: slower)
    assert all(s.launch["max_m"] <= 16 and tune.lookup("sm90", "fp8_linear", "*", f"m<={s.launch['max_m']}")[1]
               ["fuse_quant"] for s in specs if s.constexprs["QUANT_X"])
    assert len(specs) - len(fused) == 2 * len(fp8_linear_kernels.M_CLASSES)   # K 4096 and 14336, every class
    assert not [s for s in model_specs(_llama8b(), torch.bfloat16, "sm90", 16) if s.op == "fp8_linear"]


def test_fp8_linear_compiles_to_fp8_wgmma():
    pytest.importorskip("triton")
    from engc.compiler.codegen.record import compile_specs
    from engc.kernels.fp8_linear.specs import fp8_linear_specs
    specs = fp8_linear_specs(_llama8b(), "bf16", "sm90", {"m<=16": {"fuse_quant": True}},
                             classes=("m<=16", "m<=64"))   # the fused variant too (off in the tune table)
    specs = [s for s in specs if s.constexprs["K"] == 14336]
    result = compile_specs(specs, jobs=1)
    assert {r["variant"] for r in result.records} == {"k14336_m16", "q_k14336_m16", "k14336_m64"}
    for r in result.records:
        ptx = result.files[r["ptx"]].decode()
        m = r["constexprs"]["BLOCK_M"]
        assert f"wgmma.mma_async.sync.aligned.m64n{m}k32.f32.e4m3.e4m3" in ptx  # swap AB: tokens are wgmma's N
        assert "cp.async" in ptx                                               # W tiles pipelined
        assert r["shared_mem"] <= 227 * 1024                                   # fits an SM (the sweep may pick 1 a SM)
        if r["constexprs"]["QUANT_X"]:
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.full.f32" not in ptx  # as fp8_quant rounds


def test_gpu_binding_picks_kernel_then_scaled_mm_on_cpu():
    """gpu_ops' FP8Linear on the CPU with the kernels replaced by their references: a fused variant for a
    few rows, fp8_quant + a plain variant up to the last class, fp8_quant + _scaled_mm above it."""
    from engc.bundle.program import ENGC_DOMAIN
    from engc.kernels.fp8_quant import dequantize_rows, fp8_linear, quantize_rows
    from engc.runtime.gpu_ops import StepFacts, gpu_ops

    class ReferenceKernels:
        consts = {"fp8_quant": {}, "fp8_linear": {
            "q_k64_m2": dict(K=64, QUANT_X=True, max_m=2, BLOCK_N=64, BLOCK_K=64, target_programs=1, max_splits=1,
                             min_split_k_tiles=1),
            "k64_m4": dict(K=64, QUANT_X=False, max_m=4, BLOCK_N=64, BLOCK_K=64, target_programs=1, max_splits=1,
                           min_split_k_tiles=1)}}
        ran: list = []

        def run(self, op, launches):
            for variant, _grid, args in launches:
                self.ran.append(variant if op == "fp8_linear" else op)
                if op == "fp8_quant":
                    x, out, scale = args[:3]
                    q, s = quantize_rows(x)
                    out.copy_(q)
                    scale.copy_(s)
                    continue
                x, xs, w, ws, bias, out = args[:6]
                xq, xs = quantize_rows(x) if variant.startswith("q_") else (x, xs)
                y = (dequantize_rows(xq, xs) @ dequantize_rows(w, ws).t()).to(out.dtype)
                out.copy_(y + bias if args[12] else y)

    k = ReferenceKernels()
    op = gpu_ops(k, StepFacts())[(ENGC_DOMAIN, "FP8Linear")]
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g) * 0.02
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    wq, ws = quantize_rows(w)
    for rows, expect in ((2, ["q_k64_m2"]), (3, ["fp8_quant", "k64_m4"]), (9, ["fp8_quant"])):
        k.ran.clear()
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        try:
            (y,) = op(x, wq, ws, bias, has_bias=1)
        except (RuntimeError, NotImplementedError) as e:  # a torch without a CPU _scaled_mm
            pytest.skip(f"torch._scaled_mm on the CPU: {e}")
        ref = fp8_linear(x.float(), wq, ws, bias.float(), has_bias=1)
        assert k.ran == expect and y.dtype == torch.bfloat16 and float((y.float() - ref).norm() / ref.norm()) < 1e-2


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def _run_cases() -> dict:
    from test_fp8 import _patch_interpreter_fp8_cast
    from engc.kernels.fp8_linear import NUM_COUNTERS, launch
    from engc.kernels.fp8_linear.triton import fp8_linear_kernel
    from engc.kernels.fp8_quant import FP8_MAX, MIN_AMAX, fp8_linear, quantize_rows
    _patch_interpreter_fp8_cast()
    out = {}
    for name, (m, n, k, quant_x, has_bias, dtype, split) in CASES.items():
        consts = {**dict(K=k, QUANT_X=quant_x, max_m=16, BLOCK_N=64, BLOCK_K=64, target_programs=1, max_splits=8,
                         min_split_k_tiles=1), **split}
        g = torch.Generator().manual_seed(m * n + k)
        x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(torch.bfloat16)
        if m > 2:
            x[1] = 0   # an all-zero token still gets a finite scale
        wq, ws = quantize_rows(torch.randn(n, k, generator=g) * 0.05)
        bias = torch.randn(n, generator=g).to(dtype) if has_bias else None
        xq, xs = (None, None) if quant_x else quantize_rows(x)
        y = torch.full((m, n), float("nan"), dtype=dtype)
        counters = torch.zeros(NUM_COUNTERS, dtype=torch.int32)
        launches = launch(x if quant_x else xq, xs, wq, ws, bias, y, "v", consts, counters)
        for _variant, grid, args in launches:
            fp8_linear_kernel[grid](*args[:-2], K=k, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, QUANT_X=quant_x,
                                    FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, PDL=0)
        # the reference rounds to the output dtype, then adds the bias, as the kernel does
        ref = fp8_linear(x.to(dtype), wq, ws, bias, has_bias=int(has_bias)).float()
        err = float((y.float() - ref).norm() / ref.norm())
        # Same fp8 codes and scales, fp32 accumulation in another order: float32 outputs agree to ~1e-7; a
        # bf16 output to within one bf16 ulp (2^-7: the interpreter's cast to bf16 rounds toward zero,
        # ~0.3% low, the GPU's to nearest). A wrong scale, code, layout or split sum is off by O(1).
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        out[name] = {"ok": err < tol and not torch.isnan(y.float()).any().item() and int(counters.abs().sum()) == 0,
                     "rel_err": err, "splits": launches[0][1][1], "counters_left": int(counters.abs().sum())}
    return out


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_run_cases()))
