"""The W4A16 GEMM of decode batches (kernels/int4_gemm): the Triton kernel under TRITON_INTERPRET=1 against
the op's reference (the dequantized weight, bit for bit, times x in float64; split-K, M tiles, ragged M, N
and K, a short last group, group sizes 32/64/128), its launch and pick rules, the runtime choosing it for
the rows its classes hold, the specs of an int4 build, and its sm80/sm90 compilation."""
from __future__ import annotations

import json

import pytest
import torch

from interpreted import interpreted_report
from engc.kernels.int4_gemm import specs as int4_gemm_kernels

SPLIT = {"target_programs": 8, "min_split_k_tiles": 1}
# name: (M, N, K, group, dtype, BLOCK_M, BLOCK_N, BLOCK_K, split overrides)
CASES = {
    "m5_g128_ragged_n": (5, 80, 256, 128, torch.bfloat16, 16, 64, 128, {}),
    "m20_g64_split_k_ragged_k": (20, 72, 224, 64, torch.bfloat16, 32, 64, 64, SPLIT),
    "m40_g32_fp16_split_uneven": (40, 64, 448, 32, torch.float16, 64, 64, 64,
                                  {"target_programs": 3, "min_split_k_tiles": 1}),
    "m70_g128_m_tiles_split_k": (70, 48, 384, 128, torch.bfloat16, 32, 32, 128, SPLIT),
    "m9_g128_short_last_group": (9, 40, 160, 128, torch.bfloat16, 16, 32, 64, {}),
    # the magic-pair dequant (its float32 twin here)
    "m40_g128_pairs_m_tiles": (40, 80, 288, 128, torch.bfloat16, 16, 64, 128, dict(SPLIT, PAIRS=True)),
    "m33_g32_pairs_ragged": (33, 50, 224, 32, torch.bfloat16, 64, 32, 64, dict(PAIRS=True)),
}


def _consts(k, group, block_m, block_n, block_k, **ov):
    return dict(dict(K=k, GROUP=group, min_m=1, max_m=4 * block_m, BLOCK_M=block_m, BLOCK_N=block_n,
                     BLOCK_K=block_k, target_programs=1, max_splits=16, min_split_k_tiles=4), **ov)


def _weights(n, k, group, g, dtype):
    from engc.kernels.int4_linear import pack_int4
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    return pack_int4(q), scales, zeros


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    return interpreted_report(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_int4_gemm_kernel_matches_reference(report, case):
    assert report[case]["ok"], report[case]


def test_launch_rule_splits_tiles_and_picks():
    from engc.kernels.int4_gemm import NUM_COUNTERS, launch, pick
    consts = {"k4096_g128_m32": _consts(4096, 128, 32, 128, 128, min_m=9, max_m=32, target_programs=264),
              "k4096_g128_m256": _consts(4096, 128, 64, 128, 128, min_m=33, max_m=256, target_programs=264),
              "k4096_g64_m32": _consts(4096, 64, 32, 128, 128, min_m=9, max_m=32, target_programs=264)}
    assert pick(consts, 4096, 128, 8) is None                      # below every class: the GEMV
    assert pick(consts, 4096, 128, 9) == "k4096_g128_m32" and pick(consts, 4096, 64, 32) == "k4096_g64_m32"
    assert pick(consts, 4096, 128, 33) == "k4096_g128_m256" and pick(consts, 4096, 128, 257) is None
    assert pick(consts, 14336, 128, 16) is None                     # no variant for this K
    counters = torch.zeros(NUM_COUNTERS, dtype=torch.int32)
    qw, s, z = torch.empty(4096, 512, dtype=torch.int32), torch.empty(4096, 32), torch.empty(4096, 32, dtype=torch.uint8)
    x, out = torch.empty(32, 4096, dtype=torch.bfloat16), torch.empty(32, 4096, dtype=torch.bfloat16)
    (variant, grid, args), = launch(x, qw, s, z, out, "k4096_g128_m32", consts["k4096_g128_m32"], counters)
    # 8B o at M=32: 32 N tiles x 8 splits fill 264 programs; 32 K tiles of 128, 4 a split
    assert grid == (32, 8, 1) and args[6] is counters and args[7:] == [32, 4096, 4, 8, 0, 0]
    assert args[5].shape == (8, 32, 4096) and args[5].dtype == torch.float32
    x, out = torch.empty(200, 4096, dtype=torch.bfloat16), torch.empty(200, 4096, dtype=torch.bfloat16)
    (_, grid, args), = launch(x, qw, s, z, out, "k4096_g128_m256", consts["k4096_g128_m256"], counters)
    assert grid == (32, 2, 4)                                       # 4 M tiles of 64 rows: 128 tiles, 2 splits


def test_runtime_takes_the_gemm_for_the_rows_its_classes_hold():
    """int4_linear.run_quantized_linear (as gpu_ops' QLinear calls it) on the CPU, kernels replaced by their
    references: the GEMM for M in its class (bias added after), the dequant + F.linear path elsewhere."""
    from engc.kernels import int4_linear as op
    g = torch.Generator().manual_seed(0)
    n, k = 48, 256
    qw, s, z = _weights(n, k, 128, g, torch.float32)
    bias = torch.randn(n, generator=g)
    gemm_consts = {"k256_g128_m64": _consts(256, 128, 64, 64, 64, min_m=33, max_m=64),
                   "k512_g128_m32": _consts(512, 128, 32, 64, 64, min_m=9, max_m=32)}
    ran = []

    def run_gemm(launches):
        for variant, _grid, args in launches:
            ran.append(variant)
            x, qw_, s_, z_, out = args[:5]
            out.copy_(x @ op.dequantize(qw_, s_, z_, 128).t())

    def run(launches):   # the dequant kernel (no CUDA GEMV in these consts)
        for variant, _grid, args in launches:
            ran.append(variant)
            args[3].copy_(op.dequantize(*args[:3], 128))

    consts = {op.dequant_variant(128): {"BLOCK_N": 4, "BLOCK_C": 128}}
    counters = torch.zeros(64, dtype=torch.int32)
    for rows, expect in ((33, ["k256_g128_m64"]), (64, ["k256_g128_m64"]), (20, ["dequant_g128"]),
                         (65, ["dequant_g128"])):
        ran.clear()
        x = torch.randn(rows, k, generator=g)
        y = op.run_quantized_linear(x, qw, s, z, bias, group_size=128, consts=consts, run=run, counters=counters,
                                    gemm_consts=gemm_consts, run_gemm=run_gemm)
        assert ran == expect, (rows, ran)
        assert torch.allclose(y, x @ op.dequantize(qw, s, z, 128).t() + bias, atol=1e-4)


def test_int4_build_specs_follow_the_tune_table():
    from engc.compiler.codegen.specs import model_specs
    from engc.compiler import tune

    def gemm(arch, **kw):
        return {s.variant: s for s in model_specs(_llama8b(), torch.bfloat16, arch, 16, **kw) if s.op == "int4_gemm"}

    on = [b for b in int4_gemm_kernels.M_CLASSES if tune.TUNE[f"sm90/int4_gemm/*/{b}"]["enabled"]]
    specs = gemm("sm90", int4_group_sizes=(128,))
    assert {s.launch["max_m"] for s in specs.values()} == {int(b[3:]) for b in on}
    assert {s.constexprs["K"] for s in specs.values()} == ({4096, 14336} if on else set())
    assert all(s.launch["PDL"] == 1 and s.launch["GROUP"] == 128 for s in specs.values())
    assert not gemm("sm90")                                    # a float build has no int4 projections
    assert not gemm("sm80", int4_group_sizes=(128,))           # not measured there: off


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_compiles_for_sm80_and_sm90(arch):
    pytest.importorskip("triton")
    from engc.compiler.codegen.record import compile_specs
    from engc.kernels.int4_gemm.specs import int4_gemm_specs
    specs = int4_gemm_specs(_llama8b(), "bf16", arch, (128,), enabled_only=False, classes=("m<=32",))
    result = compile_specs(specs, jobs=1)
    assert {r["variant"] for r in result.records} == {"k4096_g128_m32", "k14336_g128_m32"}
    for r in result.records:
        ptx = result.files[r["ptx"]].decode()
        assert "cp.async" in ptx                                         # W words and x pipelined
        assert r["shared_mem"] <= (227 if arch == "sm90" else 163) * 1024
        if arch == "sm90":   # swap AB: W rows on wgmma's 64-row side, the 32 tokens its N
            assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx and "griddepcontrol.wait" in ptx
        else:
            assert "mma.sync.aligned.m16n8k16" in ptx and "griddepcontrol" not in ptx


def _llama8b():
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=512, hidden_size=4096, intermediate_size=14336, num_layers=1,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
                       max_position_embeddings=256, tie_word_embeddings=False)


def main():
    from test_kernels import _patch_interpreter_bf16_dot

    from engc.kernels.int4_gemm import launch
    from engc.kernels.int4_gemm.triton import int4_gemm_kernel
    from engc.kernels.int4_linear import dequantize
    _patch_interpreter_bf16_dot()
    # relative to the largest output: the output's rounding (the interpreter rounds float32 -> bfloat16 less
    # exactly than the GPU; tests/test_gemv.py allows the same)
    TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
    g = torch.Generator().manual_seed(0)
    report = {}
    for name, (m, n, k, group, dtype, block_m, block_n, block_k, ov) in CASES.items():
        x = torch.randn(m, k, generator=g).to(dtype)
        qw, s, z = _weights(n, k, group, g, dtype)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        counters = torch.zeros(64, dtype=torch.int32)
        ov = dict(ov)
        pairs = ov.pop("PAIRS", False)
        consts = _consts(k, group, block_m, block_n, block_k, **ov)
        (_, grid, args), = launch(x, qw, s, z, out, "v", consts, counters)
        int4_gemm_kernel[grid](*args[:11], K=k, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               SILU=False, PDL=0, PAIRS=pairs)
        ref = x.double() @ dequantize(qw, s, z, group).double().t()
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        report[name] = {"ok": err < TOL[dtype] and int(counters.abs().sum()) == 0, "err": err, "splits": grid[1],
                        "m_tiles": grid[2], "counters_left": int(counters.abs().sum())}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
