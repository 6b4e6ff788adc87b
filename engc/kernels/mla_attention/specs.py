"""The MLA kernels a latent-attention model needs: the cache write (norm, rope, quantize), the decode query
(absorbed latent query, rope, each row's sequence), the absorbed attention over the latent cache (split-KV) and
its reduce, specialized on the heads, the latent and rope widths, the KV page and the cache's format."""
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2
from engc.kernels import kv_quant

# Untuned starting points (no tune-table line yet): BLOCK_H 16 is the smallest tile tl.dot takes, so a
# program serves up to 16 heads from each cache tile it reads; BLOCK_N 32 keeps a bf16 [32, 512] latent tile
# in 32 KB of shared memory. Splits: enough programs to fill an H200's 132 SMs about twice at small batch.
_DEFAULTS = {
    "decode": {"num_warps": 4, "num_stages": 2, "BLOCK_H": 16, "BLOCK_N": 32, "target_programs": 264,
               "max_splits": 16, "min_split_tokens": 256},
    "reduce": {"num_warps": 4, "num_stages": 1},
    "write": {"num_warps": 4, "num_stages": 1},
    # BLOCK_T 16: tl.dot's smallest tile, one program for a decode step's rows up to 16; BLOCK_R 64 cuts a
    # 512-wide latent into 8 programs a head, so a batch-1 step still spreads w_uk's reads over 128 programs
    "query": {"num_warps": 4, "num_stages": 1, "BLOCK_T": 16, "BLOCK_R": 64, "BLOCK_S": 64},
}


def specs(b: Build) -> list:
    cfg = b.cfg
    if not cfg.kv_lora_rank:
        return []
    t, r, rope = b.t, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cache_t = f"*{kv_quant.KV_TRITON_DTYPE[b.kv]}" if b.kv is not None else f"*{t}"
    decode_types = {"q_ptr": f"*{t}", "cache_ptr": cache_t, "kv_scale_ptr": "*fp32" if b.kv is not None else f"*{t}",
                    "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                    "row_seq_ptr": "*i32", "partial_ptr": "*fp32", "lse_ptr": "*fp32", "scale": "fp32",
                    "block_table_stride": "i32", "num_splits": "i32"}
    decode = make_spec("mla_attention", "decode", b.arch, "mla_decode_kernel", decode_types,
                       {"NUM_HEADS": cfg.num_heads, "R": r, "ROPE": rope, "R_PAD": max(16, pow2(r)), "ROPE_PAD": max(16, pow2(rope)),
                        "PAGE": b.block_size, "KV_QUANT": kv_quant.KV_QUANT_CODE[b.kv],
                        "DOT_PRECISION": "ieee" if t == "fp32" else "tf32"}, "any",
                       launch_keys=("BLOCK_H", "BLOCK_N", "target_programs", "max_splits", "min_split_tokens"),
                       overrides=b.ov("mla_attention"), defaults=_DEFAULTS["decode"])
    reduce_types = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{t}", "num_splits": "i32"}
    reduce = make_spec("mla_attention", "reduce", b.arch, "mla_reduce_kernel", reduce_types,
                       {"NUM_HEADS": cfg.num_heads, "R": r, "R_PAD": max(16, pow2(r)),
                        "MAX_SPLITS": pow2(decode.tune["max_splits"])}, "any",
                       overrides=b.ov("mla_attention"), defaults=_DEFAULTS["reduce"])
    write_types = {"ckv_ptr": f"*{t}", "kv_norm_ptr": f"*{t}", "positions_ptr": "*i64", "inv_freq_ptr": "*fp32",
                   "slot_mapping_ptr": "*i64", "cache_ptr": cache_t, "kv_scale_ptr": decode_types["kv_scale_ptr"],
                   "eps": "fp32"}
    write = make_spec("mla_attention", "write", b.arch, "mla_write_kernel", write_types,
                      {"R": r, "ROPE": rope, "R_PAD": pow2(r), "HALF_PAD": pow2(rope // 2),
                       "KV_QUANT": kv_quant.KV_QUANT_CODE[b.kv]}, "any",
                      overrides=b.ov("mla_attention"), defaults=_DEFAULTS["write"])
    query_types = {"q_ptr": f"*{t}", "positions_ptr": "*i64", "inv_freq_ptr": "*fp32", "w_uk_ptr": f"*{t}",
                   "query_start_loc_ptr": "*i32", "q_abs_ptr": f"*{t}", "row_seq_ptr": "*i32", "num_rows": "i32",
                   "num_seqs": "i32"}
    nope = cfg.qk_nope_head_dim
    query = make_spec("mla_attention", "query", b.arch, "mla_query_kernel", query_types,
                      {"NUM_HEADS": cfg.num_heads, "NOPE": nope, "ROPE": rope, "R": r, "NOPE_PAD": max(16, pow2(nope)),
                       "HALF_PAD": pow2(rope // 2), "DOT_PRECISION": decode.constexprs["DOT_PRECISION"]}, "any",
                      launch_keys=("BLOCK_T", "BLOCK_R"), overrides=b.ov("mla_attention"), defaults=_DEFAULTS["query"])
    return [write, query, decode, reduce]
