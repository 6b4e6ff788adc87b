"""Final logit soft-capping (Gemma 2): logits -> cap * tanh(logits / cap), in the logits' dtype.

ONNX: ai.engc::LogitSoftcap(logits) -> logits, attribute cap. It sits between the lm_head and the float32
Cast, so a half-precision bundle rounds as HF's Gemma2ForCausalLM does (divide, tanh, multiply, each in
the model dtype). No GPU kernel: on the GPU the reference runs on the GPU's tensors (runtime/gpu_ops.py).
"""
import torch


def logit_softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap
