"""The CUDA C++ decode-attention kernels a build may add beside the Triton ones (codegen/cuda.py builds them
with nvcc): the split-KV decode template (templates/paged_decode.cu.j2, variant decode_cuda, where the tune
table's decode entry says impl "cuda") and the sm90 cluster decode (templates/paged_decode_cluster.cu.j2,
variant decode_rotary_cluster, where its decode_cluster entry is enabled). Both take the arguments the
Triton twins' launch rules produce."""
from __future__ import annotations

from engc.compiler import tune
from engc.compiler.codegen.cuda import C_TYPE, ELEM_BYTES, MMA_TYPE, SHARED_LIMIT, CudaKernelSpec

# what runs instead where nvcc is missing
WITHOUT_NVCC = "the CUDA decode kernel is skipped, Triton's decode is used"


def decode_spec(cfg, t: str, arch: str, block_size: int, overrides=None) -> tuple:
    """(spec, '') for the paged decode template on this shape, or (None, why it does not apply)."""
    vec = 16 // ELEM_BYTES[t]
    tpt = cfg.head_dim // vec if cfg.head_dim % vec == 0 else 0
    if not tpt or 32 % tpt:
        return None, f"head_dim {cfg.head_dim} does not split into a power-of-two group of 16-byte loads"
    key, entry = tune.lookup(arch, "paged_attention", "decode_cuda", tune.head_dim_bucket(cfg.head_dim), overrides)
    tokens = entry["TOKENS_PER_THREAD"]
    if block_size % tokens:
        return None, f"KV block size {block_size} is not a multiple of {tokens} tokens per thread"
    group = cfg.num_heads // cfg.num_kv_heads
    warps = entry["num_warps"]
    shared = warps * group * (cfg.head_dim + 2) * 4
    if shared > SHARED_LIMIT:
        return None, f"GQA group {group} x head_dim {cfg.head_dim} needs {shared} bytes of shared memory"
    block_n = warps * (32 // tpt) * tokens
    entry_name = f"paged_decode_{t}_h{cfg.num_heads}_kv{cfg.num_kv_heads}_d{cfg.head_dim}_p{block_size}"
    values = {"dtype": t, "ctype": C_TYPE[t], "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
              "head_dim": cfg.head_dim, "page": block_size, "num_warps": warps, "tokens_per_thread": tokens,
              "block_n": block_n, "entry": entry_name}
    types = {"q_ptr": f"*{t}", "k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}", "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "out_ptr": f"*{t}",
             "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "scale": "fp32", "sliding_window": "i32",
             "block_table_stride": "i32", "num_splits": "i32"}
    launch = {"BLOCK_N": block_n}
    launch.update({k: entry[k] for k in ("target_programs", "max_splits", "min_split_tokens",
                                         "min_split_tokens_busy")})
    return CudaKernelSpec(op="paged_attention", variant="decode_cuda", arch=arch, template="paged_decode.cu.j2",
                          entry=entry_name, render=values, arg_types=types, num_warps=warps, tune_key=key,
                          tune=entry, launch=launch), ""


def decode_cluster_spec(cfg, t: str, arch: str, block_size: int) -> tuple:
    """(spec, '') for the cluster decode template (templates/paged_decode_cluster.cu.j2, the
    'decode_rotary_cluster' variant) on this shape, or (None, why it does not apply)."""
    if arch != "sm90":
        return None, f"{arch} has no thread-block clusters"
    if t not in ("bf16", "fp16"):
        return None, f"its mma takes bf16 or fp16, not {t}"
    group = cfg.num_heads // cfg.num_kv_heads
    key, entry = tune.lookup(arch, "paged_attention", "decode_cluster", tune.head_dim_bucket(cfg.head_dim))
    warps, stages, cluster = entry["num_warps"], entry["stages"], entry["cluster"]
    if group > 8:
        return None, f"GQA group {group} is more than the 8 rows it gives the query heads"
    if cfg.head_dim % 16 or (warps * 32) % cfg.head_dim:
        return None, f"head_dim {cfg.head_dim} is not a multiple of 16 dividing {warps * 32} threads"
    if block_size % 16:
        return None, f"KV block size {block_size} is not a multiple of its 16-token tiles"
    row = cfg.head_dim + 8
    shared = (warps * stages * 2 * 16 * row * 2 + 16 * row * 2 + 2 * cfg.head_dim * 2
              + (warps + cluster) * group * (cfg.head_dim + 2) * 4)
    entry_name = f"paged_decode_cluster_{t}_h{cfg.num_heads}_kv{cfg.num_kv_heads}_d{cfg.head_dim}_p{block_size}"
    values = {"dtype": t, "ctype": C_TYPE[t], "mma_type": MMA_TYPE[t],
              "from_float": "__float2bfloat16_rn" if t == "bf16" else "__float2half_rn",
              "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "page": block_size, "cluster": cluster, "num_warps": warps, "stages": stages,
              "shared_bytes": shared, "entry": entry_name}
    types = {"qkv_ptr": f"*{t}", "positions_ptr": "*i64", "inv_freq_ptr": "*fp32", "slot_mapping_ptr": "*i64",
             "k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}", "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "out_ptr": f"*{t}", "scale": "fp32",
             "sliding_window": "i32", "block_table_stride": "i32"}
    launch = {"cluster": cluster, "max_seqs": entry["max_seqs"], "max_context": entry["max_context"],
              "PDL": int(entry.get("PDL", tune.PDL[arch]))}
    return CudaKernelSpec(op="paged_attention", variant="decode_rotary_cluster", arch=arch,
                          template="paged_decode_cluster.cu.j2", entry=entry_name, render=values, arg_types=types,
                          num_warps=warps, tune_key=key, tune=entry, launch=launch, shared_mem=shared), ""



def cuda_specs(triton_specs: list, cfg, overrides=None) -> tuple[list[CudaKernelSpec], list[str]]:
    """The CUDA decode-attention kernels the tune table selects: the cluster decode beside Triton's
    decode_rotary (its 'decode_cluster' entry enabled) and the split-KV twin in place of Triton's decode (a
    'decode' entry with impl "cuda"); and a note for each selected one that this shape cannot have."""
    specs, notes = [], []
    for s in triton_specs:
        if (s.op, s.variant) == ("paged_attention", "decode_rotary"):
            entry = tune.TUNE.get(f"{s.arch}/paged_attention/decode_cluster/{tune.head_dim_bucket(cfg.head_dim)}", {})
            wanted, q_arg, make, name = entry.get("enabled"), "qkv_ptr", decode_cluster_spec, "cluster decode kernel"
        elif (s.op, s.variant) == ("paged_attention", "decode"):
            wanted, q_arg, make, name = s.launch.get("impl") == "cuda", "q_ptr", decode_spec, "CUDA decode kernel"
        else:
            continue
        if not wanted:
            continue
        if s.constexprs.get("SOFTCAP"):   # the CUDA templates do not cap scores (Gemma 2)
            notes.append(f"{s.arch}: the {name} does not soft-cap attention scores; Triton's decode is used")
            continue
        t = s.arg_types[q_arg][1:]
        if s.arg_types["k_cache_ptr"] != s.arg_types[q_arg]:
            notes.append(f"{s.arch}: the {name} reads only a {t} KV cache; Triton's decode is used")
            continue
        spec, why = make(cfg, t, s.arch, s.constexprs["PAGE"])
        if spec is None:
            notes.append(f"{s.arch}: no {name} ({why}); Triton's decode is used")
        else:
            specs.append(spec)
    return specs, notes
