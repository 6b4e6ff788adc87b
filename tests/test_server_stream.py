"""How the server's engine thread hands outputs to the event loop: once a step, whatever the number of streams."""
import asyncio

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
