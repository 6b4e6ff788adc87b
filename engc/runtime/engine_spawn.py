"""The spawn of an engine's process (engine_process.py), light to import: engc run starts the child before it
imports the server and torch (seconds), so the child's imports and load overlap the parent's imports. Nothing
here imports torch, fastapi or the engine at import time: load_engine and the child's target import what they
need when they run."""
from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, NamedTuple

from engc.runtime.config import EngineConfig

if TYPE_CHECKING:
    from engc.runtime.engine import Engine


class Spawned(NamedTuple):
    """An engine's process started by spawn, which EngineClient.start waits for."""
    process: BaseProcess
    conn: Connection    # the parent's end of the pipe
    started: float      # time.perf_counter() at the spawn: the start-up line's total counts from it


def runs_apart(config: EngineConfig) -> bool:
    """Whether a server's engine runs in a process of its own: config.engine_process, except on an outside
    launcher's rank > 0, which serves no HTTP and loads its rank in its own process as a worker."""
    return config.engine_process and int(os.environ.get("RANK", "0")) == 0


def load_engine(bundle: str, config: EngineConfig, device: str, tp: int | None) -> Engine:
    """A server's engine: rank 0 of the bundle (its other ranks started as tp.py starts them)."""
    from engc.runtime.engine import start_engine
    from engc.runtime.tp import load_rank
    return start_engine(lambda: load_rank(bundle, device, tp), config)


def spawn_engine(bundle: str, config: EngineConfig, device: str, tp: int | None) -> Spawned:
    """A server's engine (load_engine's) in a process of its own: engc run's, spawned before it imports the
    server, or build_server's where it is given none."""
    return spawn(functools.partial(load_engine, bundle, config, device, tp))


def spawn(build) -> Spawned:
    """Starts the engine's process (spawned: CUDA-safe), which runs build() (picklable) and then serves."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=_child, args=(child_conn, build), name="engc-engine", daemon=True)
    started = time.perf_counter()
    with _sigint_held() as interrupted:
        process.start()
    if interrupted:   # the child has its whole target now: stop it, then take the Ctrl-C as it would have come
        kill(process)
        signal.raise_signal(signal.SIGINT)
    child_conn.close()   # the child's end lives in the child only: its exit is this end's EOF
    return Spawned(process, conn, started)


@contextmanager
def _sigint_held():
    """A Ctrl-C inside is held until the block ends (the yielded list says whether one came): one while start()
    still writes the child its target would leave the child reading half of it, and a traceback of its own
    after engc's one line. Signals reach only the main thread's handlers: elsewhere there is nothing to hold."""
    interrupted: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def kill(process: BaseProcess) -> None:
    """Stops a spawned process at once and reaps it; nothing for one already reaped."""
    process.kill()
    process.join()


def _child(conn: Connection, build) -> None:
    # Ctrl-C in a terminal reaches the whole process group: the parent takes it and stops this process. Ignored
    # before the engine's imports, which take seconds
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engc.runtime.engine_process import child_main
    child_main(conn, build)
