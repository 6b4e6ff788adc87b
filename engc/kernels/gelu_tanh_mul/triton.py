"""GELU(tanh)-and-mul over [T, 2I] -> [T, I]; grid (T, cdiv(I, BLOCK)).

gelu(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh written with exp (of a non-positive argument) so the interpreter runs it;
in float32, rounded to the storage dtype after the GELU and after the product, as torch does for bf16/fp16.
"""
import triton
import triton.language as tl

from engc.kernels import pdl


@triton.jit
def gelu_tanh(g):
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    e = tl.exp(-2.0 * tl.abs(inner))          # in (0, 1]: no overflow at either end
    t = (1.0 - e) / (1.0 + e)
    return 0.5 * g * (1.0 + tl.where(inner >= 0, t, -t))


@triton.jit
def gelu_tanh_mul_kernel(gate_up_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    pdl.launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    g = tl.load(gate_up_ptr + row * (2 * INTER) + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * (2 * INTER) + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    a = gelu_tanh(g).to(dt).to(tl.float32)
    tl.store(out_ptr + row * INTER + offs, (a * u).to(dt), mask=mask)
