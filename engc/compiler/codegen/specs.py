"""What to compile for a model: one KernelSpec per (op, variant) and arch, specialized on its shapes.

A spec names the Triton function by module and attribute (so records and tests can find it), gives the
type of every runtime parameter in the kernel's own order, the constexpr values, and the tune entry.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.codegen import tune
from engc.errors import UserError
from engc.kernels import kv_quant
from engc.kernels.fp8_quant import FP8_ARCHS, FP8_MAX, MIN_AMAX

TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
KV_TRITON_DTYPE = {torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}


@dataclass(frozen=True)
class KernelSpec:
    op: str
    variant: str
    arch: str
    module: str                 # e.g. engc.kernels.rms_norm.triton
    fn_name: str
    arg_types: dict             # runtime params, kernel order -> triton type ("*bf16", "i32", "fp32")
    constexprs: dict
    num_warps: int
    num_stages: int
    tune_key: str
    tune: dict
    launch: dict = field(default_factory=dict)   # constants the op's launch rule reads

    def fn(self):
        return getattr(importlib.import_module(self.module), self.fn_name)

    def signature(self) -> dict:
        """Triton's ASTSource signature: every parameter in order, constexprs typed 'constexpr'."""
        fn = self.fn()
        sig = {}
        for name in fn.arg_names:
            if name in self.constexprs:
                sig[name] = "constexpr"
            else:
                sig[name] = self.arg_types[name]
        missing = set(self.arg_types) - set(sig)
        if missing:
            raise ValueError(f"{self.fn_name}: types given for unknown params {sorted(missing)}")
        return sig


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _spec(op, variant, arch, fn_name, arg_types, constexprs, bucket, launch_keys=(), overrides=None):
    key, entry = tune.lookup(arch, op, variant, bucket, overrides)
    consts = dict(constexprs)
    consts.update({k: v for k, v in entry.items() if k.isupper()})
    launch = {k: consts.get(k, entry.get(k)) for k in launch_keys}
    module = f"engc.kernels.{op}.triton"
    if "PDL" in getattr(importlib.import_module(module), fn_name).arg_names:
        # kernels written for programmatic dependent launch (kernels/pdl.py): on where the arch has it;
        # the record's launch constant tells the runtime to launch them that way
        consts["PDL"] = launch["PDL"] = int(entry.get("PDL", tune.PDL[arch]))
    return KernelSpec(op=op, variant=variant, arch=arch, module=module, fn_name=fn_name,
                      arg_types=arg_types, constexprs=consts, num_warps=entry["num_warps"],
                      num_stages=entry["num_stages"], tune_key=key, tune=entry, launch=launch)


def rms_norm_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    block = _pow2(cfg.hidden_size)
    types = {"x_ptr": f"*{t}", "residual_ptr": f"*{t}", "weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "residual_out_ptr": f"*{t}", "eps": "fp32"}
    return [_spec("rms_norm", variant, arch, "rms_norm_kernel", types,
                  {"HIDDEN": cfg.hidden_size, "BLOCK": block, "HAS_RESIDUAL": has_res},
                  tune.block_bucket(block), overrides=overrides)
            for variant, has_res in (("rms_norm", False), ("add_rms_norm", True))]


def silu_mul_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    types = {"gate_up_ptr": f"*{t}", "out_ptr": f"*{t}"}
    return [_spec("silu_mul", "default", arch, "silu_mul_kernel", types, {"INTER": cfg.intermediate_size},
                  "any", launch_keys=("BLOCK",), overrides=overrides)]


def qk_norm_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    types = {"qkv_ptr": f"*{t}", "q_weight_ptr": f"*{t}", "k_weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "eps": "fp32", "copy_v": "i32"}
    consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "H_PAD": _pow2(cfg.num_heads), "KV_PAD": _pow2(cfg.num_kv_heads), "D_PAD": _pow2(cfg.head_dim)}
    block = consts["H_PAD"] * consts["D_PAD"]
    return [_spec("qk_norm", "default", arch, "qk_norm_kernel", types, consts, tune.block_bucket(block),
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
              "H_PAD": _pow2(cfg.num_heads), "KV_PAD": _pow2(cfg.num_kv_heads),
              "HALF_PAD": _pow2(cfg.head_dim // 2), "D_PAD": _pow2(cfg.head_dim)}
    block = consts["H_PAD"] * consts["D_PAD"]
    kv_types, kv_consts = _kv_cache_args(t, kv)
    consts.update(kv_consts)
    specs = []
    for idx in ("i64", "i32"):
        types = {"qkv_ptr": f"*{t}", "positions_ptr": f"*{idx}", "inv_freq_ptr": "*fp32", **kv_types,
                 "slot_mapping_ptr": f"*{idx}", "q_out_ptr": f"*{t}"}
        specs.append(_spec("rotary", f"pos_{idx}", arch, "rotary_kv_kernel", types, consts,
                           tune.block_bucket(block), overrides=overrides))
    return specs


def paged_attention_specs(cfg: ModelConfig, t: str, arch: str, block_size: int, overrides=None,
                          kv: torch.dtype | None = None):
    group = cfg.num_heads // cfg.num_kv_heads
    precision = "ieee" if t == "fp32" else "tf32"
    kv_types, kv_consts = _kv_cache_args(t, kv)
    common = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "D_PAD": _pow2(cfg.head_dim), "GROUP": group, "PAGE": block_size, "DOT_PRECISION": precision,
              **kv_consts}
    bucket = tune.head_dim_bucket(cfg.head_dim)
    cache = {"q_ptr": f"*{t}", **kv_types, "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "out_ptr": f"*{t}"}
    decode_types = dict(cache, part_acc_ptr="*fp32", part_ml_ptr="*fp32", counters_ptr="*i32", scale="fp32",
                        sliding_window="i32", block_table_stride="i32", num_splits="i32")
    decode_tune = tune.lookup(arch, "paged_attention", "decode", bucket, (overrides or {}).get("decode"))[1]
    # The in-kernel reduce reads [RED_SPLITS, group, D] partials at a time: ~4k fp32, 32 a thread of 4 warps.
    reduce_consts = dict(GR_PAD=_pow2(group), MAX_SPLITS=_pow2(decode_tune["max_splits"]),
                         RED_SPLITS=max(1, 4096 // (_pow2(group) * _pow2(cfg.head_dim))))
    decode = _spec("paged_attention", "decode", arch, "paged_decode_kernel", decode_types,
                   dict(common, G_PAD=max(16, _pow2(group)), **reduce_consts), bucket,
                   launch_keys=("BLOCK_N", "target_programs", "max_splits", "min_split_tokens",
                                "min_split_tokens_busy", "impl", "in_kernel_reduce", "rotary_max_rows"),
                   overrides=(overrides or {}).get("decode"))
    reduce_types = {"query_start_loc_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                    "out_ptr": f"*{t}", "num_splits": "i32"}
    max_splits = decode.tune["max_splits"]
    # decode_reduce finishes split launches of the CUDA decode template only (Triton's reduces in-kernel)
    reduce = None if decode.launch.get("impl") != "cuda" else _spec("paged_attention", "decode_reduce", arch, "paged_decode_reduce_kernel", reduce_types,
                   {"NUM_HEADS": cfg.num_heads, "HEAD_DIM": cfg.head_dim, "D_PAD": _pow2(cfg.head_dim),
                    "MAX_SPLITS": _pow2(max_splits)}, "any", launch_keys=("MAX_SPLITS",))
    prefill_types = dict(cache, scale="fp32", sliding_window="i32", block_table_stride="i32", skip_decode="i32")
    prefill = _spec("paged_attention", "prefill", arch, "paged_prefill_kernel", prefill_types, common, bucket,
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
        specs.append(_spec("sampling", f"logits_{lt}", arch, "sample_kernel", types, {"VOCAB": cfg.vocab_size},
                           "any", overrides=overrides))
    return specs


def fp8_quant_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    """Per-token FP8 activation quantization, one variant per projection input width (hidden, q, inter)."""
    if arch not in FP8_ARCHS:
        raise UserError(f"--quant fp8 needs FP8 tensor cores (sm89 or newer); {arch} has none")
    specs = []
    for k in sorted({cfg.hidden_size, cfg.q_size, cfg.intermediate_size}):
        types = {"x_ptr": f"*{t}", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        consts = {"K": k, "BLOCK": _pow2(k), "FP8_MAX": FP8_MAX, "MIN_AMAX": MIN_AMAX}
        specs.append(_spec("fp8_quant", f"k{k}", arch, "fp8_quant_kernel", types, consts,
                           tune.block_bucket(_pow2(k)), overrides=overrides))
    return specs


def fp8_linear_specs(cfg: ModelConfig, t: str, arch: str, overrides=None, classes=None):
    """W8A8 GEMM for decode/small-prefill rows per projection input width K (hidden: qkv, gate_up;
    q_size: o; intermediate: down) and M class of the tune table (FP8_LINEAR_M_CLASSES), taking float8 x
    from fp8_quant; plus a variant that quantizes x itself where the class's entry says fuse_quant.
    overrides: M class -> tune overrides; classes: the M classes to build (default: all)."""
    from engc.kernels.fp8_linear import variant_name
    if arch not in FP8_ARCHS:
        raise UserError(f"--quant fp8 needs FP8 tensor cores (sm89 or newer); {arch} has none")
    specs = []
    for k in sorted({cfg.hidden_size, cfg.q_size, cfg.intermediate_size}):
        for bucket in classes or tune.FP8_LINEAR_M_CLASSES:
            ov = (overrides or {}).get(bucket)
            _, entry = tune.lookup(arch, "fp8_linear", "*", bucket, ov)
            for quant_x in (False, True) if entry.get("fuse_quant") else (False,):
                types = {"x_ptr": f"*{t}" if quant_x else "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                         "w_scale_ptr": "*fp32", "bias_ptr": f"*{t}", "out_ptr": f"*{t}", "partial_ptr": "*fp32",
                         "counter_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles_per_split": "i32",
                         "splits": "i32", "has_bias": "i32"}
                consts = {"K": k, "QUANT_X": quant_x, "FP8_MAX": FP8_MAX, "MIN_AMAX": MIN_AMAX}
                specs.append(_spec("fp8_linear", variant_name(k, entry["max_m"], quant_x), arch,
                                   "fp8_linear_kernel", types, consts, bucket, overrides=ov,
                                   launch_keys=("K", "QUANT_X", "max_m", "BLOCK_N", "BLOCK_K", "target_programs",
                                                "max_splits", "min_split_k_tiles")))
    return specs


def dense_projections(cfg: ModelConfig, layers: bool = True) -> set[tuple[int, int]]:
    """(K, N) of the program's plain Gemms (x @ W^T, no bias), after fuse_parallel_gemms: the fused qkv
    (unless it has a bias: then cuBLAS adds it), o, the fused gate_up and the lm_head. layers=False: the
    lm_head only (--quant fp8 and int4 programs make the layer projections FP8Linear / QLinear)."""
    shapes = {(cfg.hidden_size, cfg.vocab_size)}
    if layers:
        shapes |= {(cfg.q_size, cfg.hidden_size), (cfg.hidden_size, 2 * cfg.intermediate_size)}
        if not cfg.qkv_bias:
            shapes.add((cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size))
    return shapes


def _overlap(a, b) -> bool:
    """Two inclusive (lo, hi) ranges share a value (hi 0: no bound)."""
    return (not b[1] or a[0] <= b[1]) and (not a[1] or b[0] <= a[1])


def _split_k_gemm_types(t: str) -> dict:
    """Runtime params of the split-K GEMMs of decode batches (gemv_kernel, skinny_gemm_kernel), in order."""
    return {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "partial_ptr": "*fp32", "counter_ptr": "*i32",
            "M": "i32", "N": "i32", "k_tiles_per_split": "i32", "splits": "i32"}


def gemv_specs(cfg: ModelConfig, t: str, arch: str, overrides=None, classes=None, projections=None):
    """Decode GEMV per input width K (hidden: qkv, gate_up, lm_head; q_size: o; SiLU-fused intermediate:
    down) and per M class of the tune table. N is a run-time argument, so one kernel of an M class serves
    every projection of that width (a class with plain=False builds only the SiLU-fused one).
    The per-N plain classes (tune.GEMV_PLAIN_CLASSES, one tile config each) instead build a kernel for a K
    only where one of `projections` ((K, N) pairs; default: the model's dense_projections) falls in the
    class's `serves` regions, and record the N ranges it serves for that K (launch n_ranges), so the runtime
    keeps the other N of that K on cuBLAS. overrides: tune bucket -> tune overrides; classes: the buckets to
    build (default: GEMV_M_CLASSES and GEMV_PLAIN_CLASSES)."""
    from engc.kernels.gemv import in_range, variant_name
    if t == "fp32":
        return []   # float32 bundles keep cuBLAS: the tensor-core path would round through tf32
    types = _split_k_gemm_types(t)
    launch_keys = ("K", "SILU", "max_m", "BLOCK_N", "BLOCK_K", "target_programs", "max_splits",
                   "min_split_k_tiles")
    ov = overrides or {}
    classes = classes or tune.GEMV_M_CLASSES + tune.GEMV_PLAIN_CLASSES
    projections = dense_projections(cfg) if projections is None else projections
    specs = []
    for k, silu in sorted({(cfg.hidden_size, False), (cfg.q_size, False), (cfg.intermediate_size, True)}):
        for bucket in classes:
            if bucket in tune.GEMV_PLAIN_CLASSES:
                continue
            _, entry = tune.lookup(arch, "gemv", "*", bucket, ov.get(bucket))
            if not silu and not entry.get("plain", True):
                continue
            bucket_ov = dict(ov.get(bucket) or {})
            if silu:   # the fused down's N is the hidden size: per-N tile overrides of the entry
                n = cfg.hidden_size
                bucket_ov.update(next((o for lo, hi, o in entry.get("silu_by_n", ()) if in_range(n, (lo, hi))), {}))
            specs.append(_spec("gemv", variant_name(k, silu, entry["max_m"]), arch, "gemv_kernel", types,
                               {"K": k, "SILU": silu}, bucket, overrides=bucket_ov or None,
                               launch_keys=launch_keys))
    plain = {b: tune.lookup(arch, "gemv", "*", b, ov.get(b))[1] for b in classes if b in tune.GEMV_PLAIN_CLASSES}
    for k in sorted({k for k, _ in projections}):
        # per class, the N ranges it serves at this K; a pick order between classes would be a second rule
        # the runtime would have to share, so overlapping classes of one M class are refused instead
        ranges = {b: [nr for kr, nr in e["serves"] if in_range(k, kr)] for b, e in plain.items()}
        for a, b in ((a, b) for i, a in enumerate(plain) for b in list(plain)[i + 1:]):
            if plain[a]["max_m"] == plain[b]["max_m"] and any(
                    _overlap(x, y) for x in ranges[a] for y in ranges[b]):
                raise ValueError(f"gemv tune classes {a} and {b} both serve K={k} for some N")
        ns = [n for kk, n in projections if kk == k]
        for bucket, entry in plain.items():
            if not any(in_range(n, r) for n in ns for r in ranges[bucket]):
                continue   # no projection of the model needs this kernel
            spec = _spec("gemv", variant_name(k, False, entry["max_m"], bucket.split("/")[-1]), arch,
                         "gemv_kernel", types, {"K": k, "SILU": False}, bucket, overrides=ov.get(bucket),
                         launch_keys=launch_keys)
            specs.append(dataclasses.replace(
                spec, launch=dict(spec.launch, n_ranges=[list(r) for r in ranges[bucket]])))
    return specs


def skinny_gemm_specs(cfg: ModelConfig, t: str, arch: str, overrides=None, classes=None, layers: bool = True,
                      enabled_only: bool = True):
    """The skinny GEMM of decode batches per input width K of the model's plain dense projections (hidden:
    qkv, gate_up, lm_head; q_size: o) and, with layers, the SiLU-fused down (K = intermediate), per M class
    of tune.SKINNY_GEMM_M_CLASSES whose entry is enabled (enabled_only=False: every class, for sweeps).
    layers=False: the lm_head only (--quant fp8 and int4 programs). overrides: M class -> tune overrides."""
    from engc.kernels.skinny_gemm import variant_name
    if t == "fp32":
        return []   # float32 bundles keep cuBLAS: the tensor-core path would round through tf32
    types = _split_k_gemm_types(t)
    launch_keys = ("K", "SILU", "min_m", "max_m", "max_n", "BLOCK_N", "BLOCK_K", "target_programs",
                   "max_splits", "min_split_k_tiles")
    kinds = {(k, False) for k, _ in dense_projections(cfg, layers)}
    if layers:
        kinds.add((cfg.intermediate_size, True))
    specs = []
    for bucket in classes or tune.SKINNY_GEMM_M_CLASSES:
        ov = (overrides or {}).get(bucket)
        for k, silu in sorted(kinds):
            # a per-K entry (variant name) may enable or retune one width, as fp8_linear's do
            variant = variant_name(k, silu, tune.lookup(arch, "skinny_gemm", "*", bucket, ov)[1]["max_m"])
            if enabled_only and not tune.lookup(arch, "skinny_gemm", variant, bucket, ov)[1]["enabled"]:
                continue
            specs.append(_spec("skinny_gemm", variant, arch, "skinny_gemm_kernel", types, {"K": k, "SILU": silu},
                               bucket, overrides=ov, launch_keys=launch_keys))
    return specs


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
            specs.append(_spec("int4_linear", gemv_variant(rows, g), arch, "int4_gemv_kernel", gemv_types,
                               {"GROUP": g, "BLOCK_M": rows}, bucket, overrides=ov.get(bucket),
                               launch_keys=("BLOCK_N", "BLOCK_C", "gemv_max_rows", "target_programs", "max_splits")))
        specs.append(_spec("int4_linear", dequant_variant(g), arch, "int4_dequant_kernel", dequant_types,
                           {"GROUP": g}, "dequant", overrides=ov.get("dequant"), launch_keys=("BLOCK_N", "BLOCK_C")))
    reduce_types = {"part_ptr": "*fp32", "bias_ptr": f"*{t}", "y_ptr": f"*{t}", "M": "i32", "N": "i32",
                    "num_splits": "i32", "has_bias": "i32"}
    specs.append(_spec("int4_linear", "gemv_reduce", arch, "int4_gemv_reduce_kernel", reduce_types, {},
                       "gemv_reduce", overrides=ov.get("gemv_reduce"), launch_keys=("BLOCK",)))
    return specs


def argmax_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    key, entry = tune.lookup(arch, "argmax", "*", "any", overrides)
    # chunks of at least one BLOCK each, at most MAX_SPLITS of them (a power of two: stage 2 loads them all)
    splits = 1
    while splits * 2 <= entry["max_splits"] and splits * 2 * entry["block"] <= cfg.vocab_size:
        splits *= 2
    consts = {"VOCAB": cfg.vocab_size, "SPLITS": splits, "CHUNK": -(-cfg.vocab_size // splits),
              "BLOCK": entry["block"]}
    specs = [_spec("argmax", f"partial_{lt}", arch, "argmax_partial_kernel",
                   {"logits_ptr": f"*{lt}", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32"}, consts, "any",
                   launch_keys=("SPLITS",), overrides=overrides)
             for lt in sorted({t, "fp32"})]
    specs.append(_spec("argmax", "final", arch, "argmax_final_kernel",
                       {"part_val_ptr": "*fp32", "part_idx_ptr": "*i32", "out_ptr": "*i64"}, {"SPLITS": splits},
                       "any", overrides=overrides))
    return specs


def model_specs(cfg: ModelConfig, dtype: torch.dtype, arch: str, block_size: int, overrides=None,
                quant: str = "none", kv_cache: str = "auto", int4_group_sizes=()) -> list:
    """Every kernel the model needs on one arch. overrides: op -> tune overrides (bench sweeps).
    quant: the build's --quant ('none' for float or int4-from-checkpoint; 'fp8' adds fp8_quant and
    fp8_linear).
    kv_cache: the build's --kv-cache ('auto': the model dtype; 'int8'/'fp8': rotary and paged attention
    specialized on that quantized cache). int4_group_sizes: group sizes of the program's int4 QLinears."""
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
    specs = rms_norm_specs(cfg, t, arch, ov.get("rms_norm")) + silu_mul_specs(cfg, t, arch, ov.get("silu_mul"))
    if cfg.qk_norm:
        specs += qk_norm_specs(cfg, t, arch, ov.get("qk_norm"))
    specs += rotary_specs(cfg, t, arch, ov.get("rotary"), kv)
    specs += paged_attention_specs(cfg, t, arch, block_size, ov.get("paged_attention"), kv)
    specs += sampling_specs(cfg, t, arch, ov.get("sampling"))
    specs += argmax_specs(cfg, t, arch, ov.get("argmax"))
    # --quant fp8 and int4 programs keep only the lm_head a dense Gemm
    specs += gemv_specs(cfg, t, arch, ov.get("gemv"),
                        projections=dense_projections(cfg, layers=quant != "fp8" and not int4_group_sizes))
    if quant == "fp8":
        specs += fp8_quant_specs(cfg, t, arch, ov.get("fp8_quant"))
        specs += fp8_linear_specs(cfg, t, arch, ov.get("fp8_linear"))
    specs += int4_linear_specs(t, arch, int4_group_sizes, ov.get("int4_linear"))
    specs += skinny_gemm_specs(cfg, t, arch, ov.get("skinny_gemm"), layers=quant != "fp8" and not int4_group_sizes)
    return specs
