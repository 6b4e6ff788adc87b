"""The gated activations of the fused gate_up projection: [T, 2I] -> [T, I], the gate its first half, as the
fuse_parallel_gemms pass lays it out.

ONNX: ai.engc::SiluMul(gate_up) -> y = silu(gate) * up (Llama's MLP and most others), and
ai.engc::GeluTanhMul(gate_up) -> y = gelu(gate, approximate="tanh") * up (Gemma's gelu_pytorch_tanh).
One kernel serves both as named variants (ACTIVATIONS): 'default' (SiLU) and 'gelu_tanh'. It computes in
float32 and rounds where torch rounds bf16/fp16 tensors: after the activation and after the product.
"""
import torch


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# variant -> the kernel's ACT constexpr; the variant a model's hidden_act builds
ACTIVATIONS = {"default": 0, "gelu_tanh": 1}
VARIANT_OF_ACT = {"silu": "default", "gelu_pytorch_tanh": "gelu_tanh"}
# the kernel is specialized on the intermediate size: another GLU width of the model (a shared expert's) has
# a variant of its own, named so, which the launch picks where the bundle has it
VARIANT_WIDTH = "{}_i{}"


def launch(gate_up, out, consts, variant: str = "default"):
    """Launch rule of silu_mul_kernel: [(variant, grid, args)].

    gate_up contiguous [T, 2I], out contiguous [T, I]. consts[variant]['BLOCK'] (record 'launch').
    args: gate_up, out, global_scratch=0, profile_scratch=0
    """
    rows, inter = gate_up.numel() // gate_up.shape[-1], gate_up.shape[-1] // 2
    assert gate_up.is_contiguous() and out.is_contiguous()
    if rows == 0:
        return []
    own = VARIANT_WIDTH.format(variant, inter)
    variant = own if own in consts else variant
    block = consts[variant]["BLOCK"]
    return [(variant, (rows, (inter + block - 1) // block, 1), [gate_up, out, 0, 0])]
