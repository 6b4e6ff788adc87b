"""The report of a kernel test file's own checks, run in a child process with TRITON_INTERPRET=1.

The interpreter must be switched on before triton is imported, so a test file that checks Triton kernels on
the CPU runs itself (its `__main__` part prints one JSON line: case -> result) and its tests assert on that."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def interpreted_report(test_file: str, timeout: int = 900) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, \
        f"{Path(test_file).name} checks crashed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1])


def print_report(checks: dict) -> None:
    """The child's side: run each case {name: (check, limit)}, where a check returns its error (or (error,
    launches)), and print the one JSON line interpreted_report reads. Each case is reported on its own, so one
    failure does not hide the others."""
    report = {}
    for name, (fn, limit) in checks.items():
        try:
            got = fn()
            err, info = got if isinstance(got, tuple) else (got, None)
            report[name] = {"ok": err <= limit, "err": err, "limit": limit, "launches": info}
        except Exception as exc:
            import traceback
            report[name] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()[-2000:]}
    print(json.dumps(report))
