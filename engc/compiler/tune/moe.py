"""engc tune's MoE op: the grouped expert GEMMs (kernels/moe) of a mixture-of-experts model, per variant class.

A class is the pair of variants one launch rule picks (kernels/moe/launch.py grouped_variants), measured at
token counts it serves, the routing drawn from a seeded random router (the reference's own route()):
  grouped  gate_up + down            T = 32, 64, 256 (decode-sized batches: a few to tens of rows an expert)
  prefill  gate_up_prefill + down_prefill   T = 4096 (a prompt chunk: hundreds of rows an expert)
  decode   gate_up_decode + down_decode     T = 1, 4 (one (token, expert) pair a program, no sort; without
           a shared expert the fused pair: gate_up routing its own pairs, down summing each token's)
A candidate sets one tile on both GEMMs of its class (the down walks the gate_up's schedule, so its BLOCK_M
is the gate_up's: the down's entry never names it). A class leaves its current tile only if the candidate's
time, averaged over the class's token counts as a fraction of the current tile's, is less by more than the
margin; the winner is written as "<arch>/moe/<variant>/any" entries (only the fields that change), which
`engc build --tune` takes over the spec's defaults (tune.check_overrides).
"""
from __future__ import annotations

import itertools

OP = "moe"
CLASSES = {"grouped": ("gate_up", "down"), "prefill": ("gate_up_prefill", "down_prefill"),
           "decode": ("gate_up_decode", "down_decode")}
TOKENS = {"grouped": (32, 64, 256), "prefill": (4096,), "decode": (1, 4)}
GRID = {   # the tile grids (pruned below: shared memory, tiles too small for their warps)
    "grouped": dict(BLOCK_M=(16, 32), BLOCK_N=(64, 128), BLOCK_K=(64, 128), num_warps=(4, 8),
                    num_stages=(2, 3, 4)),
    "prefill": dict(BLOCK_M=(64, 128), BLOCK_N=(64, 128), BLOCK_K=(64, 128), num_warps=(4, 8),
                    num_stages=(2, 3, 4)),
    "decode": dict(BLOCK_N=(16, 32, 64), BLOCK_K=(64, 128, 256), num_warps=(2, 4)),
}
FIELDS = {"grouped": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
          "prefill": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
          "decode": ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
MIN_LAUNCHES = 16   # launch pairs a timed graph holds (gpu.py: 64 GEMVs); a prefill pair runs for ~1 ms
# Shared memory a block may use (bytes): H100/H200 227 KiB, A100 163 KiB
SMEM = {"sm80": 166912, "sm90": 232448}


def shapes(cfg, shape_cls) -> list:
    """One shape per (class, token count) of an MoE model (none for a dense one): k the hidden size, n the
    expert intermediate size, per_step the MoE layers."""
    if not cfg.num_experts:
        return []
    return [shape_cls(OP, c, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers, tokens=t)
            for c in CLASSES for t in TOKENS[c]]


def gate_up_smem(f: dict) -> int:
    """The gate_up kernel's pipelined shared memory in bf16: per stage an activation tile and two weight tiles
    (gate and up); the down's (one weight tile) is less."""
    return f["num_stages"] * (f["BLOCK_M"] * f["BLOCK_K"] + 2 * f["BLOCK_K"] * f["BLOCK_N"]) * 2


def grid(cls: str, arch: str, stages: int) -> list[dict]:
    """The class's tiles, pruned: no pipeline over the arch's shared memory; 8 warps only on tiles of at least
    32 x 64 outputs (a 16 x 64 tile leaves most of them idle). decode: the GEMV tiles at the current stages
    (its loads are not pipelined through shared memory)."""
    axes = GRID[cls]
    out = []
    for values in itertools.product(*axes.values()):
        f = dict(zip(axes, values))
        if cls == "decode":
            out.append({**f, "num_stages": stages})
            continue
        if gate_up_smem(f) > SMEM[arch] or (f["num_warps"] == 8 and f["BLOCK_M"] * f["BLOCK_N"] < 32 * 64):
            continue
        out.append(f)
    return out


def current_fields(cfg, dtype, arch: str, cls: str) -> tuple:
    """What a build with the table (and any override in force) compiles for the class: its gate_up's tile."""
    return tuple(sorted((n, v) for n, v in class_tiles(cfg, dtype, arch)[cls].items()))


def class_tiles(cfg, dtype, arch: str) -> dict:
    """class -> the fields of FIELDS a build compiles for its gate_up variant (the down's agree: checked)."""
    specs = variant_specs(cfg, dtype, arch)
    out = {}
    for cls, (gate_up, down) in CLASSES.items():
        up, dn = specs[gate_up], specs[down]
        out[cls] = {n: up.tune.get(n, up.constexprs.get(n)) for n in FIELDS[cls]}
        mine = {n: dn.tune.get(n, dn.constexprs.get(n)) for n in FIELDS[cls]}
        if mine != out[cls]:   # a tile the tune never made (the table's or a bench override): keep it visible
            out[cls] = {**out[cls], **{f"down_{n}": v for n, v in mine.items() if v != out[cls][n]}}
    return out


def variant_specs(cfg, dtype, arch: str, entries: dict | None = None) -> dict:
    """variant -> the KernelSpec a build (under tune entries, when given) compiles for the model's MoE op."""
    from engc.compiler import tune
    from engc.compiler.codegen.kernel_spec import TRITON_DTYPE, Build
    from engc.kernels.moe.specs import specs
    with tune.overridden(entries or {}):
        return {s.variant: s for s in specs(Build(cfg, TRITON_DTYPE[dtype], arch, 16))}


def entries_for(arch: str, cls: str, fields: dict, current: dict) -> dict:
    """The tune entries that make a build compile `fields` for the class: both variants' fields that differ
    from current (the down's BLOCK_M follows the gate_up's, so it never has one)."""
    gate_up, down = CLASSES[cls]
    changed = {n: v for n, v in fields.items() if current.get(n) != v}
    out = {}
    if changed:
        out[f"{arch}/{OP}/{gate_up}/any"] = changed
    down_fields = {n: v for n, v in changed.items() if n != "BLOCK_M"}
    if down_fields:
        out[f"{arch}/{OP}/{down}/any"] = down_fields
    return out


def candidate_specs(cfg, dtype, arch: str, shape, cand) -> list:
    """The two KernelSpecs (gate_up, down) a build under the candidate's entries compiles for its class."""
    cls = shape.name
    entries = entries_for(arch, cls, dict(cand.fields), {})
    specs = variant_specs(cfg, dtype, arch, entries)
    return [specs[v] for v in CLASSES[cls]]


def label(fields: dict) -> str:
    return "".join(f"{k}{fields[n]}" for k, n in (("m", "BLOCK_M"), ("n", "BLOCK_N"), ("k", "BLOCK_K"),
                                                   ("w", "num_warps"), ("s", "num_stages")) if n in fields)


def expert_bytes(shape, num_experts: int, top_k: int, dtype_bytes: int = 2) -> float:
    """The expert weights a launch pair reads at least once, expected: every expert that gets a pair (the
    routing is near uniform: an expert is missed with probability (1 - k/E)^T)."""
    hit = num_experts * (1 - (1 - top_k / num_experts) ** shape.tokens)
    return hit * shape.k * shape.n * 3 * dtype_bytes


def flops(shape, top_k: int) -> float:
    """The two GEMMs' multiply-adds x 2 over the T * k pairs (gate_up 2I x H, down H x I)."""
    return 2.0 * shape.tokens * top_k * 3 * shape.k * shape.n
