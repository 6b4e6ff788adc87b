"""RMSNorm, optionally fused with the residual add that precedes it in every decoder block.

ONNX: ai.engc::RMSNorm(x, weight) -> y and ai.engc::AddRMSNorm(x, residual, weight) -> (y, x + residual),
attribute eps. One kernel serves both: the residual is just an optional input.

A norm over a row that tensor-parallel ranks each hold a part of (OLMoE's q/k norm over the whole projection,
compiler/passes/shard_tp.py) is two nodes around an AllReduce: ai.engc::SquareMean(x) -> each row's sum of
squares over `parts` times its width (float32 [..., 1]; summed over the ranks, the whole row's mean square,
as every rank's part is equally wide), and ai.engc::RMSNormByMean(x, mean_square, weight) -> y, attribute
eps. They are small (one [rows, 1] all-reduce a norm) and run as torch ops on every device.
"""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in float32 whatever the storage dtype, as the HF reference does.
    return rms_norm_by_mean(x, x.float().pow(2).mean(-1, keepdim=True), weight, eps)


def square_mean(x: torch.Tensor, parts: int) -> torch.Tensor:
    xf = x.float()
    return xf.pow(2).sum(-1, keepdim=True) / (x.shape[-1] * parts)


def rms_norm_by_mean(x: torch.Tensor, mean_square: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm with the row's mean square given: the same float32 steps and the same rounding."""
    return weight * (x.float() * torch.rsqrt(mean_square + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    s = x + residual
    return rms_norm(s, weight, eps), s


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm in half precision (ai.engc::RMSNormUnitOffset): y * (1 + weight) in float32, rounded
    once, as HF computes it. A float32 bundle needs none: there 1 + weight is folded into the weight at build
    time, exactly."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_unit_offset(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    s = x + residual
    return rms_norm_unit_offset(s, weight, eps), s


# The AddRMSNorm that sums a split-K GEMV's fp32 partials itself (launch's partials), built for int4 bundles
# (ai.engc::QLinearAddRMSNorm, passes/fuse_qlinear_add_norm)
PARTIALS_VARIANT = "add_rms_norm_partials"
MAX_SPLITS = 16   # the most partials it sums (the int4 GEMV's tune entries split K at most 16 ways)
# The norms that write their output as float8 codes plus a scale a row, for the FP8 GEMM after them (fp8
# bundles: ai.engc::RMSNormFP8 / AddRMSNormFP8, passes/fuse_fp8_input_quant)
FP8_VARIANTS = {"rms_norm": "rms_norm_fp8", "add_rms_norm": "add_rms_norm_fp8"}
# Gemma's (1 + weight) norms in half-precision bundles (ai.engc::RMSNormUnitOffset / AddRMSNormUnitOffset)
UNIT_OFFSET_VARIANTS = {"rms_norm": "rms_norm_unit_offset", "add_rms_norm": "add_rms_norm_unit_offset"}
# The plain norm specialized on q_lora_rank rather than the hidden size: DeepSeek's q_a_layernorm
# (ai.engc::LatentRMSNorm, kernels/mla_attention)
LATENT_VARIANT = "rms_norm_latent"


def launch(x, weight, eps: float, out, residual=None, residual_out=None, consts=None, partials: bool = False,
           scale=None, unit_offset: bool = False, latent: bool = False):
    """Launch rule of the AOT kernel rms_norm_kernel: [(variant, grid, args)], nothing to launch for 0 rows.

    x, out (and residual, residual_out): contiguous [..., hidden]; weight [hidden]. Without residual the
    variant is 'rms_norm', else 'add_rms_norm', which writes x + residual to residual_out (default: the
    residual buffer itself, in place). With partials, x is a split-K GEMV's unreduced output, fp32 [splits,
    rows, hidden], and a residual comes too: variant 'add_rms_norm_partials', which sums the splits in
    order first and rounds to out's dtype. With scale (float32 [rows]), out is float8_e4m3fn and takes the
    output quantized a row (FP8_VARIANTS; not with partials). unit_offset: Gemma's (1 + weight) norm
    (UNIT_OFFSET_VARIANTS). latent: the plain norm of q_lora_rank-wide rows (LATENT_VARIANT). args, in the
    kernel's order:
        x, residual, weight, out, residual_out, eps (fp32), splits, scale, global_scratch=0, profile_scratch=0
    (the 'rms_norm' variant ignores the residual slots; they carry x and out; splits is read by the
    partials variant alone; scale by the fp8 variants alone: the others take the weight there, their
    scale_ptr typed as it is). consts is unused.
    """
    assert not partials or (x.dtype == torch.float32 and x.dim() == 3 and x.shape[0] <= MAX_SPLITS)
    splits = x.shape[0] if partials else 1
    rows = x.numel() // x.shape[-1] // splits
    if residual is None:
        assert not partials, "partials come with a residual (AddRMSNorm)"
        variant, residual, residual_out = "rms_norm", x, out
    else:
        variant = PARTIALS_VARIANT if partials else "add_rms_norm"
        residual_out = residual if residual_out is None else residual_out
    for t in (x, residual, out, residual_out):
        assert t.is_contiguous() and t.shape[-1] == x.shape[-1]
    assert out.numel() == rows * x.shape[-1]
    if scale is not None:
        assert not partials and scale.shape == (rows,) and scale.dtype == torch.float32
        variant = FP8_VARIANTS[variant]
    if unit_offset:
        assert not partials and scale is None
        variant = UNIT_OFFSET_VARIANTS[variant]
    if latent:
        assert variant == "rms_norm", "the latent variant is the plain norm"
        variant = LATENT_VARIANT
    if rows == 0:
        return []
    return [(variant, (rows, 1, 1), [x, residual, weight, out, residual_out, float(eps), splits,
                                     weight if scale is None else scale, 0, 0])]
