"""SiLU-and-mul of the fused gate_up projection: [T, 2I] -> [T, I].

ONNX: ai.engc::SiluMul(gate_up) -> y. The gate is the first half, as the fuse_gate_up pass lays it out.
"""
import torch


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
