"""bench/ablate.py (gpu_bench --ablate): the named families' ops launch nothing on decode-sized steps and give
outputs of the shapes the program expects; other ops, and larger steps, run as they were."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ablate  # noqa: E402

D = "ai.engc"


def test_removed_ops_launch_nothing_and_keep_shapes():
    calls = []

    def real(name):
        return lambda *xs, **a: calls.append(name) or ("ran",)

    ops = {(D, n): real(n) for n in ("RMSNorm", "AddRMSNorm", "RotaryPagedAttention", "QLinearSiluMul", "SiluMul")}
    ops[("", "Gemm")] = real("Gemm")
    out = ablate.ablated_ops(ops, {"norm", "attn", "gemm"})
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    assert out[(D, "RMSNorm")](x, torch.ones(16), eps=1e-5)[0] is x
    assert out[(D, "AddRMSNorm")](x, r, torch.ones(16), 1e-5) == (x, r)
    assert out[(D, "RotaryPagedAttention")](torch.randn(4, 48), num_heads=2, head_dim=8)[0].shape == (4, 16)
    assert out[("", "Gemm")](x, torch.randn(24, 16), transB=1)[0].shape == (4, 24)
    assert out[(D, "QLinearSiluMul")](x, torch.zeros(24, 2, dtype=torch.int32), group_size=32)[0].shape == (4, 12)
    assert calls == []
    assert out[(D, "SiluMul")](torch.randn(4, 32)) == ("ran",)                # silu was not named
    assert out[(D, "RMSNorm")](torch.randn(ablate.ROWS + 1, 16), torch.ones(16), eps=1e-5) == ("ran",)   # prefill
    assert calls == ["SiluMul", "RMSNorm"]


def test_an_unknown_family_is_one_clear_line():
    with pytest.raises(SystemExit, match="unknown family \\['norms'\\]"):
        ablate.ablated_ops({}, {"norms"})
