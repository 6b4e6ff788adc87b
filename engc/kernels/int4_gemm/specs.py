"""The W4A16 GEMM of decode batches a program with int4 QLinears needs: one per input width K of its int4
projections (hidden: qkv, gate_up, an int4 lm_head; q_size: o; intermediate: down), group size, and M class
(M_CLASSES) whose tune entry is enabled."""
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import Build, make_spec
from engc.kernels.int4_gemm import variant_name

# the row classes it builds, each a bucket of the tune table
M_CLASSES = ("m<=16", "m<=32", "m<=64", "m<=128", "m<=256")


def specs(b: Build) -> list:
    return int4_gemm_specs(b.cfg, b.t, b.arch, b.int4_group_sizes, b.ov("int4_gemm"))


def int4_gemm_specs(cfg, t: str, arch: str, group_sizes, overrides=None, classes=None,
                    enabled_only: bool = True, widths=None) -> list:
    """enabled_only=False: every class of `classes` (sweeps); overrides: M class -> tune overrides; widths:
    other input widths than the model's (sweeps)."""
    if not group_sizes or t == "fp32":
        return []
    ov = overrides or {}
    types = {"x_ptr": f"*{t}", "qw_ptr": "*i32", "s_ptr": f"*{t}", "z_ptr": "*u8", "out_ptr": f"*{t}",
             "partial_ptr": "*fp32", "counter_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles_per_split": "i32",
             "splits": "i32"}
    keys = ("K", "GROUP", "min_m", "max_m", "BLOCK_M", "BLOCK_N", "BLOCK_K", "target_programs", "max_splits",
            "min_split_k_tiles")
    out = []
    for bucket in classes or M_CLASSES:
        bucket_ov = dict(ov.get(bucket) or {}, **({} if t == "bf16" else {"PAIRS": False}))  # PAIRS: bf16 math
        entry = tune.lookup(arch, "int4_gemm", "*", bucket, bucket_ov)[1]
        if enabled_only and not entry["enabled"]:
            continue
        for g in sorted(set(int(g) for g in group_sizes)):
            for k in sorted(widths or {cfg.hidden_size, cfg.q_size, *cfg.mlp_sizes}):
                out.append(make_spec("int4_gemm", variant_name(k, g, entry["max_m"]), arch, "int4_gemm_kernel",
                                     types, {"K": k, "GROUP": g, "SILU": False}, bucket, launch_keys=keys,
                                     overrides=bucket_ov))
    return out
