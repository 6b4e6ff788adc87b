"""The decode GEMVs a model needs, per input width K (hidden: qkv, gate_up, lm_head; q_size: o; SiLU-fused
intermediate: down, one per GLU width of cfg.mlp_sizes) and M class of the tune table; and the model's dense
projections, which the GEMV and the skinny GEMM (kernels/skinny_gemm) serve. N is a run-time argument, so one
kernel of an M class serves every projection of its width."""
import dataclasses

from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec
from engc.kernels.gemv import in_range, variant_name

# The row classes it builds, each a bucket of the tune table (the table's m<=4 and m<=16 are kept for sweeps)
M_CLASSES = ("m<=1",)
# plain projections at batch 1: the first class whose `serves` regions hold (K, N) serves it, else cuBLAS
PLAIN_CLASSES = ("m<=1/n4k1024w4", "m<=1/n8k512w2")
# the CUDA C++ twin's classes (templates/gemv.cu.j2)
CUDA_M_CLASSES = ("m<=8",)


def specs(b: Build) -> list:
    if b.int4_lm_head:   # an int4 lm_head leaves no dense Gemm
        return []
    return gemv_specs(b.cfg, b.t, b.arch, b.ov("gemv"), projections=dense_projections(b.cfg, b.dense_layers))


def dense_projections(cfg, layers: bool = True) -> set[tuple[int, int]]:
    """(K, N) of the program's plain Gemms (x @ W^T, no bias), after fuse_parallel_gemms: the fused qkv
    (unless it has a bias: then cuBLAS adds it), o, the fused gate_up (a shared expert's too) and the lm_head.
    layers=False: the lm_head only (--quant fp8 and int4 programs make the layer projections FP8Linear / QLinear)."""
    shapes = {(cfg.hidden_size, cfg.vocab_size)}
    if layers:
        shapes |= {(cfg.q_size, cfg.hidden_size)} | {(cfg.hidden_size, 2 * i) for i in cfg.mlp_sizes}
        if not cfg.qkv_bias:
            shapes.add((cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size))
    return shapes


def split_k_gemm_types(t: str) -> dict:
    """Runtime params of the split-K GEMMs of decode batches (gemv_kernel, skinny_gemm_kernel)."""
    return {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "partial_ptr": "*fp32", "counter_ptr": "*i32",
            "M": "i32", "N": "i32", "k_tiles_per_split": "i32", "splits": "i32"}


def _overlap(a, b) -> bool:
    """Two inclusive (lo, hi) ranges share a value (hi 0: no bound)."""
    return (not b[1] or a[0] <= b[1]) and (not a[1] or b[0] <= a[1])


def gemv_specs(cfg, t: str, arch: str, overrides=None, classes=None, projections=None) -> list:
    """A class with plain=False builds only the SiLU-fused kernel. The per-N plain classes (PLAIN_CLASSES,
    one tile config each) instead build a kernel for a K only where one of `projections` ((K, N) pairs;
    default: the model's dense_projections) falls in the class's `serves` regions, and record the N ranges
    it serves for that K (launch n_ranges), so the runtime keeps the other N of that K on cuBLAS.
    overrides: tune bucket -> tune overrides; classes: the buckets to build (default: M_CLASSES and
    PLAIN_CLASSES)."""
    if t == "fp32":
        return []   # float32 bundles keep cuBLAS: the tensor-core path would round through tf32
    types = split_k_gemm_types(t)
    launch_keys = ("K", "SILU", "max_m", "BLOCK_N", "BLOCK_K", "target_programs", "max_splits",
                   "min_split_k_tiles")
    ov = overrides or {}
    classes = classes or M_CLASSES + PLAIN_CLASSES
    projections = dense_projections(cfg) if projections is None else projections
    out = []
    for k, silu in sorted({(cfg.hidden_size, False), (cfg.q_size, False)} | {(i, True) for i in cfg.mlp_sizes}):
        for bucket in classes:
            if bucket in PLAIN_CLASSES:
                continue
            _, entry = tune.lookup(arch, "gemv", "*", bucket, ov.get(bucket))
            if not silu and not entry.get("plain", True):
                continue
            bucket_ov = dict(ov.get(bucket) or {})
            if silu:   # the fused down's N is the hidden size: per-N tile overrides of the entry
                n = cfg.hidden_size
                bucket_ov.update(next((o for lo, hi, o in entry.get("silu_by_n", ()) if in_range(n, (lo, hi))), {}))
            out.append(make_spec("gemv", variant_name(k, silu, entry["max_m"]), arch, "gemv_kernel", types,
                                 {"K": k, "SILU": silu}, bucket, overrides=bucket_ov or None,
                                 launch_keys=launch_keys))
    plain = {b: tune.lookup(arch, "gemv", "*", b, ov.get(b))[1] for b in classes if b in PLAIN_CLASSES}
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
            out.append(dataclasses.replace(
                spec, launch=dict(spec.launch, n_ranges=[list(r) for r in ranges[bucket]])))
    return out
