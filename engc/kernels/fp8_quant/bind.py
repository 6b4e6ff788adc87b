"""The node the fp8_quant kernel serves by itself: SiluMulFP8, silu(gate) * up quantized a row for the FP8
GEMM after it (passes/fuse_fp8_input_quant). Its plain variants quantize FP8Linear's input
(kernels/fp8_linear/bind.py)."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.fp8_quant import FP8, launch, silu_quant_rows

CPU_OPS = {(ENGC_DOMAIN, "SiluMulFP8"): lambda x: silu_quant_rows(x)}


def gpu_ops(ctx) -> dict:
    if not ctx.has("fp8_quant"):   # not an fp8 bundle (engc build --quant fp8)
        return {}

    def silu_fp8(gate_up):
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        xq = torch.empty(rows, width, dtype=FP8, device=gate_up.device)
        scale = torch.empty(rows, dtype=torch.float32, device=gate_up.device)
        ctx.run("fp8_quant", launch(gate_up.contiguous(), xq, scale, silu=True))
        return xq, scale

    return {(ENGC_DOMAIN, "SiluMulFP8"): silu_fp8}
