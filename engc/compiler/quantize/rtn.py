"""Asymmetric uint4 group quantization (round to nearest): the math AWQ, GPTQ and the RTN baseline share.

Weights are [out, in] as in HF checkpoints; groups run along `in`. w ~ (q - zero) * scale with q, zero
integers in [0, 15], the convention of AutoAWQ and GPTQ alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


MAXQ = 15


@dataclass
class QuantizedWeight:
    """q uint8 [out, in]; scales, zeros [out, in // g]; g_idx int32 [in]: group of each input channel."""
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        idx = self.g_idx.long()
        # in place on the one float copy of q: each temporary here is a whole [out, in] float matrix
        return self.q.float().sub_(self.zeros[:, idx]).mul_(self.scales[:, idx])


def pad_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Zero-pads the last dim to whole groups. A ragged last group is then exact: params() always
    includes 0 in a group's range, so zero padding never changes its scale or zero point."""
    extra = -w.shape[-1] % group_size
    return torch.nn.functional.pad(w, (0, extra)) if extra else w


def params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of w [..., n] from its min and max (the range includes 0)."""
    lo, hi = torch.aminmax(w, dim=-1)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = ((hi - lo) / MAXQ).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, MAXQ)
    return scale, zero


def quantize_with(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.div(w, scale).round_().add_(zero).clamp_(0, MAXQ)  # one temporary the size of w


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quantize then dequantize, group by group (the weight AWQ's searches evaluate)."""
    k = w.shape[-1]
    padded = pad_groups(w, group_size)
    g = padded.reshape(-1, group_size)
    scale, zero = params(g)
    scale, zero = scale[:, None], zero[:, None]
    # quantize_with then dequantize, in place: AWQ's searches call this ~200 times a layer
    out = torch.div(g, scale).round_().add_(zero).clamp_(0, MAXQ).sub_(zero).mul_(scale)
    return out.reshape(padded.shape)[..., :k]


def quantize_rtn(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    out, k = w.shape
    g = pad_groups(w.float(), group_size).reshape(out, -1, group_size)
    scale, zero = params(g)
    q = quantize_with(g, scale[..., None], zero[..., None]).reshape(out, -1)[:, :k]
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    return QuantizedWeight(q.to(torch.uint8), scale, zero.to(torch.uint8), g_idx, group_size)
