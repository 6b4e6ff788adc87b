"""Peak memory of `engc quantize` on a model many layers deep: it should track one layer, not the model.

    python bench/quant_memory.py [--methods rtn,gptq,awq] [--calib-samples 4 --calib-seqlen 128]
                                 [--work /tmp/engc_qmem] [--out bench/results/quant_memory_1b.json]

Writes a random Llama-3.2-1B-shape checkpoint (hidden 2048, intermediate 8192, 16 layers, 32 heads,
8 kv heads, head_dim 64, vocab 128256, tied, bf16: ~2.5 GB, one shard per layer), then runs the real
CLI (`engc quantize ... --json`) in a child process per method and polls the child's VmHWM from
/proc/<pid>/status while it runs (not ru_maxrss, which a child inherits from its parent across exec).
Reports the polled peak next to the peak the CLI's summary reports, the model's size, one layer's
size and the embedding's. Calibration is kept small (the peak's activation term is
samples x seqlen x hidden floats) because this machine's CPU is scarce; the JSON says which.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

LLAMA_1B = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256)
MB = 2**20


def vm_hwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def run_quantize(src: Path, out: Path, method: str, samples: int, seqlen: int, group_size: int) -> dict:
    """The CLI in a child process; returns its --json summary plus the peak polled from outside."""
    cmd = [sys.executable, "-c", "from engc.cli import main; main()", "quantize", str(src), "-o", str(out),
           "--method", method, "--group-size", str(group_size), "--calib-samples", str(samples),
           "--calib-seqlen", str(seqlen), "--json"]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    polled = 0.0
    while proc.poll() is None:
        polled = max(polled, vm_hwm_mb(proc.pid) or 0.0)
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"engc quantize --method {method} failed:\n{stderr[-3000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    summary["polled_peak_rss_mb"] = round(polled, 1)
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="rtn,gptq,awq")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--calib-seqlen", type=int, default=128)
    ap.add_argument("--layers", type=int, default=LLAMA_1B["layers"])
    ap.add_argument("--work", default="/tmp/engc_qmem")
    ap.add_argument("--out", default=str(ROOT / "bench/results/quant_memory_1b.json"))
    args = ap.parse_args()
    from tiny_models import write_random_llama

    shape = dict(LLAMA_1B, layers=args.layers)
    work = Path(args.work)
    src = work / f"llama1b_L{args.layers}"
    sizes_file = src / "sizes.json"
    if not sizes_file.exists():
        t = time.monotonic()
        sizes = write_random_llama(src, **shape)
        sizes_file.write_text(json.dumps(sizes))
        print(f"wrote {src} in {time.monotonic() - t:.0f}s", flush=True)
    sizes = json.loads(sizes_file.read_text())
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    results.update({
        "command": "python bench/quant_memory.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "model": dict(LLAMA_1B, dtype="bfloat16", tied=True, layers="per run"),
        "layer_mb_bf16": round(sizes["layer_bytes"] / MB, 1),
        "layer_mb_fp32": round(sizes["layer_bytes"] * 2 / MB, 1),
        "embedding_mb_bf16": round(sizes["embedding_bytes"] / MB, 1),
        "note": "calibration samples x tokens kept small, and fewer layers for the slow methods: "
                "2 CPU cores shared by several jobs",
    })
    results.setdefault("runs", {})
    for method in args.methods.split(","):
        s = run_quantize(src, work / f"q_{method}", method, args.calib_samples, args.calib_seqlen,
                         args.group_size)
        results["runs"][method] = {k: s[k] for k in ("peak_rss_mb", "polled_peak_rss_mb", "start_rss_mb",
                                                     "layer_weights_mb", "seconds", "wall_seconds")}
        results["runs"][method].update(layers=args.layers, model_mb=round(sizes["model_bytes"] / MB, 1),
                                       calibration=f"{args.calib_samples} x {args.calib_seqlen}")
        out_path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        print(method, json.dumps(results["runs"][method]), flush=True)
    print(f"\none layer {results['layer_mb_bf16']:.0f} MB bf16 / {results['layer_mb_fp32']:.0f} MB fp32; "
          f"embedding {results['embedding_mb_bf16']:.0f} MB bf16")
    print("| method | layers | model (bf16) | calibration | peak RSS (summary) | peak RSS (polled) | start RSS |")
    print("|---|---|---|---|---|---|---|")
    for method, r in results["runs"].items():
        print(f"| {method} | {r['layers']} | {r['model_mb']:.0f} MB | {r['calibration']} | {r['peak_rss_mb']:.0f} MB | "
              f"{r['polled_peak_rss_mb']:.0f} MB | {r['start_rss_mb']:.0f} MB |")


if __name__ == "__main__":
    main()
