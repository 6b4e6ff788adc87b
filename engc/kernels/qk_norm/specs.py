"""The qk_norm kernel of a model with q/k norm (Qwen3): one, specialized on the head counts and size."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2


def specs(b: Build) -> list:
    cfg = b.cfg
    if not cfg.qk_norm:
        return []
    types = {"qkv_ptr": f"*{b.t}", "q_weight_ptr": f"*{b.t}", "k_weight_ptr": f"*{b.t}", "out_ptr": f"*{b.t}",
             "eps": "fp32", "copy_v": "i32"}
    consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "H_PAD": pow2(cfg.num_heads), "KV_PAD": pow2(cfg.num_kv_heads), "D_PAD": pow2(cfg.head_dim)}
    block = consts["H_PAD"] * consts["D_PAD"]
    return [make_spec("qk_norm", "default", b.arch, "qk_norm_kernel", types, consts, tune.block_bucket(block),
                      overrides=b.ov("qk_norm"))]
