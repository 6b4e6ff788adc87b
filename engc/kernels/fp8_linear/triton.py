"""W8A8 FP8 GEMM for decode and small prefill batches: y[M, N] = (xq[M, K] @ wq[N, K]^T) * x_scale[m] * w_scale[n].

At M <= 256 the GEMM is bound by reading the float8 weight once from DRAM, so the kernel is shaped for
that (cuBLASLt's _scaled_mm stays well below the copy bandwidth there: bench/results/HISTORY.md):
- swap AB: the weight tile [BLOCK_N, BLOCK_K] is the MMA's A operand, so N fills the 64-row wgmma
  instruction and the few tokens M are its narrow N side (16..256); on sm90 tl.dot on float8e4nv
  operands becomes wgmma ...e4m3.e4m3 with an fp32 accumulator. Both operands are K-contiguous in memory,
  which is the only fp8 wgmma layout.
- split-K when N / BLOCK_N alone gives too few programs for the SMs; the splits are reduced in the same
  launch by the last program to arrive (kernels/gemm_tiles.py, as kernels/gemv does): fp32 partials, a
  per-N-tile counter left at zero for the next launch, the sum taken in split order, so results do not
  depend on timing.
- W tiles are plain 16-byte-vector loads of K-contiguous rows; Triton pipelines them through shared
  memory over num_stages (cp.async).

QUANT_X: x is the bf16/fp16 activation and each program quantizes it itself (no separate quant launch):
a first pass over x takes each row's absmax, then every K tile is scaled and rounded to e4m3 on the way
into the MMA, with the arithmetic of kernels/fp8_quant (correctly rounded divisions, clamp, RNE cast), so
the codes are the reference's bit for bit. The price is that every program reads all of x [M, K] from L2
once more: cheap for a few rows, not at M=64 (each program would read 512 KB for K=4096), so the launch
rule uses it up to `fuse_quant_max_m` rows only. Otherwise x is already float8 with its x_scale.

PDL (kernels/pdl.py; the tune entry's PDL: on for m<=16, compiler/tune/table_sm90.jsonl): the program waits for the
previous kernel before it touches x, its scales, the partials or the counters, and lets the next start.
"""
import triton
import triton.language as tl

from engc.kernels import gemm_tiles, pdl


@triton.jit
def _row_scales(x_ptr, rows, row_mask, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr):
    """Per-token scale of x's rows: absmax / 448, as kernels/fp8_quant computes it."""
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :], mask=row_mask[:, None] & (offs_k < K)[None, :],
                    other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX)


@triton.jit
def _store_tile(acc, w_scale_ptr, x_scale, bias_ptr, out_ptr, offs_n, rows, row_mask, N, has_bias):
    """acc [BLOCK_N, BLOCK_M] (transposed: swap AB) -> out[m, n] in the output dtype, scaled, bias added in
    the output dtype afterwards (as _scaled_mm(...) + bias rounds)."""
    n_mask = offs_n < N
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    y = (acc * w_scale[:, None] * x_scale[None, :]).to(out_ptr.dtype.element_ty)
    if has_bias:
        b = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0)
        y = (y.to(tl.float32) + b.to(tl.float32)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[None, :] * N + offs_n[:, None], y, mask=n_mask[:, None] & row_mask[None, :])


@triton.jit
def fp8_linear_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
                      M, N, k_tiles_per_split, splits, has_bias,
                      K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      QUANT_X: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, w_rows = gemm_tiles.w_tile_rows(w_ptr, pid_n, N, K, BLOCK_N)
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = x_ptr + rows[:, None] * K
    if QUANT_X:
        x_scale = _row_scales(x_ptr, rows, row_mask, K, BLOCK_M, BLOCK_K, FP8_MAX, MIN_AMAX)
    else:
        x_scale = tl.load(x_scale_ptr + rows, mask=row_mask, other=0.0)

    t_begin, t_end = gemm_tiles.split_tiles(pid_k, k_tiles_per_split, K, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(t_begin, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = gemm_tiles.load_w_tile(w_rows, offs_k, k_mask, K, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if QUANT_X:
            x = tl.clamp(tl.math.div_rn(x.to(tl.float32), x_scale[:, None]), -FP8_MAX, FP8_MAX)
            x = x.to(w.dtype)
        acc = tl.dot(w, tl.trans(x), acc)

    if splits == 1:
        _store_tile(acc, w_scale_ptr, x_scale, bias_ptr, out_ptr, offs_n, rows, row_mask, N, has_bias)
    else:
        part_offs = rows[None, :] * N + offs_n[:, None]
        part_mask = row_mask[None, :] & (offs_n < N)[:, None]
        if gemm_tiles.store_partial_and_arrive(acc, partial_ptr, counter_ptr, pid_n, pid_k, M, N, part_offs,
                                               part_mask, splits):
            total = gemm_tiles.sum_partials(partial_ptr, M, N, part_offs, part_mask, splits)
            _store_tile(total, w_scale_ptr, x_scale, bias_ptr, out_ptr, offs_n, rows, row_mask, N, has_bias)
            gemm_tiles.reset_counter(counter_ptr, pid_n)
