"""SiLU-and-mul over [T, 2I] -> [T, I]; grid (T, cdiv(I, BLOCK)).

Rounds silu(gate) to the storage dtype before the multiply, as torch does for bf16/fp16 tensors.
silu_times_up is that arithmetic alone, shared with the kernels that fuse SiLU-and-mul into their input
(gemm_tiles.act_tile, fp8_quant's SILU variant): one piece of code, so their bits are silu_mul's.
"""
import triton
import triton.language as tl

from engc.kernels import pdl


@triton.jit
def silu_times_up(g, u, dt: tl.constexpr):
    """silu(g) * u for float32 g and u, rounded to dt after the silu and after the product (as torch's)."""
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt)


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
