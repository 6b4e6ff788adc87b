"""The int4 checkpoint layouts other tools read and write, packed and unpacked.

AutoAWQ GEMM (quant_method "awq", version "gemm"), for a projection with `in` inputs, `out` outputs:
  qweight int32 [in, out / 8]   8 output columns per word, nibble i holding column AWQ_ORDER[i]
  qzeros  int32 [in / g, out / 8], same packing;  scales fp16 [in / g, out];  w = (q - z) * s
GPTQ (quant_method "gptq", checkpoint_format "gptq", the AutoGPTQ/GPTQModel v1 layout):
  qweight int32 [in / 8, out]   8 input rows per word, low nibble first
  qzeros  int32 [in / g, out / 8], natural order, holding (z - 1) & 15 (the v1 format's offset)
  scales  fp16 [in / g, out];  g_idx int32 [in] (group of each input channel);  w = (q - z) * s
"""
from __future__ import annotations

import torch

from engc.compiler.quantize.rtn import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NATURAL = tuple(range(8))


def pack_columns(q: torch.Tensor, order=NATURAL) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C / 8]; nibble i of word c holds column 8c + order[i]."""
    r, c = q.shape
    q = q.reshape(r, c // 8, 8)
    words = torch.zeros(r, c // 8, dtype=torch.int32)
    for i, col in enumerate(order):
        words |= q[..., col].to(torch.int32) << (4 * i)
    return words


def unpack_columns(words: torch.Tensor, order=NATURAL) -> torch.Tensor:
    r, c8 = words.shape
    nibbles = (words.unsqueeze(-1) >> (torch.arange(8, dtype=torch.int32) * 4)) & 0xF
    inverse = [order.index(i) for i in range(8)]
    return nibbles[..., inverse].reshape(r, c8 * 8).to(torch.uint8)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15, R % 8 == 0 -> int32 [R / 8, C]; nibble i of word [r, c] holds row 8r + i (GPTQ)."""
    r, c = q.shape
    q = q.reshape(r // 8, 8, c)
    words = torch.zeros(r // 8, c, dtype=torch.int32)
    for i in range(8):  # int32 shifts wrap in two's complement: nibble 7 lands in the sign bit
        words |= q[:, i].to(torch.int32) << (4 * i)
    return words


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R / 8, C] -> uint8 [R, C], the inverse of pack_rows."""
    r8, c = words.shape
    nibbles = (words.unsqueeze(1) >> (torch.arange(8, dtype=torch.int32) * 4).view(1, 8, 1)) & 0xF
    return nibbles.reshape(r8 * 8, c).to(torch.uint8)


def to_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    if not torch.equal(qw.g_idx.long(), torch.arange(qw.q.shape[1]) // qw.group_size):
        raise ValueError("the AWQ layout has no g_idx: act-order weights go to the GPTQ layout")
    return {"qweight": pack_columns(qw.q.T.contiguous(), AWQ_ORDER),
            "qzeros": pack_columns(qw.zeros.T.contiguous(), AWQ_ORDER),
            "scales": qw.scales.T.contiguous().to(torch.float16)}


def to_gptq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    return {"qweight": pack_rows(qw.q.T.contiguous()),
            "qzeros": pack_columns(((qw.zeros.to(torch.int64) - 1) & 0xF).T.contiguous()),
            "scales": qw.scales.T.contiguous().to(torch.float16),
            "g_idx": qw.g_idx.to(torch.int32)}
