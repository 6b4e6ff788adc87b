"""The rotary kernels a model needs: one per index dtype of positions and slots (int64 as the runtime stages
them, int32 for callers that keep them so), specialized on the head layout and the KV cache's format."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2
from engc.kernels import kv_quant


def specs(b: Build) -> list:
    cfg = b.cfg
    if cfg.kv_lora_rank:   # latent attention rotates its rope dims in MLAAttention (kernels/mla_attention)
        return []
    consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "H_PAD": pow2(cfg.num_heads), "KV_PAD": pow2(cfg.num_kv_heads),
              "HALF_PAD": pow2(cfg.head_dim // 2), "D_PAD": pow2(cfg.head_dim)}
    block = consts["H_PAD"] * consts["D_PAD"]
    kv_types, kv_consts = kv_quant.kernel_args(b.t, b.kv)
    consts.update(kv_consts)
    out = []
    for idx in ("i64", "i32"):
        types = {"qkv_ptr": f"*{b.t}", "positions_ptr": f"*{idx}", "inv_freq_ptr": "*fp32", **kv_types,
                 "slot_mapping_ptr": f"*{idx}", "q_out_ptr": f"*{b.t}"}
        out.append(make_spec("rotary", f"pos_{idx}", b.arch, "rotary_kv_kernel", types, consts,
                             tune.block_bucket(block), overrides=b.ov("rotary")))
    return out
