"""Where a decode step's time goes (gpu_bench.py run --profile-only, and the step breakdown of every run):
per-kernel tables of eager and graphed steps, a timeline of overlapped engine steps, and the graph replay
against the whole engine step, synchronous and overlapped."""
from __future__ import annotations

import collections
import json
import time
from pathlib import Path

from shapes import prompts
from timing import graph_replay_ms, synced


def _greedy(max_tokens: int):
    from engc.runtime.sampling import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def kernel_profile(engine, cfg, out_dir: Path, shape: str, batches=(1, 32)) -> dict:
    """Per-kernel GPU time of eager decode steps and of the graphed step (torch.profiler) at a few batch sizes;
    the tables go to out_dir/kernels{,_graph}_<shape>_b<n>.txt."""
    res = {}
    for n in batches:
        seqs = [engine.add_request(ids, _greedy(64)) for ids in prompts(n, 128, cfg.vocab_size, 100 + n)]
        while any(s.num_computed < len(s.prompt_ids) for s in seqs):
            engine.step()  # prefill
        for _ in range(3):
            engine.step()
        engine.runner.executor.enabled = False  # eager, so the profiler sees each kernel
        engine.step()
        prof = _profiled(lambda: [engine.step() for _ in range(5)], cpu=True)
        engine.runner.executor.enabled = True
        (out_dir / f"kernels_{shape}_b{n}.txt").write_text(_table(prof))
        total = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 5
        res[f"b{n}_eager_kernel_time_per_step_ms"] = round(total / 1000, 3)
        graphed = engine.runner.executor
        if graphed.enabled and n <= graphed.buckets[-1]:   # larger batches run eagerly
            graph, _ = graphed.graphs[graphed.graph_key(n, 128 + 64)][0]
            res[f"b{n}_graph_replay_ms"] = graph_replay_ms(graph, reps=50, warm=0)
            # the same step's kernels inside the graph (with PDL a kernel's time includes its wait)
            prof = _profiled(lambda: [graph.replay() for _ in range(5)])
            (out_dir / f"kernels_graph_{shape}_b{n}.txt").write_text(_table(prof))
        _, t = synced(lambda: [engine.step() for _ in range(20)])
        res[f"b{n}_engine_step_ms"] = round(t * 50, 3)
        engine.run_to_completion()
    return res


def _profiled(fn, cpu: bool = False):
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def _table(prof) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)


def step_timeline(engine, cfg, out_dir: Path, shape: str, n: int = 1, steps: int = 30) -> dict:
    """Where the GPU idles during overlapped engine decode steps at batch n: the GPU's busy and idle time a
    step (union of kernel and copy intervals), the idle gaps summed by the ops on either side, and what each
    kernel adds to the busy time; written to out_dir/timeline_<shape>_b<n>.txt."""
    for ids in prompts(n, 128, cfg.vocab_size, 200 + n):
        engine.add_request(ids, _greedy(steps + 20))
    for _ in range(5):
        engine.step()   # prefill, then warm decode steps
    prof = _profiled(lambda: [engine.step() for _ in range(steps)])
    engine.run_to_completion()
    trace = out_dir / f"trace_{shape}_b{n}.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    trace.unlink()  # large; the summary is what is kept
    t = _Timeline(sorted(events, key=lambda e: e["ts"]))
    lines = [f"{shape} b{n}: {steps} overlapped engine steps, GPU busy {t.busy / steps:.1f} us a step, "
             f"idle {t.idle / steps:.1f} us a step", "idle us a step  after -> before"]
    lines += [f"{v / steps:10.2f}  {a} -> {b}" for (a, b), v in t.gaps.most_common(15)]
    lines += ["", "busy us a step each kernel adds (in-chain), launches a step, us a launch"]
    lines += [f"{v / steps:10.2f}  {t.launches[k] / steps:6.1f}  {v / t.launches[k]:8.2f}  {k}"
              for k, v in t.pushed.most_common(20)]
    (out_dir / f"timeline_{shape}_b{n}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return {f"b{n}_timeline_busy_us": round(t.busy / steps, 1), f"b{n}_timeline_idle_us": round(t.idle / steps, 1)}


class _Timeline:
    """Busy and idle time of time-sorted GPU events. A kernel's in-chain cost is how far it pushes the end of
    the busy time: with PDL kernels overlap, and a kernel's own duration includes its wait for the one before,
    so this is what it adds to the step. Rows are kernel and grid: one kernel serving several shapes splits."""

    def __init__(self, events):
        self.busy, self.idle = 0.0, 0.0
        self.gaps, self.pushed, self.launches = collections.Counter(), collections.Counter(), collections.Counter()
        end, prev = None, None
        for e in events:
            ts, te = e["ts"], e["ts"] + e["dur"]
            grid = e.get("args", {}).get("grid")
            row = e["name"][:60] + (f" grid {tuple(grid)}" if grid else "")
            self.launches[row] += 1
            if end is not None and ts > end:
                self.idle += ts - end
                self.gaps[(prev[:40], e["name"][:40])] += ts - end
            if end is None or te > end:
                step = te - max(ts, end) if end is not None else te - ts
                self.busy += step
                self.pushed[row] += step
                end, prev = te, e["name"]


def _timed_steps(engine, ids_list, prof=None) -> float:
    """ms an engine step over 100 decode steps of a fresh batch (its prefill first), under prof when given."""
    import torch
    for ids in ids_list:
        engine.add_request(ids, _greedy(101))
    engine.step()  # prefill
    torch.cuda.synchronize()
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(100):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    engine.run_to_completion()
    return round(t * 10, 3)


def decode_breakdown(engine, ids_list, profile_path: Path) -> dict:
    """Where a decode step's time goes at batch n = len(ids_list): graph replay alone (GPU) against the
    whole engine step, synchronous and overlapped (a gap is host work the overlap does not hide). The steps
    are timed without the profiler, which slows the host 2-3x and would make a host-bound batch of a fast
    GPU step look slower than it is; a third, profiled run writes profile_path."""
    import cProfile
    import pstats
    from dataclasses import replace
    n = len(ids_list)
    out = {}
    overlap = engine.config.overlap
    for key, on in ((f"b{n}_engine_step_sync_ms", False), (f"b{n}_engine_step_ms", True)):
        engine.config = replace(engine.config, overlap=on)
        out[key] = _timed_steps(engine, ids_list)
    engine.config = replace(engine.config, overlap=overlap)
    prof = cProfile.Profile()
    _timed_steps(engine, ids_list, prof)
    # Replayed alone after the runs above, the graph's staged inputs are their last step's (n real rows at
    # full context); before any step of this batch, rows would hold context 1 and skip the attention.
    graph, _ = engine.runner.executor.graphs[engine.runner.executor.graph_key(n, len(ids_list[0]) + 101)][0]
    out[f"b{n}_graph_replay_ms"] = graph_replay_ms(graph)
    with open(profile_path, "w") as f:  # the overlapped run's profile
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)
    return out
