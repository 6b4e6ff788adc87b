"""The nodes of W8A8 projections: FP8Linear (x in the model dtype) and FP8LinearQ (x already float8 codes and
a scale a row, from the fp8-out norm or SiluMulFP8). The bundle's W8A8 GEMM serves decode/small-prefill
rows, quantizing x itself for a few rows or taking it from the fp8_quant kernel; above its M classes,
fp8_quant then torch._scaled_mm with row-wise scales (cuBLASLt; weight [N, K] row-major: weight.t() is the
column-major operand)."""
import torch

from engc.bundle.program import ENGC_DOMAIN, torch_dtype
from engc.kernels import fp8_linear as fp8_gemm
from engc.kernels import fp8_quant

# The large FP8 GEMMs in torch._scaled_mm's fast-accumulation mode: the tensor cores' accumulator over the whole
# K, not promoted to float32 every 128 products. At an 8B's projections and 1,024-8,192 rows it runs 1.09-1.54x
# the promoting mode's rate (qkv at 1,024 rows 0.97x), and max-load decoding 5.5% faster. Its error against
# float32 of the same codes is 0.5-1.8% of the largest output (promoting: 0.23-0.28%, near the bf16 output's own
# rounding), below the ~3.6% that quantizing weights and activations to float8 costs on the same random data
# (bench/results/HISTORY.md, "fp8").
FAST_ACCUM = True

CPU_OPS = {
    (ENGC_DOMAIN, "FP8Linear"): lambda *xs, **a: (fp8_quant.fp8_linear(*xs, **a),),
    (ENGC_DOMAIN, "FP8LinearQ"): lambda xq, xs, w, ws, bias=None, has_bias=0, dtype=1: (
        fp8_quant.fp8_linear_q(xq, xs, w, ws, bias, has_bias, torch_dtype(dtype)),),
}


def gpu_ops(ctx) -> dict:
    if not ctx.has("fp8_quant"):   # not an fp8 bundle (engc build --quant fp8)
        return {}
    consts = ctx.consts("fp8_linear")
    table = fp8_gemm.variant_table(consts)

    def fp8_linear(x, weight, weight_scale, bias=None, has_bias=0):
        rows, kdim = x.shape
        bias = bias if has_bias else None
        if rows == 0:
            return (x.new_empty(0, weight.shape[0]),)
        fused = fp8_gemm.pick(table, kdim, rows, quant_x=True)
        if fused and x.is_contiguous():
            out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
            ctx.run("fp8_linear", fp8_gemm.launch(x, None, weight, weight_scale, bias, out, fused, consts[fused],
                                                  ctx.counters))
            return (out,)
        xq = torch.empty(x.shape, dtype=fp8_quant.FP8, device=x.device)
        x_scale = torch.empty(rows, dtype=torch.float32, device=x.device)
        ctx.run("fp8_quant", fp8_quant.launch(x, xq, x_scale))
        return (fp8_matmul(xq, x_scale, weight, weight_scale, bias, x.dtype),)

    def fp8_matmul(xq, x_scale, weight, weight_scale, bias, dtype):
        """y = xq * x_scale @ (weight * weight_scale).t() (+ bias) in dtype: the bundle's GEMM for its M
        classes, else cuBLASLt."""
        plain = fp8_gemm.pick(table, xq.shape[1], xq.shape[0], quant_x=False)
        if plain:
            out = torch.empty(xq.shape[0], weight.shape[0], dtype=dtype, device=xq.device)
            ctx.run("fp8_linear", fp8_gemm.launch(xq, x_scale, weight, weight_scale, bias, out, plain,
                                                  consts[plain], ctx.counters))
            return out
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :],
                             out_dtype=dtype, use_fast_accum=FAST_ACCUM)
        return y + bias if bias is not None else y

    def fp8_linear_q(xq, x_scale, weight, weight_scale, bias=None, has_bias=0, dtype=1):
        out_dtype = torch_dtype(dtype)
        if xq.shape[0] == 0:
            return (torch.empty(0, weight.shape[0], dtype=out_dtype, device=xq.device),)
        return (fp8_matmul(xq, x_scale, weight, weight_scale, bias if has_bias else None, out_dtype),)

    return {(ENGC_DOMAIN, "FP8Linear"): fp8_linear, (ENGC_DOMAIN, "FP8LinearQ"): fp8_linear_q}
