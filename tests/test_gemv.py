"""The decode GEMV (kernels/gemv) under TRITON_INTERPRET=1 against its torch reference, through its launch
rule and the specs codegen makes: ragged N and K, every M of both M classes, split-K on and off, the
SiLU-fused variant, the per-N plain kernels of M=1 with their tune-table tiles; and the split-K counters are
left zeroed for the next launch. On the CPU too: which GEMV kernels a 1B/8B-shaped model gets and which
projection N each M=1 pick serves.

Like tests/test_kernels.py, the checks run in a child process that switches the interpreter on before
triton is imported, and the tests assert on its report."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from interpreted import interpreted_report

ROOT = Path(__file__).resolve().parents[1]
SMALL_TILES = {"BLOCK_N": 16, "BLOCK_K": 32, "target_programs": 64, "min_split_k_tiles": 1}


@pytest.fixture(scope="module")
def report():
    return interpreted_report(__file__)


CASES = ["gemv_bf16_n50_k96", "gemv_fp16_n50_k96", "gemv_bf16_n33_k200_ragged_k", "gemv_bf16_n70_k64_no_split",
         "silu_bf16_n40_k72", "silu_fp16_n17_k160"]
# the per-N plain classes at M=1 with their own tune entries (tiles as on the GPU), one case per config;
# (K, N) chosen inside each class's regions, so the pick lands on it
PLAIN_CASES = {"plain_n4k1024w4_bf16_n50_k96": "k96_m1_n4k1024w4",
               "plain_n4k1024w4_fp16_n33_k1024": "k1024_m1_n4k1024w4",
               "plain_n8k512w2_bf16_n40_k2176": "k2176_m1_n8k512w2"}


@pytest.mark.parametrize("case", CASES)
def test_gemv_matches_reference(report, case):
    assert case in report, f"{case} did not run"
    assert report[case]["ok"], report[case]


@pytest.mark.parametrize("case", PLAIN_CASES)
def test_plain_per_n_variant_matches_reference(report, case):
    assert case in report, f"{case} did not run"
    assert report[case]["ok"], report[case]
    assert report[case]["variant"] == PLAIN_CASES[case]


def test_split_k_was_exercised(report):
    assert any(s > 1 for s in report["gemv_bf16_n50_k96"]["splits"])
    assert report["gemv_bf16_n70_k64_no_split"]["splits"] == [1]
    assert report["plain_n8k512w2_bf16_n40_k2176"]["splits"] == [2]     # 5 N tiles, 5 K tiles of 512


def test_pick_and_split_rule():
    from engc.kernels import gemv
    consts = {"k64_m4": {"K": 64, "SILU": False, "max_m": 4}, "k64_m16": {"K": 64, "SILU": False, "max_m": 16},
              "silu_k64_m4": {"K": 64, "SILU": True, "max_m": 4}}
    table = gemv.variant_table(consts)
    assert [gemv.pick(table, 64, False, m) for m in (1, 4, 5, 16, 17)] == ["k64_m4", "k64_m4", "k64_m16",
                                                                          "k64_m16", None]
    assert gemv.pick(table, 64, True, 8) is None and gemv.pick(table, 32, False, 1) is None
    rule = {"target_programs": 528, "max_splits": 16, "min_split_k_tiles": 2}
    assert gemv.split_count(256, 28, rule) == (4, 7)       # 8B down at BLOCK_N 16, BLOCK_K 512: 1024 programs
    assert gemv.split_count(8016, 4, rule) == (1, 4)       # lm_head: N alone fills the GPU
    assert gemv.split_count(128, 4, rule) == (2, 2)        # 1B o: at most K tiles / min_split_k_tiles
    assert gemv.split_count(4, 7, dict(rule, min_split_k_tiles=1)) == (4, 2)  # never an empty split


def _llama(hidden, intermediate, heads, kv_heads, head_dim, **kw):
    from engc.bundle.model_config import ModelConfig
    return ModelConfig(family="llama", vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate,
                       num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=5e5, max_position_embeddings=8192, tie_word_embeddings=True, **kw)


LLAMA_1B = dict(hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64)
LLAMA_8B = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128)


def _gemv_launches(cfg, **kw):
    import torch
    from engc.compiler.codegen.specs import model_specs
    return {s.variant: s.launch for s in model_specs(cfg, torch.bfloat16, "sm90", 16, **kw) if s.op == "gemv"}


def test_1b_gets_exactly_its_gemv_variants():
    from engc.kernels import gemv
    consts = _gemv_launches(_llama(**LLAMA_1B))
    # down (SiLU-fused) as before; o (N 2048) and lm_head (N 128256) each with its own config; qkv (N 3072)
    # and gate_up (N 16384) have none: no kernel is built for them
    assert set(consts) == {"silu_k8192_m1", "k2048_m1_n4k1024w4", "k2048_m1_n8k512w2"}
    assert consts["k2048_m1_n4k1024w4"]["n_ranges"] == [[1, 2048]]
    assert consts["k2048_m1_n8k512w2"]["n_ranges"] == [[65536, 0]]
    assert (consts["k2048_m1_n4k1024w4"]["BLOCK_N"], consts["k2048_m1_n4k1024w4"]["BLOCK_K"]) == (4, 1024)
    table = gemv.variant_table(consts)
    picks = {n: gemv.pick(table, 2048, False, 1, n) for n in (2048, 3072, 16384, 128256)}
    assert picks == {2048: "k2048_m1_n4k1024w4", 3072: None, 16384: None, 128256: "k2048_m1_n8k512w2"}
    assert gemv.pick(table, 2048, False, 2, 2048) is None                   # M=1 only
    assert gemv.pick(table, 8192, True, 1, 2048) == "silu_k8192_m1"
    assert consts["silu_k8192_m1"]["BLOCK_N"] == 4          # the fused down's N of 2048: tune silu_by_n
    # --quant fp8: the layer projections are FP8Linear, so only the lm_head's kernel is left
    assert set(_gemv_launches(_llama(**LLAMA_1B), quant="fp8")) == {"silu_k8192_m1", "k2048_m1_n8k512w2"}


def test_8b_shares_one_plain_kernel_and_gives_gate_up_its_own():
    from engc.kernels import gemv
    consts = _gemv_launches(_llama(**LLAMA_8B))
    # qkv, o and lm_head: one K 4096 kernel; gate_up (N 28672) its own config
    assert set(consts) == {"silu_k14336_m1", "k4096_m1_n8k512w2", "k4096_m1_n4k1024w4"}
    assert consts["silu_k14336_m1"]["BLOCK_N"] == 8
    assert consts["k4096_m1_n8k512w2"]["n_ranges"] == [[1, 8192], [65536, 0]]
    table = gemv.variant_table(consts)
    picks = {n: gemv.pick(table, 4096, False, 1, n) for n in (4096, 6144, 28672, 128256)}
    assert picks == {4096: "k4096_m1_n8k512w2", 6144: "k4096_m1_n8k512w2", 28672: "k4096_m1_n4k1024w4",
                     128256: "k4096_m1_n8k512w2"}
    # a biased qkv stays a cuBLAS Gemm (the GEMV has no bias); o and lm_head still need the kernel
    assert set(_gemv_launches(_llama(**LLAMA_8B, qkv_bias=True))) == set(consts)


def test_per_n_pick_keeps_old_records_and_refuses_overlapping_classes():
    from engc.kernels.gemv.specs import gemv_specs
    from engc.kernels import gemv
    # records of older bundles carry no n_ranges: any N, N known or not, as before
    old = {"k64_m1": {"K": 64, "SILU": False, "max_m": 1}, "k64_m4": {"K": 64, "SILU": False, "max_m": 4}}
    table = gemv.variant_table(old)
    assert [gemv.pick(table, 64, False, 1, n) for n in (0, 64, 1 << 20)] == ["k64_m1"] * 3
    # a per-N kernel needs its N: an unknown N (0) or one outside its ranges falls to the next class
    new = dict(old, k64_m1_cfg={"K": 64, "SILU": False, "max_m": 1, "n_ranges": [[1, 128], [1000, 0]]})
    del new["k64_m1"]
    table = gemv.variant_table(new)
    assert [gemv.pick(table, 64, False, 1, n) for n in (0, 128, 129, 1000)] == ["k64_m4", "k64_m1_cfg", "k64_m4",
                                                                               "k64_m1_cfg"]
    cfg = _llama(**LLAMA_8B)
    with pytest.raises(ValueError, match="both serve K=4096"):
        gemv_specs(cfg, "bf16", "sm90", {"m<=1/n4k1024w4": {"serves": (((1, 0), (4096, 4096)),)}})


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def _check(dtype, n, k, silu, overrides):
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.kernels.gemv.specs import gemv_specs
    from engc.compiler.codegen.kernel_spec import TRITON_DTYPE
    from engc.kernels import gemv

    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=k, intermediate_size=k, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=k, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=True)
    specs = {s.variant: s for s in gemv_specs(cfg, TRITON_DTYPE[dtype], "sm90", overrides,
                                                 classes=("m<=4", "m<=16"))}
    table = gemv.variant_table({v: s.launch for v, s in specs.items()})
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32)
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    worst, splits = 0.0, set()
    # every M of the small class, a few of the tensor-core one; each launch after the first relies on
    # the counters the one before left zeroed
    for m in (1, 2, 3, 4, 5, 8, 16):
        x = torch.randn(m, 2 * k if silu else k, dtype=dtype)
        ref = gemv.silu_mul_linear(x, w) if silu else gemv.gemv(x, w)
        variant = gemv.pick(table, k, silu, m)
        out = torch.full((m, n), float("nan"), dtype=dtype)
        for v, grid, args in gemv.launch(x, w, out, variant, specs[variant].launch, counters):
            splits.add(grid[1])
            specs[v].fn()[grid](*args[:-2], **specs[v].constexprs)
        worst = max(worst, float((out.double() - ref.double()).norm() / ref.double().norm()))
        assert int(counters.abs().sum()) == 0, "split-K counters not reset"
    return worst, sorted(splits)


def _check_plain(dtype, n, k):
    """The per-N plain kernel the model's specs build for a (K, N) projection, at M=1 (its only M)."""
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.kernels.gemv.specs import gemv_specs
    from engc.compiler.codegen.kernel_spec import TRITON_DTYPE
    from engc.kernels import gemv

    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=k, intermediate_size=k, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=k, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=True)
    specs = {s.variant: s for s in gemv_specs(cfg, TRITON_DTYPE[dtype], "sm90", projections={(k, n)})}
    variant = gemv.pick(gemv.variant_table({v: s.launch for v, s in specs.items()}), k, False, 1, n)
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32)
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    worst, splits = 0.0, set()
    for _ in range(2):   # the second launch relies on the counters the first left zeroed
        x = torch.randn(1, k, dtype=dtype)
        out = torch.full((1, n), float("nan"), dtype=dtype)
        for v, grid, args in gemv.launch(x, w, out, variant, specs[variant].launch, counters):
            splits.add(grid[1])
            specs[v].fn()[grid](*args[:-2], **specs[v].constexprs)
        ref = gemv.gemv(x, w).double()
        worst = max(worst, float((out.double() - ref).norm() / ref.norm()))
        assert int(counters.abs().sum()) == 0, "split-K counters not reset"
    return worst, sorted(splits), variant


def main():
    import torch
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels import _patch_interpreter_bf16_dot
    _patch_interpreter_bf16_dot()
    torch.manual_seed(0)
    bf16, fp16 = torch.bfloat16, torch.float16
    small = {"m<=4": SMALL_TILES, "m<=16": SMALL_TILES}
    no_split = {c: dict(SMALL_TILES, max_splits=1) for c in small}
    checks = {
        "gemv_bf16_n50_k96": (bf16, 50, 96, False, small),
        "gemv_fp16_n50_k96": (fp16, 50, 96, False, small),
        "gemv_bf16_n33_k200_ragged_k": (bf16, 33, 200, False, small),
        "gemv_bf16_n70_k64_no_split": (bf16, 70, 64, False, no_split),
        "silu_bf16_n40_k72": (bf16, 40, 72, True, small),
        "silu_fp16_n17_k160": (fp16, 17, 160, True, small),
    }
    # the interpreter rounds float32 -> bfloat16 less exactly than the GPU (tests/test_kernels.py allows the same)
    tol = {bf16: 1.5e-2, fp16: 2e-3}
    report = {}
    for name, (dtype, n, k, silu, ov) in checks.items():
        try:
            err, splits = _check(dtype, n, k, silu, ov)
            report[name] = {"ok": err <= tol[dtype], "err": err, "limit": tol[dtype], "splits": splits}
        except Exception as exc:  # reported per case, so one failure does not hide the others
            import traceback
            report[name] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()[-2000:]}
    plain = {"plain_n4k1024w4_bf16_n50_k96": (bf16, 50, 96), "plain_n4k1024w4_fp16_n33_k1024": (fp16, 33, 1024),
             "plain_n8k512w2_bf16_n40_k2176": (bf16, 40, 2176)}
    for name, (dtype, n, k) in plain.items():
        try:
            err, splits, variant = _check_plain(dtype, n, k)
            report[name] = {"ok": err <= tol[dtype], "err": err, "limit": tol[dtype], "splits": splits,
                            "variant": variant}
        except Exception as exc:
            import traceback
            report[name] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()[-2000:]}
    print(json.dumps(report))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    main()
