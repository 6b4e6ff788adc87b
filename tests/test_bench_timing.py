"""bench/timing.py's GpuClocks: what nvidia-smi reported during a run, summarized (a stand-in nvidia-smi here)."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import timing  # noqa: E402

READINGS = """1980, 612.5, 61, 0x0000000000000000
1755, 699.8, 66, 0x0000000000000004
[Unknown Error]
1410, 700.1, 71, 0x0000000000000024
"""


def _fake_smi(tmp_path: Path, body: str) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'END'\n{body}END\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)


def test_clocks_power_and_the_limits_that_held_them_down(tmp_path, monkeypatch):
    _fake_smi(tmp_path, READINGS)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with timing.GpuClocks() as clocks:
        clocks._proc.wait()   # the stand-in prints everything at once; the real one until it is stopped
    assert clocks.summary == {"sm_mhz_min": 1410.0, "sm_mhz_median": 1755.0, "power_w_max": 700.1,
                              "temp_c_max": 71.0, "slowed_by": ["sw_power_cap", "sw_thermal"]}


def test_no_nvidia_smi_gives_an_empty_summary(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with timing.GpuClocks() as clocks:
        pass
    assert clocks.summary == {}
