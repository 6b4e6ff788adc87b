"""bench/gpu_bench.py --skip-pass: a build without the named graph pass (a fusion's A/B on one GPU machine),
named so in the manifest; an unknown name is one clear line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_bench  # noqa: E402


@pytest.fixture
def restored_passes(monkeypatch):
    """skip_pass rewrites the build's pass list in place and rebinds the build module's name: undo both."""
    from engc.compiler import build as build_module, passes
    saved = list(passes.PASSES)
    for name in ("fuse_fp8_input_quant", "quantize_fp8"):
        monkeypatch.setattr(build_module, name, getattr(build_module, name))
    yield
    passes.PASSES[:] = saved


def test_skipped_fusion_leaves_the_unfused_program(tiny_dir, tmp_path, restored_passes):
    from engc.compiler.build import BuildOptions, build
    gpu_bench.skip_pass("fuse_fp8_input_quant")
    build(str(tiny_dir("llama")), tmp_path / "b", BuildOptions(quant="fp8"))
    manifest = json.loads((tmp_path / "b/manifest.json").read_text())
    assert "skipped_fuse_fp8_input_quant" in manifest["passes"] and "fuse_fp8_input_quant" not in manifest["passes"]
    ops = _ops(tmp_path / "b")
    assert "FP8LinearQ" not in ops and "FP8Linear" in ops


def test_a_list_pass_is_skipped_too(restored_passes):
    from engc.compiler import passes
    gpu_bench.skip_pass("fuse_rotary_attention")
    assert [p.__name__ for p in passes.PASSES].count("skipped_fuse_rotary_attention") == 1


def test_unknown_pass_is_refused(restored_passes):
    with pytest.raises(SystemExit, match="--skip-pass fuse_nothing: not a pass of engc build"):
        gpu_bench.skip_pass("fuse_nothing")


def _ops(bundle: Path) -> list[str]:
    from engc.runtime.loader import load
    return [n.op for n in load(bundle).executor.program.nodes]
