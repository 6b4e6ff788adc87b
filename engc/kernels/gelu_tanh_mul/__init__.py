"""GELU(tanh)-and-mul of the fused gate_up projection: [T, 2I] -> [T, I] (Gemma's MLP, gelu_pytorch_tanh).

ONNX: ai.engc::GeluTanhMul(gate_up) -> y. The gate is the first half, as fuse_parallel_gemms lays it out;
y = gelu(gate, approximate="tanh") * up in the input dtype, as HF's Gemma MLP computes it.
No GPU kernel yet: a GPU build of a model that needs it is refused (compiler/gpu_support.py).
"""
import torch


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
