"""Rotary frequencies, resolved at build time so the runtime has one formula for every family.

Follows the HF definitions of the default, linear, llama3, dynamic (up to the original length), longrope
(short factors) and yarn rope types; anything else is refused.
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
    if rope_type == "dynamic":
        return freq    # dynamic NTK changes nothing up to the original length, the bundle's context limit
    if rope_type in LONGROPE:
        # LongRoPE's short factors: the ones HF uses while a sequence fits the original length, to which
        # the bundle's context is limited (context_limit); the long factors would need a per-sequence switch
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        if short.numel() != freq.numel():
            raise UserError(f"longrope short_factor has {short.numel()} entries, the rotary width needs {freq.numel()}")
        return 1.0 / (short * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "yarn":
        return _yarn(freq, head_dim, theta, scaling)
    raise UserError(f"unsupported rope scaling '{rope_type}'; supported: default, linear, llama3, dynamic, longrope, "
                    "yarn")


LONGROPE = ("longrope", "su")   # Phi-3's configs call it su before transformers renamed it


def _rope_type(scaling: dict | None) -> str:
    return "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))


def context_limit(scaling: dict | None, max_position_embeddings: int) -> int:
    """The longest context the resolved frequencies are exact for: the original length for dynamic NTK and
    LongRoPE (beyond it HF switches frequencies as the sequence grows) and where Llama 4's query temperature
    is set (llama_4_scaling_beta, Ministral 3: q times 1 + beta * log(1 + floor(position / original length)),
    which is 1 below the original length and is not computed), else max_position_embeddings."""
    if _rope_type(scaling) in ("dynamic", *LONGROPE) or (scaling or {}).get("llama_4_scaling_beta"):
        return min(max_position_embeddings, int(scaling.get("original_max_position_embeddings")
                                                or max_position_embeddings))
    return max_position_embeddings


def attention_factor(scaling: dict | None, max_position_embeddings: int) -> float:
    """LongRoPE's and YaRN's multiplier of cos and sin (so q.k gains its square). LongRoPE: sqrt(1 + ln(factor)
    / ln(original length)), factor being max_position_embeddings over the original length, as HF computes it;
    YaRN: mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are given (DeepSeek), else
    mscale(factor); else 1."""
    if _rope_type(scaling) == "yarn":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = _yarn_factor(scaling, max_position_embeddings)
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            return yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
        return yarn_mscale(factor)
    if _rope_type(scaling) not in LONGROPE:
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise UserError("longrope rope scaling needs original_max_position_embeddings")
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def layer_type_rope(hf_config: dict, layer_type: str) -> tuple[float, dict | None]:
    """(theta, scaling) of the layers of one type (Gemma: 'full_attention', 'sliding_attention'): from
    transformers 5's rope_parameters keyed by layer type, or the older rope_theta / rope_local_base_freq /
    rope_scaling keys (the scaling applies to global layers only; without rope_local_base_freq, as in Gemma 2,
    every layer has the global rope)."""
    params = hf_config.get("rope_parameters") or {}
    if layer_type in params:
        p = params[layer_type]
        scaling = None if _rope_type(p) == "default" else {k: v for k, v in p.items() if k != "rope_theta"}
        return float(p.get("rope_theta", 10000.0)), scaling
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf_config:
        return float(hf_config["rope_local_base_freq"]), None
    return rope_params(hf_config)


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(factor) + 1 (1 where the factor does not extend)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(scaling: dict | None, scale: float) -> float:
    """DeepSeek's MLA also scales q.k of every dim (not only the rotated ones) by mscale(factor, mscale_all_dim)
    squared under YaRN, as HF's yarn_apply_mscale does."""
    if _rope_type(scaling) == "yarn" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
        return scale * m * m
    return scale


def _yarn_factor(s: dict, max_position_embeddings: int) -> float:
    return s.get("factor") or max_position_embeddings / s["original_max_position_embeddings"]


def _yarn(freq: torch.Tensor, dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN's blend of interpolated (freq / factor) and extrapolated (freq) frequencies over a linear ramp between
    the dims that turn beta_fast and beta_slow times in the original length."""
    original = s.get("original_max_position_embeddings")
    if not original or not s.get("factor"):
        raise UserError("yarn rope scaling needs factor and original_max_position_embeddings")
    factor, fast, slow = s["factor"], s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return freq / factor * (1 - extrapolation) + freq * extrapolation
