"""examples/ci: the CI job's own script (build for sm80,sm90 with a kernel cache, verify, rebuild, compare
digests and bytes) runs on this CPU machine, as it runs on a CPU CI runner; the second run of it takes every
kernel from the cache its first run filled. And `engc bench`, what a user runs on their own machine."""
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_script_builds_verifies_and_rebuilds_identically(tiny_dir, tmp_path):
    env = dict(os.environ, ENGC_KERNEL_CACHE=str(tmp_path / "kernel-cache"))
    run = lambda out: subprocess.run(["bash", str(ROOT / "examples/ci/build.sh"), str(tiny_dir("llama")), out],
                                     cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    first = run("bundle")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "reproducible: digest" in first.stdout and "OK bundle" in first.stdout
    summary = json.loads((tmp_path / "bundle.json").read_text())
    assert summary["archs"] == ["sm80", "sm90"] and summary["kernels_by_arch"]["sm80"] > 0
    assert summary["bytes_by_part"]["kernels"] > 0 and "compile kernels for sm80,sm90" in summary["timings_s"]
    assert len(summary["digest"]) == 64
    again = run("bundle2")   # a warm cache: the same bundle without compiling
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "bundle2.json").read_text())["digest"] == summary["digest"]


def test_ci_script_fails_on_a_damaged_build(tiny_dir, tmp_path):
    """A bundle that does not verify stops the job: engc verify's one line, a non-zero exit."""
    script = tmp_path / "build.sh"
    # the same script with its rebuild replaced by damaging the first build: verify must catch it first
    text = (ROOT / "examples/ci/build.sh").read_text().replace(
        'engc verify "$OUT"', 'printf x >> "$OUT/program.onnx"\nengc verify "$OUT"')
    script.write_text(text)
    proc = subprocess.run(["bash", str(script), str(tiny_dir("llama")), "bundle", "cpu"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "is damaged" in proc.stderr


def test_engc_bench_reports_each_batch(tiny_bundle):
    proc = subprocess.run(["engc", "bench", str(tiny_bundle("llama")), "--batch-sizes", "1,3", "--input-len", "8",
                           "--output-len", "4", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [r["batch"] for r in report["results"]] == [1, 3] and report["device"] == "cpu"
    for r in report["results"]:
        assert r["output_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["prefill_s"] > 0
    bad = subprocess.run(["engc", "bench", str(tiny_bundle("llama")), "--batch-sizes", "0"], capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "--batch-sizes" in bad.stderr
