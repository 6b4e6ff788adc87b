"""The lm_head as one more streamed "layer" (`engc quantize --lm-head`): GPTQModel's `lm_head: true`.

The head [vocab, hidden] is quantized in chunks of output rows, so that at most one chunk is ever
float32 (the head of a 128k vocabulary is 2 GB in float32, several layers' worth), with the run's group
size and layout:

- rtn:        min/max per group, as for the projections (no calibration).
- gptq, awq:  GPTQ. The Hessian of the head's input (the final norm's output of the calibration
              activations, after every quantized layer) is hidden x hidden, as cheap as a q_proj's; each
              chunk of rows is quantized against it (GPTQ treats output rows independently, so chunking
              changes nothing). An AWQ run packs the result in the AWQ layout (no act-order there). AWQ's
              own search on the head (scales folded into the final norm, then clipping, scored on 512
              sampled tokens) was measured first and cost three times GPTQ's perplexity on SmolLM2
              (docs/quantization.md), so AWQ runs use GPTQ for the head.

Every chunk is packed as it is quantized; the packed pieces join along the output dimension, which is
the second dimension of every tensor of both layouts (formats.py).
"""
from __future__ import annotations

import torch

from engc.compiler.quantize.gptq import Hessian, gptq_quantize
from engc.compiler.quantize.rtn import quantize_rtn
from engc.kernels.rms_norm import rms_norm

CHUNK_ELEMENTS = 1 << 23   # float32 elements of one chunk of head rows (32 MB)


def chunk_rows(hidden: int) -> int:
    return max(8, CHUNK_ELEMENTS // hidden // 8 * 8)   # a multiple of 8: the packing's out/8 words


def quantize_head(w: torch.Tensor, norm_w: torch.Tensor, x: torch.Tensor | None, eps: float, opts,
                  pack) -> dict[str, torch.Tensor]:
    """w: the head [vocab, hidden] in its source dtype; norm_w: the final norm's weight; x: the final norm's
    calibration input [S, T, hidden] float32 (None for RTN). Returns the packed tensors of the head."""
    rows, g = chunk_rows(w.shape[1]), opts.group_size
    if opts.method == "rtn":
        quant = lambda wc: quantize_rtn(wc, g)  # noqa: E731
    else:
        h = rms_norm(x, norm_w.float(), eps)
        hessian = Hessian(w.shape[1])
        for s in range(0, h.shape[0], 8):   # a few sequences at a time, as for the layers
            hessian.add(h[s:s + 8])
        del h
        # act-order as the GPTQ run's layers; an AWQ run's head takes it with static groups, which its layout
        # (no g_idx) holds
        act_order = opts.act_order if opts.method == "gptq" else opts.static_groups
        quant = lambda wc: gptq_quantize(wc, hessian.H, g, opts.damp, act_order, opts.static_groups)  # noqa: E731
    parts = []
    for r in range(0, w.shape[0], rows):
        parts.append(pack(quant(w[r:r + rows].float())))
    return {k: parts[0][k] if k == "g_idx" else torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}
