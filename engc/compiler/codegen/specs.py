"""What to compile for a model: model_specs assembles one KernelSpec (kernel_spec.py) per (op, variant) and
arch, specialized on its shapes: the builders of the norm, rotary, attention, sampling, argmax, quant and
int4 kernels are here, those of the decode batches' split-K GEMMs (gemv, skinny_gemm, fp8_linear) in
decode_gemm_specs.py.
"""
from __future__ import annotations

import dataclasses

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler import tune
from engc.compiler.codegen.decode_gemm_specs import dense_projections, fp8_linear_specs, gemv_specs, skinny_gemm_specs
from engc.compiler.codegen.kernel_spec import TRITON_DTYPE, make_spec, pow2
from engc.errors import UserError
from engc.kernels import kv_quant, rms_norm
from engc.kernels.fp8_quant import FP8_ARCHS, FP8_MAX, MIN_AMAX

KV_TRITON_DTYPE = {torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}


def rms_norm_specs(cfg: ModelConfig, t: str, arch: str, overrides=None, partials: bool = False, fp8: bool = False):
    """The norm and the residual-add norm; with partials also the residual-add norm that sums an int4
    split-K GEMV's fp32 partials (rms_norm.PARTIALS_VARIANT, for QLinearAddRMSNorm); with fp8 also both norms
    writing float8 codes and a scale a row (rms_norm.FP8_VARIANTS, for RMSNormFP8 / AddRMSNormFP8)."""
    block = pow2(cfg.hidden_size)
    types = {"x_ptr": f"*{t}", "residual_ptr": f"*{t}", "weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "residual_out_ptr": f"*{t}", "scale_ptr": f"*{t}", "eps": "fp32", "splits": "i32"}
    variants = [("rms_norm", False, False, False), ("add_rms_norm", True, False, False)]
    variants += [(rms_norm.PARTIALS_VARIANT, True, True, False)] if partials else []
    variants += [(rms_norm.FP8_VARIANTS[v], res, False, True) for v, res, _, _ in variants[:2]] if fp8 else []
    return [make_spec("rms_norm", variant, arch, "rms_norm_kernel",
                      dict(types, **({"x_ptr": "*fp32"} if part else {}),
                           **({"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"} if q else {})),
                      {"HIDDEN": cfg.hidden_size, "BLOCK": block, "HAS_RESIDUAL": has_res, "PARTIALS": part,
                       "MAX_SPLITS": rms_norm.MAX_SPLITS if part else 1, "FP8_OUT": q, "FP8_MAX": FP8_MAX,
                       "MIN_AMAX": MIN_AMAX},
                      tune.block_bucket(block), overrides=overrides)
            for variant, has_res, part, q in variants]


def silu_mul_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    types = {"gate_up_ptr": f"*{t}", "out_ptr": f"*{t}"}
    return [make_spec("silu_mul", "default", arch, "silu_mul_kernel", types, {"INTER": cfg.intermediate_size},
                      "any", launch_keys=("BLOCK",), overrides=overrides)]


def qk_norm_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    types = {"qkv_ptr": f"*{t}", "q_weight_ptr": f"*{t}", "k_weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "eps": "fp32", "copy_v": "i32"}
    consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "H_PAD": pow2(cfg.num_heads), "KV_PAD": pow2(cfg.num_kv_heads), "D_PAD": pow2(cfg.head_dim)}
    block = consts["H_PAD"] * consts["D_PAD"]
    return [make_spec("qk_norm", "default", arch, "qk_norm_kernel", types, consts, tune.block_bucket(block),
                      overrides=overrides)]


def _kv_cache_args(t: str, kv: torch.dtype | None) -> tuple[dict, dict]:
    """(arg types, constexprs) of the KV-cache params: codes + scale pointers for a quantized cache; the
    model dtype and scale pointers fixed to None (no params) otherwise. kv: kv_quant's code dtype or None."""
    if kv is None:
        return ({"k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}"},
                {"k_scale_ptr": None, "v_scale_ptr": None, "KV_QUANT": 0})
    c = KV_TRITON_DTYPE[kv]   # (dict order is free: signature() follows the kernel's parameter order)
    return ({"k_cache_ptr": f"*{c}", "v_cache_ptr": f"*{c}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"},
            {"KV_QUANT": kv_quant.KV_QUANT_CODE[kv]})


def rotary_specs(cfg: ModelConfig, t: str, arch: str, overrides=None, kv: torch.dtype | None = None):
    consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "H_PAD": pow2(cfg.num_heads), "KV_PAD": pow2(cfg.num_kv_heads),
              "HALF_PAD": pow2(cfg.head_dim // 2), "D_PAD": pow2(cfg.head_dim)}
    block = consts["H_PAD"] * consts["D_PAD"]
    kv_types, kv_consts = _kv_cache_args(t, kv)
    consts.update(kv_consts)
    specs = []
    for idx in ("i64", "i32"):
        types = {"qkv_ptr": f"*{t}", "positions_ptr": f"*{idx}", "inv_freq_ptr": "*fp32", **kv_types,
                 "slot_mapping_ptr": f"*{idx}", "q_out_ptr": f"*{t}"}
        specs.append(make_spec("rotary", f"pos_{idx}", arch, "rotary_kv_kernel", types, consts,
                               tune.block_bucket(block), overrides=overrides))
    return specs


def paged_attention_specs(cfg: ModelConfig, t: str, arch: str, block_size: int, overrides=None,
                          kv: torch.dtype | None = None):
    group = cfg.num_heads // cfg.num_kv_heads
    precision = "ieee" if t == "fp32" else "tf32"
    kv_types, kv_consts = _kv_cache_args(t, kv)
    common = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "D_PAD": pow2(cfg.head_dim), "GROUP": group, "PAGE": block_size, "DOT_PRECISION": precision,
              **kv_consts}
    bucket = tune.head_dim_bucket(cfg.head_dim)
    cache = {"q_ptr": f"*{t}", **kv_types, "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "out_ptr": f"*{t}"}
    decode_types = dict(cache, part_acc_ptr="*fp32", part_ml_ptr="*fp32", counters_ptr="*i32", scale="fp32",
                        sliding_window="i32", block_table_stride="i32", num_splits="i32")
    # The in-kernel reduce reads [RED_SPLITS, group, D] partials at a time: ~4k fp32, 32 a thread of 4 warps.
    reduce_consts = dict(GR_PAD=pow2(group), RED_SPLITS=max(1, 4096 // (pow2(group) * pow2(cfg.head_dim))))
    decode = make_spec("paged_attention", "decode", arch, "paged_decode_kernel", decode_types,
                       dict(common, G_PAD=max(16, pow2(group)), **reduce_consts), bucket,
                       launch_keys=("BLOCK_N", "target_programs", "max_splits", "min_split_tokens",
                                    "min_split_tokens_busy", "impl", "in_kernel_reduce", "rotary_max_rows"),
                       overrides=(overrides or {}).get("decode"))
    reduce_types = {"query_start_loc_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                    "out_ptr": f"*{t}", "num_splits": "i32"}
    max_splits = decode.tune["max_splits"]
    # decode_reduce finishes split launches of the CUDA decode template only (Triton's reduces in-kernel)
    reduce = None if decode.launch.get("impl") != "cuda" else make_spec("paged_attention", "decode_reduce", arch, "paged_decode_reduce_kernel", reduce_types,
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
    decode_rotary = dataclasses.replace(decode, variant="decode_rotary", fn_name="paged_decode_rotary_kernel",
                                        arg_types=rotary_types)
    return [decode, decode_rotary, prefill] if reduce is None else [decode, decode_rotary, reduce, prefill]


def sampling_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    specs = []
    for lt in sorted({t, "fp32"}):
        types = {"logits_ptr": f"*{lt}", "temperature_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
                 "uniform_ptr": "*fp32", "out_ptr": "*i64"}
        specs.append(make_spec("sampling", f"logits_{lt}", arch, "sample_kernel", types, {"VOCAB": cfg.vocab_size},
                               "any", overrides=overrides))
    return specs


def fp8_quant_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    """Per-token FP8 activation quantization, one variant per projection input width (hidden, q, inter), and
    the one of silu(gate) * up from a fused gate_up (silu_k<inter>, for SiluMulFP8)."""
    if arch not in FP8_ARCHS:
        raise UserError(f"--quant fp8 needs FP8 tensor cores (sm89 or newer); {arch} has none")
    types = {"x_ptr": f"*{t}", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    widths = [(f"k{k}", k, False) for k in sorted({cfg.hidden_size, cfg.q_size, cfg.intermediate_size})]
    return [make_spec("fp8_quant", variant, arch, "fp8_quant_kernel", types,
                      {"K": k, "BLOCK": pow2(k), "FP8_MAX": FP8_MAX, "MIN_AMAX": MIN_AMAX, "SILU": silu},
                      tune.block_bucket(pow2(k)), overrides=overrides)
            for variant, k, silu in widths + [(f"silu_k{cfg.intermediate_size}", cfg.intermediate_size, True)]]


def int4_linear_specs(t: str, arch: str, group_sizes, overrides=None):
    """W4A16 kernels for each group size the program's QLinears use: a GEMV per row bucket, the dequant
    kernel (prefill-sized M: dequantize, then cuBLAS), and the GEMV's split-K reduce (group-free).
    overrides: tune-bucket ('gemv_m1', 'dequant', ...) -> entry."""
    from engc.kernels.int4_linear import CHUNK, GEMV_ROWS, dequant_variant, gemv_variant
    if not group_sizes:
        return []
    ov = overrides or {}
    ptr = {"qw_ptr": "*i32", "s_ptr": f"*{t}", "z_ptr": "*u8"}
    gemv_types = dict(ptr, x_ptr=f"*{t}", bias_ptr=f"*{t}", y_ptr=f"*{t}", part_ptr="*fp32", M="i32", N="i32",
                      K="i32", chunks_per_split="i32", has_bias="i32")
    dequant_types = dict(ptr, w_ptr=f"*{t}", N="i32", K="i32")
    specs = []
    for g in sorted(set(int(g) for g in group_sizes)):
        if g % CHUNK:  # a group covering all of K (per-channel) is fine too, but then g is K, a multiple of 32
            raise UserError(f"int4 group size {g} is not a multiple of {CHUNK}, which the engc int4 layout needs")
        for rows in GEMV_ROWS:
            bucket = f"gemv_m{rows}"
            specs.append(make_spec("int4_linear", gemv_variant(rows, g), arch, "int4_gemv_kernel", gemv_types,
                                   {"GROUP": g, "BLOCK_M": rows}, bucket, overrides=ov.get(bucket),
                                   launch_keys=("BLOCK_N", "BLOCK_C", "gemv_max_rows", "target_programs",
                                                "max_splits")))
        specs.append(make_spec("int4_linear", dequant_variant(g), arch, "int4_dequant_kernel", dequant_types,
                               {"GROUP": g}, "dequant", overrides=ov.get("dequant"),
                               launch_keys=("BLOCK_N", "BLOCK_C")))
    reduce_types = {"part_ptr": "*fp32", "bias_ptr": f"*{t}", "y_ptr": f"*{t}", "M": "i32", "N": "i32",
                    "num_splits": "i32", "has_bias": "i32"}
    specs.append(make_spec("int4_linear", "gemv_reduce", arch, "int4_gemv_reduce_kernel", reduce_types, {},
                           "gemv_reduce", overrides=ov.get("gemv_reduce"), launch_keys=("BLOCK",)))
    return specs


def int4_gemm_specs(cfg: ModelConfig, t: str, arch: str, group_sizes, overrides=None, classes=None,
                    enabled_only: bool = True, widths=None) -> list:
    """The W4A16 GEMM of decode batches (kernels/int4_gemm) per input width K of the int4 projections
    (hidden: qkv, gate_up, an int4 lm_head; q_size: o; intermediate: down), group size and M class whose
    tune entry is enabled (every class of `classes` with enabled_only=False: sweeps).
    overrides: M class -> tune overrides; widths: other input widths than the model's (sweeps)."""
    from engc.kernels.int4_gemm import variant_name
    if not group_sizes or t == "fp32":
        return []
    ov = overrides or {}
    types = {"x_ptr": f"*{t}", "qw_ptr": "*i32", "s_ptr": f"*{t}", "z_ptr": "*u8", "out_ptr": f"*{t}",
             "partial_ptr": "*fp32", "counter_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles_per_split": "i32",
             "splits": "i32"}
    keys = ("K", "GROUP", "min_m", "max_m", "BLOCK_M", "BLOCK_N", "BLOCK_K", "target_programs", "max_splits",
            "min_split_k_tiles")
    specs = []
    for bucket in classes or tune.INT4_GEMM_M_CLASSES:
        bucket_ov = dict(ov.get(bucket) or {}, **({} if t == "bf16" else {"PAIRS": False}))  # PAIRS: bf16 math
        entry = tune.lookup(arch, "int4_gemm", "*", bucket, bucket_ov)[1]
        if enabled_only and not entry["enabled"]:
            continue
        for g in sorted(set(int(g) for g in group_sizes)):
            for k in sorted(widths or {cfg.hidden_size, cfg.q_size, cfg.intermediate_size}):
                variant = variant_name(k, g, entry["max_m"])
                specs.append(make_spec("int4_gemm", variant, arch, "int4_gemm_kernel", types,
                                       {"K": k, "GROUP": g, "SILU": False}, bucket, launch_keys=keys,
                                       overrides=bucket_ov))
    return specs


def argmax_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    key, entry = tune.lookup(arch, "argmax", "*", "any", overrides)
    # chunks of at least one BLOCK each, at most MAX_SPLITS of them (a power of two: stage 2 loads them all)
    splits = 1
    while splits * 2 <= entry["max_splits"] and splits * 2 * entry["block"] <= cfg.vocab_size:
        splits *= 2
    consts = {"VOCAB": cfg.vocab_size, "SPLITS": splits, "CHUNK": -(-cfg.vocab_size // splits),
              "BLOCK": entry["block"]}
    specs = [make_spec("argmax", f"partial_{lt}", arch, "argmax_partial_kernel",
                       {"logits_ptr": f"*{lt}", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32"}, consts, "any",
                       launch_keys=("SPLITS",), overrides=overrides)
             for lt in sorted({t, "fp32"})]
    specs.append(make_spec("argmax", "final", arch, "argmax_final_kernel",
                           {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "out_ptr": "*i64"}, {"SPLITS": splits},
                           "any", overrides=overrides))
    return specs


def model_specs(cfg: ModelConfig, dtype: torch.dtype, arch: str, block_size: int, overrides=None,
                quant: str = "none", kv_cache: str = "auto", int4_group_sizes=(), int4_lm_head: bool = False) -> list:
    """Every kernel the model needs on one arch. overrides: op -> tune overrides (bench sweeps).
    quant: the build's --quant ('none' for float or int4-from-checkpoint; 'fp8' adds fp8_quant, fp8_linear
    and the norms' fp8-out variants).
    kv_cache: the build's --kv-cache ('auto': the model dtype; 'int8'/'fp8': rotary and paged attention
    specialized on that quantized cache). int4_group_sizes: group sizes of the program's int4 QLinears.
    int4_lm_head: the lm_head is a QLinear too (`engc quantize --lm-head`): no dense Gemm is left, so no
    GEMV or skinny GEMM is built."""
    if arch not in tune.ARCHS:
        raise UserError(f"unsupported arch '{arch}': engc builds kernels for {', '.join(tune.ARCHS)}")
    if dtype not in TRITON_DTYPE:
        raise UserError(f"unsupported kernel dtype {dtype}: engc builds bfloat16, float16 or float32 kernels")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
    t = TRITON_DTYPE[dtype]
    kv = kv_quant.cache_dtype(kv_cache, dtype)
    kv = kv if kv_quant.is_quantized(kv) else None
    if kv == torch.float8_e4m3fn and int(arch[2:]) < 89:
        raise UserError(f"--kv-cache fp8 needs sm89 or newer (e4m3 conversions); {arch} has none: "
                        "use --kv-cache int8")
    ov = overrides or {}
    specs = rms_norm_specs(cfg, t, arch, ov.get("rms_norm"), partials=bool(int4_group_sizes), fp8=quant == "fp8")
    specs += silu_mul_specs(cfg, t, arch, ov.get("silu_mul"))
    if cfg.qk_norm:
        specs += qk_norm_specs(cfg, t, arch, ov.get("qk_norm"))
    specs += rotary_specs(cfg, t, arch, ov.get("rotary"), kv)
    specs += paged_attention_specs(cfg, t, arch, block_size, ov.get("paged_attention"), kv)
    specs += sampling_specs(cfg, t, arch, ov.get("sampling"))
    specs += argmax_specs(cfg, t, arch, ov.get("argmax"))
    # --quant fp8 and int4 programs keep only the lm_head a dense Gemm; an int4 lm_head, none
    if not int4_lm_head:
        specs += gemv_specs(cfg, t, arch, ov.get("gemv"),
                            projections=dense_projections(cfg, layers=quant != "fp8" and not int4_group_sizes))
    if quant == "fp8":
        specs += fp8_quant_specs(cfg, t, arch, ov.get("fp8_quant"))
        specs += fp8_linear_specs(cfg, t, arch, ov.get("fp8_linear"))
    specs += int4_linear_specs(t, arch, int4_group_sizes, ov.get("int4_linear"))
    specs += int4_gemm_specs(cfg, t, arch, int4_group_sizes, ov.get("int4_gemm"))
    if not int4_lm_head:
        specs += skinny_gemm_specs(cfg, t, arch, ov.get("skinny_gemm"),
                                   layers=quant != "fp8" and not int4_group_sizes)
    return specs
