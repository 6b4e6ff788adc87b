"""Residual add + RMSNorm + linear in one launch for decode batches (9-32 rows): the skinny GEMM
(kernels/skinny_gemm/triton.py: swap AB, W through wgmma, the tokens on the MMA's narrow side) whose input
tile is made from the residual stream as it is loaded.

    s = x + residual              rounded to the storage dtype (as AddRMSNorm), written to residual_out
    y = (s * norm_w) @ W^T * rstd  rstd = 1 / sqrt(mean(s^2) + eps) per row

The row's rstd needs all of s, so it is applied to the accumulator at the end: each program reads every
K tile of its rows (no split-K; the launch rule never splits), sums s^2 in fp32 on the way, and scales
acc [BLOCK_N, BLOCK_M] by rstd before its store. The multiply by norm_w happens on the tile (rounded once
to the storage dtype); the reference (kernels/rms_norm then the GEMM) rounds s * rstd first and then the
product with norm_w, so the two agree to bf16 rounding, not bit for bit. Only the programs of the first
N tile store s to residual_out: it is a fresh buffer, so no program reads what another writes.
"""
import triton
import triton.language as tl

from engc.kernels import gemm_tiles, pdl


@triton.jit
def norm_linear_kernel(x_ptr, residual_ptr, norm_w_ptr, w_ptr, out_ptr, residual_out_ptr, M, N, eps,
                       K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PREFETCH_K: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_n, w_rows = gemm_tiles.w_tile_rows(w_ptr, pid_n, N, K, BLOCK_N)
    if PREFETCH_K > 0:   # W is a constant: its first columns may be asked for before the wait
        gemm_tiles.prefetch_w_l2(w_rows, 0, K - 1, PREFETCH_K)
    # x, the residual and the outputs belong to the step: wait for the kernel before
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)

    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    first_tile = tl.full([BLOCK_M], pid_n, tl.int32) == 0   # a predicate, not a branch, in the loop
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)   # s^2 by column, summed along K once, after the loop
    for t in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = gemm_tiles.load_w_tile(w_rows, offs_k, k_mask, K, BLOCK_K)
        offs = rows[:, None] * K + offs_k[None, :]
        mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        r = tl.load(residual_ptr + offs, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + offs, s, mask=mask & first_tile[:, None])
        sf = s.to(tl.float32)
        sq += sf * sf
        nw = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = (sf * nw[None, :]).to(w.dtype)
        acc = tl.dot(w, tl.trans(a), acc)

    rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)
    acc = acc * rstd[None, :]
    # acc is transposed (swap AB): element [n, m] goes to out[m, n]
    out_offs = rows[None, :] * N + offs_n[:, None]
    out_mask = row_mask[None, :] & (offs_n < N)[:, None]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
