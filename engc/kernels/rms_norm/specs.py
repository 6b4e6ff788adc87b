"""The rms_norm kernels a model needs: the norm and the residual-add norm; for int4 programs also the
residual-add norm that sums a split-K GEMV's fp32 partials (PARTIALS_VARIANT, for QLinearAddRMSNorm); for
fp8 programs also both norms writing float8 codes and a scale a row (FP8_VARIANTS, for RMSNormFP8 /
AddRMSNormFP8)."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2
from engc.kernels.fp8_quant import FP8_MAX, MIN_AMAX
from engc.kernels.rms_norm import FP8_VARIANTS, MAX_SPLITS, PARTIALS_VARIANT


def specs(b: Build) -> list:
    return rms_norm_specs(b.cfg, b.t, b.arch, b.ov("rms_norm"), partials=bool(b.int4_group_sizes),
                          fp8=b.quant == "fp8")


def rms_norm_specs(cfg, t: str, arch: str, overrides=None, partials: bool = False, fp8: bool = False) -> list:
    block = pow2(cfg.hidden_size)
    types = {"x_ptr": f"*{t}", "residual_ptr": f"*{t}", "weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "residual_out_ptr": f"*{t}", "scale_ptr": f"*{t}", "eps": "fp32", "splits": "i32"}
    variants = [("rms_norm", False, False, False), ("add_rms_norm", True, False, False)]
    variants += [(PARTIALS_VARIANT, True, True, False)] if partials else []
    variants += [(FP8_VARIANTS[v], res, False, True) for v, res, _, _ in variants[:2]] if fp8 else []
    return [make_spec("rms_norm", variant, arch, "rms_norm_kernel",
                      dict(types, **({"x_ptr": "*fp32"} if part else {}),
                           **({"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"} if q else {})),
                      {"HIDDEN": cfg.hidden_size, "BLOCK": block, "HAS_RESIDUAL": has_res, "PARTIALS": part,
                       "MAX_SPLITS": MAX_SPLITS if part else 1, "FP8_OUT": q, "FP8_MAX": FP8_MAX,
                       "MIN_AMAX": MIN_AMAX},
                      tune.block_bucket(block), overrides=overrides)
            for variant, has_res, part, q in variants]
