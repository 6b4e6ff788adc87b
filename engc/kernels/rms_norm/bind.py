"""The nodes the rms_norm kernel serves: RMSNorm and AddRMSNorm; in fp8 programs RMSNormFP8 and AddRMSNormFP8,
which write their output as float8 codes and a scale a row for the FP8 GEMM after them; Gemma's
RMSNormUnitOffset and AddRMSNormUnitOffset ((1 + weight), half-precision bundles); DeepSeek's LatentRMSNorm
(q_lora_rank-wide rows; its reference is kernels/mla_attention's); SquareMean and RMSNormByMean, a norm
over a row the tensor-parallel ranks share (torch on every device)."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.fp8_quant import FP8, quantize_rows
from engc.kernels.rms_norm import (LATENT_VARIANT, UNIT_OFFSET_VARIANTS, add_rms_norm, add_rms_norm_unit_offset, launch,
                                   rms_norm, rms_norm_by_mean, rms_norm_unit_offset, square_mean)


def _quantized_first(y, *rest):
    return (*quantize_rows(y), *rest)


CPU_OPS = {
    (ENGC_DOMAIN, "RMSNorm"): lambda x, w, eps: (rms_norm(x, w, eps),),
    (ENGC_DOMAIN, "AddRMSNorm"): lambda x, r, w, eps: add_rms_norm(x, r, w, eps),
    (ENGC_DOMAIN, "RMSNormFP8"): lambda x, w, eps: quantize_rows(rms_norm(x, w, eps)),
    (ENGC_DOMAIN, "AddRMSNormFP8"): lambda x, r, w, eps: _quantized_first(*add_rms_norm(x, r, w, eps)),
    (ENGC_DOMAIN, "RMSNormUnitOffset"): lambda x, w, eps: (rms_norm_unit_offset(x, w, eps),),
    (ENGC_DOMAIN, "AddRMSNormUnitOffset"): lambda x, r, w, eps: add_rms_norm_unit_offset(x, r, w, eps),
    (ENGC_DOMAIN, "SquareMean"): lambda x, parts: (square_mean(x, parts),),
    (ENGC_DOMAIN, "RMSNormByMean"): lambda x, ms, w, eps: (rms_norm_by_mean(x, ms, w, eps),),
}


def gpu_ops(ctx) -> dict:
    if not ctx.has("rms_norm"):
        return {}
    def norm(x, w, eps, unit_offset=False, latent=False):
        out = torch.empty_like(x)
        ctx.run("rms_norm", launch(x, w, eps, out, unit_offset=unit_offset, latent=latent))
        return (out,)

    def add_norm(x, r, w, eps, unit_offset=False):
        out, r_out = torch.empty_like(x), torch.empty_like(r)
        ctx.run("rms_norm", launch(x, w, eps, out, residual=r, residual_out=r_out, unit_offset=unit_offset))
        return out, r_out

    def quantized_rows(x):
        return (torch.empty(x.shape[0], x.shape[1], dtype=FP8, device=x.device),
                torch.empty(x.shape[0], dtype=torch.float32, device=x.device))

    def norm_fp8(x, w, eps):
        xq, scale = quantized_rows(x)
        ctx.run("rms_norm", launch(x, w, eps, xq, scale=scale))
        return xq, scale

    def add_norm_fp8(x, r, w, eps):
        (xq, scale), r_out = quantized_rows(x), torch.empty_like(r)
        ctx.run("rms_norm", launch(x, w, eps, xq, residual=r, residual_out=r_out, scale=scale))
        return xq, scale, r_out

    ops = {(ENGC_DOMAIN, "RMSNorm"): norm, (ENGC_DOMAIN, "AddRMSNorm"): add_norm}
    if ctx.has("fp8_quant"):   # an fp8 bundle (engc build --quant fp8) has the fp8-out variants
        ops.update({(ENGC_DOMAIN, "RMSNormFP8"): norm_fp8, (ENGC_DOMAIN, "AddRMSNormFP8"): add_norm_fp8})
    if UNIT_OFFSET_VARIANTS["rms_norm"] in ctx.consts("rms_norm"):
        ops.update({(ENGC_DOMAIN, "RMSNormUnitOffset"): lambda x, w, eps: norm(x, w, eps, unit_offset=True),
                    (ENGC_DOMAIN, "AddRMSNormUnitOffset"): lambda x, r, w, eps: add_norm(x, r, w, eps,
                                                                                        unit_offset=True)})
    if LATENT_VARIANT in ctx.consts("rms_norm"):
        ops[(ENGC_DOMAIN, "LatentRMSNorm")] = lambda x, w, eps: norm(x, w, eps, latent=True)
    return ops
