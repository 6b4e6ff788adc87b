"""Residual add + RMSNorm + linear of decode batches in one launch (passes/fuse_norm_linear makes the node).

ONNX: ai.engc::AddRMSNormLinear(x, residual, norm_weight, W) -> (y, x + residual), attribute eps: what
AddRMSNorm -> Gemm computed, y = rms_norm(x + residual) * norm_weight @ W^T. The program's every AddRMSNorm
feeds a projection (qkv, gate_up), and at 9-32 rows the norm is a launch of its own between two GEMMs that
each read ~50-235 MB of weights: this kernel (the skinny GEMM's shape, triton.py says how) takes the norm
into the projection, one launch and one round trip of the residual stream fewer per norm.

A bundle holds one kernel per (K, M class) whose tune entry is enabled: variant `k{K}_m{max_m}`, launch
constants K, min_m, max_m, BLOCK_N. Where none serves the batch, the runtime runs the two kernels as before
(kernels/rms_norm, then the GEMV, skinny GEMM or cuBLAS), so the fused node never costs a launch.
"""
from __future__ import annotations

import torch.nn.functional as F

from engc.kernels.rms_norm import add_rms_norm


def add_rms_norm_linear(x, residual, norm_weight, w, eps: float):
    """The reference: AddRMSNorm, then the linear. -> (y, x + residual)."""
    normed, s = add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(normed, w), s


def variant_name(k: int, max_m: int) -> str:
    return f"k{k}_m{max_m}"


def variant_table(consts: dict) -> dict:
    """K -> [(max_m, min_m, variant)] by ascending M class, from the op's launch constants."""
    table: dict = {}
    for variant, c in consts.items():
        table.setdefault(c["K"], []).append((c["max_m"], c["min_m"], variant))
    return {k: sorted(v) for k, v in table.items()}


def pick(table: dict, k: int, m: int) -> str | None:
    """The variant for M rows of a K-wide input, or None (then the norm and the GEMM run apart)."""
    return next((v for max_m, min_m, v in table.get(k, ()) if min_m <= m <= max_m), None)


def launch(x, residual, norm_weight, w, eps: float, out, residual_out, variant: str, consts: dict):
    """Launch rule of norm_linear_kernel: [(variant, grid, args)], one program per BLOCK_N rows of W.

    x, residual, residual_out contiguous [M, K]; norm_weight [K]; w contiguous [N, K]; out contiguous [M, N];
    consts: the variant's record launch. args: x, residual, norm_weight, w, out, residual_out, M, N, eps,
    global/profile scratch."""
    m, (n, k) = x.shape[0], w.shape
    assert k == consts["K"] and consts["min_m"] <= m <= consts["max_m"] and norm_weight.shape == (k,)
    for t, shape in ((x, (m, k)), (residual, (m, k)), (residual_out, (m, k)), (w, (n, k)), (out, (m, n))):
        assert t.is_contiguous() and tuple(t.shape) == shape
    n_tiles = -(-n // consts["BLOCK_N"])
    return [(variant, (n_tiles, 1, 1), [x, residual, norm_weight, w, out, residual_out, m, n, float(eps), 0, 0])]
