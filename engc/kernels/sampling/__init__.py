"""Sampling of one token per row from logits, with per-row temperature, top-k and top-p.

ONNX: ai.engc::Sample(logits, temperature, top_k, top_p, uniform) -> token_ids (int64).
logits [B, V] (any float dtype); temperature, top_p [B] float32; top_k [B] int32; uniform [B] float32
in [0, 1). The caller draws uniform, so the op is a pure function of its inputs and needs no host sync.

Per row:
  temperature == 0 -> argmax of the logits (first index on ties; a NaN counts as +inf).
  A row whose largest logit is not finite (NaN, +inf, or all -inf) takes that argmax too, whatever its
  temperature: a valid token id, never one outside the vocabulary.
  s = logits.float() / temperature.
  top-k (0 < k < V): keep s >= the k-th largest s (ties at the threshold are kept).
  top-p (p < 1): over the kept tokens in descending s order, find the first token whose cumulative
    mass exp(s - max) reaches p * (kept mass); keep s >= its s.
  Then inverse-CDF sampling in vocabulary order: the first kept token whose cumulative mass exceeds
  uniform * (kept mass).
"""
import torch

from engc.kernels.argmax import nan_as_max


def sample(logits, temperature, top_k, top_p, uniform) -> torch.Tensor:
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    for i in range(b):
        out[i] = sample_row(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), float(uniform[i]))
    return out


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> int:
    x = nan_as_max(logits)
    if temperature == 0.0 or not torch.isfinite(x.max()):   # NaN, +inf, or all -inf: nothing to draw from
        return int(torch.argmax(x))
    s = logits.float() / temperature
    v = s.shape[0]
    keep = torch.ones_like(s, dtype=torch.bool)
    if 0 < top_k < v:
        kth = torch.sort(s, descending=True).values[top_k - 1]
        keep = s >= kth
    mass = torch.exp(s - s.max()) * keep
    if top_p < 1.0:
        order = torch.sort(torch.where(keep, s, float("-inf")), descending=True).values
        cum = torch.cumsum(torch.exp(order - s.max()), 0)
        cross = int(torch.searchsorted(cum, top_p * cum[-1]).clamp(max=v - 1))
        keep &= s >= order[cross]
        mass = mass * keep
    cum = torch.cumsum(mass, 0)
    idx = int(torch.searchsorted(cum, u * cum[-1], right=True))
    last_kept = int(torch.nonzero(keep).max())
    return min(idx, last_kept)


_TRITON_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def launch(logits, temperature, top_k, top_p, uniform, out, consts=None):
    """Launch rule of sample_kernel: [(variant, grid, args)]; variant 'logits_<dtype>' (fp32, bf16, fp16).

    logits contiguous [B, V]; temperature, top_p, uniform float32 [B]; top_k int32 [B]; out int64 [B].
    args: logits, temperature, top_k, top_p, uniform, out, global_scratch=0, profile_scratch=0.
    consts is unused.
    """
    assert logits.is_contiguous()
    assert temperature.dtype == top_p.dtype == uniform.dtype == torch.float32 and top_k.dtype == torch.int32
    assert out.dtype == torch.int64
    rows = logits.shape[0]
    if rows == 0:
        return []
    return [(f"logits_{_TRITON_NAME[logits.dtype]}", (rows, 1, 1),
             [logits, temperature, top_k, top_p, uniform, out, 0, 0])]
