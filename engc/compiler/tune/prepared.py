"""A tune-prepare folder: every candidate of `engc tune` compiled ahead of time where `engc build` runs, so
the GPU machine times the cubins the build itself would ship, not what its own Triton makes of them.

    engc tune SRC --prepare DIR --arch sm90     # build machine, no GPU: shapes, candidates, cubins
    engc tune --from DIR -o tune.json           # GPU machine: load, check, time (no compiling there)

DIR/tune_plan.json holds the plan (model config, shapes, the table's current choice, the candidate grid),
a kernel record per compiled candidate (codegen/record.kernel_record: the build's own record, with the
candidate's launch constants), the sha256 of every cubin, the compiling Triton version and a digest of the
arch's gemv and moe tune entries and the MoE spec's defaults (a checkout whose differ would mislabel the
current choice). The records are stored once per cubin ("kernels": the first of its candidates' records); a
candidate names its cubin ("kernel") and keeps only the launch constants and tune fields in which its record differs from that one
(the candidates of one cubin differ in those alone, e.g. target_programs), so the file stays small.
DIR/kernels/<arch>/<sha256[:16]>.cubin: one file per distinct kernel (candidates differing only in a launch
constant such as target_programs share it). A candidate of kernels timed together (moe: the class's
gate_up and down) keeps one such entry per kernel ("parts"), in launch order. No PTX: the folder is checked
to match the GPU's arch.
Deterministic: no dates, sorted keys, content-named files.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engc.compiler import tune
from engc.compiler.tune import plan as tp
from engc.errors import UserError
from engc.kernels.gemv import specs as gemv_kernels

FORMAT = "engc-tune-prepare"
VERSION = 3   # 3: a candidate of several kernels (moe) lists them as parts
PLAN_FILE = "tune_plan.json"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class Prepared:
    """A loaded tune-prepare folder: the plan, each candidate's kernel record (None: cuBLAS or a config
    that did not compile; a list of records for a candidate of several kernels) and the folder's provenance
    (model, arch, sms, triton, engc)."""
    folder: Path
    plan: tp.TunePlan
    records: dict   # (Shape, Candidate) -> record | [record, ...] | None
    info: dict

    def cubin(self, record: dict) -> bytes:
        """A record's cubin, checked against the sha256 the folder was written with."""
        path = self.folder / record["cubin"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"{self.folder}: cannot read {record['cubin']} ({e.strerror or e}); "
                            "prepare it again") from None
        if hashlib.sha256(data).hexdigest() != self.info["files"].get(record["cubin"]):
            raise UserError(f"{self.folder}: {record['cubin']} differs from what --prepare wrote; prepare it again")
        return data


def table_digest(arch: str) -> str:
    """sha256 of the arch's gemv and moe tune entries (and the MoE spec's defaults, its entries where the table
    has none): what the current choice and the overrides are derived from."""
    from engc.kernels.moe.specs import DEFAULTS as moe_defaults
    tuned = {k: v for k, v in tune.TUNE.items() if k.startswith((f"{arch}/gemv/", f"{arch}/moe/"))}
    blob = json.dumps([tuned, list(gemv_kernels.PLAIN_CLASSES), moe_defaults], sort_keys=True, default=list)
    return hashlib.sha256(blob.encode()).hexdigest()


def _compile_key(spec):
    return (spec.module, spec.fn_name, tuple(sorted((k, repr(v)) for k, v in spec.constexprs.items())),
            tuple(spec.arg_types.items()), spec.num_warps, spec.num_stages)


def compile_candidates(specs: list, say, jobs: int | None = None) -> list:
    """The build's AOT compile (codegen/aot.py) over specs: (cubin, ptx, meta) each, or None for a config
    Triton cannot lower (named on say; the others still compile)."""
    from engc.compiler.codegen.aot import compile_in_children, compile_spec
    from engc.compiler.codegen.record import default_jobs
    if not specs:
        return []
    try:
        return compile_in_children(specs, default_jobs() if jobs is None else jobs)
    except RuntimeError:   # one bad config fails its whole child: compile one by one to name it
        out = []
        for spec in specs:
            try:
                out.append(compile_spec(spec))
            except Exception as e:  # noqa: BLE001 -- Triton raises many types for a config it cannot lower
                say(f"COMPILE FAILED {spec.variant} {spec.tune}: {str(e).splitlines()[0][:200]}")
                out.append(None)
        return out


def write(folder: Path, plan: tp.TunePlan, info: dict, say, compiler=compile_candidates) -> dict:
    """Compile every candidate of plan (identical kernels once) and write the folder (atomically).
    info: model, sms, ops (provenance written as is). compiler(specs, say) -> [(cubin, ptx, meta) | None]
    replaces the compile (tests). Returns the plan file's content."""
    from engc.atomic import atomic_folder
    from engc.compiler.codegen.record import kernel_record
    import triton
    pairs = [(s, c) for s in plan.shapes for c in plan.candidates[s]]
    specs = {}
    for s, c in pairs:   # the shapes of one moe class share their candidates' kernels
        key = (s.op, s.name, s.k, s.n, c) if s.op == tp.moe.OP else (s, c)
        if key not in specs:
            specs[key] = tp.kernel_specs(plan.cfg, plan.dtype, plan.arch, s, c)
        specs[(s, c)] = specs[key]
    unique = {}
    for group in specs.values():
        for spec in group:
            unique.setdefault(_compile_key(spec), spec)
    say(f"engc tune: compiling {len(unique)} kernels for {len(pairs)} candidates of {len(plan.shapes)} shapes "
        f"({plan.arch}, Triton {triton.__version__})")
    compiled = dict(zip(unique, compiler(list(unique.values()), say)))
    files, shapes, kernels = {}, [], {}
    for s in plan.shapes:
        cands = []
        for c in plan.candidates[s]:
            records = []
            for spec in specs[(s, c)]:
                res = compiled.get(_compile_key(spec))
                if res is None:
                    break
                cubin, _, meta = res
                path = f"kernels/{plan.arch}/{hashlib.sha256(cubin).hexdigest()[:16]}.cubin"
                files[path] = cubin
                # the build's record, less the PTX and source paths the folder does not carry
                records.append({k: v for k, v in kernel_record(spec, meta, path, "", "").items()
                                if k not in ("ptx", "source")})
            stored = {}
            if len(records) != len(specs[(s, c)]):
                stored = {"failed": True}
            elif len(records) == 1:
                stored = _stored(kernels, records[0])
            elif records:
                stored = {"parts": [_stored(kernels, r) for r in records]}
            cands.append({"bucket": c.bucket, "fields": [list(f) for f in c.fields], **stored})
        cur = plan.candidates[s].index(plan.current[s])
        shapes.append({"op": s.op, "name": s.name, "k": s.k, "n": s.n, "per_step": s.per_step, "current": cur,
                       **({"tokens": s.tokens} if s.tokens else {}), "candidates": cands})
    doc = {"format": FORMAT, "version": VERSION, **info, "arch": plan.arch, "dtype": DTYPE_NAMES[plan.dtype],
           "cfg": plan.cfg.to_dict(), "triton": triton.__version__, "engc": engc_version(),
           "tune_table": table_digest(plan.arch), "shapes": shapes, "kernels": kernels,
           "files": {p: hashlib.sha256(b).hexdigest() for p, b in sorted(files.items())}}
    with atomic_folder(folder) as tmp:
        for path, data in files.items():
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp / path).write_bytes(data)
        (tmp / PLAN_FILE).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


PER_CANDIDATE = ("launch", "tune")   # the record fields in which candidates of one cubin differ


def _stored(kernels: dict, record: dict) -> dict:
    """A candidate's record as the plan file keeps it: its cubin's record (added to kernels, path -> record,
    by the first candidate of that cubin) named, plus the PER_CANDIDATE fields' entries that differ from it."""
    base = kernels.setdefault(record["cubin"], record)
    stored = {"kernel": record["cubin"],
              **{k: {f: v for f, v in record[k].items() if f not in base[k] or base[k][f] != v}
                 for k in PER_CANDIDATE}}
    if _record(kernels, stored) != record:   # the candidates of one cubin differ in more than PER_CANDIDATE
        raise RuntimeError(f"{record['variant']}: its record is not its cubin's record plus {PER_CANDIDATE}")
    return stored


def _record(kernels: dict, cand: dict) -> dict | list | None:
    """A candidate's full kernel record from the plan file (None: cuBLAS, or a config that did not compile;
    a list of them for a candidate of several kernels)."""
    if "parts" in cand:
        return [_record(kernels, part) for part in cand["parts"]]
    if "kernel" not in cand:
        return None
    base = kernels[cand["kernel"]]
    return {**base, **{k: {**base[k], **cand[k]} for k in PER_CANDIDATE}}


def load(folder) -> Prepared:
    """Read a tune-prepare folder; one clear line if it is not one, is of a newer format, or was prepared
    with a tune table other than this checkout's."""
    from engc.bundle.model_config import ModelConfig
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--from {folder}: no such folder (write it with engc tune SRC --prepare {folder})")
    try:
        doc = json.loads((folder / PLAN_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(f"--from {folder}: not a folder written by engc tune --prepare (no valid {PLAN_FILE})")
    if doc.get("version") != VERSION:
        raise UserError(f"--from {folder}: tune-prepare format {doc.get('version')}; this engc reads {VERSION}: "
                        "prepare it with this checkout")
    arch = doc["arch"]
    if arch not in tune.ARCHS or doc["tune_table"] != table_digest(arch):
        raise UserError(f"--from {folder}: prepared with another {arch} tune table than this checkout's; "
                        "prepare it again with the engc you run here")
    cfg = ModelConfig.from_dict(doc["cfg"])
    dtype = {v: k for k, v in DTYPE_NAMES.items()}[doc["dtype"]]
    shapes, current, candidates, records = [], {}, {}, {}
    for d in doc["shapes"]:
        s = tp.Shape(d["op"], d["name"], d["k"], d["n"], d["per_step"], d.get("tokens", 0))
        cands = [tp.Candidate(c["bucket"], tuple(tuple(f) for f in c["fields"])) for c in d["candidates"]]
        shapes.append(s)
        candidates[s], current[s] = cands, cands[d["current"]]
        records.update({(s, c): _record(doc["kernels"], r) for c, r in zip(cands, d["candidates"])})
    plan = tp.TunePlan(arch, dtype, cfg, shapes, current, candidates)
    info = {k: v for k, v in doc.items() if k not in ("shapes", "cfg", "kernels")}
    return Prepared(folder, plan, records, info)


def engc_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("engc")
    except PackageNotFoundError:
        return "unknown"
