"""W4A16 GEMM for decode batches: y[M, N] = act(x)[M, K] @ dequant(W)[N, K]^T over the engc int4 layout.

The skinny bf16 GEMM (kernels/skinny_gemm) with its W tile read packed: from 9 rows up, dequantizing each
weight once per program and letting the tensor cores multiply it by every row beats the GEMV, which
dequantizes each weight again for every 8 rows of x, and the dequant + cuBLAS path, which writes and
reads W in bf16 (4.5 bytes of traffic a weight against 0.5).
- swap AB: the dequantized W tile [BLOCK_N, BLOCK_K] is the MMA's A operand (from registers on sm90's
  wgmma), the tokens its narrow N side; acc is [BLOCK_N, BLOCK_M]. Triton pipelines the packed W words
  and x over num_stages.
- dequant: a nibble masked into the mantissa of 2**23 reads as the float 2**23 + q, exactly; subtracting
  2**23 + zero leaves the exact q - zero, and one multiply by the group scale, rounded once to the
  activation dtype, gives W as kernels/int4_linear.dequantize does, bit for bit.
- the layout's interleave (nibble j of word 4c + i holds input 32c + 4j + i) is undone on the tile in
  registers (a permute of the [.., 4, 8] word/nibble axes), so x loads in plain K order.
- split-K when the N tiles leave SMs idle, reduced in the same launch by the last split to arrive
  (kernels/gemm_tiles.py); M past BLOCK_M takes more programs along the grid's third axis, each
  reading W again (from L2 where the programs run together).
"""
import triton
import triton.language as tl

from engc.kernels import gemm_tiles, pdl

MAGIC = tl.constexpr(0x4B000000)   # float 2**23: its 23 mantissa bits hold an integer exactly
MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def _w_tile(qw_rows, s_rows, z_rows, t, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, dtype):
    """Tile t of the program's rows, dequantized: [BLOCK_N, BLOCK_K] in `dtype`, inputs in K order."""
    words_per_tile: tl.constexpr = BLOCK_K // 8
    groups: tl.constexpr = (K + GROUP - 1) // GROUP
    w_idx = t * words_per_tile + tl.arange(0, words_per_tile)          # the tile's words along the row
    if K % BLOCK_K == 0:
        words = tl.load(qw_rows + w_idx[None, :])                          # [BLOCK_N, BLOCK_K / 8] int32
    else:
        words = tl.load(qw_rows + w_idx[None, :], mask=(w_idx < K // 8)[None, :], other=0)
    grp = tl.minimum((w_idx // 4) * 32 // GROUP, groups - 1)              # chunk w // 4 lies in one group
    s = tl.load(s_rows + grp[None, :]).to(tl.float32)
    zz = tl.load(z_rows + grp[None, :]).to(tl.float32) + MAGIC_F
    shifts = tl.arange(0, 8) * 4
    bits = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) | MAGIC  # [BLOCK_N, BLOCK_K / 8, 8]
    w = ((bits.to(tl.float32, bitcast=True) - zz[:, :, None]) * s[:, :, None]).to(dtype)
    # word 4c + i, nibble j holds input 32c + 4j + i: swap the (i, j) axes to get K order
    w = tl.permute(tl.reshape(w, [w.shape[0], BLOCK_K // 32, 4, 8]), [0, 1, 3, 2])
    return tl.reshape(w, [w.shape[0], BLOCK_K])


@triton.jit
def int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, partial_ptr, counter_ptr, M, N, k_tiles_per_split,
                     splits, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    groups: tl.constexpr = (K + GROUP - 1) // GROUP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]             # rows past N re-read row N-1
    qw_rows = qw_ptr + rows_n * (K // 8)
    s_rows, z_rows = s_ptr + rows_n * groups, z_ptr + rows_n * groups
    t_begin, t_end = gemm_tiles.split_tiles(pid_k, k_tiles_per_split, K, BLOCK_K)
    # x, the partials and the counters belong to the step: wait for the kernel before
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(t_begin, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        x = gemm_tiles.act_tile(x_ptr, rows, offs_k, row_mask, offs_k < K, K, SILU)
        w = _w_tile(qw_rows, s_rows, z_rows, t, K, GROUP, BLOCK_K, x.dtype)
        acc = tl.dot(w, tl.trans(x), acc)

    # acc is transposed (swap AB): element [n, m] goes to out[m, n]; one split counter per (N, M) tile
    out_offs = rows[None, :] * N + offs_n[:, None]
    out_mask = row_mask[None, :] & (offs_n < N)[:, None]
    gemm_tiles.store_split_k(acc, out_ptr, partial_ptr, counter_ptr, pid_n + pid_m * tl.num_programs(0), pid_k,
                             M, N, out_offs, out_mask, splits)
