"""The paged-attention kernels a model needs: split-KV decode (with its in-launch combine), the decode that
rotates q/k and writes the new k/v itself (RotaryPagedAttention on decode-only steps), the CUDA template's
separate reduce where the tune entry picks that template, and prefill/extend; each specialized on the head
layout, the KV page and the cache's format."""
import dataclasses

from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec, pow2
from engc.kernels import kv_quant


def specs(b: Build) -> list:
    if b.cfg.kv_lora_rank:   # latent attention caches latents: kernels/mla_attention attends over them
        return []
    return paged_attention_specs(b.cfg, b.t, b.arch, b.block_size, b.ov("paged_attention"), b.kv)


def decode_bucket(arch: str, bucket: str, kv) -> str:
    """The decode's tune bucket: the head size's, or its line for this KV-cache format where the table has one
    (an fp8 cache's loop has tiles of its own: widening the codes costs registers, and they bound occupancy)."""
    name = {v: k for k, v in kv_quant.KV_CACHE_DTYPES.items()}.get(kv)
    own = f"{bucket},kv-{name}"
    return own if name and f"{arch}/paged_attention/decode/{own}" in tune.TUNE else bucket


def paged_attention_specs(cfg, t: str, arch: str, block_size: int, overrides=None, kv=None) -> list:
    group = cfg.num_heads // cfg.num_kv_heads
    precision = "ieee" if t == "fp32" else "tf32"
    kv_types, kv_consts = kv_quant.kernel_args(t, kv)
    common = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "D_PAD": pow2(cfg.head_dim), "GROUP": group, "PAGE": block_size, "DOT_PRECISION": precision,
              "SOFTCAP": float(cfg.attn_logit_softcap), **kv_consts}   # Gemma 2's score cap (0.0: none)
    bucket = tune.head_dim_bucket(cfg.head_dim)
    cache = {"q_ptr": f"*{t}", **kv_types, "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "out_ptr": f"*{t}"}
    decode_types = dict(cache, part_acc_ptr="*fp32", part_ml_ptr="*fp32", counters_ptr="*i32", scale="fp32",
                        sliding_window="i32", block_table_stride="i32", num_splits="i32")
    # The in-kernel reduce reads [RED_SPLITS, group, D] partials at a time: ~4k fp32, 32 a thread of 4 warps.
    reduce_consts = dict(GR_PAD=pow2(group), RED_SPLITS=max(1, 4096 // (pow2(group) * pow2(cfg.head_dim))))
    decode = make_spec("paged_attention", "decode", arch, "paged_decode_kernel", decode_types,
                       dict(common, G_PAD=max(16, pow2(group)), **reduce_consts), decode_bucket(arch, bucket, kv),
                       launch_keys=("BLOCK_N", "target_programs", "max_splits", "min_split_tokens",
                                    "min_split_tokens_busy", "impl", "in_kernel_reduce", "rotary_max_rows"),
                       overrides=(overrides or {}).get("decode"))
    reduce_types = {"query_start_loc_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                    "out_ptr": f"*{t}", "num_splits": "i32"}
    max_splits = decode.tune["max_splits"]
    # decode_reduce finishes split launches of the CUDA decode template only (Triton's reduces in-kernel)
    reduce = None if decode.launch.get("impl") != "cuda" else make_spec(
        "paged_attention", "decode_reduce", arch, "paged_decode_reduce_kernel", reduce_types,
        {"NUM_HEADS": cfg.num_heads, "HEAD_DIM": cfg.head_dim, "D_PAD": pow2(cfg.head_dim),
         "MAX_SPLITS": pow2(max_splits)}, "any", launch_keys=("MAX_SPLITS",))
    prefill_types = dict(cache, scale="fp32", sliding_window="i32", block_table_stride="i32", skip_decode="i32")
    prefill = make_spec("paged_attention", "prefill", arch, "paged_prefill_kernel", prefill_types, common, bucket,
                        launch_keys=("BLOCK_M", "GROUP"), overrides=(overrides or {}).get("prefill"))
    if prefill.constexprs["BLOCK_M"] < group:
        raise ValueError(f"prefill BLOCK_M {prefill.constexprs['BLOCK_M']} is smaller than the GQA group {group}")
    # RotaryPagedAttention on decode-only steps: the decode kernel that rotates q/k and writes the new
    # k/v itself (same tune entry and constexprs; positions and slots int64, as the runtime stages them)
    rotary_types = {k: v for k, v in decode_types.items() if k != "q_ptr"}
    rotary_types.update(qkv_ptr=f"*{t}", positions_ptr="*i64", inv_freq_ptr="*fp32", slot_mapping_ptr="*i64")
    # It keeps no register cap (maxnreg): it serves batches up to rotary_max_rows, too few programs for occupancy to
    # matter, and its rotary code would spill under the cap. Its loop stays Triton's to pipeline, with the entry's
    # stages (PREFETCH is the plain decode's).
    decode_rotary = dataclasses.replace(decode, variant="decode_rotary", fn_name="paged_decode_rotary_kernel",
                                        arg_types=rotary_types,
                                        constexprs={k: v for k, v in decode.constexprs.items() if k != "PREFETCH"},
                                        tune={k: v for k, v in decode.tune.items() if k != "maxnreg"})
    if decode.constexprs.get("PREFETCH"):   # its loop is pipelined by hand: Triton's pipeliner has nothing to add
        decode = dataclasses.replace(decode, num_stages=1)
    return [decode, decode_rotary, prefill] if reduce is None else [decode, decode_rotary, reduce, prefill]
