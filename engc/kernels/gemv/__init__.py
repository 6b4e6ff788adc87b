"""Decode GEMV for dense projections: y[M, N] = x[M, K] @ W[N, K]^T for a few rows (decode batches).

ONNX: the standard Gemm (transB=1, no bias) and ai.engc::SiluMulLinear(gate_up, W) = silu_mul(gate_up) @ W^T,
which the fuse_silu_mul_linear pass makes of SiluMul -> Gemm. cuBLAS is fine for wide batches but at M of
1-8 it leaves bandwidth on the table and adds a splitK-reduce launch; this kernel reads W once for all
rows in one launch (kernels/gemv/triton.py says how).

A bundle holds one kernel per (K, SILU, M class): variant `[silu_]k{K}_m{max_m}`, each with launch
constants (its record's `launch`): K, SILU, max_m, BLOCK_N, BLOCK_K and the split rule's target_programs,
max_splits, min_split_k_tiles. Plain projections at M=1 get one kernel per (K, M class, tile config) of the
tune table's per-N entries: variant `k{K}_m{max_m}_{config}` (e.g. k4096_m1_n8k512w2), whose launch adds
n_ranges, the [lo, hi] N ranges (hi 0: no bound) it serves; other N of that K stay with cuBLAS. It may
also hold the CUDA C++ twin (templates/gemv.cu.j2, same parameters and launch rule, no Triton scratch
pointers): variant `cuda_[silu_]k{K}_m{max_m}`, launch constants plus impl "cuda" and max_n (used for
N <= max_n only; 0: any N). The runtime picks a CUDA kernel first, else a Triton one, of the smallest M
class that holds M and whose N ranges hold N (`pick`), and falls back to cuBLAS when none does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.kernels.silu_mul import silu_mul

# Split-K arrival counters the runtime keeps zeroed: one per N tile of a launch.
NUM_COUNTERS = 1 << 16


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def silu_mul_linear(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_mul(gate_up), w)


def variant_name(k: int, silu: bool, max_m: int, config: str = "") -> str:
    return f"{'silu_' if silu else ''}k{k}_m{max_m}" + (f"_{config}" if config else "")


def in_range(v: int, bounds) -> bool:
    """lo <= v <= hi for bounds (lo, hi); hi 0: no upper bound."""
    lo, hi = bounds
    return lo <= v and (not hi or v <= hi)


def n_ranges(c: dict) -> tuple:
    """The N ranges a variant serves: its launch's n_ranges (a per-N tune entry's kernel), else N <= max_n
    (the CUDA variant; 0: any N), else any N (a record with neither). Ranges of the first two kinds start
    at 0 so a caller that does not know N (n=0) still gets them; n_ranges start at 1."""
    if "n_ranges" in c:
        return tuple(tuple(r) for r in c["n_ranges"])
    return ((0, c.get("max_n", 0)),)


def is_cuda(c: dict) -> bool:
    """A variant of the CUDA C++ template (its launch constants say so)."""
    return c.get("impl") == "cuda"


def table_by_k(consts: dict, flag: str, row) -> dict:
    """(K, bool(c[flag])) -> sorted [row(variant, c)] over an op's variants (variant -> record launch c):
    the table the pick of gemv, skinny_gemm and fp8_linear walks, its order set by what row puts first."""
    table: dict = {}
    for variant, c in consts.items():
        table.setdefault((c["K"], bool(c[flag])), []).append(row(variant, c))
    return {key: sorted(v) for key, v in table.items()}


def variant_table(consts: dict) -> dict:
    """(K, silu) -> [(rank, max_m, n_ranges, variant)] in pick order: CUDA variants (rank 0) before Triton
    ones (the tune table builds a CUDA kernel only where it beat both), each by ascending M class."""
    return table_by_k(consts, "SILU", lambda v, c: (0 if is_cuda(c) else 1, c["max_m"], n_ranges(c), v))


def pick(table: dict, k: int, silu: bool, m: int, n: int = 0) -> str | None:
    """The variant for M rows of a K-wide input and N outputs (0: not known), or None (then cuBLAS runs)."""
    return next((v for _, max_m, ranges, v in table.get((k, silu), ())
                 if 1 <= m <= max_m and any(in_range(n, r) for r in ranges)), None)


def split_count(n_tiles: int, k_tiles: int, c: dict) -> tuple[int, int]:
    """(splits, K tiles per split): split K until the grid reaches target_programs, each split keeping at
    least min_split_k_tiles tiles; no split is left empty."""
    splits = 1
    while (n_tiles * splits < c["target_programs"] and 2 * splits <= c["max_splits"]
           and k_tiles // (2 * splits) >= c["min_split_k_tiles"]):
        splits *= 2
    per = -(-k_tiles // splits)
    return -(-k_tiles // per), per


def split_k(x, n: int, k: int, consts: dict, counters, rule=split_count, m_tiles: int = 1):
    """The split-K half of the gemv, skinny_gemm, fp8_linear and int4_gemm launch rules: (N tiles, splits, K
    tiles per split, partial, counter argument), splits by the op's rule (its split_count) over the N x M
    output tiles (m_tiles: programs along M, one counter each), none where there are fewer counters than
    output tiles. The fp32 partials [splits, M, N] come from torch's allocator (inside a CUDA graph, its
    pool); unsplit, partial and counters are 0 (null pointers the kernel never reads)."""
    n_tiles = -(-n // consts["BLOCK_N"])
    k_tiles = -(-k // consts["BLOCK_K"])
    splits, per = rule(n_tiles * m_tiles, k_tiles, consts)
    if splits > 1 and n_tiles * m_tiles > counters.numel():
        splits, per = 1, k_tiles
    if splits == 1:
        return n_tiles, splits, per, 0, 0
    partial = torch.empty((splits, x.shape[0], n), dtype=torch.float32, device=x.device)
    return n_tiles, splits, per, partial, counters


def launch(x, w, out, variant: str, consts: dict, counters):
    """Launch rule of gemv_kernel: [(variant, grid, args)].

    x contiguous [M, K] ([M, 2K] gate_up for a SILU variant), w contiguous [N, K], out contiguous [M, N];
    consts: the variant's record launch; counters: NUM_COUNTERS int32, zero, owned by the caller (split
    launches leave them zero; split_k). args: x, w, out, partial, counter, M, N, k_tiles_per_split, splits,
    then the Triton kernel's global/profile scratch zeros (a CUDA variant takes none).
    """
    m, (n, k) = x.shape[0], w.shape
    assert k == consts["K"] and x.shape[1] == (2 * k if consts["SILU"] else k) and m <= consts["max_m"]
    assert x.is_contiguous() and w.is_contiguous() and out.is_contiguous() and out.shape == (m, n)
    if m == 0:
        return []
    n_tiles, splits, per, partial, counter = split_k(x, n, k, consts, counters)
    scratch = [] if is_cuda(consts) else [0, 0]
    return [(variant, (n_tiles, splits, 1), [x, w, out, partial, counter, m, n, per, splits] + scratch)]
