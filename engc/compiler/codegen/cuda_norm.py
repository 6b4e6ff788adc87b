"""The CUDA cluster AddRMSNorm over a split-K GEMV's fp32 partials (templates/add_rms_norm_cluster.cu.j2) as a
kernel spec for codegen/cuda.py's nvcc build.

Built beside the Triton add_rms_norm_partials variant (which stays in the bundle: the fallback without nvcc,
and on sm80, which has no clusters) where the tune table's 'rms_norm/add_rms_norm_partials_cluster' entry is
on. Record: op "rms_norm", variant rms_norm.CLUSTER_VARIANT; its launch constants (cluster, PDL) drive
kernels/rms_norm's launch rule.
"""
from __future__ import annotations

from engc.bundle.model_config import ModelConfig
from engc.compiler.codegen import tune
from engc.compiler.codegen.cuda import C_TYPE, MMA_TYPE, CudaKernelSpec
from engc.kernels import rms_norm

ARG_TYPES = {"partials_ptr": "*fp32", "residual_ptr": "*{t}", "weight_ptr": "*{t}", "out_ptr": "*{t}",
             "residual_out_ptr": "*{t}", "eps": "fp32", "splits": "i32"}


def norm_cluster_spec(cfg: ModelConfig, t: str, arch: str, overrides=None) -> tuple:
    """(spec, '') for the cluster partials norm on this shape, or (None, why it does not apply)."""
    if arch != "sm90":
        return None, f"{arch} has no thread-block clusters"
    if t not in MMA_TYPE:
        return None, f"it writes bf16 or fp16, not {t}"
    key, entry = tune.lookup(arch, "rms_norm", rms_norm.CLUSTER_VARIANT, "any", overrides)
    cluster, hidden = entry["cluster"], cfg.hidden_size
    if cluster not in (1, 2, 4, 8):
        return None, f"cluster {cluster} is not 1, 2, 4 or 8 CTAs (the portable sizes)"
    if hidden % (cluster * 4 * 32) or hidden // (cluster * 4) > 1024:
        return None, f"hidden {hidden} does not split into {cluster} CTAs of 32-1024 threads of 4 columns"
    warps = hidden // (cluster * 4 * 32)
    name = f"add_rms_norm_partials_cluster_{t}_h{hidden}_c{cluster}"
    values = {"dtype": t, "ctype": C_TYPE[t], "hidden": hidden, "cluster": cluster,
              "to_float": "__bfloat162float" if t == "bf16" else "__half2float",
              "from_float": "__float2bfloat16_rn" if t == "bf16" else "__float2half_rn",
              "max_splits": rms_norm.MAX_SPLITS, "num_warps": warps, "entry": name}
    launch = {"cluster": cluster, "PDL": int(entry.get("PDL", tune.PDL[arch]))}
    types = {name_: ty.format(t=t) for name_, ty in ARG_TYPES.items()}
    return CudaKernelSpec(op="rms_norm", variant=rms_norm.CLUSTER_VARIANT, arch=arch,
                          template="add_rms_norm_cluster.cu.j2", entry=name, render=values, arg_types=types,
                          num_warps=warps, tune_key=key, tune=entry, launch=launch), ""


def selected_norm_specs(triton_specs: list, cfg: ModelConfig) -> tuple[list, list[str]]:
    """The cluster partials norm for each arch whose Triton specs have the partials variant (int4 programs)
    and whose tune entry turns it on; a note for each that this shape cannot have."""
    specs, notes = [], []
    for s in triton_specs:
        if (s.op, s.variant) != ("rms_norm", rms_norm.PARTIALS_VARIANT):
            continue
        if not tune.TUNE.get(f"{s.arch}/rms_norm/{rms_norm.CLUSTER_VARIANT}/any", {}).get("enabled"):
            continue
        spec, why = norm_cluster_spec(cfg, s.arg_types["out_ptr"][1:], s.arch)
        if spec is None:
            notes.append(f"{s.arch}: no cluster partials norm ({why}); the Triton one runs")
        else:
            specs.append(spec)
    return specs, notes
