"""The lm_head as one more streamed "layer" (`engc quantize --lm-head`): GPTQModel's `lm_head: true`.

The head [vocab, hidden] is quantized with the run's method, in chunks of output rows so that at most
one chunk is ever float32 (the head of a 128k vocabulary is 2 GB in float32, several layers' worth):

- rtn:  min/max per group, as for the projections.
- gptq: the Hessian of the head's input (the final norm's output of the calibration activations, after
        every quantized layer) is hidden x hidden, as cheap as a q_proj's; each chunk of rows is quantized
        against it (GPTQ treats output rows independently, so chunking changes nothing).
- awq:  the scale search and the clipping search of awq.py with the final norm as the folded-into op
        (its only reader is the head: a tied embedding stays the unscaled gather table), scored on a
        sample of CLIP_TOKENS calibration tokens, since the full output is tokens x vocab; the identity
        scale is a candidate too, so the search never does worse than RTN + clipping on that sample.

Every chunk is packed as it is quantized; the packed pieces join along the output dimension, which is
the second dimension of every tensor of both layouts (formats.py).
"""
from __future__ import annotations

import torch

from engc.compiler.quantize.awq import CLIP_TOKENS, clip_weight
from engc.compiler.quantize.gptq import Hessian, gptq_quantize
from engc.compiler.quantize.rtn import fake_quantize, pad_groups, quantize_rtn
from engc.kernels.rms_norm import rms_norm

CHUNK_ELEMENTS = 1 << 23   # float32 elements of one chunk of head rows (32 MB)


def head_source(ckpt, cfg) -> str:
    """The tensor the bundle's logits read: the embedding for a tied model (as decoder.lower does)."""
    if cfg.tie_word_embeddings or not ckpt.has("lm_head.weight"):
        return "model.embed_tokens.weight"
    return "lm_head.weight"


def chunk_rows(hidden: int) -> int:
    return max(8, CHUNK_ELEMENTS // hidden // 8 * 8)   # a multiple of 8: the packing's out/8 words


def quantize_head(w: torch.Tensor, norm_w: torch.Tensor, x: torch.Tensor | None, eps: float, opts, pack):
    """w: the head [vocab, hidden] in its source dtype; norm_w: the final norm's weight; x: the final norm's
    calibration input [S, T, hidden] float32 (None for RTN). Returns (packed tensors of the head, the final
    norm's new weight in its dtype or None when unchanged)."""
    rows, g = chunk_rows(w.shape[1]), opts.group_size

    def chunks(scale=None):
        for r in range(0, w.shape[0], rows):
            wc = w[r:r + rows].to(torch.float32, copy=True)  # a copy even when w is float32: edited in place
            yield wc.mul_(scale) if scale is not None else wc

    h = rms_norm(x, norm_w.float(), eps) if x is not None else None
    new_norm, scale = None, None
    if opts.method == "gptq":
        hessian = Hessian(w.shape[1])
        for s in range(0, h.shape[0], 8):
            hessian.add(h[s:s + 8])
        quant = lambda wc: gptq_quantize(wc, hessian.H, g, opts.damp, opts.act_order)  # noqa: E731
    elif opts.method == "awq":
        sample = _sample(h)
        scale = awq_head_scale(chunks, h, sample, g, opts.awq_grid)
        new_norm = (norm_w.float() / scale).to(norm_w.dtype)
        scaled_in = sample / scale  # the head's input once the norm is divided by the scale
        quant = lambda wc: quantize_rtn(clip_weight(wc, scaled_in, g, opts.awq_grid), g)  # noqa: E731
    else:
        quant = lambda wc: quantize_rtn(wc, g)  # noqa: E731
    parts = []
    for wc in chunks(scale):
        parts.append(pack(quant(wc)))
        del wc
    packed = {k: parts[0][k] if k == "g_idx" else torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}
    return packed, new_norm


def _sample(h: torch.Tensor) -> torch.Tensor:
    flat = h.reshape(-1, h.shape[-1])
    return flat[torch.linspace(0, flat.shape[0] - 1, min(CLIP_TOKENS, flat.shape[0])).long()]


def awq_head_scale(chunks, h: torch.Tensor, sample: torch.Tensor, group_size: int, grid: int) -> torch.Tensor:
    """AWQ's per-input scale s = x_mean^a / w_mean^(1-a) for the head, the grid point (or s = 1) whose
    fake-quantized head changes the logits of `sample` least (summed over chunks of rows)."""
    x_mean = h.abs().reshape(-1, h.shape[-1]).mean(0)
    w_sum, n = torch.zeros_like(x_mean), 0
    for wc in chunks():
        gr = pad_groups(wc.abs_(), group_size).reshape(wc.shape[0], -1, group_size)
        w_sum += (gr / gr.amax(dim=-1, keepdim=True).clamp(min=1e-8)).reshape(wc.shape[0], -1)[:, :wc.shape[1]].sum(0)
        n += wc.shape[0]
        del gr
    w_mean = w_sum / n

    def loss(s: torch.Tensor) -> float:
        total = 0.0
        for wc in chunks():
            err = fake_quantize(wc * s, group_size).div_(s).sub_(wc)
            total += (sample @ err.T).pow_(2).sum().item()
        return total

    best, best_loss = torch.ones_like(x_mean), loss(torch.ones_like(x_mean))
    for i in range(grid):
        ratio = i / grid
        s = (x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        candidate = loss(s)
        if candidate < best_loss:
            best, best_loss = s, candidate
    return best
