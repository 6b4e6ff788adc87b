"""The decode GEMV (kernels/gemv) under TRITON_INTERPRET=1 against its torch reference, through its launch
rule and the specs codegen makes: ragged N and K, every M of both M classes, split-K on and off, the
SiLU-fused variant; and the split-K counters are left zeroed for the next launch.

Like tests/test_kernels.py, the checks run in a child process that switches the interpreter on before
triton is imported, and the tests assert on its report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL_TILES = {"BLOCK_N": 16, "BLOCK_K": 32, "target_programs": 64, "min_split_k_tiles": 1}


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"gemv checks crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1])


CASES = ["gemv_bf16_n50_k96", "gemv_fp16_n50_k96", "gemv_bf16_n33_k200_ragged_k", "gemv_bf16_n70_k64_no_split",
         "silu_bf16_n40_k72", "silu_fp16_n17_k160"]


@pytest.mark.parametrize("case", CASES)
def test_gemv_matches_reference(report, case):
    assert case in report, f"{case} did not run"
    assert report[case]["ok"], report[case]


def test_split_k_was_exercised(report):
    assert any(s > 1 for s in report["gemv_bf16_n50_k96"]["splits"])
    assert report["gemv_bf16_n70_k64_no_split"]["splits"] == [1]


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


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def _check(dtype, n, k, silu, overrides):
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.compiler.codegen.specs import gemv_specs
    from engc.compiler.codegen.specs import TRITON_DTYPE
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
    print(json.dumps(report))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    main()
