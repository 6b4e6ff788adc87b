"""The unit_offset_norm kernels a model needs: those of a (1 + weight) model built in half precision (a float32
build folds the 1 into the weights and runs rms_norm / qk_norm): the norm, the residual-add norm, and the q/k
norm where the model has one."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2


def _warps(block: int) -> dict:
    """rms_norm's table rule: warps grow with the row width (4 to 1024 columns, 8 to 4096, 16 above)."""
    return {"num_warps": 4 if block <= 1024 else 8 if block <= 4096 else 16, "num_stages": 1}


def specs(b: Build) -> list:
    if not b.cfg.norm_unit_offset or b.t == "fp32":
        return []
    return unit_offset_norm_specs(b.cfg, b.t, b.arch, b.ov("unit_offset_norm"))


def unit_offset_norm_specs(cfg, t: str, arch: str, overrides=None) -> list:
    block = pow2(cfg.hidden_size)
    types = {"x_ptr": f"*{t}", "residual_ptr": f"*{t}", "weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "residual_out_ptr": f"*{t}", "eps": "fp32"}
    out = [make_spec("unit_offset_norm", variant, arch, "rms_norm_unit_offset_kernel", types,
                     {"HIDDEN": cfg.hidden_size, "BLOCK": block, "HAS_RESIDUAL": has_res},
                     tune.block_bucket(block), overrides=overrides, defaults=_warps(block))
           for variant, has_res in (("rms_norm", False), ("add_rms_norm", True))]
    if cfg.qk_norm:
        consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
                  "H_PAD": pow2(cfg.num_heads), "KV_PAD": pow2(cfg.num_kv_heads), "D_PAD": pow2(cfg.head_dim)}
        qk_block = consts["H_PAD"] * consts["D_PAD"]
        out.append(make_spec("unit_offset_norm", "qk_norm", arch, "qk_norm_unit_offset_kernel",
                             {"qkv_ptr": f"*{t}", "q_weight_ptr": f"*{t}", "k_weight_ptr": f"*{t}",
                              "out_ptr": f"*{t}", "eps": "fp32", "copy_v": "i32"},
                             consts, tune.block_bucket(qk_block), overrides=overrides,
                             defaults=_warps(qk_block)))
    return out
