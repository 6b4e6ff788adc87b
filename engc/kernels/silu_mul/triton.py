"""Gated activation over [T, 2I] -> [T, I]; grid (T, cdiv(I, BLOCK)). ACT 0: silu(gate) * up, 1:
gelu_tanh(gate) * up.

The activation is rounded to the storage dtype before the multiply, as torch does for bf16/fp16 tensors.
The SiLU arithmetic is kernels/silu_rows.py's, shared with the kernels that fuse SiLU-and-mul into their
input. tanh is written with exp of a non-positive argument: no overflow at either end, and the interpreter
runs it.
"""
import triton
import triton.language as tl

from engc.kernels import pdl
from engc.kernels.silu_rows import silu_times_up


@triton.jit
def gelu_tanh(g):
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    e = tl.exp(-2.0 * tl.abs(inner))          # in (0, 1]
    t = (1.0 - e) / (1.0 + e)
    return 0.5 * g * (1.0 + tl.where(inner >= 0, t, -t))


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr,
                    PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    g = tl.load(gate_up_ptr + row * (2 * INTER) + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * (2 * INTER) + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if ACT == 0:
        y = silu_times_up(g, u, dt)
    else:
        y = (gelu_tanh(g).to(dt).to(tl.float32) * u).to(dt)
    tl.store(out_ptr + row * INTER + offs, y, mask=mask)
