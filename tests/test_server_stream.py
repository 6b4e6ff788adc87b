"""How the server's engine thread hands outputs to the event loop: once a step, whatever the number of streams;
and how many tokens a reader gets a wake (one while the readers keep up, several merged under a large step)."""
import asyncio
import json
import time

import pytest
import torch

from engc.runtime.async_engine import AsyncEngine
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_bundle):
    return load(tiny_bundle("llama"), "cpu")


def test_one_handoff_a_step_for_all_streams(model):
    engine = Engine(model, EngineConfig(num_blocks=256, cuda_graphs=False))
    steps_with_outputs = 0
    step = engine.step

    def counted():
        nonlocal steps_with_outputs
        time.sleep(0.02)   # a step's device time, the GIL released: the readers keep up
        outputs = step()
        steps_with_outputs += bool(outputs)
        return outputs
    engine.step = counted
    async_engine = AsyncEngine(engine).start()
    n, tokens = 8, 12
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def run():
        async def one(i):
            ids = model.tokenizer.encode(f"stream {i} says")
            return [d async for d in async_engine.generate([(ids, params)])]
        # every add is on the inbox before the engine thread's next step: the streams decode in one batch
        return await asyncio.gather(*(one(i) for i in range(n)))
    try:
        streams = asyncio.run(run())
    finally:
        async_engine.shutdown()
    for deltas in streams:
        assert sum(len(d.token_ids) for d in deltas) == tokens and deltas[-1].finished
        assert [d.completion_tokens for d in deltas] == list(range(1, tokens + 1))
    assert async_engine.handoffs == steps_with_outputs
    assert async_engine.handoffs < n * tokens // 2   # one a step, not one a sequence's token


async def _until(ready, what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.002)


class _Paced:
    """engine.step run a step a permit, so a test paces the engine itself and holds on a loaded machine as on
    an idle one; `stepped` records whether each step had outputs. free() lets it run (before shutdown)."""

    def __init__(self, engine):
        import threading
        self.gate, self.stepped, step = threading.Semaphore(0), [], engine.step

        def paced():
            self.gate.acquire(timeout=60)
            outputs = step()
            self.stepped.append(bool(outputs))
            return outputs
        engine.step = paced

    async def step(self, unless=lambda: False) -> None:
        """One step, run to its end (unless `unless()` holds first: no step is coming)."""
        k = len(self.stepped)
        self.gate.release()
        await _until(lambda: len(self.stepped) > k or unless(), "a step did not run")

    def free(self) -> None:
        for _ in range(64):
            self.gate.release()


def test_a_stream_that_fell_behind_reads_its_waiting_deltas_as_one(model):
    """The engine runs ahead of a reader: what waits for it is read as one delta. The test paces the engine
    (a step a permit), so the first read comes before the last token on any machine, loaded or not."""
    engine = Engine(model, EngineConfig(num_blocks=64, cuda_graphs=False))
    paced = _Paced(engine)
    async_engine = AsyncEngine(engine).start()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)

    async def run():
        stream = async_engine.generate([(model.tokenizer.encode("Paris is"), params)])
        async with stream:
            while not stream.ready:          # one step at a time until the first token is there
                await paced.step()
                await asyncio.sleep(0.05)    # its outputs reach the stream
            first = await stream.__anext__()
            for _ in range(8):               # the rest, while the reader is away
                paced.gate.release()
            await _until(lambda: stream.ready and stream.ready[-1].finished, "the engine did not finish")
            behind = list(stream.ready)
            rest = [d async for d in stream]
        return first, behind, rest, stream.pending()
    try:
        first, behind, rest, left = asyncio.run(run())
    finally:
        paced.free()
        async_engine.shutdown()
    assert behind and len(first.token_ids) + sum(len(d.token_ids) for d in behind) == 6 and left == 0
    (merged,) = rest
    assert merged.token_ids == [t for d in behind for t in d.token_ids]
    assert merged.text == "".join(d.text for d in behind)
    assert [x.token for x in merged.logprobs] == merged.token_ids
    assert merged.finished and merged.finish_reason == behind[-1].finish_reason == "length"
    assert merged.completion_tokens == 6 and merged.prompt_tokens == behind[0].prompt_tokens


def _stream_all(model, monkeypatch, flush_streams: int, drain: bool, n: int = 8, tokens: int = 12):
    """n greedy streams decoded in one batch: each stream's deltas as its reader got them. The test paces
    the engine, a step a permit: the next step waits until this one's outputs are in the streams and, with
    drain, until every reader has read them (readers that keep up, on any machine, loaded or not)."""
    from engc.runtime import async_engine as ae
    engine = Engine(model, EngineConfig(num_blocks=256, cuda_graphs=False))
    paced, dispatched = _Paced(engine), [0]
    dispatch = ae._Outbox.dispatch

    def counted(self, items):
        dispatch(self, items)
        dispatched[0] += 1
    monkeypatch.setattr(ae._Outbox, "dispatch", counted)
    async_engine = AsyncEngine(engine, flush_streams=flush_streams).start()
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def run():
        streams = [async_engine.generate([(model.tokenizer.encode(f"stream {i} says"), params)]) for i in range(n)]

        async def read(stream):
            return [d async for d in stream]
        readers = [asyncio.ensure_future(read(s)) for s in streams]
        while not all(r.done() for r in readers):
            await paced.step(unless=lambda: all(r.done() for r in readers))
            await _until(lambda: dispatched[0] >= sum(paced.stepped), "a step's outputs did not reach the streams")
            if drain:
                await _until(lambda: not any(s.ready for s in streams), "a reader did not read")
        return [r.result() for r in readers]
    try:
        return asyncio.run(run())
    finally:
        paced.free()
        async_engine.shutdown()


def test_readers_of_a_large_step_get_several_tokens_a_wake_and_the_same_answer(model, monkeypatch):
    # 8 streams: woken every step (readers that keep up), or every 4th step
    alone, paced = _stream_all(model, monkeypatch, 64, drain=True), _stream_all(model, monkeypatch, 2, drain=False)
    for one_each, grouped in zip(alone, paced):
        assert [len(d.token_ids) for d in one_each] == [1] * 12   # the readers keep up: one delta a token
        assert [t for d in grouped for t in d.token_ids] == [t for d in one_each for t in d.token_ids]
        assert "".join(d.text for d in grouped) == "".join(d.text for d in one_each)
        assert len(grouped[0].token_ids) == 1   # the first token is never held
        assert len(grouped) < 12 and max(len(d.token_ids) for d in grouped) >= 4   # 4 a wake
        assert grouped[-1].finished and [d.finished for d in grouped].count(True) == 1
        assert grouped[-1].completion_tokens == 12


def test_a_held_reader_is_woken_by_a_step_without_its_sequence():
    from collections import deque
    from types import SimpleNamespace

    from engc.runtime.async_engine import Delta, _Outbox

    class Reader:
        def __init__(self):
            self.ready, self.waiter, self.woken = deque(), object(), 0

        def wake(self):   # as RequestStream.wake: a reader not waiting is left alone
            if self.waiter is not None:
                self.waiter, self.woken = None, self.woken + 1

    def delta(i, n):
        return Delta(0, "x", [i], [], False, None, None, 3, 0, n)
    outbox = _Outbox(SimpleNamespace(flush_streams=2, metrics=None))
    readers = [Reader() for _ in range(4)]
    outbox.dispatch([(SimpleNamespace(stream=r), delta(i, 2)) for i, r in enumerate(readers)])
    assert [r.woken for r in readers] == [0, 0, 0, 0] and [len(r.ready) for r in readers] == [1, 1, 1, 1]
    outbox.dispatch([(SimpleNamespace(stream=r), delta(i, 3)) for i, r in enumerate(readers[:3])])
    assert [r.woken for r in readers] == [1, 1, 1, 1]   # two waiting each, and the fourth got none this step
    first = Reader()
    outbox.dispatch([(SimpleNamespace(stream=r), delta(i, 1)) for i, r in enumerate([first] + readers[1:])])
    assert first.woken == 1   # a sequence's first token goes out at once


def test_merged_deltas_stop_at_another_sequence_an_error_or_the_end():
    from collections import deque
    from types import SimpleNamespace

    from engc.runtime.async_engine import Delta, RequestStream

    def delta(index, n, finished=False, logprobs=(), prompt_logprobs=None):
        return Delta(index, f"<{index}.{n}>", [10 * index + n], list(logprobs), finished,
                     "length" if finished else None, None, 3, 1, n, prompt_logprobs)

    def merge(first, *rest):
        reader = SimpleNamespace(ready=deque(rest))
        return RequestStream._merge(reader, first), list(reader.ready)
    error = RuntimeError("a broken step")
    merged, left = merge(delta(0, 1, prompt_logprobs=["p"]), delta(0, 2, logprobs=["a"]), delta(0, 3), delta(1, 1),
                         delta(0, 4))
    assert (merged.text, merged.token_ids, merged.logprobs, merged.completion_tokens) == \
        ("<0.1><0.2><0.3>", [1, 2, 3], ["a"], 3)
    assert merged.prompt_logprobs == ["p"] and [d.token_ids for d in left] == [[11], [4]]
    merged, left = merge(delta(0, 1), delta(0, 2, finished=True), delta(0, 3))
    assert merged.token_ids == [1, 2] and merged.finished and merged.finish_reason == "length" and len(left) == 1
    merged, left = merge(delta(0, 1), error, delta(0, 2))
    assert merged.token_ids == [1] and left[0] is error
    first = delta(0, 1, finished=True)
    assert merge(first, delta(0, 2))[0] is first


@pytest.mark.parametrize("kind", ["chat.completion", "text_completion"])
@pytest.mark.parametrize("usage", [False, True])
def test_text_chunks_are_the_chunks_json_dumps_writes(kind, usage):
    from types import SimpleNamespace

    from engc.runtime.server.openai import _Output
    req = SimpleNamespace(n=2, stream_options=SimpleNamespace(include_usage=usage) if usage else None)
    out = _Output(SimpleNamespace(model_name='m "x" ü'), req, "chatcmpl-abc", kind, [3])
    for index, text in [(0, "Hello"), (1, ' "quoted"\n\tand \\ back'), (0, "ünïcödé 日本語 🙂"), (1, "\x00\x1f\u2028")]:
        whole = out.obj([out.choice(index, text, None, None, delta=True)], chunk=True)
        assert out.text_chunk(index, text) == f"data: {json.dumps(whole, ensure_ascii=False)}\n\n"


def test_text_events_are_the_events_json_dumps_writes():
    from engc.runtime.server.anthropic import event, text_event
    for text in ["Hello", ' "quoted"\n\\', "ünïcödé 日本語 🙂", "\x00\u2028"]:
        assert text_event(text) == event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                                       "text": text}})


def test_a_failed_step_ends_each_stream_with_its_error_after_what_it_streamed(srv):
    import httpx

    def fail_after(k):
        def arm(e):
            real, count = type(e).step.__get__(e), [0]

            def step():
                count[0] += 1
                if count[0] > k:
                    del e.step   # once: the engine's own step from now on
                    raise RuntimeError("a broken step")
                return real()
            e.step = step
        srv.call(arm)
    body = {"model": srv.model, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Hello"}]}
    fail_after(5)
    lines = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).text.split("\n\n")
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)
    assert events[-1]["error"]["type"] == "server_error" and lines[-2] == "data: [DONE]"
    fail_after(5)
    text = httpx.post(srv.url + "/v1/messages", json=body, timeout=60).text
    kinds = [x.split("\n")[0].removeprefix("event: ") for x in text.split("\n\n") if x]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"] and "content_block_delta" in kinds
    assert kinds[-1] == "error" and "message_stop" not in kinds
    srv.wait_idle()
    srv.call(lambda e: e.check_integrity())


def test_settle_heap_leaves_what_start_up_made_out_of_collections():
    import gc

    from engc.runtime.heap import settle_heap
    threshold = gc.get_threshold()
    kept = [[i] for i in range(1000)]   # objects alive at start-up
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(kept) and gc.get_threshold()[0] == 10_000
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_grouped_chunks_carry_every_token_once(srv):
    """Four streams of one step, each reader woken every fourth step: the chunks carry several tokens (their
    logprobs one entry a token), and each stream's text, tokens and usage are those of its peers, whose
    rows in the batch are the same."""
    import httpx
    body = {"model": srv.model, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Count with me"}]}

    async def one(client):
        r = await client.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        return [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]

    async def four():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client) for _ in range(4)))
    srv.engine.flush_streams = 1
    try:
        streams = asyncio.run(four())
    finally:
        srv.engine.flush_streams = 64
    answers = []
    for events in streams:
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
        tokens = [[t["token"] for t in c["logprobs"]["content"]] for c in chunks]
        assert sum(map(len, tokens)) == events[-1]["usage"]["completion_tokens"] == 16
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        answers.append(("".join(c["delta"].get("content", "") for c in chunks), sum(tokens, []), tokens))
    assert len({(text, tuple(ids)) for text, ids, _ in answers}) == 1
    assert any(len(group) > 1 for _, _, groups in answers for group in groups)


async def _event_stream(events, receive):
    """(sent messages, the response's outcome) of an EventStream over `events`."""
    from engc.runtime.server.app import EventStream
    sent = []

    async def send(message):
        sent.append(message)
    await EventStream(events)({"type": "http"}, receive, send)
    return sent


def test_an_event_stream_sends_its_events_and_ends_the_body_with_the_last():
    from engc.runtime.server.app import Last

    async def never():
        await asyncio.Event().wait()

    async def events(last):
        yield "data: 1\n\n"
        yield "data: ü\n\n"
        if last:
            yield Last("data: [DONE]\n\n")
            yield "data: never sent\n\n"
    for last in (True, False):
        sent = asyncio.run(_event_stream(events(last), never))
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
        bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
        end = [(b"data: [DONE]\n\n", False)] if last else [(b"", False)]
        assert bodies == [(b"data: 1\n\n", True), ("data: ü\n\n".encode(), True)] + end


def test_an_event_stream_whose_client_goes_stops_its_events_and_returns():
    gone, cleaned = asyncio.Event(), []

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def events():
        try:
            yield "data: 1\n\n"
            gone.set()   # the client leaves while the next event is awaited
            await asyncio.Event().wait()
            yield "data: never\n\n"
        finally:
            cleaned.append(True)   # an `async with stream` aborts its request here

    async def run():
        sent = await _event_stream(events(), receive)
        task = asyncio.current_task()
        return sent, task.cancelling() if hasattr(task, "cancelling") else 0
    sent, cancelling = asyncio.run(run())
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"] and cleaned == [True]
    assert cancelling == 0   # the disconnect's cancel is the response's own, taken back


def test_an_event_stream_whose_receive_fails_stops_and_raises_it():
    cleaned = []

    async def receive():
        raise OSError("the connection broke")

    async def events():
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()
            yield "data: never\n\n"
        finally:
            cleaned.append(True)
    with pytest.raises(OSError, match="broke"):
        asyncio.run(_event_stream(events(), receive))
    assert cleaned == [True]


def test_an_event_stream_cancelled_from_outside_is_cancelled():
    started, cleaned = asyncio.Event(), []

    async def never():
        await asyncio.Event().wait()

    async def events():
        try:
            started.set()
            await asyncio.Event().wait()
            yield "data: never\n\n"
        finally:
            cleaned.append(True)

    async def run():
        task = asyncio.ensure_future(_event_stream(events(), never))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(run())
    assert cleaned == [True]
