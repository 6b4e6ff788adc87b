"""The qk_norm kernel of a model with q/k norm: per head (Qwen3, Gemma 3), specialized on the head counts and
size and on Gemma's (1 + weight) ('unit_offset') where the program's QKNorm is QKNormUnitOffset (half precision:
a float32 bundle folds the 1 into the weights); or over the whole q and k projections ('projection', OLMoE's
QKNormProjection), specialized on their widths."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2


def specs(b: Build) -> list:
    if b.cfg.qk_norm_projection:
        return qk_norm_specs(b.cfg, b.t, b.arch, b.ov("qk_norm"), projection=True)
    if not b.cfg.qk_norm or b.cfg.layer_norm:   # Cohere's per-head q/k LayerNorm is layer_norm's (no kernel)
        return []
    return qk_norm_specs(b.cfg, b.t, b.arch, b.ov("qk_norm"), unit_offset=b.cfg.norm_unit_offset and b.t != "fp32")


def qk_norm_specs(cfg, t: str, arch: str, overrides=None, unit_offset: bool = False, projection: bool = False) -> list:
    types = {"qkv_ptr": f"*{t}", "q_weight_ptr": f"*{t}", "k_weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "eps": "fp32", "copy_v": "i32"}
    consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "H_PAD": pow2(cfg.num_heads), "KV_PAD": pow2(cfg.num_kv_heads), "D_PAD": pow2(cfg.head_dim),
              "UNIT_OFFSET": unit_offset, "PROJECTION": projection,
              "Q_PAD": pow2(cfg.q_size), "K_PAD": pow2(cfg.kv_size)}
    block = consts["Q_PAD"] if projection else consts["H_PAD"] * consts["D_PAD"]
    variant = "projection" if projection else "unit_offset" if unit_offset else "default"
    return [make_spec("qk_norm", variant, arch, "qk_norm_kernel", types, consts, tune.block_bucket(block),
                      overrides=overrides)]
