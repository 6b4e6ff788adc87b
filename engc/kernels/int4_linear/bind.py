"""The nodes of int4 (W4A16) projections: QLinear, and its fusions QLinearSiluMul (passes/fuse_qlinear_silu_mul)
and QLinearAddRMSNorm (passes/fuse_qlinear_add_norm); and prepack_int4, which packs the GEMV's scale / zero
words at load."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels import int4_linear as q4
from engc.kernels import rms_norm
from engc.kernels.int4_linear import int4_linear
from engc.kernels.silu_mul import silu_mul

CPU_OPS = {
    (ENGC_DOMAIN, "QLinear"): lambda *xs, **a: (int4_linear(*xs, **a),),
    (ENGC_DOMAIN, "QLinearSiluMul"): lambda *xs, **a: (silu_mul(int4_linear(*xs, **a)),),
    (ENGC_DOMAIN, "QLinearAddRMSNorm"): lambda x, qw, s, z, r, w, group_size, eps: rms_norm.add_rms_norm(
        int4_linear(x, qw, s, z, group_size=group_size), r, w, eps),
}


def gpu_ops(ctx) -> dict:
    """The int4 GEMM for the decode batches its M classes hold, the CUDA C++ GEMV where built, else the
    Triton GEMV up to gemv_max_rows rows; above, dequantize into a scratch W and cuBLAS. ctx.packed: the
    scale / zero words of the GEMV builds that read them so (int4_linear.PackedScales), one set per model
    (a GGUF weight's offsets: their term is added to the kernels' product, int4_linear.offset_term)."""
    if not ctx.has("int4_linear"):   # a bundle built from an AWQ/GPTQ checkpoint (or a GGUF's kept Q4 blocks)
        return {}
    run = dict(consts=ctx.consts("int4_linear"), run=lambda launches: ctx.run("int4_linear", launches),
               counters=ctx.counters, packed=ctx.packed)

    def qlinear(x, qweight, scales, zeros, *extra, group_size, has_bias=0, act_order=0, has_offsets=0):
        if act_order:  # GPTQ desc_act: rows were sorted by group at build time, x follows them
            x = x.index_select(-1, extra[int(bool(has_bias))])
        x = x.contiguous()
        y = q4.run_quantized_linear(x, qweight, scales, zeros, extra[0] if has_bias else None,
                                    group_size=group_size, gemm_consts=ctx.consts("int4_gemm") or None,
                                    run_gemm=lambda launches: ctx.run("int4_gemm", launches), **run)
        return (y + q4.offset_term(x, extra[-1], group_size) if has_offsets else y,)

    # the SiLU-out CUDA GEMV where the bundle has it and M fits; else the projection as QLinear runs it, then
    # the SiluMul node's kernel
    def qlinear_silu(x, qweight, scales, zeros, *extra, group_size, has_bias=0, act_order=0, has_offsets=0):
        if not act_order and not has_offsets:
            act_out = q4.run_quantized_silu(x.contiguous(), qweight, scales, zeros, extra[0] if has_bias else None,
                                            group_size=group_size, **run)
            if act_out is not None:
                return (act_out,)
        return ctx.op("SiluMul")(qlinear(x, qweight, scales, zeros, *extra, group_size=group_size,
                                         has_bias=has_bias, act_order=act_order, has_offsets=has_offsets)[0])

    # where the CUDA GEMV serves M rows in one launch that splits K and the bundle has the norm's partials
    # build, the GEMV leaves its fp32 partials unreduced and the norm sums them (same bits, no fence, ticket or
    # re-read in the GEMV); else QLinear, then AddRMSNorm
    def qlinear_add_norm(x, qweight, scales, zeros, residual, weight, *, group_size, eps):
        x = x.contiguous()
        partials = None
        if rms_norm.PARTIALS_VARIANT in ctx.consts("rms_norm"):
            partials = q4.run_quantized_partials(x, qweight, scales, zeros, group_size=group_size,
                                                 gemm_consts=ctx.consts("int4_gemm") or None, **run)
        if partials is None:
            return ctx.op("AddRMSNorm")(qlinear(x, qweight, scales, zeros, group_size=group_size)[0], residual,
                                        weight, eps)
        out, r_out = torch.empty_like(residual), torch.empty_like(residual)
        ctx.run("rms_norm", rms_norm.launch(partials, weight, eps, out, residual=residual, residual_out=r_out,
                                            partials=True))
        return out, r_out

    return {(ENGC_DOMAIN, "QLinear"): qlinear, (ENGC_DOMAIN, "QLinearSiluMul"): qlinear_silu,
            (ENGC_DOMAIN, "QLinearAddRMSNorm"): qlinear_add_norm}


def prepack_int4(program, weights: dict, consts: dict, packed: q4.PackedScales) -> None:
    """Packs every int4 weight's scale / zero words that the bundle's packed_sz GEMV builds will read
    (int4_linear.packed_flavours) for the program's int4 nodes (consts: the bundle's int4_linear launch
    constants), now rather than at the weight's first launch: the engine sizes the KV cache from the GPU
    memory free after loading, so the words (~0.2 GB for an 8B model) must exist by then. One synchronize at
    the end, not one a weight (an EARLY_W build reads the words before its PDL wait, so they must be written
    before any launch)."""
    if not consts or not any(c.get("packed_sz") for c in consts.values()):
        return
    on_gpu = False
    for node in program.nodes:
        if node.domain != ENGC_DOMAIN or node.op not in ("QLinear", "QLinearSiluMul", "QLinearAddRMSNorm"):
            continue
        qweight, scales, zeros = (weights.get(name) for name in node.inputs[1:4])   # inputs: x, then these
        if qweight is None or scales is None or zeros is None:   # not the bundle's weights: nothing to pack ahead
            continue
        n, kdim = qweight.shape[0], qweight.shape[1] * q4.PACK
        silu_node = node.op == "QLinearSiluMul" and not node.attrs.get("act_order")
        for silu in q4.packed_flavours(n, kdim, node.attrs["group_size"], consts, silu_node):
            packed(scales, zeros, silu, sync=False)
            on_gpu = on_gpu or scales.is_cuda
    if on_gpu:
        torch.cuda.current_stream().synchronize()
