"""The tune table, read from its data files: table_<arch>.jsonl, one entry a line,
{"key": "op/variant/bucket", "why": one line, "entry": {field: value}}.

Values are JSON; a list becomes a tuple here, so entries are immutable shapes the kernels' launch rules
and the kernel cache read the same way whatever wrote them. The measurements behind each entry are in
bench/results/HISTORY.md; `why` says what the entry is for and what decided it.
"""
from __future__ import annotations

import json
from pathlib import Path

ARCHS = ("sm80", "sm90")
# Programmatic dependent launch of the kernels that support it (kernels/pdl.py): griddepcontrol is sm90+.
PDL = {"sm80": 0, "sm90": 1}
# Multiprocessors of the GPU each arch's entries assume (split rules aim at a multiple of them)
SM_COUNT = {"sm80": 108, "sm90": 132}

HERE = Path(__file__).parent


def _frozen(value):
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


def read_table(arch: str) -> dict[str, dict]:
    """arch's entries, keyed "arch/op/variant/bucket"; a malformed line is an error naming it."""
    table = {}
    path = HERE / f"table_{arch}.jsonl"
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if set(row) != {"key", "why", "entry"} or row["key"].count("/") < 2 or not row["why"]:
            raise ValueError(f"{path.name}:{n}: expected key 'op/variant/bucket', why and entry")
        key = f"{arch}/{row['key']}"
        if key in table:
            raise ValueError(f"{path.name}:{n}: {row['key']} twice")
        table[key] = _frozen(row["entry"])
    return table


TUNE: dict[str, dict] = {k: v for arch in ARCHS for k, v in read_table(arch).items()}
