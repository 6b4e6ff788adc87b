"""Rotary frequencies, resolved at build time so the runtime has one formula for every family.

Follows the HF definitions of the default, linear and llama3 rope types; anything else is refused.
"""
from __future__ import annotations

import math

import torch

from engc.errors import UserError


def rope_params(hf_config: dict) -> tuple[float, dict | None]:
    # transformers 5 moved theta and scaling into rope_parameters; older configs have both at top level.
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    theta = hf_config.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(freq, scaling)
    raise UserError(f"unsupported rope scaling '{rope_type}'; supported: default, linear, llama3")


def _llama3(freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
