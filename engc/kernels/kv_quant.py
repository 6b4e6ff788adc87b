"""The quantized KV-cache formats (`engc build --kv-cache int8|fp8`): the one definition of their math.

A quantized cache stores each (token, KV head) row of K and of V as head_dim 1-byte codes plus one
float32 scale, in two paged tensors per layer:

    codes  [2, num_blocks, block_size, num_kv_heads, head_dim]  int8 or float8_e4m3fn
    scales [2, num_blocks, block_size, num_kv_heads]            float32

scale = absmax(row) / QMAX, code = row / scale (int8: rounded half up and clamped to +-127; fp8:
e4m3 round-to-nearest, |code| <= 448). Scales are per token, so a row is quantized once, when the rotary
op writes it, and never again (per-block scales would need a requantize as a block fills; static scales,
a calibration set). Dequantizing is code * scale in float32. An all-zero row gets scale 0 and codes 0.

The rotary op's reference (quantize) and the paged-attention reference (dequantize) call these; the
Triton kernels do the same arithmetic in the same order. Free of triton: the runtime imports it.
"""
from __future__ import annotations

import torch

# --kv-cache value -> the code dtype (auto: the model dtype, no scales)
KV_CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
KV_CACHE_CHOICES = ("auto", *KV_CACHE_DTYPES)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# the kernels' KV_QUANT constexpr: 0 = model dtype, 1 = int8, 2 = fp8 (e4m3)
KV_QUANT_CODE = {None: 0, torch.int8: 1, torch.float8_e4m3fn: 2}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def cache_dtype(kv_cache: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache is stored in for a --kv-cache setting (ValueError on an unknown one)."""
    if kv_cache == "auto":
        return model_dtype
    if kv_cache not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv-cache setting '{kv_cache}'; known: {', '.join(KV_CACHE_CHOICES)}")
    return KV_CACHE_DTYPES[kv_cache]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] of dtype, scales [...] float32)."""
    qmax = QMAX[dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    y = (x * inv[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.floor(y + 0.5).clamp(-qmax, qmax)
    return y.to(dtype), amax / qmax


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales[..., None]


KV_TRITON_DTYPE = {torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}


def kernel_args(t: str, kv: torch.dtype | None) -> tuple[dict, dict]:
    """(argument types, constexprs) of the KV-cache parameters of the rotary and attention kernels: codes and
    scale pointers for a quantized cache; the model dtype t, the scale pointers fixed to None (no
    parameters) otherwise. kv: the cache's code dtype or None."""
    if kv is None:
        return ({"k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}"},
                {"k_scale_ptr": None, "v_scale_ptr": None, "KV_QUANT": 0})
    c = KV_TRITON_DTYPE[kv]
    return ({"k_cache_ptr": f"*{c}", "v_cache_ptr": f"*{c}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"},
            {"KV_QUANT": KV_QUANT_CODE[kv]})
