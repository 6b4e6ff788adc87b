"""The W4A16 kernels (kernels/int4_linear) compile AOT for sm80 and sm90 with no GPU, only when the
program has int4 projections, and their records agree with the launch rule the runtime calls."""
from __future__ import annotations

import pytest
import torch

from engc.bundle.model_config import ModelConfig

TINY = ModelConfig(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                   max_position_embeddings=256, tie_word_embeddings=True)
_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32, "i32": torch.int32, "u8": torch.uint8}


@pytest.fixture(scope="module")
def records():
    pytest.importorskip("triton")
    from engc.compiler.codegen.record import compile_specs
    from engc.kernels.int4_linear.specs import int4_linear_specs
    specs = [s for arch in ("sm80", "sm90") for s in int4_linear_specs("bf16", arch, (64,))]
    return compile_specs(specs, jobs=2).records


def test_int4_variants_compiled_per_arch(records):
    got = {(r["arch"], r["variant"]) for r in records}
    variants = {"gemv_m1_g64", "gemv_m2_g64", "gemv_m4_g64", "gemv_m8_g64", "dequant_g64", "gemv_reduce"}
    assert got == {(a, v) for a in ("sm80", "sm90") for v in variants}
    dequant = next(r for r in records if r["variant"] == "dequant_g64")
    assert dequant["constexprs"]["GROUP"] == 64 and dequant["launch"]["BLOCK_C"] == dequant["constexprs"]["BLOCK_C"]
    gemv = next(r for r in records if r["variant"] == "gemv_m4_g64")
    assert gemv["constexprs"]["BLOCK_M"] == 4 and gemv["launch"]["gemv_max_rows"] == 8


def test_no_int4_kernels_without_int4_projections():
    from engc.compiler.codegen.specs import model_specs
    assert not [s for s in model_specs(TINY, torch.bfloat16, "sm90", 16) if s.op == "int4_linear"]
    with_int4 = model_specs(TINY, torch.bfloat16, "sm90", 16, int4_group_sizes=(128, 32, 128))
    assert sorted({s.constexprs.get("GROUP") for s in with_int4 if s.op == "int4_linear"} - {None}) == [32, 128]


def test_group_size_the_layout_cannot_take_is_one_line():
    from engc.kernels.int4_linear.specs import int4_linear_specs
    from engc.errors import UserError
    with pytest.raises(UserError, match="not a multiple of 32"):
        int4_linear_specs("bf16", "sm90", (48,))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 300])
def test_launch_rule_matches_records(records, rows):
    from engc.kernels import int4_linear
    recs = {r["variant"]: r for r in records if r["arch"] == "sm90"}
    consts = {v: r["launch"] for v, r in recs.items()}
    k, n = 8192, 96  # few N tiles and two BLOCK_C tiles of K: the GEMV splits over K
    x, y = torch.randn(rows, k, dtype=torch.bfloat16), torch.empty(rows, n, dtype=torch.bfloat16)
    qw = torch.zeros(n, k // 8, dtype=torch.int32)
    s, z = torch.ones(n, k // 64, dtype=torch.bfloat16), torch.zeros(n, k // 64, dtype=torch.uint8)
    for bias in (None, torch.zeros(n, dtype=torch.bfloat16)):
        if int4_linear.uses_gemv(rows, 64, consts):
            launches = int4_linear.launch(x, qw, s, z, bias, y, group_size=64, consts=consts)
        else:
            launches = int4_linear.dequant_launch(qw, s, z, torch.empty(n, k, dtype=torch.bfloat16), group_size=64,
                                                  consts=consts)
        kinds = [int4_linear.variant_kind(v) for v, _, _ in launches]
        assert kinds == (["dequant"] if rows > 8 else ["gemv", "gemv_reduce"])
        for variant, grid, args in launches:
            rec = recs[variant]
            assert len(grid) == 3 and all(isinstance(g, int) and g >= 1 for g in grid)
            assert len(args) == len(rec["args"]), variant
            for value, spec in zip(args, rec["args"]):
                if spec["type"].startswith("*") and isinstance(value, int):
                    assert value == 0 and (spec["name"] in ("bias_ptr", "global_scratch", "profile_scratch")
                                           or variant.startswith("gemv_m")), (variant, spec)
                elif spec["type"].startswith("*"):
                    assert value.dtype == _TORCH[spec["type"][1:]], (variant, spec)
                else:
                    assert isinstance(value, int) and not isinstance(value, bool), (variant, spec)
