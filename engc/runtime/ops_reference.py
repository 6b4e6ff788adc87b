"""The CPU binding of every op in an engine program: the plain-torch references of kernels/<op>.

Each entry takes the node's input tensors and attributes and returns its outputs as a tuple. The GPU
binding (the bundle's cubins) has the same shape, so the executor does not care which one it runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.fp8_quant import fp8_linear, fp8_linear_q, quantize_rows, silu_quant_rows
from engc.kernels.gemv import silu_mul_linear
from engc.kernels.int4_linear import int4_linear
from engc.kernels.paged_attention import paged_attention, rotary_paged_attention
from engc.kernels.qk_norm import qk_norm
from engc.kernels.rms_norm import add_rms_norm, rms_norm
from engc.kernels.rotary import rotary_kv_write
from engc.kernels.silu_mul import silu_mul
from engc.runtime import ops_half

ONNX_TO_TORCH = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}


def _gather(data, indices, axis=0):
    return (torch.index_select(data, axis, indices.long()),)


def _gemm(a, b, c=None, transB=0, transA=0, alpha=1.0, beta=1.0):
    if transA or alpha != 1.0 or beta != 1.0:
        raise NotImplementedError("Gemm with transA/alpha/beta")
    return (F.linear(a, b, c) if transB else a @ b + (c if c is not None else 0),)


def _quantized_first(y, *rest):
    return (*quantize_rows(y), *rest)


REFERENCE_OPS = {
    ("", "Gather"): _gather,
    ("", "Gemm"): _gemm,
    ("", "Concat"): lambda *xs, axis: (torch.cat(xs, dim=axis),),
    ("", "Cast"): lambda x, to: (x.to(ONNX_TO_TORCH[to]),),
    (ENGC_DOMAIN, "RMSNorm"): lambda x, w, eps: (rms_norm(x, w, eps),),
    (ENGC_DOMAIN, "AddRMSNorm"): lambda x, r, w, eps: add_rms_norm(x, r, w, eps),
    (ENGC_DOMAIN, "QKNorm"): lambda qkv, qw, kw, **a: (qk_norm(qkv, qw, kw, **a),),
    # a quantized KV cache (--kv-cache int8|fp8) passes its scales as a 6th input
    (ENGC_DOMAIN, "RotaryKVWrite"): lambda qkv, pos, inv_freq, kv, slots, kv_scale=None, **a: (
        rotary_kv_write(qkv, pos, inv_freq, kv, slots, kv_scale=kv_scale, **a),),
    (ENGC_DOMAIN, "PagedAttention"): lambda q, kv, tables, ctx, starts, kv_scale=None, **a: (
        paged_attention(q, kv, tables, ctx, starts, kv_scale=kv_scale, **a),),
    (ENGC_DOMAIN, "RotaryPagedAttention"): lambda *xs, **a: (rotary_paged_attention(*xs[:8], kv_scale=(
        xs[8] if len(xs) > 8 else None), **a),),
    (ENGC_DOMAIN, "SiluMul"): lambda x: (silu_mul(x),),
    (ENGC_DOMAIN, "SiluMulLinear"): lambda x, w: (silu_mul_linear(x, w),),
    (ENGC_DOMAIN, "QLinear"): lambda *xs, **a: (int4_linear(*xs, **a),),
    (ENGC_DOMAIN, "QLinearSiluMul"): lambda *xs, **a: (silu_mul(int4_linear(*xs, **a)),),
    (ENGC_DOMAIN, "QLinearAddRMSNorm"): lambda x, qw, s, z, r, w, group_size, eps: add_rms_norm(
        int4_linear(x, qw, s, z, group_size=group_size), r, w, eps),
    (ENGC_DOMAIN, "FP8Linear"): lambda *xs, **a: (fp8_linear(*xs, **a),),
    # an fp8 program's FP8Linear inputs quantized by their producers (passes/fuse_fp8_input_quant)
    (ENGC_DOMAIN, "RMSNormFP8"): lambda x, w, eps: quantize_rows(rms_norm(x, w, eps)),
    (ENGC_DOMAIN, "AddRMSNormFP8"): lambda x, r, w, eps: _quantized_first(*add_rms_norm(x, r, w, eps)),
    (ENGC_DOMAIN, "SiluMulFP8"): lambda x: silu_quant_rows(x),
    (ENGC_DOMAIN, "FP8LinearQ"): lambda xq, xs, w, ws, bias=None, has_bias=0, dtype=1: (
        fp8_linear_q(xq, xs, w, ws, bias, has_bias, ONNX_TO_TORCH[dtype]),),
}

# a bfloat16 / float16 bundle on the CPU: HF transformers' roundings where the references round otherwise
HALF_OPS = {
    **REFERENCE_OPS,
    (ENGC_DOMAIN, "RotaryKVWrite"): lambda qkv, pos, inv_freq, kv, slots, kv_scale=None, **a: (
        ops_half.rotary_kv_write(qkv, pos, inv_freq, kv, slots, kv_scale=kv_scale, **a),),
    (ENGC_DOMAIN, "PagedAttention"): lambda q, kv, tables, ctx, starts, kv_scale=None, **a: (
        ops_half.paged_attention(q, kv, tables, ctx, starts, kv_scale=kv_scale, **a),),
    (ENGC_DOMAIN, "RotaryPagedAttention"): lambda *xs, **a: (ops_half.rotary_paged_attention(*xs[:8], kv_scale=(
        xs[8] if len(xs) > 8 else None), **a),),
}


def reference_ops(dtype: torch.dtype) -> dict:
    """The CPU op table of a bundle of this dtype."""
    return REFERENCE_OPS if dtype == torch.float32 else HALF_OPS
