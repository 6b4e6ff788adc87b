"""Read a weight into the GPU's L2 cache ahead of the GEMM that needs it (decode steps).

Why: a small-batch decode step alternates DRAM-bound projections with latency-bound kernels (norm,
rotary, attention) during which DRAM sits idle, and each projection then pays its own ramp-up before
it streams at full bandwidth (an 8B o_proj at batch 1: 13.7 us for 33.5 MB, 2.4 TB/s, on an H200).
Launched on a side stream at the start of such an idle window (runtime/l2_prefetch.py), this kernel
streams the next projection's first bytes into L2, and the GEMM then hits there.

Not an op of the program: nothing it writes is read back except by tests. Each program reads its run
of whole BLOCK-word blocks and stores the XOR of every 32-bit word it read, which keeps the compiler
from dropping the loads and lets the interpreter test prove every byte of the range was read.
MODE 1 issues PTX `prefetch.global.L2` per 128-byte line instead of loads (no registers, no check).
"""
import numpy as np
import torch


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def plan(nbytes: int, block: int, programs: int) -> tuple[int, int, int]:
    """(blocks, blocks per program, programs) for the whole BLOCK-word blocks in the first nbytes."""
    blocks = nbytes // (4 * block)
    if blocks == 0:
        return 0, 0, 0
    per = _cdiv(blocks, programs)
    return blocks, per, _cdiv(blocks, per)


def checksums(data: torch.Tensor, nbytes: int, block: int, programs: int) -> torch.Tensor:
    """Reference: the XOR of the 32-bit words each program reads (MODE 0), [programs] int32."""
    blocks, per, n = plan(min(nbytes, data.numel() * data.element_size()), block, programs)
    words = data.detach().cpu().contiguous().view(-1).view(torch.uint8)[:blocks * block * 4].numpy().view(np.int32)
    out = [np.bitwise_xor.reduce(words[p * per * block:min(blocks, (p + 1) * per) * block]) for p in range(n)]
    return torch.tensor(np.array(out, dtype=np.int32))


def launch(data: torch.Tensor, nbytes: int, out: torch.Tensor, consts: dict):
    """Launch rule: [(variant, grid, args)] reading the first nbytes of data (rounded down to whole blocks).

    data: any contiguous tensor (16-byte aligned, as torch allocates); out: int32 with at least
    consts['default']['programs'] elements. args: data, out, n_blocks (i32), blocks_per_program (i32), 0, 0
    """
    c = consts["default"]
    assert data.is_contiguous() and data.data_ptr() % 16 == 0 and out.dtype == torch.int32
    blocks, per, n = plan(min(nbytes, data.numel() * data.element_size()), c["BLOCK"], c["programs"])
    if n == 0:
        return []
    assert out.numel() >= n
    flat = data.reshape(-1).view(torch.uint8)
    words = flat[:flat.numel() // 4 * 4].view(torch.int32)   # the kernel's *i32 view of any dtype
    return [("default", (n, 1, 1), [words, out, blocks, per, 0, 0])]
