"""The nodes the decode GEMMs serve: the standard Gemm (transB=1, no bias) and SiluMulLinear, with the GEMV
(M=1 classes; its CUDA C++ variant first where built), then the skinny GEMM (kernels/skinny_gemm: about
9-64 rows), whichever has a kernel for this K, M and N; else cuBLAS through torch."""
import torch
import torch.nn.functional as F

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels import gemv, skinny_gemm
from engc.kernels.gemv import silu_mul_linear

CPU_OPS = {(ENGC_DOMAIN, "SiluMulLinear"): lambda x, w: (silu_mul_linear(x, w),)}


def gpu_ops(ctx) -> dict:
    if not (ctx.has("gemv") or ctx.has("skinny_gemm")):   # float32 bundles keep cuBLAS
        return {}
    # both take the same counters and torch-allocated partials
    kernels = [(op, mod, ctx.consts(op), mod.variant_table(ctx.consts(op)))
               for op, mod in (("gemv", gemv), ("skinny_gemm", skinny_gemm))]

    def run_linear(x, w, silu):
        if x.dtype != w.dtype or not (x.is_contiguous() and w.is_contiguous()):
            return None
        for op, mod, consts, table in kernels:
            variant = mod.pick(table, w.shape[1], silu, x.shape[0], w.shape[0])
            if variant is not None:
                out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
                ctx.run(op, mod.launch(x, w, out, variant, consts[variant], ctx.counters))
                return out
        return None

    def gemm(a, b, c=None, transB=0, **attrs):
        if transB and c is None and not attrs and a.dim() == 2:
            out = run_linear(a, b, silu=False)
            if out is not None:
                return (out,)
        return ctx.cpu_op("", "Gemm")(a, b, c, transB=transB, **attrs)

    def silu_linear(gate_up, w):
        out = run_linear(gate_up, w, silu=True)
        return (out,) if out is not None else (F.linear(ctx.op("SiluMul")(gate_up)[0], w),)

    return {("", "Gemm"): gemm, (ENGC_DOMAIN, "SiluMulLinear"): silu_linear}
