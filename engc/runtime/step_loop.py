"""The thread that owns an Engine: it applies commands between steps, steps while there is work, and hands
each step's outputs on in one batch.

Requests never touch the Engine directly. They put commands (add, abort, call) on the loop's inbox and the
loop applies them between steps, so the Engine stays single-threaded and a cancelled request frees its blocks
before the next step. The same loop runs in a thread of the server's process (AsyncEngine) and as the main
thread of the engine's own process (engine_process.py); only where a step's outputs go differs (deliver).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from engc.runtime.engine import Engine
from engc.runtime.tp import RankFailure

log = logging.getLogger("engc.engine")


class EngineError(RuntimeError):
    """The step loop failed while this request was in flight (a bug, reported as a 500)."""
    status = 500


class EngineDown(EngineError):
    """The engine stopped for good: a tensor-parallel rank died or its collectives failed (runtime/tp.py), or
    the engine's process ended. Every request, in flight or new, gets a 503, and the server exits."""
    status = 503


class StepLoop:
    def __init__(self, engine: Engine, deliver: Callable[[list], None], on_down: Callable[[str], None],
                 make_delta: Callable, routes: dict | None = None):
        """deliver(items): once an iteration, with the (route, delta or exception) pairs it produced, after
        stats is current. on_down(reason): the engine cannot go on (a tensor-parallel rank failed).
        make_delta(index, text, token_ids, logprobs, finished, finish_reason, stop_string, prompt_tokens,
        cached_tokens, completion_tokens, prompt_logprobs): what a sequence's step output becomes. routes: request
        id -> route (anything with .index), shared with the request side where it lives in this process."""
        self.engine = engine
        self.deliver = deliver
        self.on_down = on_down
        self.make_delta = make_delta
        self.routes = routes if routes is not None else {}
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.applied = 0   # adds taken from the inbox: with the request side's count, the adds in flight
        self.stats = self._stats()
        self.stopped = threading.Event()
        self._out: list = []

    def stop(self) -> None:
        self.stopped.set()
        self.inbox.put(("wake",))

    def run(self) -> None:
        engine, inbox = self.engine, self.inbox
        while not self.stopped.is_set():
            try:
                cmd = inbox.get(timeout=0.5) if not engine.has_work else inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(cmd)
                try:
                    cmd = inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if engine.has_work and not self.stopped.is_set():
                self._step()
            self.stats = self._stats()
            out, self._out = self._out, []
            self.deliver(out)

    def _stats(self) -> dict:
        """The engine's stats and the adds applied by then: one snapshot, so the request side's count of
        sequences waiting (AsyncEngine.queued) neither misses nor doubles an add."""
        stats = self.engine.stats()
        stats["applied"] = self.applied
        return stats

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt_ids, params, priority, session_id, route = cmd
            self.applied += 1
            self.routes[rid] = route
            try:
                self.engine.add_request(prompt_ids, params, priority, rid, session_id)
            except ValueError as e:
                self._out.append((self.routes.pop(rid), e))
        elif kind == "abort":
            self.engine.abort(cmd[1])
            self.routes.pop(cmd[1], None)
        elif kind == "call":
            _, fn, future = cmd
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RankFailure as e:   # the ranks are out of step: the engine stops, the server with it
            self.stop()
            self.on_down(str(e))
            return
        except Exception:  # noqa: BLE001 - a failed step fails its requests, not the server
            log.exception("engine step failed; aborting the requests in flight")
            for rid in self.routes:
                self.engine.abort(rid)
            self._out += [(route, EngineError("the engine failed while running this request"))
                          for route in self.routes.values()]
            self.routes.clear()
            return
        routes, items, make = self.routes, self._out, self.make_delta
        for out in outputs:
            seq = out.seq
            rid = seq.request_id
            route = routes.get(rid)
            if route is None:
                continue
            if out.finished:
                del routes[rid]
            items.append((route, make(route.index, out.text_delta, out.new_token_ids, out.logprobs, out.finished,
                                      seq.finish_reason, seq.stop_string, len(seq.prompt_ids),
                                      seq.num_cached_tokens or 0, len(seq.output_ids), out.prompt_logprobs)))
