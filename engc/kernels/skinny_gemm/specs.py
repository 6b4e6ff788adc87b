"""The skinny GEMMs of decode batches (about 9-64 rows) a model needs: per input width K of its plain dense
projections (hidden: qkv, gate_up, lm_head; q_size: o) and, where the layers are dense, the SiLU-fused down
(K = intermediate), per M class whose tune entry is enabled."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec
from engc.kernels.gemv.specs import dense_projections, split_k_gemm_types
from engc.kernels.skinny_gemm import variant_name

# the row classes it builds, each a bucket of the tune table
M_CLASSES = ("m<=16", "m<=32", "m<=64")


def specs(b: Build) -> list:
    if b.int4_lm_head:   # an int4 lm_head leaves no dense Gemm
        return []
    return skinny_gemm_specs(b.cfg, b.t, b.arch, b.ov("skinny_gemm"), layers=b.dense_layers)


def skinny_gemm_specs(cfg, t: str, arch: str, overrides=None, classes=None, layers: bool = True,
                      enabled_only: bool = True) -> list:
    """layers=False: the lm_head only (--quant fp8 and int4 programs); enabled_only=False: every class
    (sweeps); overrides: M class -> tune overrides."""
    if t == "fp32":
        return []   # float32 bundles keep cuBLAS: the tensor-core path would round through tf32
    types = split_k_gemm_types(t)
    launch_keys = ("K", "SILU", "min_m", "max_m", "max_n", "BLOCK_N", "BLOCK_K", "target_programs",
                   "max_splits", "min_split_k_tiles")
    kinds = {(k, False) for k, _ in dense_projections(cfg, layers)}
    if layers:
        kinds |= {(i, True) for i in cfg.mlp_sizes}
    out = []
    for bucket in classes or M_CLASSES:
        ov = (overrides or {}).get(bucket)
        for k, silu in sorted(kinds):
            # a per-K entry (variant name) may enable or retune one width, as fp8_linear's do
            variant = variant_name(k, silu, tune.lookup(arch, "skinny_gemm", "*", bucket, ov)[1]["max_m"])
            if enabled_only and not tune.lookup(arch, "skinny_gemm", variant, bucket, ov)[1]["enabled"]:
                continue
            out.append(make_spec("skinny_gemm", variant, arch, "skinny_gemm_kernel", types, {"K": k, "SILU": silu},
                                 bucket, overrides=ov, launch_keys=launch_keys))
    return out
