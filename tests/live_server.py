"""A live engc server in this process: uvicorn on a free loopback port, in a thread; the engine in a thread
of this process too, or with process=True in a process of its own as engc run has it."""
from __future__ import annotations

import dataclasses
import threading
import time

import uvicorn

from engc.runtime.engine import EngineConfig
from engc.runtime.server.app import build_server
from engc.runtime.server.listen import listening_socket


class LiveServer:
    def __init__(self, bundle, config: EngineConfig = EngineConfig(), api_key: str | None = None,
                 model_name: str = "tiny", max_body_bytes: int | None = None, process: bool = False):
        config = dataclasses.replace(config, engine_process=process)
        self.app, self.engine = build_server(str(bundle), config, model_name, api_key, max_body_bytes=max_body_bytes)
        self.socket = listening_socket("127.0.0.1", 0)   # engc run --port 0's: bound here, no race for it
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model_name
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()
        self.socket.close()

    def call(self, fn, timeout: float = 30):
        """fn(engine) run in the engine's thread between steps (a module's function where it is a process)."""
        return self.engine.submit_call(fn).result(timeout)

    def wait_idle(self, timeout: float = 30) -> dict:
        """Waits until nothing is queued or running; returns the engine's stats then."""
        deadline = time.time() + timeout
        while True:
            stats = self.call(idle_stats)
            if stats is not None:
                return stats
            assert time.time() < deadline, "engine still busy"
            time.sleep(0.05)


def idle_stats(engine) -> dict | None:
    """The engine's stats once it has nothing queued or running, else None."""
    return None if engine.has_work else engine.stats()
