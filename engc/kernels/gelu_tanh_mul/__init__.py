"""GELU(tanh)-and-mul of the fused gate_up projection: [T, 2I] -> [T, I] (Gemma's MLP, gelu_pytorch_tanh).

ONNX: ai.engc::GeluTanhMul(gate_up) -> y. The gate is the first half, as fuse_parallel_gemms lays it out;
y = gelu(gate, approximate="tanh") * up in the input dtype, as HF's Gemma MLP computes it.
The Triton kernel (triton.py) computes in float32 and rounds where torch rounds bf16/fp16 tensors: after
the GELU and after the product.
"""
import torch


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def launch(gate_up, out, consts):
    """Launch rule of gelu_tanh_mul_kernel: [(variant, grid, args)], as silu_mul's.

    gate_up contiguous [T, 2I], out contiguous [T, I]. consts['default']['BLOCK'] (record 'launch').
    args: gate_up, out, global_scratch=0, profile_scratch=0
    """
    rows, inter = gate_up.numel() // gate_up.shape[-1], gate_up.shape[-1] // 2
    assert gate_up.is_contiguous() and out.is_contiguous()
    if rows == 0:
        return []
    block = consts["default"]["BLOCK"]
    return [("default", (rows, (inter + block - 1) // block, 1), [gate_up, out, 0, 0])]
