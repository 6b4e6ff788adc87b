"""Tensor-parallel serving: one process a rank, the program's collectives over torch.distributed.

Rank 0 is the engine: scheduler, sampler, server. Every other rank is a worker that loads its own weight
file (weights/rank<r>.safetensors), holds its own KV cache (its heads) and runs the same program on the
inputs rank 0 broadcasts before each forward (ModelRunner.follow), so all ranks reach every AllReduce and
AllGather together. The step inputs go over a gloo group on the host (they are built on the host anyway);
the program's collectives go over the default group: NCCL on GPUs, gloo on the CPU.

Launch: `engc run --tp N` starts ranks 1..N-1 itself, each `python -m engc.runtime.tp` with the
torchrun-style variables an outside launcher would set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a free
local port), so a script need not guard its main module as multiprocessing's spawn would require. Under an
outside launcher (torchrun, Slurm, Ray) that sets them, every process runs `engc run` (or engc.LLM) and
rank 0 alone serves. Failure: a worker's process ending (the watchdog watches
the ones engc spawned), or a collective failing or passing ENGC_TP_TIMEOUT_S (default 120), is a
RankFailure: the server answers 503 and exits; a worker whose rank 0 is gone exits when its broadcast fails.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from engc.bundle.reader import read_manifest
from engc.errors import BundleError, UserError
from engc.kernels import collectives

log = logging.getLogger("engc.tp")
_IDLE = timedelta(days=3650)   # a worker waits for rank 0's next step however long the server idles


class RankFailure(RuntimeError):
    """A rank died or a collective failed: the ranks are out of step, the engine cannot go on."""


def timeout_s() -> float:
    return float(os.environ.get("ENGC_TP_TIMEOUT_S", "120"))


@dataclass
class Group:
    rank: int
    world: int
    steps: object                      # gloo group: rank 0's step inputs to the workers
    procs: list = field(default_factory=list)   # the workers engc started (rank 0): subprocess.Popen
    failure: str | None = None
    on_failure: list = field(default_factory=list)   # callbacks(reason), from the watchdog thread
    closing: bool = False

    # --- rank 0 ------------------------------------------------------------------------------------

    def send(self, message) -> None:
        """Broadcasts one message (a step's inputs, the engine's setup, or None: stop) to the workers."""
        if self.failure:
            raise RankFailure(self.failure)
        try:
            dist.broadcast_object_list([message], src=0, group=self.steps)
        except Exception as e:  # noqa: BLE001 - a closed connection or a timeout: a rank is gone
            raise self.fail(f"cannot reach the other ranks ({e.__class__.__name__}: {str(e)[:200]})") from e

    def setup_workers(self, num_blocks: int, setup: dict) -> int:
        """Rank 0 sends the engine's setup (EngineConfig's fields the workers need); every rank's KV cache
        then takes the fewest blocks any rank's memory holds (agree_blocks). Returns that count."""
        self.send(setup)
        return self.agree_blocks(num_blocks)

    def agree_blocks(self, num_blocks: int) -> int:
        blocks = torch.tensor([num_blocks], dtype=torch.int64)
        try:
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.steps)
        except Exception as e:  # noqa: BLE001
            raise self.fail(f"the ranks did not agree on the KV cache ({e.__class__.__name__})") from e
        return int(blocks.item())

    def fail(self, reason: str) -> RankFailure:
        """Records the first failure, tells the callbacks once; returns the exception to raise."""
        if self.failure is None:
            self.failure = reason
            log.error("tensor parallel: %s", reason)
            for callback in list(self.on_failure):
                callback(reason)
        return RankFailure(self.failure)

    def watch(self) -> None:
        """Watchdog threads: a worker engc started that ends while rank 0 serves is a failure."""
        def run(rank: int, p):
            code = p.wait()
            if not self.closing:
                self.fail(f"rank {rank} (pid {p.pid}) exited with code {code}")
        for rank, p in enumerate(self.procs, start=1):
            threading.Thread(target=run, args=(rank, p), name=f"engc-tp-watch{rank}", daemon=True).start()

    def close(self) -> None:
        """Stops the workers: a stop message where they can hear it, then their processes."""
        if self.closing:
            return
        self.closing = True
        if self.rank == 0:
            if self.failure is None:
                try:
                    dist.broadcast_object_list([None], src=0, group=self.steps)
                except Exception:  # noqa: BLE001 - a worker already gone: stopped below
                    pass
            for p in self.procs:
                try:
                    p.wait(timeout=10 if self.failure is None else 1)
                except subprocess.TimeoutExpired:
                    p.terminate()
                    p.wait(timeout=5)
        collectives.use(None)
        if self.failure is None:
            dist.destroy_process_group()

    # --- workers -----------------------------------------------------------------------------------

    def receive(self):
        """The next message from rank 0 (None: stop). Raises RankFailure when rank 0 is gone."""
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.steps)
        except Exception as e:  # noqa: BLE001
            raise RankFailure(f"rank 0 is gone ({e.__class__.__name__})") from e
        return box[0]


class Leader:
    """Rank 0's executor: each forward's inputs go to the workers first, then it runs as the wrapped one.

    Fills (input ids still on the device) are applied on the host here, since the workers have no tokens."""

    def __init__(self, inner, group: Group):
        self.inner, self.group = inner, group

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, inputs: dict[str, torch.Tensor], kv_caches, fill=None, draws=None):
        if fill is not None:
            inputs["input_ids"].index_copy_(0, fill.rows, fill.tokens.index_select(0, fill.src.to(
                fill.tokens.device)).to(inputs["input_ids"].device))
        self.group.send({k: v.numpy() for k, v in inputs.items()})
        try:
            return self.inner.forward(inputs, kv_caches, None, draws=draws)
        except Exception as e:  # noqa: BLE001 - the ranks are out of step: nothing can go on
            raise self.group.fail(self.group.failure or
                                  f"a step failed on rank 0 ({e.__class__.__name__}: {str(e)[:200]})") from e


def step_inputs(message: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.asarray(v)) for k, v in message.items()}


# --- start-up ----------------------------------------------------------------------------------------

def start(bundle: str, device: str, tp: int | None = None) -> Group | None:
    """The process group of this process's rank, made before the model loads (None: one rank). tp: what the
    command line asked for, checked against the bundle's."""
    from pathlib import Path
    manifest = read_manifest(Path(bundle))
    built = int(manifest.get("tp", 1))
    if tp is not None and tp != built:
        raise UserError(f"--tp {tp}: {bundle} was built for {built} rank{'s' if built > 1 else ''} "
                        f"(engc build --tp {tp} makes a bundle for {tp})")
    if built == 1:
        return None
    # NCCL where the model goes on the GPU, as loader.pick_device decides it for every rank
    from engc.bundle.reader import Bundle
    from engc.runtime.loader import pick_device
    gpu = pick_device(device, Bundle(Path(bundle), manifest)).type == "cuda"
    outside = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if outside:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != built:
            raise UserError(f"WORLD_SIZE {world} but {bundle} was built for --tp {built}")
        init, procs = "env://", []
    else:
        rank, world, port = 0, built, _free_port()
        init = f"tcp://127.0.0.1:{port}"
        procs = [subprocess.Popen([sys.executable, "-m", "engc.runtime.tp", bundle, device],
                                  env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(1, world)]
    return _join(rank, world, init, gpu, procs)


def load_rank(bundle: str, device: str, tp: int | None = None):
    """The LoadedModel of this process's rank 0 (the workers started); in any other rank of an outside
    launch, serves as a worker until rank 0 stops, then exits the process."""
    from engc.runtime.loader import load
    group = start(bundle, device, tp)
    if group is not None and group.rank != 0:
        serve_worker(group, bundle, device)
        raise SystemExit(0)
    try:
        return load(bundle, device=device, tp=group)
    except BaseException:
        if group is not None:
            group.fail("rank 0 could not load the bundle")
            group.close()
        raise


def _join(rank: int, world: int, init: str, gpu: bool, procs: list) -> Group:
    if gpu:   # this rank's GPU, its context made current now: the bundle's cubins load into the current one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1))
        torch.empty(0, device="cuda")
    try:
        dist.init_process_group("nccl" if gpu else "gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s()))
        steps = dist.new_group(backend="gloo", timeout=_IDLE)
    except Exception as e:  # noqa: BLE001 - a rank that never came up
        for p in procs:
            p.terminate()
        raise UserError(f"tensor parallel: the {world} ranks did not meet ({e.__class__.__name__}: "
                        f"{str(e)[:200]})") from None
    collectives.use(dist.group.WORLD)
    group = Group(rank, world, steps, procs)
    group.watch()
    if rank == 0:   # workers stop with the process, however it ends
        atexit.register(group.close)
    return group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(bundle: str, device: str) -> None:
    """A rank engc started (python -m engc.runtime.tp BUNDLE DEVICE): join, load this rank's weights, then
    follow rank 0 until it stops."""
    rank = int(os.environ.get("RANK", "-1"))
    # Ctrl-C in the terminal reaches the whole process group: rank 0 takes it and stops this rank itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        group = start(bundle, device)
        serve_worker(group, bundle, device)
        os._exit(0)
    except Exception as e:  # noqa: BLE001 - one line, and the process ends: rank 0's watchdog sees it
        print(f"engc: rank {rank}: {e if isinstance(e, (RankFailure, UserError, BundleError)) else repr(e)}",
              file=sys.stderr, flush=True)
        os._exit(1)


def serve_worker(group: Group, bundle: str, device: str) -> None:
    """Loads this rank's weights, takes the engine's setup from rank 0, then runs every step it sends."""
    from engc.runtime.engine import context_limit
    from engc.runtime.kv_cache import KVCache
    from engc.runtime.loader import load
    from engc.runtime.runner import ModelRunner
    model = load(bundle, device=device, tp=group)
    setup = group.receive()
    if setup is None:
        return
    kv_dtype = model.kv_dtype or model.dtype
    num_blocks = group.agree_blocks(setup["num_blocks"] or KVCache.default_num_blocks(
        model.kv_config, model.block_size, kv_dtype, model.device, setup["kv_memory_fraction"]))
    kv = KVCache(model.kv_config, num_blocks, model.block_size, kv_dtype, model.device, False)
    runner = ModelRunner(model, kv, context_limit(model, num_blocks, setup["max_context"]), setup["max_num_seqs"],
                         setup["cuda_graphs"], False)
    runner.follow()
    group.close()


if __name__ == "__main__":
    from engc.runtime import tp   # the package's module, not this __main__ copy: one RankFailure class
    tp.worker_main(*sys.argv[1:3])
