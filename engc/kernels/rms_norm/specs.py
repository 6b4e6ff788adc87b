"""The rms_norm kernels a model needs: the norm and the residual-add norm; for int4 programs also the
residual-add norm that sums a split-K GEMV's fp32 partials (PARTIALS_VARIANT, for QLinearAddRMSNorm); for
fp8 programs also both norms writing float8 codes and a scale a row (FP8_VARIANTS, for RMSNormFP8 /
AddRMSNormFP8); for Gemma's (1 + weight) norm in half precision both norms so (UNIT_OFFSET_VARIANTS); for
latent attention with q_lora_rank the plain norm of that width (LATENT_VARIANT, for LatentRMSNorm)."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2
from engc.kernels.fp8_quant import FP8_MAX, MIN_AMAX
from engc.kernels.rms_norm import FP8_VARIANTS, LATENT_VARIANT, MAX_SPLITS, PARTIALS_VARIANT, UNIT_OFFSET_VARIANTS


def specs(b: Build) -> list:
    return rms_norm_specs(b.cfg, b.t, b.arch, b.ov("rms_norm"), partials=bool(b.int4_group_sizes),
                          fp8=b.quant == "fp8", unit_offset=b.cfg.norm_unit_offset and b.t != "fp32")


def rms_norm_specs(cfg, t: str, arch: str, overrides=None, partials: bool = False, fp8: bool = False,
                   unit_offset: bool = False) -> list:
    types = {"x_ptr": f"*{t}", "residual_ptr": f"*{t}", "weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "residual_out_ptr": f"*{t}", "scale_ptr": f"*{t}", "eps": "fp32", "splits": "i32"}
    plain = (("rms_norm", False), ("add_rms_norm", True))   # (variant, has a residual)
    h = cfg.hidden_size
    # (variant, has a residual, sums partials, writes fp8, (1 + weight), row width)
    variants = [(v, res, False, False, False, h) for v, res in plain]
    variants += [(PARTIALS_VARIANT, True, True, False, False, h)] if partials else []
    variants += [(FP8_VARIANTS[v], res, False, True, False, h) for v, res in plain] if fp8 else []
    variants += [(UNIT_OFFSET_VARIANTS[v], res, False, False, True, h) for v, res in plain] if unit_offset else []
    # DeepSeek's q_a_layernorm: without a kernel of its width the GPU would run the torch reference, ~6 launches
    variants += [(LATENT_VARIANT, False, False, False, False, cfg.q_lora_rank)] if cfg.q_lora_rank else []
    return [make_spec("rms_norm", variant, arch, "rms_norm_kernel",
                      dict(types, **({"x_ptr": "*fp32"} if part else {}),
                           **({"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"} if q else {})),
                      {"HIDDEN": width, "BLOCK": pow2(width), "HAS_RESIDUAL": has_res, "PARTIALS": part,
                       "MAX_SPLITS": MAX_SPLITS if part else 1, "FP8_OUT": q, "FP8_MAX": FP8_MAX,
                       "MIN_AMAX": MIN_AMAX, "UNIT_OFFSET": unit},
                      tune.block_bucket(pow2(width)), overrides=overrides)
            for variant, has_res, part, q, unit, width in variants]
