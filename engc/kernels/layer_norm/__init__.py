"""LayerNorm without a bias (Cohere's): each row minus its mean, over the root of its variance plus eps,
times the weight; computed in float32 and rounded once to the input's dtype, as HF's CohereLayerNorm does.

ONNX: ai.engc::LayerNorm(x, weight) -> y and ai.engc::AddLayerNorm(x, residual, weight) -> (y, x + residual),
attribute eps: the norms of a family whose norms subtract the mean (ModelConfig.layer_norm), in the places
RMSNorm and AddRMSNorm take for the others. ai.engc::QKLayerNorm(qkv, q_weight, k_weight) -> qkv, attributes
num_heads, num_kv_heads, head_dim, eps: QKNorm's place (kernels/qk_norm) for such a family (Command R+'s
use_qk_norm): each head of q and k normed over its head_dim, with a weight of its own per head ([heads,
head_dim]), v passed through. No GPU kernel: on the GPU the reference runs on the GPU's tensors
(runtime/gpu_ops.py), a few small torch launches a norm.
"""
import torch

from engc.kernels.qk_norm import qk_norm


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(layer_norm(x + residual), x + residual), the sum in the model dtype as HF's residual adds are."""
    total = x + residual
    return layer_norm(total, weight, eps), total


def qk_layer_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int, eps: float) -> torch.Tensor:
    """q and k of a fused qkv row normed head by head (layer_norm over head_dim; the [heads, head_dim] weights
    broadcast over the rows)."""
    return qk_norm(qkv, q_weight, k_weight, num_heads, num_kv_heads, head_dim, eps, norm=layer_norm)
