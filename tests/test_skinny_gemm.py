"""The skinny bf16/fp16 GEMM of decode batches (kernels/skinny_gemm): the Triton kernel under
TRITON_INTERPRET=1 against the op's references (plain and SiLU-fused; split-K, ragged M, N and K), its
launch and pick rules, the specs (built only where the tune entry is enabled), its sm80/sm90 compilation,
and gpu_ops' Gemm / SiluMulLinear choosing it between the GEMV and cuBLAS."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from interpreted import interpreted_report
from engc.kernels.skinny_gemm import specs as skinny_kernels

ROOT = Path(__file__).resolve().parents[1]
SPLIT = {"target_programs": 8, "min_split_k_tiles": 1}
# name: (M, N, K, silu, dtype, BLOCK_M, BLOCK_N, BLOCK_K, split overrides)
CASES = {
    "m5_bf16_ragged_n": (5, 80, 256, False, torch.bfloat16, 16, 64, 64, {}),
    "m20_bf16_split_k_ragged_k": (20, 72, 200, False, torch.bfloat16, 32, 64, 64, SPLIT),
    # 7 K tiles over 3 splits (3, 3, 1): a split count that is no power of two, a short last split
    "m40_fp16_split_k_uneven": (40, 64, 448, False, torch.float16, 64, 64, 64,
                                {"target_programs": 3, "min_split_k_tiles": 1}),
    "m3_silu_bf16_split_k": (3, 40, 192, True, torch.bfloat16, 16, 64, 64, SPLIT),
    "m16_silu_fp16_ragged_k": (16, 70, 160, True, torch.float16, 16, 64, 64, {}),
}


def _consts(k, silu, block_m, block_n, block_k, **ov):
    return dict(dict(K=k, SILU=silu, min_m=1, max_m=block_m, max_n=0, BLOCK_N=block_n, BLOCK_K=block_k,
                     target_programs=1, max_splits=16, min_split_k_tiles=4), **ov)


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    return interpreted_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_skinny_gemm_kernel_matches_reference(report, case):
    assert report[case]["ok"], report[case]


def test_launch_rule_splits_and_picks():
    from engc.kernels.skinny_gemm import NUM_COUNTERS, launch, pick, split_count, variant_table
    consts = {"k4096_m16": _consts(4096, False, 16, 64, 128, min_m=9, target_programs=132),
              "k4096_m32": _consts(4096, False, 32, 64, 128, min_m=17, max_n=8192, target_programs=132),
              "silu_k14336_m32": _consts(14336, True, 32, 64, 128, min_m=17, target_programs=132)}
    table = variant_table(consts)
    assert pick(table, 4096, False, 8, 6144) is None              # below the first class: GEMV or cuBLAS
    assert pick(table, 4096, False, 9, 6144) == "k4096_m16"
    assert pick(table, 4096, False, 17, 6144) == "k4096_m32"
    assert pick(table, 4096, False, 32, 28672) is None             # above the class's max_n: cuBLAS
    assert pick(table, 4096, False, 33, 6144) is None              # above every class
    assert pick(table, 14336, True, 32, 4096) == "silu_k14336_m32" and pick(table, 14336, False, 32, 4096) is None
    counters = torch.zeros(NUM_COUNTERS, dtype=torch.int32)
    x, w = torch.empty(32, 4096, dtype=torch.bfloat16), torch.empty(4096, 4096, dtype=torch.bfloat16)
    out = torch.empty(32, 4096, dtype=torch.bfloat16)
    (variant, grid, args), = launch(x, w, out, "k4096_m32", consts["k4096_m32"], counters)
    # 8B o at M=32: 64 N tiles x 2 splits fill 132 programs' worth of SMs; 32 K tiles of 128, 16 a split
    assert grid == (64, 2, 1) and args[4] is counters and args[5:] == [32, 4096, 16, 2, 0, 0]
    assert args[3].shape == (2, 32, 4096) and args[3].dtype == torch.float32
    assert split_count(448, 32, consts["k4096_m32"]) == (1, 32)     # 8B gate_up: enough N tiles, no split
    assert split_count(64, 112, consts["k4096_m32"]) == (2, 56)     # 8B down
    gate_up = torch.empty(32, 2 * 14336, dtype=torch.bfloat16)
    (_, grid, _), = launch(gate_up, torch.empty(4096, 14336, dtype=torch.bfloat16), out, "silu_k14336_m32",
                           consts["silu_k14336_m32"], counters)
    assert grid == (64, 2, 1)
    with pytest.raises(AssertionError):   # a SiLU variant takes the [M, 2K] gate_up
        launch(x, w, out, "silu_k14336_m32", consts["silu_k14336_m32"], counters)


def _llama8b(vocab=512):
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=4096, intermediate_size=14336, num_layers=1,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=256, tie_word_embeddings=False)


def _enable(*classes, arch="sm90"):
    from engc.compiler import tune
    return tune.overridden({f"{arch}/skinny_gemm/*/{c}": {"enabled": True} for c in classes})


def test_specs_only_where_enabled():
    from engc.compiler import tune
    from engc.kernels.skinny_gemm.specs import skinny_gemm_specs
    from engc.compiler.codegen.specs import model_specs

    def skinny(**kw):
        return {s.variant: s for s in model_specs(_llama8b(), torch.bfloat16, "sm90", 16, **kw) if s.op == "skinny_gemm"}

    assert not any(tune.TUNE[f"sm90/skinny_gemm/*/{c}"]["enabled"] for c in skinny_kernels.M_CLASSES)
    # the table's per-K entries (the 8B's widths at 9-32 rows, measured on the H200) are on by themselves ...
    own = skinny()
    assert {v: (s.launch["min_m"], s.launch["max_m"]) for v, s in own.items()} == {
        "k4096_m16": (9, 16), "silu_k14336_m16": (9, 16), "k4096_m32": (17, 32), "silu_k14336_m32": (17, 32)}
    for m in (16, 32):
        assert (own[f"silu_k14336_m{m}"].launch["BLOCK_N"], own[f"silu_k14336_m{m}"].num_warps) == (128, 8)
        assert (own[f"k4096_m{m}"].launch["BLOCK_N"], own[f"k4096_m{m}"].num_stages) == (64, 4)
    # ... and no other width gets the skinny GEMM unless its class is enabled
    narrow = dataclasses.replace(_llama8b(), hidden_size=2048, intermediate_size=8192, head_dim=64)
    assert not [s for s in model_specs(narrow, torch.bfloat16, "sm90", 16) if s.op == "skinny_gemm"]
    assert not [s for s in model_specs(_llama8b(), torch.bfloat16, "sm80", 16) if s.op == "skinny_gemm"]
    with _enable("m<=32"):
        specs = skinny()
        # hidden = q_size: qkv, o, gate_up, lm_head; down
        assert set(specs) == {f"{p}_m{m}" for p in ("k4096", "silu_k14336") for m in (16, 32)}
        launch = specs["k4096_m32"].launch
        assert (launch["min_m"], launch["max_m"], launch["PDL"]) == (17, 32, 1)
        assert specs["silu_k14336_m32"].constexprs["SILU"] and specs["k4096_m32"].constexprs["BLOCK_M"] == 32
        assert set(skinny(quant="fp8")) == {"k4096_m16", "k4096_m32"}   # fp8 layers: the lm_head only
        assert not [s for s in model_specs(_llama8b(), torch.float32, "sm90", 16) if s.op == "skinny_gemm"]
    # the sweep builds every class whatever the table says
    every = skinny_gemm_specs(_llama8b(), "bf16", "sm80", enabled_only=False)
    assert {s.variant for s in every} == {f"{p}_m{m}" for p in ("k4096", "silu_k14336") for m in (16, 32, 64)}
    assert all(s.launch["PDL"] == 0 for s in every)                  # no PDL on sm80


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_compiles_for_sm80_and_sm90(arch):
    pytest.importorskip("triton")
    from engc.compiler.codegen.record import compile_specs
    from engc.kernels.skinny_gemm.specs import skinny_gemm_specs
    specs = skinny_gemm_specs(_llama8b(), "bf16", arch, classes=("m<=32",), enabled_only=False)
    result = compile_specs(specs, jobs=1)
    assert {r["variant"] for r in result.records} == {"k4096_m32", "silu_k14336_m32"}
    for r in result.records:
        ptx = result.files[r["ptx"]].decode()
        assert "cp.async" in ptx and "prefetch.global.L2" in ptx         # W tiles pipelined, first ones prefetched
        assert r["shared_mem"] <= (227 if arch == "sm90" else 163) * 1024
        if arch == "sm90":   # swap AB: W rows on wgmma's 64-row side, the 32 tokens its N
            assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx and "griddepcontrol.wait" in ptx
        else:
            assert "mma.sync.aligned.m16n8k16" in ptx and "griddepcontrol" not in ptx


def test_gpu_binding_picks_gemv_then_skinny_then_cublas_on_cpu():
    """gpu_ops' Gemm and SiluMulLinear on the CPU with the kernels replaced by their references: the GEMV
    where it has a variant, then the skinny GEMM for the rows its classes hold, else cuBLAS (F.linear)."""
    from engc.bundle.program import ENGC_DOMAIN
    from engc.kernels.silu_mul import silu_mul
    from engc.runtime.gpu_ops import StepFacts, gpu_ops

    class ReferenceKernels:
        consts = {"silu_mul": {"default": {"BLOCK": 64}},
                  "gemv": {"k64_m1": dict(K=64, SILU=False, max_m=1, BLOCK_N=8, BLOCK_K=64, target_programs=1,
                                          max_splits=1, min_split_k_tiles=1)},
                  "skinny_gemm": {"k64_m16": _consts(64, False, 16, 64, 64, min_m=2),
                                  "silu_k64_m16": _consts(64, True, 16, 64, 64, min_m=2)}}
        ran: list = []

        def run(self, op, launches):
            for variant, _grid, args in launches:
                self.ran.append(f"{op}.{variant}")
                if op == "silu_mul":
                    args[1].copy_(silu_mul(args[0]))
                    continue
                x, w, out = args[:3]
                out.copy_((silu_mul(x) if variant.startswith("silu_") else x) @ w.t())

    k = ReferenceKernels()
    ops = gpu_ops(k, StepFacts())
    gemm, silu_linear = ops[("", "Gemm")], ops[(ENGC_DOMAIN, "SiluMulLinear")]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    for rows, expect in ((1, ["gemv.k64_m1"]), (9, ["skinny_gemm.k64_m16"]), (17, [])):
        k.ran.clear()
        x = torch.randn(rows, 64, generator=g)
        (y,) = gemm(x, w, transB=1)
        assert k.ran == expect and torch.allclose(y, x @ w.t(), atol=1e-5)
    for rows, expect in ((9, ["skinny_gemm.silu_k64_m16"]), (17, ["silu_mul.default"])):
        k.ran.clear()
        gate_up = torch.randn(rows, 128, generator=g)
        (y,) = silu_linear(gate_up, w)
        assert k.ran == expect and torch.allclose(y, silu_mul(gate_up) @ w.t(), atol=1e-5)


def main():
    from test_kernels import _patch_interpreter_bf16_dot

    from engc.kernels.silu_mul import silu_mul
    from engc.kernels.skinny_gemm import launch
    from engc.kernels.skinny_gemm.triton import skinny_gemm_kernel
    _patch_interpreter_bf16_dot()
    # relative to the largest output: the output's rounding (the interpreter rounds float32 -> bfloat16 less
    # exactly than the GPU; tests/test_gemv.py allows the same)
    TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
    g = torch.Generator().manual_seed(0)
    report = {}
    for name, (m, n, k, silu, dtype, block_m, block_n, block_k, ov) in CASES.items():
        x = torch.randn(m, 2 * k if silu else k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        counters = torch.zeros(64, dtype=torch.int32)
        consts = _consts(k, silu, block_m, block_n, block_k, **ov)
        (_, grid, args), = launch(x, w, out, "v", consts, counters)
        skinny_gemm_kernel[grid](*args[:9], K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SILU=silu,
                                 PREFETCH_K=128, PDL=0)
        # the reference in the same dtype (silu_mul rounds as the kernel does), accumulated in fp32
        act = silu_mul(x) if silu else x
        ref = act.float() @ w.float().t()
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        report[name] = {"ok": err < TOL[dtype] and int(counters.abs().sum()) == 0, "err": err, "splits": grid[1],
                        "counters_left": int(counters.abs().sum())}
    print(json.dumps(report))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    main()
