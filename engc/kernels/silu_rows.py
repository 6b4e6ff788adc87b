"""silu(gate) * up inside a Triton kernel, shared by the kernels that compute it: silu_mul_kernel,
gemm_tiles.act_tile (the SiLU-fused down of the GEMV and skinny GEMM) and fp8_quant's SILU variant
(passes/fuse_fp8_input_quant), so the fused kernels' inputs are silu_mul's bits.
"""
import triton
import triton.language as tl


@triton.jit
def silu_times_up(g, u, dt: tl.constexpr):
    """silu(g) * u for float32 g and u, rounded to dt after the silu and after the product, as torch does for
    bf16 / fp16 tensors."""
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt)
