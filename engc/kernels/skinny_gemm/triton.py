"""Skinny bf16/fp16 GEMM for decode batches: y[M, N] = act(x)[M, K] @ W[N, K]^T for M up to 64.

At 9-64 rows a dense projection is still bound by reading W once from DRAM; the kernel is shaped for
that, as kernels/fp8_linear is for float8:
- swap AB: the W tile [BLOCK_N, BLOCK_K] is the MMA's A operand, so W rows fill the 64-row wgmma
  instruction and the few tokens are its narrow N side (BLOCK_M 16/32/64); acc is [BLOCK_N, BLOCK_M].
  Triton pipelines W and x tiles through shared memory over num_stages (cp.async) into wgmma on sm90
  (mma.sync on sm80).
- split-K when N / BLOCK_N alone leaves SMs idle; the splits are reduced in the same launch by the last
  program to arrive (fp32 partials, a per-N-tile counter left at zero, the sum taken in split order, so
  results do not depend on timing: kernels/gemm_tiles.py, as kernels/gemv and kernels/fp8_linear do).
- PDL (kernels/pdl.py): W is a constant weight, so before waiting on the previous kernel each program
  asks L2 for the first PREFETCH_K columns of its W slice (prefetch.global.L2, one per 128-byte line):
  the DRAM reads of its first tiles overlap the previous kernel's tail instead of following it.

SILU: x is the fused gate_up [M, 2K] (gate first) and the kernel multiplies by silu(gate) * up
(gemm_tiles.act_tile, the GEMV's), so results match silu_mul + linear.
"""
import os

import triton
import triton.language as tl

from engc.kernels import gemm_tiles, pdl

# bf16/fp16 elements in a 128-byte cache line: one L2 prefetch each
LINE: tl.constexpr = tl.constexpr(64)

if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter runs no PTX; a prefetch changes no result
    @triton.jit
    def _prefetch_l2(ptrs):
        pass
else:
    @triton.jit
    def _prefetch_l2(ptrs):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, counter_ptr, M, N, k_tiles_per_split, splits,
                       K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SILU: tl.constexpr, PREFETCH_K: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, w_rows = gemm_tiles.w_tile_rows(w_ptr, pid_n, N, K, BLOCK_N)
    t_begin, t_end = gemm_tiles.split_tiles(pid_k, k_tiles_per_split, K, BLOCK_K)
    if PREFETCH_K > 0:   # the split's first columns, clamped to its own range
        k_first = t_begin * BLOCK_K
        k_last = tl.minimum(t_end * BLOCK_K, K) - 1
        lines = tl.minimum(k_first + tl.arange(0, PREFETCH_K // LINE) * LINE, k_last)
        _prefetch_l2(w_rows + lines[None, :])
    # x, the partials and the counters belong to the step: wait for the kernel before
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)

    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for t in range(t_begin, t_end):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = gemm_tiles.load_w_tile(w_rows, offs_k, k_mask, K, BLOCK_K)
        x = gemm_tiles.act_tile(x_ptr, rows, offs_k, row_mask, k_mask, K, SILU)
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)

    # acc is transposed (swap AB): element [n, m] goes to out[m, n]
    out_offs = rows[None, :] * N + offs_n[:, None]
    out_mask = row_mask[None, :] & (offs_n < N)[:, None]
    gemm_tiles.store_split_k(acc, out_ptr, partial_ptr, counter_ptr, pid_n, pid_k, M, N, out_offs, out_mask, splits)
