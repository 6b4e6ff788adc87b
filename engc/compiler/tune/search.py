"""engc tune: measure kernel configs for one model on the GPU it will serve on; write the ones that beat the
tune table (engc/compiler/tune/table_<arch>.jsonl) as a file `engc build --tune` takes.

A config's speed depends on the Triton that compiled it (bench/results/HISTORY.md), so the candidates are
compiled where bundles are built, by the build's own path, and the GPU machine only loads and times those cubins:

    engc tune SRC --prepare DIR --arch sm90       # where engc build runs, no GPU (prepared.py)
    engc tune --from DIR -o tune.json             # on the GPU (gpu.py: load, check vs torch, time)
    engc build SRC --arch sm90 --tune tune.json -o bundle/
    engc tune SRC -o tune.json                    # both in one process, on a GPU machine that also builds

plan.py says what is measured and how winners map onto the table. The file holds only entries that differ
from the table, plus `_meta` (GPU, arch, the compiling Triton, date, every measurement), which
tune.check_overrides skips: it changes neither the kernels nor the bundle.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from engc.compiler import tune as table
from engc.compiler.tune import plan as tp
from engc.compiler.tune import prepared
from engc.errors import UserError

CHECK_TOL = 1e-2   # relative error (Frobenius) of a candidate's output against the op's torch reference
DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16}
NOTE = ("per-kernel times over cold L2 in CUDA graphs, each launch starting from an idle GPU after a tiny "
        "kernel: they leave out what a decode step adds (programmatic dependent launch overlapping "
        "neighbours, warm caches); time the bundle built with this file end to end against a stock one "
        "before keeping it")


@dataclass(frozen=True)
class TuneOptions:
    ops: tuple[str, ...] = tp.OPS
    dtype: str = "auto"         # auto: bfloat16, as `engc build --arch smXX` makes it
    budget_s: float = 150.0     # timing stops taking new candidates after this
    margin: float = 0.03        # a config replaces the table's only if faster by more than this fraction

    def validate(self) -> "TuneOptions":
        unknown = [o for o in self.ops if o not in tp.OPS]
        if unknown or not self.ops:
            raise UserError(f"unknown --ops '{','.join(unknown) or ''}'; known: {', '.join(tp.OPS)}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype}: engc tune measures the GEMV kernels of bfloat16 and float16 "
                            "bundles (float32 bundles keep cuBLAS); use auto, bfloat16 or float16")
        return self


def _say(say):
    return say or (lambda msg: print(msg, file=sys.stderr, flush=True))


def prepare(src: str, folder: Path, opts: TuneOptions, arch: str = "sm90", sms: int | None = None, say=None,
            compiler=prepared.compile_candidates) -> dict:
    """Derive SRC's shapes and candidates for arch (a GPU of `sms` multiprocessors: the split-K targets are
    multiples of it; default the arch's H100/H200 or A100 count) and compile them into folder. No GPU."""
    say = _say(say)
    opts.validate()
    if arch not in table.ARCHS:
        raise UserError(f"--arch {arch}: engc tune prepares kernels for {', '.join(table.ARCHS)}")
    sms = sms or table.sm_count(arch)
    name, hf = tp.source_config(src)
    cfg = tp.model_config(hf)
    from engc.compiler.frontend.quantized import is_quantized
    int4_head = bool((hf.get("quantization_config") or {}).get("lm_head"))  # engc quantize --lm-head
    shapes = tp.model_shapes(cfg, opts.ops, int4=is_quantized(hf), int4_lm_head=int4_head)
    if not shapes:
        raise UserError(f"{name}: no {'/'.join(opts.ops)} kernel to tune for this model")
    dtype = DTYPES[opts.dtype]
    plan = tp.TunePlan(arch, dtype, cfg, shapes, {s: tp.current_choice(cfg, dtype, arch, s) for s in shapes})
    plan.candidates = {s: tp.candidates(s, plan.current[s], arch, sms) for s in shapes}
    return prepared.write(Path(folder), plan, {"model": name, "sms": sms, "ops": list(opts.ops)}, say, compiler)


def tune_from(folder: Path, out: Path, opts: TuneOptions, say=None, bench=None, gpu=None,
              clock=time.monotonic) -> dict:
    """Load a tune-prepare folder's cubins on this machine's GPU, check and time them, choose, write `out`;
    returns {"entries", "choices", "meta"}. bench(prepared, say) / gpu() replace the GPU (tests):
    gpu() -> (arch, name, multiprocessors)."""
    say = _say(say)
    opts.validate()
    started = clock()
    prep = prepared.load(folder)
    if gpu is None:
        from engc.compiler.tune.gpu import local_gpu as gpu
    arch, gpu_name, sms = gpu()
    plan = prep.plan
    if arch != plan.arch:
        raise UserError(f"--from {folder}: prepared for {plan.arch}, but this GPU ({gpu_name}) is {arch}: "
                        f"prepare it with --arch {arch}")
    if sms != prep.info["sms"]:
        raise UserError(f"--from {folder}: prepared for a GPU of {prep.info['sms']} multiprocessors; this one "
                        f"({gpu_name}) has {sms}: prepare it with --sms {sms}")
    if bench is None:
        from engc.compiler.tune.gpu import GpuBench as bench
    n = sum(len(c) for c in plan.candidates.values())
    say(f"engc tune: {prep.info['model']} on {gpu_name} ({arch}): {n} candidates of {len(plan.shapes)} shapes, "
        f"compiled by Triton {prep.info['triton']}")
    b = bench(prep, say)
    measured = measure(plan, b, started + opts.budget_s, clock, say)
    choices = tp.choose(plan, measured, opts.margin)
    entries = tp.overrides(plan, choices)
    tp.verify(plan, choices, entries)
    meta = _meta(prep, gpu_name, sms, opts, measured, clock() - started)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**entries, "_meta": meta}, indent=1, sort_keys=True) + "\n")
    return {"entries": entries, "choices": choices, "meta": meta, "plan": plan}


def tune(src: str, out: Path, opts: TuneOptions, say=None, bench=None, gpu=None, clock=time.monotonic,
         compiler=prepared.compile_candidates) -> dict:
    """prepare + tune_from in one process, for a GPU machine that also builds: the candidates are compiled by
    this machine's Triton, so the file fits bundles built here (its _meta names that Triton)."""
    if gpu is None:
        from engc.compiler.tune.gpu import local_gpu as gpu
    arch, gpu_name, sms = gpu()   # refuse before compiling where there is no GPU
    with tempfile.TemporaryDirectory(prefix="engc-tune-") as tmp:
        folder = Path(tmp) / "prepared"
        prepare(src, folder, opts, arch, sms, say, compiler)
        return tune_from(folder, out, opts, say, bench, gpu=lambda: (arch, gpu_name, sms), clock=clock)


def measure(plan: tp.TunePlan, bench, deadline: float, clock, say) -> list[tp.Measured]:
    """Check, then time, each candidate of each shape. The current choice (and cuBLAS) are always timed;
    the others while the shape's share of the budget lasts. A wrong output is discarded, loudly."""
    out = []
    for i, shape in enumerate(plan.shapes):
        share = clock() + max(0.0, deadline - clock()) / (len(plan.shapes) - i)
        for cand in plan.candidates[shape]:
            m = tp.Measured(shape, cand)
            out.append(m)
            must = cand == plan.current[shape] or cand.bucket is None
            if not must and clock() > share:
                continue
            if not bench.ready(shape, cand):
                m.status = "failed"
                continue
            m.err = bench.check(shape, cand)
            if not m.err <= CHECK_TOL:   # nan too
                m.status = "wrong"
                say(f"WRONG OUTPUT, discarded: {shape.label} {cand.label}: rel err {m.err:.2e} vs torch")
                continue
            m.us, m.status = bench.time_us(shape, cand), "ok"
        timed = [m for m in out if m.shape == shape]
        say(f"{shape.label}: {sum(m.status == 'ok' for m in timed)}/{len(timed)} candidates timed"
            + "".join(f", {n} {st}" for st in ("wrong", "failed", "untimed")
                      if (n := sum(m.status == st for m in timed))))
    return out


def _meta(prep: prepared.Prepared, gpu_name, sms, opts, measured, seconds) -> dict:
    from importlib.metadata import PackageNotFoundError, version
    try:
        local_triton = version("triton")
    except PackageNotFoundError:
        local_triton = None
    plan = prep.plan
    return {"gpu": gpu_name, "arch": plan.arch, "multiprocessors": sms, "model": prep.info["model"],
            "dtype": prepared.DTYPE_NAMES[plan.dtype],
            # triton: the compiler of the timed cubins (engc build --tune warns when its own differs)
            "triton": prep.info["triton"], "engc": prep.info["engc"],
            "gpu_machine": {"torch": torch.__version__, "triton": local_triton, "engc": prepared.engc_version()},
            "torch": torch.__version__, "note": NOTE,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": round(seconds, 1),
            "options": {"ops": prep.info["ops"], "budget_s": opts.budget_s, "margin": opts.margin},
            "measured": [{"shape": m.shape.label, "op": m.shape.op, "candidate": m.cand.label, "status": m.status,
                          **({"us": round(m.us, 3)} if math.isfinite(m.us) else {}),
                          **({"rel_err": m.err} if m.status in ("ok", "wrong") else {})} for m in measured]}


def summary(result: dict, out: Path) -> list[str]:
    """The table printed after a run: per shape, the table's choice and time, the best, and the gain (the MoE
    op's in a table of its own, moe_summary)."""
    rows = [f"{'op':<10} {'shape':<22} {'x/step':>6} {'cuBLAS':>8} {'current':>8} {'best':>8} {'gain':>6}  "
            f"{'current config':<26} chosen"]
    saved = 0.0
    moe_rows = moe_summary(result)
    if moe_rows and not any(c.shape.op != tp.moe.OP for c in result["choices"]):
        rows = []
    for c in (c for c in result["choices"] if c.shape.op != tp.moe.OP):
        gain = c.current_us / c.best_us if math.isfinite(c.best_us) and c.best_us else float("nan")
        saved += c.shape.per_step * (c.current_us - c.best_us) if c.changed else 0.0
        rows.append(f"{c.shape.op:<10} {c.shape.label:<22} {c.shape.per_step:>6} {_us(c.cublas_us)} "
                    f"{_us(c.current_us)} {_us(c.best_us)} {gain:5.2f}x  {c.current.label:<26} "
                    f"{c.best.label if c.changed else '(keep)'}")
    n = len(result["entries"])
    rows += moe_rows
    rows.append(f"wrote {out}: {n} tune entr{'y' if n == 1 else 'ies'}"
                + (f"; about {saved:.1f} us less GEMV time per decode step" if saved else "" if n else
                   f" (nothing beat the table by more than {result['meta']['options']['margin']:.0%})")
                + f"; build with: engc build SRC --arch {result['meta']['arch']} --tune {out} -o BUNDLE")
    rows.append("per-kernel times (cold L2, each launch from an idle GPU): time the bundle built with it end to "
                "end before keeping it")
    return rows


def moe_summary(result: dict) -> list[str]:
    """Per MoE class and token count: the current tile's time, the chosen one's, the fastest at that count
    alone, and the chosen time's implied rates: the expert bytes read (each expert a batch routes to, once)
    per second and the GEMMs' TFLOP/s. Times are a layer's gate_up + down launch pair."""
    choices = [c for c in result["choices"] if c.shape.op == tp.moe.OP]
    if not choices:
        return []
    cfg = result["plan"].cfg
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    rows = [f"{'moe class':<10} {'T':>5} {'x/step':>6} {'current':>9} {'chosen':>9} {'gain':>6} {'GB/s':>7} "
            f"{'TFLOP/s':>7}  {'current tile':<18} {'chosen tile':<18} fastest at this T alone"]
    for c in choices:
        s = c.shape
        gain = c.current_us / c.best_us if math.isfinite(c.best_us) and c.best_us else float("nan")
        rate = (lambda v: v / (c.best_us * 1e-6)) if math.isfinite(c.best_us) and c.best_us > 0 else \
            (lambda v: float("nan"))
        fastest, fastest_us = c.fastest or (c.best, c.best_us)
        rows.append(f"{s.name:<10} {s.tokens:>5} {s.per_step:>6} {_us(c.current_us):>9} {_us(c.best_us):>9} "
                    f"{gain:5.2f}x {rate(tp.moe.expert_bytes(s, e, k)) / 1e9:7.0f} "
                    f"{rate(tp.moe.flops(s, k)) / 1e12:7.1f}  {c.current.label:<18} "
                    f"{c.best.label if c.changed else '(keep)':<18} {fastest.label} {_us(fastest_us).strip()}")
    return rows


def _us(v: float) -> str:
    return f"{v:8.2f}" if math.isfinite(v) else f"{'-':>8}"
