"""The engine in a process of its own: the HTTP server's event loop and the engine's step loop each get a
GIL and a core.

In one process the loop's work a streamed token (chunks, writes, handoffs) and the engine's (inputs,
detokenizing, stop strings) take turns on one GIL, so the server process sat at one core while the engine
alone could step twice as many tokens (H200, 8B, 256 streams). Here the child process (spawned: CUDA-safe)
loads the bundle and runs the StepLoop as its main thread; the parent (EngineClient) keeps only the
tokenizer and the request checks. Messages are pickled over one multiprocessing Pipe, batched both ways: the
parent sends the adds and aborts of one event-loop turn as one message, and the child sends each step's
outputs, every sequence's delta as a tuple, with its stats snapshot, as one message, which the parent's
reader thread (blocked in recv without the GIL) hands to the event loop in one call_soon_threadsafe.

The spawn is engine_spawn.py's, a module light to import: engc run spawns the child right after binding its
port, before it imports the server and torch (seconds), so the child's imports and load overlap the parent's;
EngineClient.start then waits for the child to serve.

The child's end is watched from both sides: a child that dies ends every open stream with EngineDown (the
server's 503 path, /health says why); a parent that dies closes the pipe, and the child stops.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import signal
import sys
import threading
import time
import traceback

from engc.errors import UserError
from engc.runtime.async_engine import Delta, EngineDown, EngineFront
from engc.runtime.engine import Engine, EngineConfig, check_request
from engc.runtime.engine_spawn import Spawned, kill
from engc.runtime.heap import settle_heap
from engc.runtime.step_loop import StepLoop

log = logging.getLogger("engc.engine")


class EngineClient(EngineFront):
    """The request side in the server's process, over an engine in a child process (the module's doc)."""

    @classmethod
    def start(cls, bundle: str, config: EngineConfig, child: Spawned, metrics=None,
              flush_streams: int = 64) -> "EngineClient":
        """Waits until the engine's process serves: child, as engine_spawn started it (spawn_engine: a server's
        engine; spawn: any build). A start-up error there is raised here: a UserError as the child raised it,
        anything else as one line naming it; on any error here the process is killed."""
        try:
            from engc.bundle.reader import open_bundle
            from engc.runtime.tokenizer import Tokenizer
            facts = open_bundle(bundle, verify_hashes=True, defer_big=True)   # the weights are the child's
            tokenizer = Tokenizer(facts.file("tokenizer"), facts.config.eos_token_ids)
            ready = _receive_ready(child.conn, child.process)
        except BaseException:
            kill(child.process)
            raise
        client = cls(child.process, child.conn, config, metrics, flush_streams)
        client.manifest, client.tokenizer = facts.manifest, tokenizer
        client.block_size = facts.manifest["kv_block_size"]
        client.vocab_size, client.max_context, client.stats = facts.config.vocab_size, ready[1], ready[2]
        client.startup = ready[3]
        client.startup.total_s = time.perf_counter() - child.started
        client.reader.start()
        return client

    def __init__(self, process, conn, config: EngineConfig, metrics, flush_streams: int):
        super().__init__(metrics, flush_streams)
        self.process, self.conn, self.config = process, conn, config
        self.closing = False
        self._send_lock = threading.Lock()
        self._pending: list = []      # adds and aborts of this event-loop turn, sent as one message
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self.reader = threading.Thread(target=self._read, name="engc-engine-reader", daemon=True)

    @functools.cached_property
    def matchers(self):
        """Grammars compiled over the vocabulary here too: a request's format is checked (and refused with a
        400) before it is sent; the child compiles its own copy off its step loop."""
        from engc.runtime.constrained import Matchers, vocab_of
        return Matchers(vocab_of(self.tokenizer, self.vocab_size))

    def check_request(self, prompt_ids, params) -> None:
        check_request(prompt_ids, params, self.max_context, self.vocab_size, lambda: self.matchers)

    # --- to the child --------------------------------------------------------------------------------

    def submit_add(self, rid, prompt_ids, params, priority, session_id, route) -> None:
        self.added += 1
        self.routes[rid] = route
        self._queue(("add", rid, prompt_ids, params, priority, session_id, route.index))
        if self.down is not None and self.routes.pop(rid, None) is not None:   # fail's sweep may have missed it
            self._post([(route, EngineDown(f"the engine is down: {self.down}"))])

    def submit_abort(self, rid: str) -> None:
        self.routes.pop(rid, None)
        self._queue(("abort", rid))

    def submit_call(self, fn) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        if self.down is not None:
            future.set_exception(EngineDown(f"the engine is down: {self.down}"))
            return future
        cid = next(self._call_ids)
        self._calls[cid] = future
        self._send([("call", cid, fn)])
        return future

    def _queue(self, cmd: tuple) -> None:
        """Sends cmd with the others of this event-loop turn, at the turn's end (at once off a loop)."""
        with self._send_lock:
            self._pending.append(cmd)
            first = len(self._pending) == 1
        if first:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._flush()
                return
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        with self._send_lock:
            batch, self._pending = self._pending, []
        if batch:
            self._send(batch)

    def _send(self, batch: list) -> None:
        with self._send_lock:
            try:
                self.conn.send(batch)
            except OSError:   # the child is gone: the reader fails every request
                pass

    def shutdown(self) -> None:
        self.closing = True
        self._flush()
        self._send([("stop",)])
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.reader.join(timeout=10)
        self.conn.close()

    # --- from the child ------------------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - a value that does not unpickle here; the next message may
                log.exception("a message from the engine's process could not be read")
                continue
            kind = message[0]
            if kind == "step":
                self.stats = message[2]
                self._deliver(message[1])
            elif kind == "result":
                _, cid, ok, value = message
                future = self._calls.pop(cid)
                future.set_result(value) if ok else future.set_exception(value)
            elif kind == "down":
                self.fail(message[1])
        if not self.closing:
            self.process.join(timeout=10)
            self.fail(_exit_reason(self.process.exitcode))
        for cid in list(self._calls):
            self._calls.pop(cid).set_exception(EngineDown(f"the engine is down: {self.down or 'stopped'}"))

    def _deliver(self, payload: list) -> None:
        """One step's (request id, delta fields or exception) pairs to their streams."""
        routes, items = self.routes, []
        for rid, item in payload:
            if item.__class__ is tuple:
                route = routes.get(rid)
                if route is None:   # aborted here while the child stepped it
                    continue
                if item[4]:   # finished
                    routes.pop(rid, None)
                items.append((route, Delta(*item)))
            else:
                route = routes.pop(rid, None)
                if route is not None:
                    items.append((route, item))
        if items:
            self._post(items)


def _receive_ready(conn, process) -> tuple:
    try:
        message = conn.recv()
    except (EOFError, OSError):
        process.join(timeout=10)
        raise UserError(f"the engine's process ended before it served ({_exit_reason(process.exitcode)})") from None
    if message[0] == "failed":
        process.join(timeout=10)
        raise message[1]
    return message


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "the engine's process stopped answering"
    if code < 0:
        return f"the engine's process was killed by {signal.Signals(-code).name}"
    return f"the engine's process exited with code {code}"


# --- the child -----------------------------------------------------------------------------------------

class _RemoteRoute:
    """Where a sequence's deltas go from the child: its request id and its index in the request."""
    __slots__ = ("rid", "index")

    def __init__(self, rid: str, index: int):
        self.rid, self.index = rid, index


def _fields(*fields) -> tuple:
    """A delta as the tuple of Delta's fields: pickled as plain values, rebuilt by Delta(*fields)."""
    return fields


def child_main(conn, build) -> None:
    """The engine's process, once engine_spawn's target has imported this module (SIGINT ignored there)."""
    try:
        engine = build()
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which says it in one line
        if not isinstance(e, UserError):
            traceback.print_exc()
            e = UserError(f"the engine could not start: {e.__class__.__name__}: {str(e)[:300]}")
        conn.send(("failed", e))
        sys.exit(1)
    settle_heap()   # the model's objects, out of the collections that would stall steps
    _Child(conn, engine).run()


class _Child:
    def __init__(self, conn, engine: Engine):
        self.conn, self.engine = conn, engine
        self.lock = threading.Lock()
        self.loop = StepLoop(engine, self.deliver, self.down, _fields)
        self.sent_stats: dict | None = None
        if engine.model.tp is not None:   # a rank's watchdog
            engine.model.tp.on_failure.append(self.down)

    def run(self) -> None:
        self.send(("ready", self.engine.max_context, self.loop.stats, self.engine.startup))
        threading.Thread(target=self.read, name="engc-engine-inbox", daemon=True).start()
        self.loop.run()
        if self.engine.model.tp is not None:
            self.engine.model.tp.close()

    def send(self, message) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except OSError:   # the parent is gone
                self.loop.stop()

    def deliver(self, items: list) -> None:
        stats = self.loop.stats
        if items or stats != self.sent_stats:
            self.sent_stats = stats
            self.send(("step", [(route.rid, item) for route, item in items], stats))

    def down(self, reason: str) -> None:
        self.send(("down", reason))
        self.loop.stop()

    def read(self) -> None:
        """The parent's messages onto the loop's inbox; a grammar is compiled here first, off the step loop."""
        inbox = self.loop.inbox
        try:
            while True:
                for cmd in self.conn.recv():
                    kind = cmd[0]
                    if kind == "add":
                        _, rid, ids, params, priority, session_id, index = cmd
                        if params.grammar is not None:
                            try:
                                self.engine.matchers.built(params.grammar)
                            except ValueError:
                                pass   # add_request refuses it with the same error
                        inbox.put(("add", rid, ids, params, priority, session_id, _RemoteRoute(rid, index)))
                    elif kind == "abort":
                        inbox.put(cmd)
                    elif kind == "call":
                        inbox.put(("call", cmd[2], self._answer(cmd[1])))
                    else:   # stop
                        self.loop.stop()
                        return
        except (EOFError, OSError):   # the parent died: nobody is left to serve
            self.loop.stop()

    def _answer(self, cid: int) -> concurrent.futures.Future:
        """A future whose outcome goes back to the parent as call cid's (a picklable stand-in if it is not)."""
        future = concurrent.futures.Future()

        def reply(f):
            error = f.exception()
            message = ("result", cid, error is None, f.result() if error is None else error)
            try:
                with self.lock:
                    self.conn.send(message)
            except Exception as e:  # noqa: BLE001 - an unpicklable result
                self.send(("result", cid, False, RuntimeError(f"call {cid}: {e.__class__.__name__}: {e}")))
        future.add_done_callback(reply)
        return future
