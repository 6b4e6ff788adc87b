"""How the server's engine thread hands outputs to the event loop: once a step, whatever the number of streams."""
import asyncio
import json

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


def test_a_stream_that_fell_behind_reads_its_deltas_without_waiting(model):
    engine = Engine(model, EngineConfig(num_blocks=64, cuda_graphs=False))
    async_engine = AsyncEngine(engine).start()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def run():
        stream = async_engine.generate([(model.tokenizer.encode("Paris is"), params)])
        async with stream:
            first = await stream.__anext__()
            while not (stream.ready and stream.ready[-1].finished):   # the engine finishes the rest meanwhile
                await asyncio.sleep(0.01)
            behind = stream.pending()
            rest = [d async for d in stream]
        return first, behind, rest, stream.pending()
    try:
        first, behind, rest, left = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert behind == len(rest) >= 1 and rest[-1].finished and left == 0
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 6


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

    from engc.runtime.server.app import settle_heap
    threshold = gc.get_threshold()
    kept = [[i] for i in range(1000)]   # objects alive at start-up
    try:
        settle_heap()
        assert gc.get_freeze_count() >= len(kept) and gc.get_threshold()[0] == 10_000
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
