"""Skinny GEMM for dense projections of decode batches (about 9-64 rows): y[M, N] = x[M, K] @ W[N, K]^T.

ONNX: the standard Gemm (transB=1, no bias) and ai.engc::SiluMulLinear(gate_up, W) = silu_mul(gate_up) @ W^T
(the references are kernels/gemv's). At these row counts cuBLAS reads the weights well below
the copy bandwidth (bench/results/HISTORY.md); this kernel streams W through wgmma with the tokens on
the MMA's narrow side, split-K reduced in the same launch (triton.py says how).

A bundle holds one kernel per (K, SILU, M class) whose tune entry is enabled: variant
`[silu_]k{K}_m{max_m}`, launch constants K, SILU, min_m, max_m, max_n (0: any N), BLOCK_N, BLOCK_K and
the split rule's target_programs, max_splits, min_split_k_tiles. The runtime tries it after the decode
GEMV (kernels/gemv, M=1 classes) and before cuBLAS: the smallest class with min_m <= M <= max_m whose
max_n admits N (`pick`).
"""
from __future__ import annotations

from engc.kernels import gemv
from engc.kernels.fp8_linear import split_count  # noqa: F401  (the same rule: fill target_programs, one wave)
from engc.kernels.gemv import gemv as skinny_gemm, silu_mul_linear  # noqa: F401  (the op's references)
from engc.kernels.gemv import variant_name  # noqa: F401  (the same names: [silu_]k{K}_m{max_m})

# Split-K arrival counters the runtime keeps zeroed, one per N tile of a launch: the GEMV's array.
NUM_COUNTERS = gemv.NUM_COUNTERS


def variant_table(consts: dict) -> dict:
    """(K, silu) -> [(max_m, min_m, max_n, variant)] by ascending M class, from the op's launch constants."""
    return gemv.table_by_k(consts, "SILU", lambda v, c: (c["max_m"], c["min_m"], c["max_n"], v))


def pick(table: dict, k: int, silu: bool, m: int, n: int) -> str | None:
    """The variant for M rows of a K-wide input and N outputs, or None (then cuBLAS runs)."""
    return next((v for max_m, min_m, max_n, v in table.get((k, silu), ())
                 if min_m <= m <= max_m and (not max_n or n <= max_n)), None)


def launch(x, w, out, variant: str, consts: dict, counters):
    """Launch rule of skinny_gemm_kernel: [(variant, grid, args)].

    x contiguous [M, K] ([M, 2K] gate_up for a SILU variant), w contiguous [N, K], out contiguous [M, N];
    consts: the variant's record launch; counters: NUM_COUNTERS int32, zero, owned by the caller (split
    launches leave them zero; gemv.split_k). args: x, w, out, partial, counter, M, N, k_tiles_per_split,
    splits, global/profile scratch.
    """
    m, (n, k) = x.shape[0], w.shape
    assert k == consts["K"] and x.shape[1] == (2 * k if consts["SILU"] else k) and m <= consts["max_m"]
    assert x.is_contiguous() and w.is_contiguous() and out.is_contiguous() and out.shape == (m, n)
    if m == 0:
        return []
    n_tiles, splits, per, partial, counter = gemv.split_k(x, n, k, consts, counters, split_count)
    return [(variant, (n_tiles, splits, 1), [x, w, out, partial, counter, m, n, per, splits, 0, 0])]
