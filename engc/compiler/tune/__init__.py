"""engc's tune package: the per-arch table of kernel configurations (block shapes, warps, pipeline depth,
launch constants), kept as data in table_<arch>.jsonl, and the `engc tune` search that measures new
entries on a user's GPU (search.py, plan.py, prepared.py, gpu.py).

Keys are "arch/op/variant/bucket"; the bucket names the shape class an entry serves. The chosen key and
entry go into every kernel record of the manifest; `engc build --tune FILE` overrides entries for one
build (check_overrides, overridden).
"""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

from engc.compiler.tune.table import ARCHS, PDL, SM_COUNT, TUNE  # noqa: F401  (the package's API)
from engc.errors import UserError

def sm_count(arch: str) -> int:
    """The multiprocessors of the GPU the table's split targets (target_programs) assume for arch: A100 108,
    H100/H200 132 (engc tune --prepare plans for it unless --sms says otherwise)."""
    return SM_COUNT[arch]


def block_bucket(block: int) -> str:
    return "block<=1024" if block <= 1024 else "block<=4096" if block <= 4096 else "block>4096"


def head_dim_bucket(head_dim: int) -> str:
    return "d<=64" if head_dim <= 64 else "d<=128" if head_dim <= 128 else "d>128"


def lookup(arch: str, op: str, variant: str, bucket: str, overrides: dict | None = None,
           defaults: dict | None = None) -> tuple[str, dict]:
    """The tune entry for a kernel: exact variant first, then the op's '*' entry, then the defaults its spec
    builder declares (a new op needs no table line until it is tuned per arch; key '<op>/<variant>/default')."""
    for key in (f"{arch}/{op}/{variant}/{bucket}", f"{arch}/{op}/*/{bucket}"):
        if key in TUNE:
            entry = dict(TUNE[key])
            break
    else:
        if defaults is None:
            raise KeyError(f"no tune-table entry for {arch}/{op}/{variant}/{bucket}")
        key, entry = f"{arch}/{op}/{variant}/default", dict(defaults)
    if overrides:
        entry.update(overrides)
        key += "+override"
    return key, entry


# Fields an override may add to an entry that does not spell them out (PDL: read with a per-arch default;
# smem_carveout: absent means the driver's choice; maxnreg: a register cap a thread, absent means ptxas's choice).
OPTIONAL_FIELDS = ("PDL", "smem_carveout", "maxnreg")


def record_launch(launch: dict, entry: dict) -> dict:
    """A kernel record's launch constants: the spec's, plus the entry's preferred L1/shared-memory split where it
    names one (smem_carveout: percent of the most shared memory an SM can have; -1 no preference; absent, the
    driver picks), sorted. The split is a launch constant, not a compile one: the runtime sets it on the loaded
    kernel, the cubin is the same."""
    if "smem_carveout" not in entry:
        return dict(sorted(launch.items()))
    value = entry["smem_carveout"]
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= 100:
        raise ValueError(f"smem_carveout {value!r}: expected a percent 0..100 or -1 (no preference)")
    return dict(sorted({**launch, "smem_carveout": value}.items()))


# The key of a tune file's provenance (`engc tune` writes GPU, versions, date, measurements there): skipped
# and dropped by check_overrides, so it reaches neither the kernels, the kernel cache nor the manifest, and
# two tune files with the same entries build the same bundle.
META_KEY = "_meta"


def spec_defaults(key: str) -> dict | None:
    """The entry a key of an op without table lines stands for: its spec builder's DEFAULTS[variant]
    (engc/kernels/<op>/specs.py; bucket 'any'), or None where there is none. `engc tune` writes such keys for
    ops it tunes before the table has lines for them (the MoE op's)."""
    import importlib
    import importlib.util
    parts = key.split("/")
    if len(parts) != 4 or parts[0] not in ARCHS or parts[3] != "any" or not parts[1].isidentifier():
        return None
    name = f"engc.kernels.{parts[1]}.specs"
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None
    defaults = getattr(importlib.import_module(name), "DEFAULTS", None) if found else None
    entry = defaults.get(parts[2]) if isinstance(defaults, dict) else None
    return dict(entry) if entry else None


def _entry(key: str) -> dict | None:
    return TUNE[key] if key in TUNE else spec_defaults(key)


def check_overrides(entries, where: str = "--tune") -> dict:
    """A tune-table override ({"arch/op/variant/bucket": {field: value}}, e.g. from `engc build --tune
    FILE`), checked: every key an entry of the table (or of an op's spec defaults, spec_defaults), every
    field one that entry has (or PDL), every value a number, string, bool or list of them. Typos would
    otherwise be ignored silently. Returns the entries without META_KEY."""
    if not isinstance(entries, dict):
        raise UserError(f"{where}: expected a JSON object of tune entries, got {type(entries).__name__}")
    entries = {key: fields for key, fields in entries.items() if key != META_KEY}
    for key, fields in entries.items():
        entry = _entry(key)
        if entry is None:
            near = sorted(k for k in TUNE if k.split("/")[1:2] == key.split("/")[1:2])[:6]
            raise UserError(f"{where}: no tune entry '{key}'" + (f"; that op has {', '.join(near)}" if near else ""))
        if not isinstance(fields, dict) or not fields:
            raise UserError(f"{where}: '{key}' must map to an object of fields")
        for name, value in fields.items():
            if name not in entry and name not in OPTIONAL_FIELDS:
                raise UserError(f"{where}: '{key}' has no field '{name}'; it has {', '.join(sorted(entry))}")
            if not isinstance(value, (int, float, str, bool, list)):
                raise UserError(f"{where}: '{key}'.{name} must be a number, string, bool or list")
    return entries


@contextmanager
def overridden(entries: dict | None):
    """The table with `entries` (check_overrides' form) merged over it (over an op's spec defaults where the
    table has no line), for the duration of one build."""
    saved = {key: TUNE.get(key) for key in entries or {}}
    try:
        for key, fields in (entries or {}).items():
            TUNE[key] = {**_entry(key), **fields}
        yield
    finally:
        for key, entry in saved.items():
            if entry is None:
                TUNE.pop(key, None)
            else:
                TUNE[key] = entry


def read_tune_file(path: Path) -> dict:
    """--tune FILE: the JSON tune overrides, checked (one clear line for a missing file, bad JSON or a key
    or field the table does not have)."""
    try:
        entries = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"--tune {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"--tune {path}: not JSON ({e.msg} at line {e.lineno})") from None
    _warn_other_compiler(entries, path)
    return check_overrides(entries, f"--tune {path}")


def _warn_other_compiler(entries, path: Path) -> None:
    """An `engc tune` file ranks kernels compiled by the Triton its _meta names; this build compiles with its
    own, and a config's speed can differ between two Triton versions (bench/results/HISTORY.md)."""
    from importlib.metadata import PackageNotFoundError, version
    meta = entries.get("_meta") if isinstance(entries, dict) else None
    measured = meta.get("triton") if isinstance(meta, dict) else None
    try:
        here = version("triton")
    except PackageNotFoundError:
        return
    if measured and measured != here:
        print(f"engc: warning: --tune {path} was measured on kernels compiled by Triton {measured}; this build "
              f"compiles with Triton {here}, so its ranking may not hold (engc tune --prepare here, "
              "--from on the GPU)", file=sys.stderr)
