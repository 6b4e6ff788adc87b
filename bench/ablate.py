"""Decode-step ablations for bench/gpu_bench.py --ablate: the GPU runtime with kernel families removed.

What removing a family from the decode steps gives is an upper bound on what fusing it away or speeding it
up can give (bench/results/HISTORY.md lists what it found). Each named family's ops return
an unwritten buffer of the right shape (a norm: its input) for steps of at most ROWS rows, launching
nothing; larger steps (prefill) run as usual. The outputs are garbage: only timings mean anything (the
samplers turn the NaN logits into valid ids, so the engine keeps running). Families:
  norm  RMSNorm, AddRMSNorm            attn  RotaryPagedAttention, PagedAttention
  silu  SiluMul                        gemm  Gemm (the lm_head too), SiluMulLinear, QLinear, QLinearSiluMul,
                                             FP8Linear, QLinearAddRMSNorm (its norm goes with it)
"""
from __future__ import annotations

import torch

ROWS = 64
FAMILIES = {"RMSNorm": "norm", "AddRMSNorm": "norm", "RotaryPagedAttention": "attn", "PagedAttention": "attn",
            "SiluMul": "silu", "Gemm": "gemm", "SiluMulLinear": "gemm", "QLinear": "gemm",
            "QLinearSiluMul": "gemm", "FP8Linear": "gemm", "QLinearAddRMSNorm": "gemm"}


def _empty(x: torch.Tensor, cols: int) -> tuple[torch.Tensor]:
    return (torch.empty(x.shape[0], cols, dtype=x.dtype, device=x.device),)


def _removed(name: str, xs: tuple, attrs: dict) -> tuple:
    """The op's outputs with no work done."""
    x = xs[0]
    if name == "RMSNorm":
        return (x,)
    if name == "AddRMSNorm":
        return x, xs[1]
    if name == "RotaryPagedAttention":
        return _empty(x, attrs["num_heads"] * attrs["head_dim"])
    if name == "PagedAttention":
        return (torch.empty_like(x),)
    if name == "SiluMul":
        return _empty(x, x.shape[1] // 2)
    if name == "Gemm":
        return _empty(x, xs[1].shape[0] if attrs.get("transB") else xs[1].shape[1])
    if name == "QLinearSiluMul":
        return _empty(x, xs[1].shape[0] // 2)
    if name == "QLinearAddRMSNorm":   # no projection, no norm: (an unwritten y, the residual as it was)
        return _empty(xs[4], xs[4].shape[1])[0], xs[4]
    return _empty(x, xs[1].shape[0])   # SiluMulLinear, QLinear, FP8Linear: weight [N, ...]


def ablated_ops(ops: dict, families: set[str]) -> dict:
    """ops (gpu_ops' table) with the named families' ops removed for steps of at most ROWS rows."""
    unknown = families - set(FAMILIES.values())
    if unknown:
        raise SystemExit(f"--ablate: unknown famil{'ies' if len(unknown) > 1 else 'y'} {sorted(unknown)}; "
                         f"known: {sorted(set(FAMILIES.values()))}")
    out = dict(ops)
    for key, op in ops.items():
        name = key[1]
        if FAMILIES.get(name) in families:
            def skip(*xs, _op=op, _name=name, **attrs):
                return _removed(_name, xs, attrs) if xs[0].shape[0] <= ROWS else _op(*xs, **attrs)
            out[key] = skip
    return out


def install(families: set[str]) -> None:
    """Make every bundle loaded on the GPU from now on in this process run with those families removed."""
    from engc.runtime import loader
    real = loader.gpu_ops
    loader.gpu_ops = lambda kernels, facts: ablated_ops(real(kernels, facts), families)
