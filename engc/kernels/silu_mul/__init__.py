"""SiLU-and-mul of the fused gate_up projection: [T, 2I] -> [T, I].

ONNX: ai.engc::SiluMul(gate_up) -> y. The gate is the first half, as the fuse_gate_up pass lays it out.
"""
import torch


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def launch(gate_up, out, consts):
    """Launch rule of silu_mul_kernel: [(variant, grid, args)].

    gate_up contiguous [T, 2I], out contiguous [T, I]. consts['default']['BLOCK'] (record 'launch').
    args: gate_up, out, global_scratch=0, profile_scratch=0
    """
    rows, inter = gate_up.numel() // gate_up.shape[-1], gate_up.shape[-1] // 2
    assert gate_up.is_contiguous() and out.is_contiguous()
    if rows == 0:
        return []
    block = consts["default"]["BLOCK"]
    return [("default", (rows, (inter + block - 1) // block, 1), [gate_up, out, 0, 0])]
