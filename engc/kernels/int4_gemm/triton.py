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
import os

import triton
import triton.language as tl

from engc.kernels import gemm_tiles, pdl

MAGIC = tl.constexpr(0x4B000000)   # float 2**23: its 23 mantissa bits hold an integer exactly
MAGIC_F = tl.constexpr(8388608.0)

if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter runs no PTX: the same values in float32
    @triton.jit
    def _pair(words, shift, nz, s, dtype):
        """(q[4s'] - z) * s and (q[4s' + 16] - z) * s of each word's pair s' (shift = 4 s'), rounded once."""
        lo = (((words >> shift) & 0xF).to(tl.float32) + 128.0 + nz) * s          # nz = -(128 + z)
        hi = (((words >> (shift + 16)) & 0xF).to(tl.float32) + 128.0 + nz) * s
        return lo.to(dtype), hi.to(dtype)
else:
    @triton.jit
    def _pair(words, shift, nz, s, dtype):
        """As above, on bf16 pairs: one shift and one LOP3 give (128 + q, 128 + q') exactly (the CUDA GEMV's
        magic pair), one fma.bf16x2 the exact q - z, one more the product with the scale, rounded once."""
        nz2 = (nz.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) * 0x10001
        s2 = (s.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) * 0x10001
        shape: tl.constexpr = [words.shape[0], words.shape[1], shift.shape[2]]
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, one, neg0;
            mov.b32 one, 0x3f803f80;
            mov.b32 neg0, 0x80008000;
            shr.b32 t, $2, $3;
            lop3.b32 t, t, 0x000f000f, 0x43004300, 0xea;
            fma.rn.bf16x2 t, t, one, $4;
            fma.rn.bf16x2 t, t, $5, neg0;
            mov.b32 {$0, $1}, t;
            }""",
            "=h,=h,r,r,r,r", [tl.broadcast_to(words, shape), tl.broadcast_to(shift, shape),
                              tl.broadcast_to(nz2, shape), tl.broadcast_to(s2, shape)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _tile_words(qw_rows, s_rows, z_rows, t, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile t of the program's rows, packed: words [BLOCK_N, BLOCK_K / 8] int32 and each word's group
    scale and zero point (float32, same shape; chunk w // 4 lies in one group)."""
    words_per_tile: tl.constexpr = BLOCK_K // 8
    groups: tl.constexpr = (K + GROUP - 1) // GROUP
    w_idx = t * words_per_tile + tl.arange(0, words_per_tile)          # the tile's words along the row
    if K % BLOCK_K == 0:
        words = tl.load(qw_rows + w_idx[None, :])
    else:
        words = tl.load(qw_rows + w_idx[None, :], mask=(w_idx < K // 8)[None, :], other=0)
    grp = tl.minimum((w_idx // 4) * 32 // GROUP, groups - 1)
    return words, tl.load(s_rows + grp[None, :]).to(tl.float32), tl.load(z_rows + grp[None, :]).to(tl.float32)


@triton.jit
def _w_tile(qw_rows, s_rows, z_rows, t, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, dtype):
    """Tile t dequantized by float32 math: [BLOCK_N, BLOCK_K] in `dtype`, inputs in K order."""
    words, s, z = _tile_words(qw_rows, s_rows, z_rows, t, K, GROUP, BLOCK_K)
    zz = z + MAGIC_F
    shifts = tl.arange(0, 8) * 4
    bits = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) | MAGIC  # [BLOCK_N, BLOCK_K / 8, 8]
    w = ((bits.to(tl.float32, bitcast=True) - zz[:, :, None]) * s[:, :, None]).to(dtype)
    # word 4c + i, nibble j holds input 32c + 4j + i: swap the (i, j) axes to get K order
    w = tl.permute(tl.reshape(w, [w.shape[0], BLOCK_K // 32, 4, 8]), [0, 1, 3, 2])
    return tl.reshape(w, [w.shape[0], BLOCK_K])


@triton.jit
def _w_tile_pairs(qw_rows, s_rows, z_rows, t, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile t dequantized (bf16) by magic pairs: [BLOCK_N, BLOCK_K] in K order."""
    words, s, z = _tile_words(qw_rows, s_rows, z_rows, t, K, GROUP, BLOCK_K)
    shift = tl.arange(0, 4) * 4
    lo, hi = _pair(words[:, :, None], shift[None, None, :], (-z - 128.0)[:, :, None], s[:, :, None], tl.bfloat16)
    w = tl.join(lo, hi)                                  # [BLOCK_N, BLOCK_K / 8, 4 (s), 2 (h)]: nibble s + 4h
    # word 4c + i, nibble s + 4h: input 32c + 16h + 4s + i; (i, s, h) -> (h, s, i) is K order
    w = tl.permute(tl.reshape(w, [w.shape[0], BLOCK_K // 32, 4, 4, 2]), [0, 1, 4, 3, 2])
    return tl.reshape(w, [w.shape[0], BLOCK_K])


@triton.jit
def int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, partial_ptr, counter_ptr, M, N, k_tiles_per_split,
                     splits, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr, PAIRS: tl.constexpr):
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
        if PAIRS:
            w = _w_tile_pairs(qw_rows, s_rows, z_rows, t, K, GROUP, BLOCK_K)
        else:
            w = _w_tile(qw_rows, s_rows, z_rows, t, K, GROUP, BLOCK_K, x.dtype)
        acc = tl.dot(w, tl.trans(x), acc)

    # acc is transposed (swap AB): element [n, m] goes to out[m, n]; one split counter per (N, M) tile
    out_offs = rows[None, :] * N + offs_n[:, None]
    out_mask = row_mask[None, :] & (offs_n < N)[:, None]
    gemm_tiles.store_split_k(acc, out_ptr, partial_ptr, counter_ptr, pid_n + pid_m * tl.num_programs(0), pid_k,
                             M, N, out_offs, out_mask, splits)
