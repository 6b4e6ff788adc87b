"""Split argmax: stage 1 reduces a chunk of a row to (max, first index), stage 2 the chunks of a row.

Within a chunk every lane keeps its own running max with a strict '>' (so it holds the first index of
its lane's maximum); the lanes are reduced once at the end by taking the smallest index whose value
equals the maximum. Both stages use that rule, which makes the result torch's first-index argmax.
A NaN counts as +inf, as torch.argmax counts it the maximum: the result is always an index of the row (a
NaN-only row would otherwise give 2^31 - 1, and the next step's embedding gather a device-side assert).
"""
import triton
import triton.language as tl

from engc.kernels import pdl


@triton.jit
def argmax_partial_kernel(logits_ptr, part_val_ptr, part_idx_ptr, VOCAB: tl.constexpr, SPLITS: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start = split * CHUNK
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for off in range(0, CHUNK, BLOCK):
        offs = start + off + tl.arange(0, BLOCK)
        mask = (offs < VOCAB) & (off + tl.arange(0, BLOCK) < CHUNK)
        x = tl.load(logits_ptr + row * VOCAB + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        take = (x > best) | ((x == best) & mask & (offs < best_idx))
        best = tl.where(take, x, best)
        best_idx = tl.where(take, offs, best_idx)
    m = tl.max(best, axis=0)
    i = tl.min(tl.where(best == m, best_idx, 2147483647), axis=0)
    tl.store(part_val_ptr + row * SPLITS + split, m)
    tl.store(part_idx_ptr + row * SPLITS + split, i)


@triton.jit
def argmax_final_kernel(part_val_ptr, part_idx_ptr, out_ptr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPLITS)
    v = tl.load(part_val_ptr + row * SPLITS + offs)
    i = tl.load(part_idx_ptr + row * SPLITS + offs)
    m = tl.max(v, axis=0)
    best = tl.min(tl.where(v == m, i, 2147483647), axis=0)
    tl.store(out_ptr + row, best.to(tl.int64))
