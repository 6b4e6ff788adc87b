"""The fp8_quant kernels of an fp8 program: per-token FP8 activation quantization, one per projection input
width (kernels/fp8_quant projection_input_widths), and the one of silu(gate) * up from a fused gate_up
(silu_k<inter>, SiluMulFP8)."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2
from engc.errors import UserError
from engc.kernels.fp8_quant import FP8_ARCHS, FP8_MAX, MIN_AMAX, projection_input_widths


def specs(b: Build) -> list:
    return fp8_quant_specs(b.cfg, b.t, b.arch, b.ov("fp8_quant")) if b.quant == "fp8" else []


def fp8_quant_specs(cfg, t: str, arch: str, overrides=None) -> list:
    if arch not in FP8_ARCHS:
        raise UserError(f"--quant fp8 needs FP8 tensor cores (sm89 or newer); {arch} has none")
    types = {"x_ptr": f"*{t}", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    # the MoE experts' inputs too (kernels/moe): the hidden size is a projection's, the experts' width is theirs
    moe = {cfg.moe_intermediate_size} if cfg.num_experts else set()
    widths = [(f"k{k}", k, False) for k in sorted(set(projection_input_widths(cfg)) | moe)]
    return [make_spec("fp8_quant", variant, arch, "fp8_quant_kernel", types,
                      {"K": k, "BLOCK": pow2(k), "FP8_MAX": FP8_MAX, "MIN_AMAX": MIN_AMAX, "SILU": silu},
                      tune.block_bucket(pow2(k)), overrides=overrides)
            for variant, k, silu in widths + [(f"silu_k{cfg.intermediate_size}", cfg.intermediate_size, True)]]
