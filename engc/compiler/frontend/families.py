"""The model families engc knows: each is a few facts on top of the shared decoder mapping."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False
    qk_norm: bool = False
    # config.json key that, when true, turns the sliding window on (None: always on when set)
    sliding_window_switch: str | None = None


FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("mistral"),
    "qwen2": Family("qwen2", qkv_bias=True, sliding_window_switch="use_sliding_window"),
    "qwen3": Family("qwen3", qk_norm=True, sliding_window_switch="use_sliding_window"),
}


def family_of(hf_config: dict) -> Family:
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        arch = ",".join(hf_config.get("architectures") or []) or model_type
        from engc.errors import UserError
        raise UserError(f"unsupported architecture '{arch}' (model_type '{model_type}'); "
                        f"supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]
