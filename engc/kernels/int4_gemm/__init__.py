"""W4A16 GEMM for decode batches over the engc int4 layout (kernels/int4_linear): y = act(x) @ dequant(W)^T.

ONNX: the QLinear of kernels/int4_linear (its reference is this op's), without bias, act_order or a fused
SiLU so far (SILU is a constexpr of the kernel, built off: int4 programs keep SiluMul separate).

A bundle holds one kernel per (K, group size, M class) whose tune entry is enabled: variant
`k{K}_g{G}_m{max_m}`, launch constants K, GROUP, min_m, max_m, BLOCK_M, BLOCK_N, BLOCK_K and the split
rule's target_programs, max_splits, min_split_k_tiles. The runtime (int4_linear.run_quantized_linear)
runs it for min_m <= M <= max_m ahead of the CUDA GEMV builds and dequant + cuBLAS (`pick`).
"""
from __future__ import annotations

from engc.kernels import gemv
from engc.kernels.fp8_linear import split_count
from engc.kernels.int4_linear import int4_linear as int4_gemm  # noqa: F401  (the op's reference)

# Split-K arrival counters the runtime keeps zeroed, one per (N tile, M tile) of a launch: the GEMV's array.
NUM_COUNTERS = gemv.NUM_COUNTERS


def variant_name(k: int, group: int, max_m: int) -> str:
    return f"k{k}_g{group}_m{max_m}"


def pick(consts: dict, k: int, group: int, m: int) -> str | None:
    """The variant for M rows of a K-wide input in groups of `group`, or None: the smallest M class that
    holds M."""
    fits = [(c["max_m"], v) for v, c in consts.items()
            if c.get("K") == k and c.get("GROUP") == group and c["min_m"] <= m <= c["max_m"]]
    return min(fits)[1] if fits else None


def launch(x, qweight, scales, zeros, out, variant: str, consts: dict, counters):
    """Launch rule of int4_gemm_kernel: [(variant, grid, args)].

    x contiguous [M, K], out contiguous [M, N], qweight/scales/zeros in the engc int4 layout; consts: the
    variant's record launch; counters: NUM_COUNTERS int32, zero, owned by the caller (split launches leave
    them zero). grid (N tiles, splits, M tiles); args: x, qweight, scales, zeros, out, partial, counter, M,
    N, k_tiles_per_split, splits, global/profile scratch."""
    m, k = x.shape
    n = qweight.shape[0]
    assert k == consts["K"] and consts["min_m"] <= m <= consts["max_m"] and qweight.shape[1] * 8 == k
    assert x.is_contiguous() and out.is_contiguous() and out.shape == (m, n)
    m_tiles = -(-m // consts["BLOCK_M"])
    n_tiles, splits, per, partial, counter = gemv.split_k(x, n, k, consts, counters, split_count, m_tiles)
    return [(variant, (n_tiles, splits, m_tiles), [x, qweight, scales, zeros, out, partial, counter, m, n, per,
                                                   splits, 0, 0])]
