"""W8A8 FP8 linear: per-output-channel float8_e4m3fn weights, per-token dynamic float8 activations.

ONNX: ai.engc::FP8Linear(x, weight, weight_scale[, bias]) -> y, attribute has_bias.
  weight        float8_e4m3fn [N, K] (row-major: w.t() is the column-major operand _scaled_mm wants)
  weight_scale  float32 [N], absmax of each output row / 448, taken at build time
  W[n, k] = weight[n, k] * weight_scale[n]
At run time each token's row of x gets its own scale (row absmax / 448): x ~= x_fp8 * x_scale[:, None].
Then y = (x_fp8 @ weight.t()) * x_scale[:, None] * weight_scale[None, :] (+ bias), accumulated in fp32.
ai.engc::FP8LinearQ(x_fp8, x_scale, weight, weight_scale[, bias]) -> y, attributes has_bias and dtype (ONNX
code of y's): the same GEMM on an input its producer quantized (passes/fuse_fp8_input_quant; the norms'
fp8 variants in kernels/rms_norm, this kernel's SILU variant for SiluMulFP8).

The kernel here is the activation quantization (triton.py, fp8_quant_kernel); the GEMM is kernels/fp8_linear
for decode batches, else cuBLASLt through torch._scaled_mm with row-wise scales (kernels/fp8_linear/bind.py).
fp8_linear below is the op's
reference: the same quantization, the matmul in float32 on the dequantized operands, which is what the
GPU computes up to accumulation order.

Launch rule: one program per row (the whole row in registers: the absmax needs all of it before any
element can be scaled); the variant is the row width, 'k<K>', one per distinct projection input width, and
'silu_k<I>' for silu(gate) * up of a fused gate_up [M, 2I].
"""
import torch

from engc.kernels.silu_mul import silu_mul

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0        # largest finite float8_e4m3fn
MIN_AMAX = 1e-12       # an all-zero row still gets a finite scale (its values quantize to 0)
FP8_ARCHS = ("sm89", "sm90")   # GPUs with FP8 tensor cores (Ada, Hopper); sm80/sm86 have none


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (q float8_e4m3fn [..., K], scale float32 [...]), x ~= q * scale[..., None].

    One scale per row (output channel of a weight, or token of an activation). The clamp matters: torch
    turns a value past 448 into NaN, and x / scale can round just past it."""
    # In place on one float32 copy: the build quantizes every projection of the model through here.
    # The divisor 448 is a tensor on x's device: given a Python number, torch on CUDA multiplies by its
    # reciprocal instead, up to 1 ulp off the kernel's correctly rounded division, which changes some codes.
    xf = x.to(torch.float32, copy=True)
    amax = torch.linalg.vector_norm(xf, ord=float("inf"), dim=-1).clamp_min_(MIN_AMAX)
    scale = amax.div_(torch.full_like(amax, FP8_MAX))
    q = xf.div_(scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def projection_input_widths(cfg) -> list[int]:
    """The K of every decoder-layer projection an fp8 program quantizes the input of: the hidden size (qkv and
    gate_up; latent attention's q or q_a and kv_a), the attention's output (o: q_size, or num_heads *
    v_head_dim under latent attention), latent attention's q_lora_rank (q_b) and the intermediate size (down; a
    shared expert stays in the model dtype: passes/quantize_fp8)."""
    if cfg.kv_lora_rank:
        widths = {cfg.hidden_size, cfg.num_heads * cfg.v_head_dim, cfg.intermediate_size, cfg.q_lora_rank}
    else:
        widths = {cfg.hidden_size, cfg.q_size, cfg.intermediate_size}
    return sorted(widths - {0})


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().unsqueeze(-1)


def fp8_linear(x, weight, weight_scale, bias=None, has_bias: int = 0) -> torch.Tensor:
    """The reference of FP8Linear: quantize x per token, matmul in float32 with the dequantized weight.

    weight may be the float8 tensor or an upcast copy of it (a float32 oracle): values are the same."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = fp8_linear_q(xq, xs, weight, weight_scale, bias, has_bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_q(xq, x_scale, weight, weight_scale, bias=None, has_bias: int = 0, dtype=torch.float32):
    """The reference of FP8LinearQ, FP8Linear on an input that comes quantized (xq [M, K] float8, x_scale
    [M]; passes/fuse_fp8_input_quant): the product in float32, then rounded to dtype (the model's)."""
    y = (dequantize_rows(xq, x_scale) @ dequantize_rows(weight, weight_scale).t()).to(dtype)
    return y + bias if has_bias else y


def launch(x, out, scale, consts=None, silu: bool = False):
    """Launch rule of fp8_quant_kernel: [(variant, grid, args)], nothing to launch for 0 rows.

    x contiguous [M, K] (bf16/fp16/fp32), out float8_e4m3fn [M, K], scale float32 [M]: variant 'k<K>'.
    silu: x is a fused gate_up [M, 2K] and out / scale take silu(gate) * up quantized: variant 'silu_k<K>'.
    args: x, out, scale, global_scratch=0, profile_scratch=0. consts is unused.
    """
    rows, k = out.shape
    assert x.is_contiguous() and out.is_contiguous() and scale.shape == (rows,)
    assert x.shape == (rows, 2 * k if silu else k)
    if rows == 0:
        return []
    return [(f"silu_k{k}" if silu else f"k{k}", (rows, 1, 1), [x, out, scale, 0, 0])]


def silu_quant_rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of the SILU variant (ai.engc::SiluMulFP8): silu_mul, then quantize_rows."""
    return quantize_rows(silu_mul(gate_up))
