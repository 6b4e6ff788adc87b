"""The GPU binding of the quantized projections: ai.engc::QLinear and its fusions (int4 W4A16: kernels/int4_linear,
kernels/int4_gemm) and ai.engc::FP8Linear (W8A8: kernels/fp8_linear, fp8_quant), split from gpu_ops for size.

gpu_ops hands over what they share with the other ops: the bundle's kernels, the split-K counters, the model's
packed int4 scale / zero words, and the SiLU-and-mul and AddRMSNorm bindings their unfused paths fall back to.
"""
from __future__ import annotations

import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels import fp8_quant, int4_linear, rms_norm
from engc.kernels import fp8_linear as fp8_gemm
from engc.runtime.ops_reference import ONNX_TO_TORCH


def quant_ops(k, counters: torch.Tensor, packed: int4_linear.PackedScales, *, act, add_norm) -> dict:
    """The quantized ops this bundle's kernels serve, for the executor's table; k: gpu_ops.BundleKernels."""

    # FP8Linear: the bundle's W8A8 GEMM (kernels/fp8_linear) for decode/small-prefill rows, quantizing x
    # itself for a few rows or taking it from the fp8_quant kernel; above its M classes, fp8_quant then
    # cuBLASLt FP8 with row-wise scales (weight [N, K] row-major: weight.t() is the column-major operand).
    fp8_consts = k.consts.get("fp8_linear", {})
    fp8_table = fp8_gemm.variant_table(fp8_consts)

    def fp8_linear(x, weight, weight_scale, bias=None, has_bias=0):
        rows, kdim = x.shape
        bias = bias if has_bias else None
        if rows == 0:
            return (x.new_empty(0, weight.shape[0]),)
        fused = fp8_gemm.pick(fp8_table, kdim, rows, quant_x=True)
        if fused and x.is_contiguous():
            out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
            k.run("fp8_linear", fp8_gemm.launch(x, None, weight, weight_scale, bias, out, fused,
                                                fp8_consts[fused], counters))
            return (out,)
        xq = torch.empty(x.shape, dtype=fp8_quant.FP8, device=x.device)
        x_scale = torch.empty(rows, dtype=torch.float32, device=x.device)
        k.run("fp8_quant", fp8_quant.launch(x, xq, x_scale))
        return (fp8_matmul(xq, x_scale, weight, weight_scale, bias, x.dtype),)

    def fp8_matmul(xq, x_scale, weight, weight_scale, bias, dtype):
        """y = xq * x_scale @ (weight * weight_scale).t() (+ bias) in dtype: the bundle's GEMM for its M
        classes, else cuBLASLt."""
        plain = fp8_gemm.pick(fp8_table, xq.shape[1], xq.shape[0], quant_x=False)
        if plain:
            out = torch.empty(xq.shape[0], weight.shape[0], dtype=dtype, device=xq.device)
            k.run("fp8_linear", fp8_gemm.launch(xq, x_scale, weight, weight_scale, bias, out, plain,
                                                fp8_consts[plain], counters))
            return out
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :],
                             out_dtype=dtype)
        return y + bias if bias is not None else y

    # The fp8 program's producers of FP8LinearQ inputs (passes/fuse_fp8_input_quant): the norms write float8
    # codes and a scale a row (rms_norm's fp8 variants), the SiLU-and-mul is the quant kernel's SILU variant.
    def quantized_rows(rows, width, device):
        return (torch.empty(rows, width, dtype=fp8_quant.FP8, device=device),
                torch.empty(rows, dtype=torch.float32, device=device))

    def norm_fp8(x, w, eps):
        xq, scale = quantized_rows(x.shape[0], x.shape[1], x.device)
        k.run("rms_norm", rms_norm.launch(x, w, eps, xq, scale=scale))
        return xq, scale

    def add_norm_fp8(x, r, w, eps):
        (xq, scale), r_out = quantized_rows(x.shape[0], x.shape[1], x.device), torch.empty_like(r)
        k.run("rms_norm", rms_norm.launch(x, w, eps, xq, residual=r, residual_out=r_out, scale=scale))
        return xq, scale, r_out

    def silu_fp8(gate_up):
        xq, scale = quantized_rows(gate_up.shape[0], gate_up.shape[1] // 2, gate_up.device)
        k.run("fp8_quant", fp8_quant.launch(gate_up.contiguous(), xq, scale, silu=True))
        return xq, scale

    def fp8_linear_q(xq, x_scale, weight, weight_scale, bias=None, has_bias=0, dtype=1):
        out_dtype = ONNX_TO_TORCH[dtype]
        if xq.shape[0] == 0:
            return (torch.empty(0, weight.shape[0], dtype=out_dtype, device=xq.device),)
        return (fp8_matmul(xq, x_scale, weight, weight_scale, bias if has_bias else None, out_dtype),)

    # W4A16: the int4 GEMM for the decode batches its M classes hold, the CUDA C++ GEMV where built, else
    # the Triton GEMV up to gemv_max_rows rows; above, dequantize into a scratch W and cuBLAS. packed: the
    # scale / zero words of the GEMV builds that read them so (int4_linear.PackedScales), one set per model
    # (a GGUF weight's offsets: their term is added to the kernels' product, int4_linear.offset_term)
    def qlinear(x, qweight, scales, zeros, *extra, group_size, has_bias=0, act_order=0, has_offsets=0):
        if act_order:  # GPTQ desc_act: rows were sorted by group at build time, x follows them
            x = x.index_select(-1, extra[int(bool(has_bias))])
        x = x.contiguous()
        y = int4_linear.run_quantized_linear(x, qweight, scales, zeros,
                                             extra[0] if has_bias else None, group_size=group_size,
                                             consts=k.consts["int4_linear"],
                                             run=lambda launches: k.run("int4_linear", launches),
                                             counters=counters, gemm_consts=k.consts.get("int4_gemm"),
                                             run_gemm=lambda launches: k.run("int4_gemm", launches),
                                             packed=packed)
        return (y + int4_linear.offset_term(x, extra[-1], group_size) if has_offsets else y,)

    # QLinearSiluMul (passes/fuse_qlinear_silu_mul): the SiLU-out CUDA GEMV where the bundle has it and M fits;
    # else the projection as QLinear runs it, then the silu_mul kernel
    def qlinear_silu(x, qweight, scales, zeros, *extra, group_size, has_bias=0, act_order=0, has_offsets=0):
        if not act_order and not has_offsets:
            act_out = int4_linear.run_quantized_silu(x.contiguous(), qweight, scales, zeros,
                                                     extra[0] if has_bias else None, group_size=group_size,
                                                     consts=k.consts["int4_linear"],
                                                     run=lambda launches: k.run("int4_linear", launches),
                                                     counters=counters, packed=packed)
            if act_out is not None:
                return (act_out,)
        return act(qlinear(x, qweight, scales, zeros, *extra, group_size=group_size, has_bias=has_bias,
                           act_order=act_order, has_offsets=has_offsets)[0])

    # QLinearAddRMSNorm (passes/fuse_qlinear_add_norm): where the CUDA GEMV serves M rows in one launch that
    # splits K and the bundle has the norm's partials build, the GEMV leaves its fp32 partials unreduced and
    # the norm sums them (same bits, no fence, ticket or re-read in the GEMV); else QLinear, then AddRMSNorm
    def qlinear_add_norm(x, qweight, scales, zeros, residual, weight, *, group_size, eps):
        x = x.contiguous()
        partials = None
        if rms_norm.PARTIALS_VARIANT in k.consts["rms_norm"]:
            partials = int4_linear.run_quantized_partials(x, qweight, scales, zeros, group_size=group_size,
                                                          consts=k.consts["int4_linear"],
                                                          run=lambda launches: k.run("int4_linear", launches),
                                                          counters=counters, gemm_consts=k.consts.get("int4_gemm"),
                                                          packed=packed)
        if partials is None:
            return add_norm(qlinear(x, qweight, scales, zeros, group_size=group_size)[0], residual, weight, eps)
        out, r_out = torch.empty_like(residual), torch.empty_like(residual)
        k.run("rms_norm", rms_norm.launch(partials, weight, eps, out, residual=residual, residual_out=r_out,
                                          partials=True))
        return out, r_out

    ops = {}
    if "int4_linear" in k.consts:  # a bundle built from an AWQ/GPTQ checkpoint
        ops[(ENGC_DOMAIN, "QLinear")] = qlinear
        ops[(ENGC_DOMAIN, "QLinearSiluMul")] = qlinear_silu
        ops[(ENGC_DOMAIN, "QLinearAddRMSNorm")] = qlinear_add_norm
    if "fp8_quant" in k.consts:  # an fp8 bundle (engc build --quant fp8)
        ops[(ENGC_DOMAIN, "FP8Linear")] = fp8_linear
        ops[(ENGC_DOMAIN, "FP8LinearQ")] = fp8_linear_q
        ops[(ENGC_DOMAIN, "RMSNormFP8")] = norm_fp8
        ops[(ENGC_DOMAIN, "AddRMSNormFP8")] = add_norm_fp8
        ops[(ENGC_DOMAIN, "SiluMulFP8")] = silu_fp8
    return ops


def prepack_int4(program, weights: dict, k, packed: int4_linear.PackedScales) -> None:
    """Packs every int4 weight's scale / zero words that the bundle's packed_sz GEMV builds will read
    (int4_linear.packed_flavours) for the program's int4 nodes (k: gpu_ops.BundleKernels), now rather than at the
    weight's first launch: the engine sizes the KV cache from the GPU memory free after loading, so the words
    (~0.2 GB for an 8B model) must exist by then. One synchronize at the end, not one a weight (an EARLY_W build
    reads the words before its PDL wait, so they must be written before any launch)."""
    consts = k.consts.get("int4_linear")
    if not consts or not any(c.get("packed_sz") for c in consts.values()):
        return
    on_gpu = False
    for node in program.nodes:
        if node.domain != ENGC_DOMAIN or node.op not in ("QLinear", "QLinearSiluMul", "QLinearAddRMSNorm"):
            continue
        qweight, scales, zeros = (weights.get(name) for name in node.inputs[1:4])   # inputs: x, then these
        if qweight is None or scales is None or zeros is None:   # not the bundle's weights: nothing to pack ahead
            continue
        n, kdim = qweight.shape[0], qweight.shape[1] * int4_linear.PACK
        silu_node = node.op == "QLinearSiluMul" and not node.attrs.get("act_order")
        for silu in int4_linear.packed_flavours(n, kdim, node.attrs["group_size"], consts, silu_node):
            packed(scales, zeros, silu, sync=False)
            on_gpu = on_gpu or scales.is_cuda
    if on_gpu:
        torch.cuda.current_stream().synchronize()

