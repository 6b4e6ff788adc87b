"""The CUDA C++ W4A16 decode GEMV (templates/int4_gemv.cu.j2) and prefill dequant (templates/int4_dequant.cu.j2)
as kernel specs for codegen/cuda.py's nvcc build.

One kernel per int4 group size of the program (K and N are run-time arguments), built where the tune table's
'int4_linear/cuda/gemv' entry is on and nvcc is there; the bundle keeps the Triton int4 kernels anyway (the
GEMV for M the CUDA one does not take, dequant + cuBLAS for prefill, the fallback without nvcc). Records are
op "int4_linear", variant `cuda_g{G}` (`cuda_wide{R}_g{G}`: the builds for up to R = 16, 32 rows; `cuda_silu_g{G}`:
the up-to-8-rows build that writes silu(gate) * up of a fused gate_up, where the entry says silu_out); their launch
constants (impl "cuda", GROUP, max_m, BLOCK_N, BLOCK_K and the split rule of kernels/gemv) drive
kernels/int4_linear's cuda_launch. The dequant kernel, where its
own entry ('int4_linear/cuda/dequant') is on: variant `cuda_dequant_g{G}` (launch: impl, GROUP, BLOCK chunks
per CTA), run by kernels/int4_linear's dequant_launch in place of the Triton one.
"""
from __future__ import annotations

from engc.compiler import tune
from engc.compiler.codegen.cuda import C_TYPE, MMA_TYPE, CudaKernelSpec
from engc.kernels import int4_linear as op   # the variant names its launch rules look up

# what runs instead where nvcc is missing
WITHOUT_NVCC = "the CUDA int4 GEMV is skipped, the Triton int4 GEMV runs"

LAUNCH_KEYS = ("GROUP", "max_m", "BLOCK_N", "BLOCK_K", "target_programs", "max_splits", "min_split_k_tiles")
ARG_TYPES = {"x_ptr": "*{t}", "qw_ptr": "*i32", "s_ptr": "*{t}", "z_ptr": "*u8", "bias_ptr": "*{t}",
             "y_ptr": "*{t}", "partial_ptr": "*fp32", "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
             "k_tiles_per_split": "i32", "splits": "i32", "has_bias": "i32"}


DEQUANT_ARG_TYPES = {"qw_ptr": "*i32", "s_ptr": "*{t}", "z_ptr": "*u8", "w_ptr": "*{t}", "N": "i32", "K": "i32"}


def int4_dequant_spec(group: int, t: str, arch: str, overrides=None) -> tuple:
    """(spec, '') for the dequant template at this group size, or (None, why it does not apply)."""
    if t not in MMA_TYPE:
        return None, f"the CUDA int4 dequant writes bf16 or fp16, not {t}"
    if group % 32:
        return None, f"group size {group} is not a multiple of 32"
    key, entry = tune.lookup(arch, "int4_linear", "cuda", "dequant", overrides)
    warps, chunks = entry["num_warps"], entry["CHUNKS"]
    name = f"int4_dequant_{t}_g{group}_w{warps}c{chunks}"
    values = {"dtype": t, "ctype": C_TYPE[t], "mma_type": MMA_TYPE[t], "group": group, "num_warps": warps,
              "chunks": chunks, "block": 32 * warps * chunks, "entry": name}
    launch = {"impl": "cuda", "GROUP": group, "BLOCK": 32 * warps * chunks}
    types = {name_: ty.format(t=t) for name_, ty in DEQUANT_ARG_TYPES.items()}
    return CudaKernelSpec(op="int4_linear", variant=op.cuda_dequant_variant(group), arch=arch,
                          template="int4_dequant.cu.j2", entry=name, render=values, arg_types=types,
                          num_warps=warps, tune_key=key, tune=entry, launch=launch), ""


def int4_gemv_spec(group: int, t: str, arch: str, overrides=None, kind: str = "gemv", silu_out: bool = False) -> tuple:
    """(spec, '') for the template at this group size, or (None, why it does not apply). kind: the tune
    entry, 'gemv' (up to 8 rows) or 'gemv_wide{R}' for R in int4_linear.CUDA_WIDE_ROWS (max_m / 8 n8 tiles of x).
    silu_out: the build that writes silu(gate) * up of a fused gate_up (variant cuda_silu_g{G}, 'gemv' only)."""
    if t not in MMA_TYPE:
        return None, f"the CUDA int4 GEMV multiplies bf16 or fp16, not {t}"
    if group % 32:
        return None, f"group size {group} is not a multiple of 32"
    key, entry = tune.lookup(arch, "int4_linear", "cuda", kind, overrides)
    shape = _shape_of(kind)
    # what the variant's name promises (the M <= 8 GEMV and its per-shape builds: 32 rows of x, 4 n8 tiles)
    rows = 32 if kind == "gemv" or shape else int(kind[len("gemv_wide"):])
    if not 1 <= entry["max_m"] <= rows:
        return None, f"max_m {entry['max_m']} is outside 1..{rows} (up to {rows // 8} n8 mma tiles of x)"
    warps, tiles, unroll, x_tiles = entry["num_warps"], entry["TILES"], entry["UNROLL"], -(-entry["max_m"] // 8)
    block_n, block_k = 16 * tiles, 128 * warps * unroll
    acc_split = entry.get("ACC_SPLIT", 1)
    if silu_out and kind != "gemv":
        return None, f"only the 'gemv' build has a SiLU-out twin, not '{kind}'"
    early_w = bool(entry.get("EARLY_W", False))
    packed_sz = bool(entry.get("PACKED_SZ", False))   # scales and zeros as int4_linear.pack_scales_zeros
    # MAXNREG: registers a thread at most (__maxnreg__ in place of the launch bounds' CTAs an SM); 0: min_blocks
    maxnreg = int(entry.get("MAXNREG", 0))
    name = (f"int4_gemv_{t}_g{group}_w{warps}t{tiles}u{unroll}b{entry['min_blocks']}x{x_tiles}"
            f"{'z' if entry['ZERO_SUM'] else ''}{f's{acc_split}' if acc_split > 1 else ''}{'e' if early_w else ''}"
            f"{'k' if packed_sz else ''}{f'r{maxnreg}' if maxnreg else ''}{'_silu' if silu_out else ''}")
    values = {"dtype": t, "ctype": C_TYPE[t], "mma_type": MMA_TYPE[t], "group": group, "num_warps": warps,
              "tiles": tiles, "unroll": unroll, "min_blocks": entry["min_blocks"], "block_n": block_n,
              "block_k": block_k, "zero_sum": entry["ZERO_SUM"], "acc_split": acc_split, "x_tiles": x_tiles,
              "silu_out": silu_out, "early_w": early_w, "packed_sz": packed_sz, "maxnreg": maxnreg, "entry": name}
    consts = dict(entry, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k)
    launch = {k: consts[k] for k in LAUNCH_KEYS}
    launch["impl"] = "cuda"
    launch["PDL"] = int(entry.get("PDL", tune.PDL[arch]))   # the template waits first on sm90 (kernels/pdl.py)
    # partials_out: a split launch may leave its partials to the AddRMSNorm after it (QLinearAddRMSNorm)
    launch["partials_out"] = int(bool(entry.get("partials_out", False)))
    # packed_sz: its `scales` argument is the weight's packed scale / zero words, `zeros` unused (cuda_launch)
    launch["packed_sz"] = int(packed_sz)
    types = {name_: ty.format(t=t) for name_, ty in ARG_TYPES.items()}
    if packed_sz:   # s_ptr: the packed words, int32 [tiles, groups, 8, 2]; z_ptr: null
        types["s_ptr"] = "*i32"
    variant = (op.cuda_shape_variant(group, *shape) if shape else op.cuda_silu_variant(group) if silu_out
               else op.cuda_variant(group) if kind == "gemv" else op.cuda_wide_variant(group, rows))
    return CudaKernelSpec(op="int4_linear", variant=variant, arch=arch, template="int4_gemv.cu.j2",
                          entry=name, render=values, arg_types=types, num_warps=warps, tune_key=key, tune=entry,
                          launch=launch), ""


def shape_kind(n: int, k: int) -> str:
    """The tune entry (int4_linear/cuda/<kind>) of the CUDA GEMV built for one projection shape [N, K]."""
    return f"gemv_n{n}_k{k}"


def _shape_of(kind: str) -> tuple[int, int] | None:
    if not kind.startswith("gemv_n"):
        return None
    n, k = kind[len("gemv_n"):].split("_k")
    return int(n), int(k)


def int4_shapes(cfg) -> set[tuple[int, int]]:
    """[N, K] of every projection an int4 program may quantize: qkv, o, gate_up, down (a shared expert's too)
    and the lm_head."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    return {(q + 2 * kv, h), (h, q), (cfg.vocab_size, h)} | {s for i in cfg.mlp_sizes for s in ((2 * i, h), (h, i))}


def selected_int4_specs(triton_specs: list, overrides=None, shapes=()) -> tuple[list[CudaKernelSpec], list[str]]:
    """A CUDA int4 GEMV and dequant kernel for each (arch, group size) the Triton int4 kernels of the build
    cover, each where the tune table turns it on, plus a GEMV per projection shape [N, K] of `shapes` that
    has an entry of its own (gemv_n{N}_k{K}: constants measured best for that shape); and a note for each it
    cannot have. overrides: 'gemv' / 'dequant' / ... -> tune overrides."""
    specs, notes = [], []
    for s in triton_specs:
        if s.op != "int4_linear" or not s.variant.startswith("gemv_m1_g"):
            continue
        group, t = s.constexprs["GROUP"], s.arg_types["x_ptr"][1:]
        wide = [(f"gemv_wide{r}", f"GEMV for up to {r} rows") for r in op.CUDA_WIDE_ROWS]
        own = [(shape_kind(n, k), f"GEMV for [{n}, {k}]") for n, k in sorted(shapes)
               if f"{s.arch}/int4_linear/cuda/{shape_kind(n, k)}" in tune.TUNE]
        for kind, what in [("gemv", "GEMV")] + wide + own + [("dequant", "dequant")]:
            ov = (overrides or {}).get(kind)
            entry = tune.lookup(s.arch, "int4_linear", "cuda", kind, ov)[1]
            if not entry["enabled"]:
                continue
            if kind == "dequant":
                made = [int4_dequant_spec(group, t, s.arch, ov)]
            else:
                made = [int4_gemv_spec(group, t, s.arch, ov, kind)]
                if kind == "gemv" and entry.get("silu_out"):
                    made.append(int4_gemv_spec(group, t, s.arch, ov, kind, silu_out=True))
            for spec, why in made:
                if spec is None:
                    notes.append(f"{s.arch}: no CUDA int4 {what} ({why}); the Triton one runs")
                else:
                    specs.append(spec)
    return specs, notes


def cuda_specs(triton_specs: list, cfg, overrides=None) -> tuple[list[CudaKernelSpec], list[str]]:
    """The build's CUDA int4 kernels: selected_int4_specs over the model's projection shapes."""
    return selected_int4_specs(triton_specs, overrides, shapes=int4_shapes(cfg))
