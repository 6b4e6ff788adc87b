"""LayerNorm without a bias (Cohere's): each row minus its mean, over the root of its variance plus eps,
times the weight; computed in float32 and rounded once to the input's dtype, as HF's CohereLayerNorm does.

ONNX: ai.engc::LayerNorm(x, weight) -> y and ai.engc::AddLayerNorm(x, residual, weight) -> (y, x + residual),
attribute eps: the norms of a family whose norms subtract the mean (ModelConfig.layer_norm), in the places
RMSNorm and AddRMSNorm take for the others. No GPU kernel: on the GPU the reference runs on the GPU's tensors
(runtime/gpu_ops.py), two small torch launches a norm.
"""
import torch


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(layer_norm(x + residual), x + residual), the sum in the model dtype as HF's residual adds are."""
    total = x + residual
    return layer_norm(total, weight, eps), total
