"""FP8Linear's GEMM for decode and small-prefill batches (M <= 256): a Triton W8A8 kernel (triton.py).

ONNX: ai.engc::FP8Linear(x, weight, weight_scale[, bias]) -> y; the op, its scales and its reference
(`fp8_linear`, re-exported here) are kernels/fp8_quant's. torch._scaled_mm (cuBLASLt) reads the float8
weight well below the memory bandwidth at decode batch sizes and needs a separate activation-quant launch;
this kernel streams the weight through wgmma with split-K and, for a few rows, quantizes x itself.

A bundle holds one kernel per (K, M class, QUANT_X): variant `[q_]k{K}_m{max_m}` (q_: x is bf16 and the
kernel quantizes it; else x is float8 from the fp8_quant kernel, with its per-token scales). Each has
launch constants (its record's `launch`): K, QUANT_X, max_m, BLOCK_N, BLOCK_K and the split rule's
target_programs, max_splits, min_split_k_tiles (split_count below). The runtime picks a fused variant
for the smallest M class holding M if there is one, else the fp8_quant kernel + a plain variant, else
(M above every class: prefill) fp8_quant + _scaled_mm, where cuBLASLt's big tiles win.
"""
from __future__ import annotations

from engc.kernels import gemv
from engc.kernels.fp8_quant import fp8_linear  # noqa: F401  (the op's reference)

# Split-K arrival counters the runtime keeps zeroed, one per N tile of a launch: the same array as
# the GEMV's (runtime/gpu_ops.py shares one between them).
NUM_COUNTERS = gemv.NUM_COUNTERS


def variant_name(k: int, max_m: int, quant_x: bool) -> str:
    return f"{'q_' if quant_x else ''}k{k}_m{max_m}"


def variant_table(consts: dict) -> dict:
    """(K, quant_x) -> [(max_m, variant)] ascending, from the op's launch constants (variant -> record launch)."""
    return gemv.table_by_k(consts, "QUANT_X", lambda v, c: (c["max_m"], v))


def pick(table: dict, k: int, m: int, quant_x: bool) -> str | None:
    """The variant for M rows of a K-wide input (x bf16 when quant_x, else float8), or None."""
    return next((v for max_m, v in table.get((k, quant_x), ()) if 1 <= m <= max_m), None)


def split_count(n_tiles: int, k_tiles: int, c: dict) -> tuple[int, int]:
    """(splits, K tiles per split): the most splits that keep the grid within target_programs, each split
    at least min_split_k_tiles tiles, at most max_splits; no split is left empty.

    At decode sizes the kernel is bound by how many weight bytes are in flight (Little's law; the figures are
    in bench/results/HISTORY.md), so the grid should fill what the SMs hold at once (target_programs = SMs x programs per SM, which the
    tune entry's shared memory allows) and not spill into a second, mostly empty wave. Any count is
    allowed, not just powers of two: 8B qkv at BLOCK_N 128 is 48 N tiles, x5 = 240 programs for 264 slots
    (doubling would give 192 or 384)."""
    splits = max(1, min(c["target_programs"] // n_tiles, c["max_splits"], k_tiles // c["min_split_k_tiles"]))
    per = -(-k_tiles // splits)
    return -(-k_tiles // per), per


def launch(x, x_scale, w, w_scale, bias, out, variant: str, consts: dict, counters):
    """Launch rule of fp8_linear_kernel: [(variant, grid, args)].

    x contiguous [M, K]: bf16/fp16 for a QUANT_X variant (x_scale None), else float8_e4m3fn with x_scale
    float32 [M]; w float8_e4m3fn [N, K] contiguous, w_scale float32 [N], bias [N] or None, out [M, N];
    consts: the variant's record launch; counters: NUM_COUNTERS int32, zero, owned by the caller (split
    launches leave them zero; gemv.split_k). args: x, x_scale, w, w_scale, bias, out, partial, counter, M,
    N, k_tiles_per_split, splits, has_bias, global/profile scratch.
    """
    m, (n, k) = x.shape[0], w.shape
    assert k == consts["K"] and x.shape[1] == k and m <= consts["max_m"] and out.shape == (m, n)
    assert (x_scale is None) == bool(consts["QUANT_X"])
    assert x.is_contiguous() and w.is_contiguous() and out.is_contiguous()
    if m == 0:
        return []
    n_tiles, splits, per, partial, counter = gemv.split_k(x, n, k, consts, counters, split_count)
    return [(variant, (n_tiles, splits, 1),
             [x, 0 if x_scale is None else x_scale, w, w_scale, 0 if bias is None else bias, out, partial,
              counter, m, n, per, splits, int(bias is not None), 0, 0])]
