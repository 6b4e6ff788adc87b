"""The engine behind an asyncio server: the request side (EngineFront: generate -> RequestStream, abort,
queued, call, fail) over an engine that steps elsewhere, in a thread of this process (AsyncEngine, here) or in
a process of its own (EngineClient, engine_process.py).

Outputs come back once a step: all the step's Deltas for an event loop in one call_soon_threadsafe, which
hands each to its request's stream on the loop. A handoff wakes the loop through its self-pipe (a syscall)
and runs under the loop's GIL, so one a sequence cost as much host time at 256 streams as the step itself.

A stream's reader takes every delta waiting for it as one (RequestStream.__anext__ merges them), so each
wake of a reader is one event and one socket write, whatever the tokens. With more streams in a step than
`flush_streams`, a reader is woken every ceil(streams / flush_streams) steps instead of every step (_Outbox):
a write a stream a step cost more host time at 256 streams than the engine's own step (CPU harness,
server/hostbench.py). Below that, every token is its own event as soon as its step ends.
"""
from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import itertools
import threading
import time
from dataclasses import dataclass, field

from engc.runtime.engine import Engine, EngineConfig, Startup
from engc.runtime.sampling import Sampled, SamplingParams
from engc.runtime.step_loop import EngineDown, EngineError, StepLoop
from engc.runtime.tokenizer import Tokenizer

__all__ = ["AsyncEngine", "Delta", "EngineDown", "EngineError", "EngineFront", "QueueFull", "RequestStream"]
_ids = itertools.count()


@dataclass(slots=True)
class Delta:
    """What one step produced for one sequence of a request, copied out of the engine's thread."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Sampled]
    finished: bool
    finish_reason: str | None
    stop_string: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_logprobs: list[Sampled | None] | None = None   # with a sequence's first delta, where asked


@dataclass(slots=True)
class _Route:
    loop: asyncio.AbstractEventLoop
    stream: "RequestStream"
    index: int


class QueueFull(RuntimeError):
    """More sequences would wait for a place in the running batch than EngineConfig.max_waiting allows. The
    server answers 429 at once, so a router or proxy in front can send the request to another replica or
    another model instead of queueing it here."""


class EngineFront(abc.ABC):
    """What the server holds: the engine's fixed facts (the bundle's manifest, tokenizer, config, max_context,
    block_size, vocab_size, check_request, startup: where its start went) and the request side. A subclass says where commands go
    (submit_add, submit_abort, submit_call) and feeds each step's (route, Delta or exception) pairs to _post
    and its stats to .stats."""
    manifest: dict
    tokenizer: Tokenizer
    config: EngineConfig
    max_context: int
    block_size: int
    vocab_size: int
    startup: Startup

    def __init__(self, metrics=None, flush_streams: int = 64):
        """flush_streams: the streams of a step whose readers are all woken at once (the module's doc)."""
        self.metrics = metrics
        self.flush_streams = flush_streams
        self._outboxes: dict[asyncio.AbstractEventLoop, _Outbox] = {}
        self.routes: dict[str, _Route] = {}
        self.stats: dict = {"waiting": 0, "running": 0, "applied": 0}
        self.added = 0                    # sequences sent to the engine; stats["applied"]: those it took
        self.down: str | None = None      # why the engine stopped for good (EngineDown)
        self.on_down: list = []           # callbacks(reason): the server's exit
        self.handoffs = 0                 # calls into the event loops (tests count them: one a step)

    @abc.abstractmethod
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError with a one-line reason if the engine would refuse the request (from any thread)."""

    @abc.abstractmethod
    def submit_add(self, rid: str, prompt_ids: list[int], params: SamplingParams, priority: int,
                   session_id: str | None, route: _Route) -> None:
        """Queues a sequence; its deltas go to route."""

    @abc.abstractmethod
    def submit_abort(self, rid: str) -> None:
        """The sequence rid ends and frees its blocks before the engine's next step."""

    @abc.abstractmethod
    def submit_call(self, fn) -> concurrent.futures.Future:
        """fn(engine) run between steps; across a process boundary fn must pickle (a module's function)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stops the engine (and a tensor-parallel bundle's other ranks)."""

    def _stopping(self) -> None:
        """fail's part that stops the engine's side."""

    def fail(self, reason: str) -> None:
        """The engine cannot go on: requests in flight and to come get EngineDown, and the on_down callbacks
        run (once). Called from the engine's thread, a watchdog, or the reader of the engine's process."""
        if self.down is not None:
            return
        self.down = reason
        self._stopping()
        self._post([(route, EngineDown(f"the engine is down: {reason}")) for route in list(self.routes.values())])
        self.routes.clear()
        for callback in list(self.on_down):
            callback(reason)

    def generate(self, prompts: list[tuple[list[int], SamplingParams]], priority: int = 0,
                 session_id: str | None = None) -> "RequestStream":
        """Queues one sequence per (prompt, params); raises ValueError if the engine would refuse one,
        EngineDown if it has stopped."""
        if self.down is not None:
            raise EngineDown(f"the engine is down: {self.down}")
        for ids, params in prompts:
            self.check_request(ids, params)
        limit = self.config.max_waiting
        if limit is not None and self.queued(len(prompts)) > limit:
            raise QueueFull(f"the queue is full: more than {limit} requests would wait for a place in the batch")
        return RequestStream(self, prompts, priority, session_id)

    def queued(self, more: int = 0) -> int:
        """Sequences that would wait for a place in the running batch with `more` added: those the engine
        held waiting at its last stats, plus the adds it had not taken by then beyond the batch's free places."""
        s = self.stats
        free = max(self.config.max_num_seqs - s["running"], 0)
        return s["waiting"] + max(self.added - s["applied"] + more - free, 0)

    async def call(self, fn):
        """Runs fn(engine) between steps and returns its result."""
        return await asyncio.wrap_future(self.submit_call(fn))

    def _post(self, items: list[tuple[_Route, object]]) -> None:
        """Hands (route, Delta or exception) pairs to their streams: one call a loop (a server has one)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for pair in items:
            by_loop.setdefault(pair[0].loop, []).append(pair)
        for loop, group in by_loop.items():
            self.handoffs += 1
            outbox = self._outboxes.get(loop)
            if outbox is None:
                outbox = self._outboxes[loop] = _Outbox(self)
            try:
                loop.call_soon_threadsafe(outbox.dispatch, group)
            except RuntimeError:
                self._outboxes.pop(loop, None)   # the requests' event loop is gone; so are the requests


class AsyncEngine(EngineFront):
    """The engine in a thread of the server's process (StepLoop): the library's and the tests' way, and
    `engc run --no-engine-process`. The thread and the event loop share one GIL."""

    def __init__(self, engine: Engine, metrics=None, flush_streams: int = 64):
        super().__init__(metrics, flush_streams)
        self.engine = engine
        self.startup = engine.startup
        self.manifest = engine.model.bundle.manifest
        self.tokenizer = engine.model.tokenizer
        self.config = engine.config
        self.max_context = engine.max_context
        self.block_size = engine.model.block_size
        self.vocab_size = engine.model.config.vocab_size
        self.step_loop = StepLoop(engine, self._deliver, self.fail, Delta, self.routes)
        self.stats = self.step_loop.stats
        self.thread = threading.Thread(target=self.step_loop.run, name="engc-engine", daemon=True)
        if engine.model.tp is not None:   # the watchdog's or a failed step's RankFailure
            engine.model.tp.on_failure.append(self.fail)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_ids, params)

    def start(self) -> "AsyncEngine":
        self.thread.start()
        return self

    def shutdown(self) -> None:
        self.step_loop.stop()
        self.thread.join(timeout=10)
        if self.engine.model.tp is not None:   # after the loop: no step is sent past the workers' stop
            self.engine.model.tp.close()

    def _stopping(self) -> None:
        self.step_loop.stop()

    def _deliver(self, items: list) -> None:
        self.stats = self.step_loop.stats
        if items:
            self._post(items)

    def submit_add(self, rid, prompt_ids, params, priority, session_id, route) -> None:
        self.added += 1
        self.step_loop.inbox.put(("add", rid, prompt_ids, params, priority, session_id, route))

    def submit_abort(self, rid: str) -> None:
        self.step_loop.inbox.put(("abort", rid))

    def submit_call(self, fn) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self.step_loop.inbox.put(("call", fn, future))
        return future


class _Outbox:
    """A loop's side of the handoff: each step's outputs into their requests' streams, and which readers
    that wakes. A reader waiting on a step of more than flush_streams streams is left to sleep while it has
    fewer than ceil(streams / flush_streams) deltas waiting, unless the delta is its sequence's first or last
    (time to the first token and the end are never held) or an error; a reader held at one step and given
    nothing at the next is woken then, so a sequence the engine pauses (preempted) does not hold its
    tokens back."""

    def __init__(self, engine: EngineFront):
        self.engine = engine
        self.held: dict[int, RequestStream] = {}

    def dispatch(self, items: list) -> None:
        """On the loop: one step's (route, Delta or exception) pairs."""
        tokens, every = 0, -(-len(items) // self.engine.flush_streams)
        was_held, held = self.held, {}
        for route, item in items:
            stream = route.stream
            ready = stream.ready
            ready.append(item)
            is_delta = item.__class__ is Delta
            if is_delta:
                tokens += len(item.token_ids)
            if stream.waiter is None:   # not waiting: its reader takes this when it next asks
                continue
            if is_delta and every > 1 and len(ready) < every and not item.finished \
                    and item.completion_tokens > len(item.token_ids):
                held[id(stream)] = stream
                continue
            stream.wake()
        for key, stream in was_held.items():
            if key not in held:
                stream.wake()
        self.held = held
        metrics = self.engine.metrics
        if metrics is not None and tokens:
            metrics.generation_tokens.inc(tokens)


@dataclass
class RequestStream:
    """An async iterator over a request's Deltas; leaving it early (or `async with`) aborts the rest."""
    engine: EngineFront
    prompts: list
    priority: int = 0
    session_id: str | None = None
    request_ids: list[str] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        loop = self.loop = asyncio.get_running_loop()
        self.ready: collections.deque = collections.deque()   # Deltas (or an exception) handed over, not yet read
        self.waiter: asyncio.Future | None = None             # set while __anext__ waits for the next handoff
        self.remaining = len(self.prompts)
        self.last_token_at: dict[int, float] = {}
        tag = next(_ids)
        for i, (ids, params) in enumerate(self.prompts):
            rid = f"req-{tag}-{i}"
            self.request_ids.append(rid)
            session = self.session_id if i == 0 else None
            self.engine.submit_add(rid, list(ids), params, self.priority, session, _Route(loop, self, i))

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        """The next delta: all of one sequence's deltas waiting at the front, merged into one."""
        if self.remaining == 0:
            raise StopAsyncIteration
        if not self.ready:
            self.waiter = self.loop.create_future()
            await self.waiter
        item = self.ready.popleft()
        if item.__class__ is not Delta:   # an exception
            self.remaining = 0
            self.abort()
            raise item
        if self.ready:
            item = self._merge(item)
        self._observe(item)
        if item.finished:
            self.remaining -= 1
        return item

    def wake(self) -> None:
        """Lets __anext__ read what was handed over (on the loop)."""
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _merge(self, first: Delta) -> Delta:
        """first with the deltas of its sequence that follow it in ready, as one delta: their text, tokens
        and logprobs one after the other, the counts and the finish of the last."""
        ready, index, last = self.ready, first.index, first
        texts, tokens, logprobs, prompt_logprobs = [first.text], None, None, first.prompt_logprobs
        while ready and not last.finished:
            d = ready[0]
            if d.__class__ is not Delta or d.index != index:
                break
            ready.popleft()
            if tokens is None:
                tokens, logprobs = list(first.token_ids), list(first.logprobs)
            texts.append(d.text)
            tokens += d.token_ids
            if d.logprobs:
                logprobs += d.logprobs
            if prompt_logprobs is None:
                prompt_logprobs = d.prompt_logprobs
            last = d
        if last is first:
            return first
        return Delta(index, "".join(texts), tokens, logprobs, last.finished, last.finish_reason, last.stop_string,
                     last.prompt_tokens, last.cached_tokens, last.completion_tokens, prompt_logprobs)

    def pending(self) -> int:
        """Deltas already handed over that __anext__ returns without waiting (a stream that fell behind
        the engine writes them out together)."""
        return len(self.ready) if self.remaining else 0

    def abort(self) -> None:
        for rid in self.request_ids:
            self.engine.submit_abort(rid)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        if self.remaining:
            self.remaining = 0
            self.abort()

    def _observe(self, d: Delta) -> None:
        metrics = self.engine.metrics
        if metrics is None:
            return
        now = time.perf_counter()
        last = self.last_token_at.get(d.index)
        if last is None:
            metrics.ttft.observe(now - self.start)
        elif d.token_ids:
            metrics.tpot.observe((now - last) / len(d.token_ids))
        self.last_token_at[d.index] = now
        if d.finished:
            metrics.prompt_tokens.inc(d.prompt_tokens)
            metrics.cached_tokens.inc(d.cached_tokens)
            metrics.e2e.observe(now - self.start)
