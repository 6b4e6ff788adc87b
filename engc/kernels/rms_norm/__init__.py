"""RMSNorm, optionally fused with the residual add that precedes it in every decoder block.

ONNX: ai.engc::RMSNorm(x, weight) -> y and ai.engc::AddRMSNorm(x, residual, weight) -> (y, x + residual),
attribute eps. One kernel serves both: the residual is just an optional input.
"""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in float32 whatever the storage dtype, as the HF reference does.
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    s = x + residual
    return rms_norm(s, weight, eps), s
