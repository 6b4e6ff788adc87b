"""The server's host path alone: `engc run`'s server over a bundle whose forward is a stub, for measuring what
the process spends per streamed token outside the model (the engine thread's scheduling, inputs, stop checks
and detokenizing; the event loop's handoff, chunks and HTTP writes).

    python -m engc.runtime.server.hostbench BUNDLE [--port 23333] [--step-ms 0] [--loop asyncio --http h11]
                                                   [--no-engine-process]
    python bench/serve_bench.py run --url http://127.0.0.1:23333 --model hostbench --workload fixed ...

The bundle's tokenizer, scheduler, KV block accounting and output processing are the real ones; only the
forward and the sampling are replaced: each step's sampled rows get random ordinary tokens (seeded), and a
step's tokens are ready `--step-ms` after its launch (a sleep, which releases the GIL as a GPU wait does), so
the host work of the next step overlaps it as on a GPU. The engine runs as `engc run` runs it: in a process of
its own, or with --no-engine-process in a thread of the server's. On exit (Ctrl-C) it prints the CPU seconds
per streamed token of the server's process and of the engine's (its process, or its thread). `--loop asyncio
--http h11` is uvicorn without uvloop and httptools, as in an image that lacks them.
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import resource
import time

import torch

from engc.runtime.async_engine import AsyncEngine
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.engine_process import EngineClient
from engc.runtime.engine_spawn import spawn
from engc.runtime.runner import InFlight
from engc.runtime.server.metrics import Metrics


def stub_forward(engine: Engine, step_s: float = 0.0, seed: int = 0) -> None:
    """Replaces the engine's forward and sampling with random ordinary tokens, ready step_s after launch."""
    runner, tok = engine.runner, engine.model.tokenizer
    special = set(tok.eos_token_ids) | {i for i in range(tok.vocab_size) if tok.decode([i]) == ""}
    ordinary = [i for i in range(min(tok.vocab_size, engine.model.config.vocab_size)) if i not in special]
    rng = random.Random(seed)
    engine.stub_steps = 0
    device_free = [0.0]   # when the stand-in device finishes the steps launched so far: they run one at a time

    def launch(batch):
        _, sampled, _ = runner.inputs(batch)   # built as for a real forward: part of the host path
        step = InFlight(batch, sampled, None)
        step.tokens = rng.choices(ordinary, k=len(sampled))
        step.row_of = {seq: i for i, seq in enumerate(sampled)}
        step.ready = device_free[0] = max(time.perf_counter(), device_free[0]) + step_s
        engine.stub_steps += 1
        return step

    def read(step):
        wait = step.ready - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return step.tokens, None

    runner.launch, runner.read = launch, read
    runner.sample_after_read = lambda step: None


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu_seconds(native_id: int) -> float:
    """One thread's CPU seconds (Linux; 0 elsewhere): the engine thread's share of the process's."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime


def stub_engine(bundle: str, config: EngineConfig, step_s: float) -> Engine:
    """The bundle's engine with the stub forward (in the engine's process, where it has one)."""
    from engc.runtime.loader import load
    model = load(bundle, "cpu")
    zeros = torch.zeros
    torch.zeros = torch.empty   # the KV cache: the stub never reads or writes it, so its pages stay untouched
    try:
        engine = Engine(model, config)
    finally:
        torch.zeros = zeros
    stub_forward(engine, step_s)
    return engine


def engine_usage(engine: Engine) -> tuple[float, int]:
    """(CPU seconds of the engine's own process, steps so far): run there between steps."""
    return cpu_seconds(), engine.stub_steps


def _engine_cpu(front):
    """() -> (the engine's CPU seconds: its process's, or its thread's, and the steps so far)."""
    if isinstance(front, EngineClient):
        return lambda: front.submit_call(engine_usage).result(60)
    native_id, engine = front.thread.native_id, front.engine
    return lambda: (thread_cpu_seconds(native_id), engine.stub_steps)


def main(argv=None) -> None:
    import uvicorn

    from engc.runtime.heap import settle_heap
    from engc.runtime.server.app import create_app
    from engc.runtime.server.listen import listening_socket

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=23333)
    ap.add_argument("--model-name", default="hostbench")
    ap.add_argument("--step-ms", type=float, default=0.0, help="a step's device time (default 0: host only)")
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=8192, help="KV blocks (counted, never written)")
    ap.add_argument("--flush-streams", type=int, default=64,
                    help="AsyncEngine's flush_streams: above it a step's readers are woken every few steps")
    ap.add_argument("--loop", default="auto", help="uvicorn's loop: auto, asyncio, uvloop")
    ap.add_argument("--http", default="auto", help="uvicorn's HTTP protocol: auto, h11, httptools")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=EngineConfig.engine_process,
                    help="the engine in a process of its own (engc run's --engine-process)")
    args = ap.parse_args(argv)

    sock = listening_socket(args.host, args.port)
    config = EngineConfig(num_blocks=args.num_blocks, max_num_seqs=args.max_batch_size, cuda_graphs=False,
                          engine_process=args.engine_process)
    build = functools.partial(stub_engine, args.bundle, config, args.step_ms / 1000)
    if config.engine_process:
        async_engine = EngineClient.start(args.bundle, config, spawn(build), Metrics(), args.flush_streams)
    else:
        async_engine = AsyncEngine(build(), Metrics(), args.flush_streams).start()
    app = create_app(async_engine, args.model_name)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", loop=args.loop, http=args.http))
    print(f"hostbench: serving {args.model_name} on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    pauses = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}   # collections and seconds by generation
    began = [0.0]

    def gc_timer(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses[info["generation"]][0] += 1
            pauses[info["generation"]][1] += time.perf_counter() - began[0]
    gc.callbacks.append(gc_timer)
    settle_heap()   # as engc run does
    engine_cpu = _engine_cpu(async_engine)
    start, engine_start = cpu_seconds(), engine_cpu()
    try:
        server.run(sockets=[sock])
    finally:
        (engine_used, steps), used = engine_cpu(), cpu_seconds() - start
        engine_used -= engine_start[0]
        async_engine.shutdown()
        tokens = max(async_engine.metrics.generation_tokens._value.get(), 1)
        where = "process" if args.engine_process else "thread, within the server's"
        print(f"hostbench: {tokens:.0f} tokens streamed in {steps} steps; CPU us a token: server process "
              f"{1e6 * used / tokens:.1f}, engine {where} {1e6 * engine_used / tokens:.1f}", flush=True)
        print("hostbench: gc " + ", ".join(f"gen{g} {n} in {t:.3f} s" for g, (n, t) in pauses.items()), flush=True)


if __name__ == "__main__":
    main()
