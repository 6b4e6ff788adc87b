"""The CUDA C++ decode GEMV (templates/gemv.cu.j2) as kernel specs for codegen/cuda.py's nvcc build.

One kernel per (input width K, SILU) and CUDA M class of the tune table ('sm90/gemv/cuda/m<=8'), built
only for the projection kinds its entry turns on (plain: K = hidden or q_size; silu: the fused down) --
the tune table turns them on per arch where the kernel measured ahead of cuBLAS and the Triton GEMV
(bench/results/HISTORY.md). Records are op "gemv", variant `cuda_[silu_]k{K}_m{max_m}`; their launch
constants are the Triton GEMV's (K, SILU, max_m, BLOCK_N, BLOCK_K, split rule) plus impl "cuda" and
max_n, so kernels/gemv's pick and launch rule serve both.
"""
from __future__ import annotations

from engc.compiler import tune
from engc.compiler.codegen.cuda import C_TYPE, MMA_TYPE, CudaKernelSpec
from engc.kernels.gemv import specs as gemv_kernels

# what runs instead where nvcc is missing
WITHOUT_NVCC = "the CUDA GEMV is skipped, the Triton GEMV or cuBLAS runs"

LAUNCH_KEYS = ("K", "SILU", "max_m", "max_n", "BLOCK_N", "BLOCK_K", "target_programs", "max_splits",
               "min_split_k_tiles")


def variant_name(k: int, silu: bool, max_m: int) -> str:
    return f"cuda_{'silu_' if silu else ''}k{k}_m{max_m}"


def gemv_spec(k: int, silu: bool, t: str, arch: str, bucket: str, overrides=None) -> tuple:
    """(spec, '') for the template at this K, or (None, why it does not apply)."""
    if t not in MMA_TYPE:
        return None, f"the CUDA GEMV multiplies bf16 or fp16, not {t}"
    if k % 8:
        return None, f"K {k} is not a multiple of 8 (the kernel reads W in 16-byte pieces)"
    key, entry = tune.lookup(arch, "gemv", "cuda", bucket, overrides)
    if not 1 <= entry["max_m"] <= 8:
        return None, f"max_m {entry['max_m']} is outside 1..8 (one n8 mma tile)"
    warps, tiles, unroll = entry["num_warps"], entry["TILES"], entry["UNROLL"]
    block_n, block_k = 16 * tiles, 32 * warps * unroll
    variant = variant_name(k, silu, entry["max_m"])
    acc_split = entry.get("ACC_SPLIT", 1)
    if unroll % acc_split:
        return None, f"ACC_SPLIT {acc_split} does not divide UNROLL {unroll}"
    name = (f"gemv_{t}_{'silu_' if silu else ''}k{k}_m{entry['max_m']}"
            f"_w{warps}t{tiles}u{unroll}b{entry['min_blocks']}{f's{acc_split}' if acc_split > 1 else ''}")
    values = {"dtype": t, "ctype": C_TYPE[t], "mma_type": MMA_TYPE[t], "k": k, "silu": silu,
              "max_m": entry["max_m"], "num_warps": warps, "tiles": tiles, "unroll": unroll,
              "min_blocks": entry["min_blocks"], "acc_split": acc_split,
              "block_n": block_n, "block_k": block_k, "entry": name}
    types = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "partial_ptr": "*fp32",
             "counter_ptr": "*i32", "M": "i32", "N": "i32", "k_tiles_per_split": "i32", "splits": "i32"}
    consts = dict(entry, K=k, SILU=silu, BLOCK_N=block_n, BLOCK_K=block_k)
    launch = {key_: consts[key_] for key_ in LAUNCH_KEYS}
    launch["impl"] = "cuda"
    launch["PDL"] = int(entry.get("PDL", tune.PDL[arch]))   # the template waits first on sm90 (kernels/pdl.py)
    return CudaKernelSpec(op="gemv", variant=variant, arch=arch, template="gemv.cu.j2", entry=name,
                          render=values, arg_types=types, num_warps=warps, tune_key=key, tune=entry,
                          launch=launch), ""


def gemv_specs(cfg, t: str, arch: str, overrides=None) -> tuple[list[CudaKernelSpec], list[str]]:
    """The CUDA GEMVs the tune table turns on for this model and arch, and a note per one it cannot have.
    overrides: CUDA M class -> tune overrides (tests, bench sweeps)."""
    specs, notes = [], []
    if t not in MMA_TYPE:
        return specs, notes   # float32 bundles keep cuBLAS, as with the Triton GEMV
    for bucket in gemv_kernels.CUDA_M_CLASSES:
        _, entry = tune.lookup(arch, "gemv", "cuda", bucket, (overrides or {}).get(bucket))
        kinds = {(cfg.hidden_size, False), (cfg.q_size, False)} if entry["plain"] else set()
        kinds |= {(i, True) for i in cfg.mlp_sizes} if entry["silu"] else set()
        for k, silu in sorted(kinds):
            spec, why = gemv_spec(k, silu, t, arch, bucket, (overrides or {}).get(bucket))
            if spec is None:
                notes.append(f"{arch}: no CUDA GEMV for K={k} ({why}); the Triton GEMV or cuBLAS runs")
            else:
                specs.append(spec)
    return specs, notes


def cuda_specs(triton_specs: list, cfg, overrides=None) -> tuple[list, list[str]]:
    """The CUDA decode GEMVs the tune table turns on, per arch of the build, in the model's dtype (that of its
    attention). overrides: CUDA GEMV M class -> tune overrides."""
    specs, notes = [], []
    for s in triton_specs:
        if (s.op, s.variant) == ("paged_attention", "decode"):
            more, why = gemv_specs(cfg, s.arg_types["q_ptr"][1:], s.arch, overrides)
            specs += more
            notes += why
    return specs, notes
