"""SiLU-and-mul over [T, 2I] -> [T, I]; grid (T, cdiv(I, BLOCK)).

Rounds silu(gate) to the storage dtype before the multiply, as torch does for bf16/fp16 tensors.
The arithmetic is kernels/silu_rows.py's, shared with the kernels that fuse SiLU-and-mul into their input.
"""
import triton
import triton.language as tl

from engc.kernels import pdl
from engc.kernels.silu_rows import silu_times_up


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    g = tl.load(gate_up_ptr + row * (2 * INTER) + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * (2 * INTER) + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * INTER + offs, silu_times_up(g, u, out_ptr.dtype.element_ty), mask=mask)
