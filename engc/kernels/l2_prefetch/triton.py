"""L2 prefetch: each program reads its run of BLOCK-word blocks (see __init__.py for why)."""
import triton
import triton.language as tl


@triton.jit
def l2_prefetch_kernel(src_ptr, out_ptr, n_blocks, blocks_per_program, BLOCK: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    first = pid * blocks_per_program
    count = tl.minimum(blocks_per_program, n_blocks - first)
    base = src_ptr + first.to(tl.int64) * BLOCK     # int64: a weight may exceed 2**31 words
    if MODE == 0:
        acc = tl.zeros([BLOCK], tl.int32)
        for i in range(0, count):
            acc ^= tl.load(base + i * BLOCK + tl.arange(0, BLOCK))
        tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))
    else:
        LINES: tl.constexpr = BLOCK // 32   # 128-byte lines per block
        acc = tl.zeros([LINES], tl.int32)
        for i in range(0, count):
            lines = base + i * BLOCK + tl.arange(0, LINES) * 32
            acc ^= tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines],
                                             dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))
