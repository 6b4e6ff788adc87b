"""RMSNorm, optionally fused with the residual add that precedes it in every decoder block.

ONNX: ai.engc::RMSNorm(x, weight) -> y and ai.engc::AddRMSNorm(x, residual, weight) -> (y, x + residual),
attribute eps. One kernel serves both: the residual is just an optional input.
"""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in float32 whatever the storage dtype, as the HF reference does.
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    s = x + residual
    return rms_norm(s, weight, eps), s


def launch(x, weight, eps: float, out, residual=None, residual_out=None, consts=None):
    """Launch rule of the AOT kernel rms_norm_kernel: [(variant, grid, args)], nothing to launch for 0 rows.

    x, out (and residual, residual_out): contiguous [..., hidden]; weight [hidden]. Without residual the
    variant is 'rms_norm', else 'add_rms_norm', which writes x + residual to residual_out (default: the
    residual buffer itself, in place). args, in the kernel's order:
        x, residual, weight, out, residual_out, eps (fp32), global_scratch=0, profile_scratch=0
    (the 'rms_norm' variant ignores the residual slots; they carry x and out). consts is unused.
    """
    rows = x.numel() // x.shape[-1]
    if residual is None:
        variant, residual, residual_out = "rms_norm", x, out
    else:
        variant = "add_rms_norm"
        residual_out = residual if residual_out is None else residual_out
    for t in (x, residual, out, residual_out):
        assert t.is_contiguous() and t.shape[-1] == x.shape[-1]
    if rows == 0:
        return []
    return [(variant, (rows, 1, 1), [x, residual, weight, out, residual_out, float(eps), 0, 0])]
