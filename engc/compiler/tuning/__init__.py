"""engc tune: measure kernel configs for one model on this machine's GPU; write the ones that beat the tune
table (engc/compiler/codegen/tune.py) as a file `engc build --tune` takes.

    engc tune SRC -o tune.json          # on the GPU machine (only config.json of an HF folder is read)
    engc build SRC --arch sm90 --tune tune.json -o bundle/      # anywhere

plan.py says what is measured and how winners map onto the table; gpu.py measures. The file holds only
entries that differ from the table, plus `_meta` (GPU, arch, versions, date, every measurement), which
tune.check_overrides skips: it changes neither the kernels nor the bundle.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from engc.compiler.tuning import plan as tp
from engc.errors import UserError

CHECK_TOL = 1e-2   # relative error (Frobenius) of a candidate's output against the op's torch reference
DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TuneOptions:
    ops: tuple[str, ...] = tp.OPS
    dtype: str = "auto"         # auto: bfloat16, as `engc build --arch smXX` makes it
    budget_s: float = 150.0     # timing stops taking new candidates after this (compiling counts too)
    margin: float = 0.03        # a config replaces the table's only if faster by more than this fraction

    def validate(self) -> "TuneOptions":
        unknown = [o for o in self.ops if o not in tp.OPS]
        if unknown or not self.ops:
            raise UserError(f"unknown --ops '{','.join(unknown) or ''}'; known: {', '.join(tp.OPS)}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype}: engc tune measures the GEMV kernels of bfloat16 and float16 "
                            "bundles (float32 bundles keep cuBLAS); use auto, bfloat16 or float16")
        return self


def tune(src: str, out: Path, opts: TuneOptions, say=None, bench=None, gpu=None, clock=time.monotonic) -> dict:
    """Measure, choose, write `out`; returns {"entries", "choices", "meta"}.
    bench(plan, say) / gpu() replace the GPU (tests): gpu() -> (arch, name, multiprocessors)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    opts.validate()
    started = clock()
    name, hf = tp.source_config(src)
    cfg = tp.model_config(hf)
    from engc.compiler.frontend.quantized import is_quantized
    if gpu is None:
        from engc.compiler.tuning.gpu import local_gpu as gpu
    arch, gpu_name, sms = gpu()
    dtype = DTYPES[opts.dtype]
    shapes = tp.model_shapes(cfg, opts.ops, int4=is_quantized(hf))
    if not shapes:
        raise UserError(f"{name}: no {'/'.join(opts.ops)} kernel to tune for this model")
    plan = tp.TunePlan(arch, dtype, cfg, shapes, {s: tp.current_choice(cfg, dtype, arch, s) for s in shapes})
    plan.candidates = {s: tp.candidates(s, plan.current[s], arch, sms) for s in shapes}
    if bench is None:
        from engc.compiler.tuning.gpu import GpuBench as bench
    b = bench(plan, say)
    pairs = [(s, c) for s in shapes for c in plan.candidates[s]]
    say(f"engc tune: {name} on {gpu_name} ({arch}): compiling {len(pairs)} candidates of {len(shapes)} shapes")
    b.prepare(pairs)
    measured = measure(plan, b, started + opts.budget_s, clock, say)
    choices = tp.choose(plan, measured, opts.margin)
    entries = tp.overrides(plan, choices)
    tp.verify(plan, choices, entries)
    meta = _meta(name, gpu_name, arch, sms, dtype, opts, measured, clock() - started)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**entries, "_meta": meta}, indent=1, sort_keys=True) + "\n")
    return {"entries": entries, "choices": choices, "meta": meta}


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
            if not bench.compiled(shape, cand):
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


def _meta(name, gpu_name, arch, sms, dtype, opts, measured, seconds) -> dict:
    import triton
    from importlib.metadata import PackageNotFoundError, version
    try:
        engc_version = version("engc")
    except PackageNotFoundError:
        engc_version = "unknown"
    return {"gpu": gpu_name, "arch": arch, "multiprocessors": sms, "model": name, "dtype": str(dtype)[6:],
            "torch": torch.__version__, "triton": triton.__version__, "engc": engc_version,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": round(seconds, 1),
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(opts).items()},
            "measured": [{"shape": m.shape.label, "op": m.shape.op, "candidate": m.cand.label, "status": m.status,
                          **({"us": round(m.us, 3)} if math.isfinite(m.us) else {}),
                          **({"rel_err": m.err} if m.status in ("ok", "wrong") else {})} for m in measured]}


def summary(result: dict, out: Path) -> list[str]:
    """The table printed after a run: per shape, the table's choice and time, the best, and the gain."""
    rows = [f"{'op':<10} {'shape':<22} {'x/step':>6} {'cuBLAS':>8} {'current':>8} {'best':>8} {'gain':>6}  "
            f"{'current config':<26} chosen"]
    saved = 0.0
    for c in result["choices"]:
        gain = c.current_us / c.best_us if math.isfinite(c.best_us) and c.best_us else float("nan")
        saved += c.shape.per_step * (c.current_us - c.best_us) if c.changed else 0.0
        rows.append(f"{c.shape.op:<10} {c.shape.label:<22} {c.shape.per_step:>6} {_us(c.cublas_us)} "
                    f"{_us(c.current_us)} {_us(c.best_us)} {gain:5.2f}x  {c.current.label:<26} "
                    f"{c.best.label if c.changed else '(keep)'}")
    n = len(result["entries"])
    rows.append(f"wrote {out}: {n} tune entr{'y' if n == 1 else 'ies'}"
                + (f"; about {saved:.1f} us less GEMV time per decode step" if n else
                   f" (nothing beat the table by more than {result['meta']['options']['margin']:.0%})")
                + f"; build with: engc build SRC --arch {result['meta']['arch']} --tune {out} -o BUNDLE")
    return rows


def _us(v: float) -> str:
    return f"{v:8.2f}" if math.isfinite(v) else f"{'-':>8}"
