"""What `engc tune` measures and how its measurements become `engc build --tune` entries. No GPU here.

Shapes come from the model config through the build's own helpers (kernels/gemv/specs.py:dense_projections for
the plain projections, the SiLU-fused down at K = intermediate, N = hidden); each candidate is a tune bucket
plus the fields it sets, turned into a KernelSpec by kernels/gemv/specs.py:gemv_specs exactly as a build under
that override would make it.

How a winner becomes an override (the tune table's structure decides):
- silu_gemv, the SiLU-fused down at M=1: its entry ("m<=1") names no tile, so any tile may win; the
  winner is written as a rule for exactly N = hidden prepended to the entry's `silu_by_n` (first match
  wins), so the entry's other rules and fields stay as they are.
- gemv, plain projections at M=1: the classes of GEMV_PLAIN_CLASSES are named by their tile
  ("m<=1/n4k1024w4"), and the variant name in every bundle carries it, so a tune run never changes a
  class's BLOCK_N / BLOCK_K / num_warps: a "n4k1024w4" kernel with another tile would be a lie. It routes
  each (K, N) to the fastest of cuBLAS and the classes, and tunes the fields a name does not fix
  (num_stages; target_programs, the split-K rule's grid target). When a route changes, every class's
  `serves` is rewritten to the exact (K, N) points measured (other shapes then stay with cuBLAS): a tune
  file is for the model and GPU it was measured on.
- moe, the grouped expert GEMMs of a mixture-of-experts model: one tile per variant class (decode, grouped,
  prefill), each class's gate_up and down together, written as "<arch>/moe/<variant>/any" entries over the
  spec's defaults (tune/moe.py).
A projection leaves its current route or config only for a gain of more than `margin` (noise).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engc.compiler import tune
from engc.errors import UserError
from engc.compiler.tune import moe
from engc.kernels.gemv import specs as gemv_kernels

OPS = ("gemv", "silu_gemv", "moe")
SILU_BUCKET = "m<=1"   # the M class whose entry builds the SiLU-fused down GEMV
# Tile grid of the SiLU-fused down: BLOCK_K a multiple of 8 elements x 32 threads x num_warps, so the row
# of x loads in the W tile's own layout (kernels/gemv/triton.py)
SILU_TILES = [(bn, bk, w) for bn in (2, 4, 8, 16) for bk, w in
              ((512, 2), (1024, 2), (1024, 4), (2048, 2), (2048, 4), (2048, 8))]
STAGES = (1, 2, 3)
TARGET_MULTS = (1, 2, 4)   # target_programs = this x the GPU's multiprocessors


@dataclass(frozen=True)
class Shape:
    op: str         # "gemv" (plain x @ W^T at M=1), "silu_gemv" (silu_mul(gate_up) @ W^T at M=1), "moe"
    name: str       # "qkv", "o", "gate_up", "lm_head", "down" ("+"-joined where two share a shape); moe: the
                    # variant class (tune/moe.py CLASSES)
    k: int          # moe: the hidden size
    n: int          # moe: the expert intermediate size
    per_step: int   # launches per decode step (layers; 1 for the lm_head)
    tokens: int = 0   # moe: the batch's tokens (the routing and the schedule follow from them)

    @property
    def label(self) -> str:
        return f"{self.name} T={self.tokens}" if self.op == moe.OP else f"{self.name} {self.k}x{self.n}"


@dataclass(frozen=True)
class Candidate:
    bucket: str | None      # tune bucket ("m<=1/n4k1024w4", "m<=1"); None = cuBLAS
    fields: tuple = ()      # sorted (field, value) pairs set over the table entry

    @property
    def label(self) -> str:
        if self.bucket is None:
            return "cuBLAS"
        f = dict(self.fields)
        if self.bucket in moe.CLASSES:
            return moe.label(f)
        if self.bucket == SILU_BUCKET:
            return (f"n{f['BLOCK_N']}k{f['BLOCK_K']}w{f['num_warps']}s{f['num_stages']}"
                    f" t{f['target_programs']}")
        return f"{self.bucket.split('/')[-1]} s{f['num_stages']} t{f['target_programs']}"


@dataclass
class Measured:
    shape: Shape
    cand: Candidate
    status: str = "untimed"   # ok, wrong (output differs from torch: discarded), failed (no kernel), untimed
    us: float = float("inf")
    err: float = 0.0


@dataclass
class Choice:
    shape: Shape
    current: Candidate
    current_us: float
    best: Candidate
    best_us: float
    cublas_us: float = float("inf")
    changed: bool = False
    fastest: tuple | None = None   # moe: (candidate, us) fastest at this shape alone (the class picks one tile)


@dataclass
class TunePlan:
    arch: str
    dtype: torch.dtype
    cfg: object                     # ModelConfig
    shapes: list[Shape]
    current: dict[Shape, Candidate]  # what the table gives each shape now
    candidates: dict[Shape, list[Candidate]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ the model's shapes

def source_config(src: str) -> tuple[str, dict]:
    """(name, HF config) of SRC, as `engc build` reads it; an HF folder needs only its config.json."""
    from engc.compiler.build import read_source
    path = Path(src)
    if src != "default" and path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
        try:
            return path.resolve().name, json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{config} is not valid JSON: {e}") from None
    ckpt = read_source(src)   # 'default', a .gguf file, or build's one-line refusal
    return ckpt.name, ckpt.hf_config


def model_config(hf: dict):
    from engc.compiler.frontend.decoder import resolve_config
    cfg = resolve_config(hf)
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(f"num_attention_heads {cfg.num_heads} is not a multiple of "
                        f"num_key_value_heads {cfg.num_kv_heads}")
    return cfg


def model_shapes(cfg, ops, int4: bool = False, int4_lm_head: bool = False) -> list[Shape]:
    """The decode GEMV shapes a bundle of cfg runs at M=1 (an int4 checkpoint: the lm_head only; one with
    an int4 lm_head too: none)."""
    from engc.kernels.gemv.specs import dense_projections
    names: dict[tuple[int, int], list[str]] = {}
    shared = [((cfg.hidden_size, 2 * cfg.shared_expert_intermediate_size), "shared_gate_up")] \
        if cfg.shared_expert_intermediate_size else []
    for kn, name in [((cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size), "qkv"), ((cfg.q_size, cfg.hidden_size), "o"),
                     ((cfg.hidden_size, 2 * cfg.intermediate_size), "gate_up"), *shared]:
        names.setdefault(kn, []).append(name)
    shapes = []
    if "gemv" in ops and not (int4 and int4_lm_head):
        for k, n in sorted(dense_projections(cfg, layers=not int4)):
            layer = [] if int4 else names.get((k, n), [])
            head = (k, n) == (cfg.hidden_size, cfg.vocab_size)
            shapes.append(Shape("gemv", "+".join(layer + ["lm_head"] * head), k, n,
                                cfg.num_layers * len(layer) + head))
    if "silu_gemv" in ops and not int4:
        for i in cfg.mlp_sizes:
            name = "down" if i == cfg.intermediate_size else "shared_down"
            shapes.append(Shape("silu_gemv", name, i, cfg.hidden_size, cfg.num_layers))
    if "moe" in ops and not int4:   # candidates time float experts; int4 ones take the same entries, untimed
        shapes += moe.shapes(cfg, Shape)
    return shapes


# ------------------------------------------------------------------------------------------ candidates

def kernel_specs(cfg, dtype, arch: str, shape: Shape, cand: Candidate) -> list:
    """The KernelSpecs a build under this candidate's override compiles for shape and that are timed together
    (none: cuBLAS; moe: the class's gate_up and down)."""
    if shape.op == moe.OP:
        return moe.candidate_specs(cfg, dtype, arch, shape, cand)
    spec = gemv_spec(cfg, dtype, arch, shape, cand)
    return [] if spec is None else [spec]


def gemv_spec(cfg, dtype, arch: str, shape: Shape, cand: Candidate):
    """The KernelSpec a build under this candidate's override would compile for shape (None: cuBLAS)."""
    from engc.kernels.gemv.specs import gemv_specs
    from engc.compiler.codegen.kernel_spec import TRITON_DTYPE
    if cand.bucket is None:
        return None
    t = TRITON_DTYPE[dtype]
    if shape.op == "silu_gemv":
        # silu_by_n []: the candidate's tile is not replaced by the entry's per-N rules
        ov = {SILU_BUCKET: dict(cand.fields, silu_by_n=[])}
        specs = gemv_specs(cfg, t, arch, ov, classes=(SILU_BUCKET,), projections=set())
    else:
        # serve every N at this K (N is a run-time argument: one kernel per K serves all shapes of it)
        ov = {cand.bucket: dict(cand.fields, serves=[[[shape.k, shape.k], [1, 0]]])}
        specs = gemv_specs(cfg, t, arch, ov, classes=(cand.bucket,), projections={(shape.k, shape.n)})
    silu = shape.op == "silu_gemv"
    found = [s for s in specs if s.constexprs["K"] == shape.k and bool(s.constexprs["SILU"]) == silu]
    if len(found) != 1:
        raise RuntimeError(f"gemv_specs gave {len(found)} kernels for {shape.label} under {cand.label}")
    return found[0]


def current_choice(cfg, dtype, arch: str, shape: Shape) -> Candidate:
    """What a build with the table as it is gives shape: the runtime's pick (kernels/gemv.pick) among the
    bundle's GEMV kernels, as a candidate with its fields spelled out; cuBLAS where none serves it. moe: the
    class's tile."""
    if shape.op == moe.OP:
        return Candidate(shape.name, moe.current_fields(cfg, dtype, arch, shape.name))
    from engc.kernels.gemv.specs import gemv_specs
    from engc.compiler.codegen.kernel_spec import TRITON_DTYPE
    from engc.kernels import gemv
    specs = gemv_specs(cfg, TRITON_DTYPE[dtype], arch)
    by_variant = {s.variant: s for s in specs}
    silu = shape.op == "silu_gemv"
    variant = gemv.pick(gemv.variant_table({v: s.launch for v, s in by_variant.items()}), shape.k, silu, 1,
                        shape.n)
    if variant is None:
        return Candidate(None)
    spec = by_variant[variant]
    bucket = spec.tune_key.split("/", 3)[3].removesuffix("+override")
    return Candidate(bucket, _fields(spec, silu))


def _fields(spec, silu: bool) -> tuple:
    names = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "target_programs") if silu else \
        ("num_stages", "target_programs")
    return tuple(sorted((n, spec.tune[n]) for n in names))


def candidates(shape: Shape, current: Candidate, arch: str, sms: int) -> list[Candidate]:
    """The grid for one shape: cuBLAS, then the current choice, then the rest (moe: no cuBLAS)."""
    if shape.op == moe.OP:
        cur = dict(current.fields)
        grid = [Candidate(shape.name, tuple(sorted(f.items())))
                for f in moe.grid(shape.name, arch, cur.get("num_stages", 2))]
        return list(dict.fromkeys([current] + grid))
    targets = sorted({m * sms for m in TARGET_MULTS})
    if shape.op == "silu_gemv":
        cur = dict(current.fields)
        grid = [Candidate(SILU_BUCKET, tuple(sorted(dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w,
                                                          num_stages=cur["num_stages"],
                                                          target_programs=tp).items())))
                for bn, bk, w in SILU_TILES for tp in sorted({*targets, cur["target_programs"]})]
        out = [Candidate(None), current] + grid   # cuBLAS for the record (no override routes the down there)
    else:
        out = [Candidate(None), current]
        for bucket in gemv_kernels.PLAIN_CLASSES:
            entry = tune.TUNE[f"{arch}/gemv/*/{bucket}"]
            for s, tp in itertools.product(sorted({*STAGES, entry["num_stages"]}),
                                           sorted({*targets, entry["target_programs"]})):
                out.append(Candidate(bucket, (("num_stages", s), ("target_programs", tp))))
    return list(dict.fromkeys(out))   # unique, first occurrence kept


def table_fields(arch: str, bucket: str) -> tuple:
    entry = tune.TUNE[f"{arch}/gemv/*/{bucket}"]
    return (("num_stages", entry["num_stages"]), ("target_programs", entry["target_programs"]))


# ------------------------------------------------------------------------------------------- selection

def choose(plan: TunePlan, measured: list[Measured], margin: float) -> list[Choice]:
    """Per shape, what to build with: the current choice unless something measured faster by > margin."""
    us = {(m.shape, m.cand): m.us for m in measured if m.status == "ok"}
    time = lambda s, c: us.get((s, c), float("inf"))  # noqa: E731
    choices = []
    silu = [s for s in plan.shapes if s.op == "silu_gemv"]
    for s in silu:
        cur = plan.current[s]
        best = min((c for c in plan.candidates[s] if c.bucket), key=lambda c: (time(s, c), c != cur))
        win = time(s, best) < time(s, cur) * (1 - margin)
        choices.append(Choice(s, cur, time(s, cur), best if win else cur, time(s, best if win else cur),
                              time(s, Candidate(None)), changed=win and best != cur))
    plain = [s for s in plan.shapes if s.op == "gemv"]
    if plain:
        choices += _choose_plain(plan, plain, time, margin)
    choices += _choose_moe(plan, [s for s in plan.shapes if s.op == moe.OP], time, margin)
    return sorted(choices, key=lambda c: plan.shapes.index(c.shape))


def _choose_moe(plan: TunePlan, shapes: list[Shape], time, margin: float) -> list[Choice]:
    """One tile per class: the candidate timed at every token count of the class whose time, as a fraction of
    the current tile's and averaged over them, is least; kept only if under 1 - margin."""
    out = []
    for cls in dict.fromkeys(s.name for s in shapes):
        mine = [s for s in shapes if s.name == cls]
        cur = plan.current[mine[0]]

        def score(c):
            return sum(time(s, c) / time(s, cur) for s in mine) / len(mine)
        timed = [c for c in plan.candidates[mine[0]] if all(time(s, c) < float("inf") for s in mine)]
        best = min(timed, key=lambda c: (score(c), c != cur), default=cur)
        win = best != cur and score(best) < 1 - margin
        chosen = best if win else cur
        for s in mine:
            fastest = min(plan.candidates[s], key=lambda c: time(s, c))
            out.append(Choice(s, cur, time(s, cur), chosen, time(s, chosen), changed=win,
                              fastest=(fastest, time(s, fastest))))
    return out


def _choose_plain(plan: TunePlan, shapes: list[Shape], time, margin: float) -> list[Choice]:
    """Settings per class and a route per shape: among every combination of class settings, the one with
    the least decode-step time, each shape routed to its fastest option if that beats its current route
    under those settings by > margin; a class keeps its table settings unless the shapes it serves gain
    more than margin from the change."""
    arch = plan.arch
    options = {b: sorted({c.fields for s in shapes for c in plan.candidates[s] if c.bucket == b})
               for b in gemv_kernels.PLAIN_CLASSES}
    stock = {b: table_fields(arch, b) for b in gemv_kernels.PLAIN_CLASSES}

    def routes(settings):
        out = {}
        for s in shapes:
            cur = plan.current[s]
            opts = [Candidate(None)] + [Candidate(b, settings[b]) for b in gemv_kernels.PLAIN_CLASSES]
            stay = Candidate(cur.bucket, settings[cur.bucket]) if cur.bucket else cur
            best = min(opts, key=lambda c: (time(s, c), c.bucket != cur.bucket))
            out[s] = best if time(s, best) < time(s, stay) * (1 - margin) else stay
        return out

    def step_us(r):
        return sum(s.per_step * time(s, c) for s, c in r.items())

    combos = [dict(zip(options, fs)) for fs in itertools.product(*options.values())]
    # ties go to the combination that changes the fewest fields of the table
    settings = min(combos, key=lambda st: (step_us(routes(st)),
                                           sum(x != y for b in st for x, y in zip(st[b], stock[b]))))
    r = routes(settings)
    for b in gemv_kernels.PLAIN_CLASSES:   # a settings change must pay for itself on the shapes it serves
        mine = [s for s in shapes if r[s].bucket == b]
        if settings[b] != stock[b] and not (
                sum(s.per_step * time(s, Candidate(b, settings[b])) for s in mine)
                < sum(s.per_step * time(s, Candidate(b, stock[b])) for s in mine) * (1 - margin)):
            settings[b] = stock[b]
            r = routes(settings)
    out = []
    for s in shapes:
        cur = plan.current[s]
        out.append(Choice(s, cur, time(s, cur), r[s], time(s, r[s]), time(s, Candidate(None)),
                          changed=r[s] != cur))
    return out


# -------------------------------------------------------------------------------------------- overrides

def overrides(plan: TunePlan, choices: list[Choice]) -> dict:
    """The choices as `engc build --tune` entries (only what differs from the table)."""
    arch, out = plan.arch, {}
    for c in choices:
        if c.shape.op == moe.OP and c.changed:
            out.update(moe.entries_for(arch, c.shape.name, dict(c.best.fields), dict(c.current.fields)))
    for c in choices:
        if c.shape.op == "silu_gemv" and c.changed:
            key = f"{arch}/gemv/*/{SILU_BUCKET}"
            rules = out.get(key, {}).get("silu_by_n") or _jsonable(tune.TUNE[key].get("silu_by_n", ()))
            out[key] = {"silu_by_n": [[c.shape.n, c.shape.n, dict(c.best.fields)], *rules]}
    plain = [c for c in choices if c.shape.op == "gemv"]
    rerouted = any(c.best.bucket != c.current.bucket for c in plain)
    for b in gemv_kernels.PLAIN_CLASSES:
        key, fields = f"{arch}/gemv/*/{b}", {}
        chosen = {c.best.fields for c in plain if c.best.bucket == b}
        if len(chosen) > 1:
            raise RuntimeError(f"{b}: shapes chose different settings {sorted(chosen)}")
        stock = dict(table_fields(arch, b))
        for name, value in next(iter(chosen), ()):
            if stock[name] != value:
                fields[name] = value
        if rerouted:
            fields["serves"] = [[[c.shape.k, c.shape.k], [c.shape.n, c.shape.n]]
                                for c in sorted(plain, key=lambda c: (c.shape.k, c.shape.n)) if c.best.bucket == b]
        if fields:
            out[key] = fields
    return out


def _jsonable(v):
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def verify(plan: TunePlan, choices: list[Choice], entries: dict) -> None:
    """Under entries, a build of this model must compile exactly the choices: checked with the build's own
    spec functions (model_specs refuses overlapping classes) and the runtime's pick. A mismatch is a bug."""
    from engc.compiler.build import KV_BLOCK_SIZE
    from engc.compiler.codegen.specs import model_specs
    tune.check_overrides(entries, "engc tune")
    with tune.overridden(entries):
        model_specs(plan.cfg, plan.dtype, plan.arch, KV_BLOCK_SIZE)
        for c in choices:
            got = current_choice(plan.cfg, plan.dtype, plan.arch, c.shape)
            if got != c.best:
                raise RuntimeError(f"engc tune: the override gives {c.shape.label} {got.label}, "
                                   f"not the chosen {c.best.label}")
