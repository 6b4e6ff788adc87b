"""The split-K GEMMs of decode batches, per arch: the GEMV (gemv), the skinny GEMM (skinny_gemm) and the FP8
W8A8 GEMM (fp8_linear), and the model's dense projections they serve. One kernel per input width K and M
class of the tune table, N a run-time argument; the three kernels share kernels/gemm_tiles.py and their
launch rules gemv.split_k / gemv.table_by_k. specs.model_specs assembles them with the other ops' specs.
"""
from __future__ import annotations

import dataclasses

from engc.bundle.model_config import ModelConfig
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import make_spec
from engc.errors import UserError
from engc.kernels.fp8_quant import FP8_ARCHS, FP8_MAX, MIN_AMAX


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
            specs.append(make_spec("gemv", variant_name(k, silu, entry["max_m"]), arch, "gemv_kernel", types,
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
            spec = make_spec("gemv", variant_name(k, False, entry["max_m"], bucket.split("/")[-1]), arch,
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
            specs.append(make_spec("skinny_gemm", variant, arch, "skinny_gemm_kernel", types, {"K": k, "SILU": silu},
                                   bucket, overrides=ov, launch_keys=launch_keys))
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
                specs.append(make_spec("fp8_linear", variant_name(k, entry["max_m"], quant_x), arch,
                                       "fp8_linear_kernel", types, consts, bucket, overrides=ov,
                                       launch_keys=("K", "QUANT_X", "max_m", "BLOCK_N", "BLOCK_K", "target_programs",
                                                    "max_splits", "min_split_k_tiles")))
    return specs
