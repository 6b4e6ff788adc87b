"""The engine's scheduling on CPU with a tiny model: prefix cache, preemption, priorities, cancellation,
sessions. Every test ends with the allocator's integrity check."""
import pytest
import torch

from engc.llm import LLM
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.kv_cache import BlockAllocator
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams

torch.set_num_threads(1)  # tiny models: threads only contend (25x slower on a busy 2-core runner)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
        "Hello, world! How are you today? engc compiles models ahead of time. ")


@pytest.fixture(scope="module")
def model(tiny_bundle):
    return load(tiny_bundle("llama"))


def run_alone(model, prompts, params=GREEDY):
    """The oracle: each prompt on its own fresh engine, no prefix cache."""
    outs = []
    for ids in prompts:
        engine = Engine(model, EngineConfig(prefix_cache=False))
        seq = engine.add_request(ids, params)
        engine.run_to_completion()
        outs.append(seq.output_ids)
    return outs


def assert_clean(engine):
    engine.check_integrity()
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


def test_prefix_cache_reuses_full_blocks(model):
    engine = Engine(model)
    base = model.tokenizer.encode(TEXT * 2)
    first = engine.add_request(base, GREEDY)
    engine.run_to_completion()
    before = engine.stats()["computed_tokens"]
    longer = base + model.tokenizer.encode(" And then some more.")
    second = engine.add_request(longer, GREEDY)
    engine.run_to_completion()
    bs = model.block_size
    assert first.num_cached_tokens == 0
    # base plus its 24 outputs were cached; the second prompt shares base's full blocks
    assert second.num_cached_tokens == len(base) // bs * bs > 0
    assert engine.stats()["computed_tokens"] - before == len(longer) - second.num_cached_tokens + GREEDY.max_tokens - 1
    assert [first.output_ids, second.output_ids] == run_alone(model, [base, longer])
    assert_clean(engine)


def test_whole_prompt_cached_still_computes_last_token(model):
    engine = Engine(model)
    ids = model.tokenizer.encode(TEXT)[:48]  # exactly three blocks
    a = engine.add_request(ids, GREEDY)
    engine.run_to_completion()
    b = engine.add_request(ids, GREEDY)
    engine.run_to_completion()
    assert b.num_cached_tokens == 32 and a.output_ids == b.output_ids
    assert_clean(engine)


def test_preemption_by_recompute_leaves_outputs_unchanged(model):
    prompts = [model.tokenizer.encode(f"{i} " + TEXT)[:20 + 3 * i] for i in range(5)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = run_alone(model, prompts, params)
    for prefix_cache in (False, True):
        engine = Engine(model, EngineConfig(num_blocks=8, prefix_cache=prefix_cache))
        seqs = [engine.add_request(ids, params) for ids in prompts]
        while engine.has_work:
            engine.step()
            engine.check_integrity()
        assert engine.scheduler.num_preemptions > 0
        assert [s.output_ids for s in seqs] == expected
        assert_clean(engine)


def test_priorities_order_admission(model):
    engine = Engine(model, EngineConfig(max_num_seqs=1))
    ids = model.tokenizer.encode("Hello")
    low = engine.add_request(ids, GREEDY, priority=5)
    high = engine.add_request(ids, GREEDY, priority=-1)
    finished = []
    while engine.has_work:
        finished += [o.seq for o in engine.step() if o.finished]
    assert finished == [high, low]
    assert_clean(engine)


def test_abort_frees_blocks_at_once(model):
    engine = Engine(model)
    seq = engine.add_request(model.tokenizer.encode(TEXT), GREEDY, request_id="r1")
    engine.step()
    assert seq.block_table and engine.kv.allocator.num_free < engine.kv.allocator.num_blocks
    engine.abort("r1")
    assert seq.finish_reason == "abort"
    assert_clean(engine)


def test_lru_evicts_oldest_cached_blocks_first():
    alloc = BlockAllocator(4, 2)
    a, b = alloc.allocate(), alloc.allocate()
    hashes = []
    alloc.register([1, 2, 3, 4], [a, b], hashes)
    alloc.release([a, b])
    assert alloc.num_free == 4 and len(alloc.cached) == 2
    taken = [alloc.allocate() for _ in range(3)]  # two never-hashed blocks, then the chain's tail
    assert b in taken and a not in taken
    assert alloc.match([1, 2, 3, 4, 5], []) == [a]
    alloc.check_integrity([taken, [a]])


def test_session_keeps_kv_under_eviction_pressure(model):
    tok = model.tokenizer
    turn1 = tok.encode(TEXT)[:40]
    others = [tok.encode(f"{i} {TEXT}")[:60] for i in range(4)]
    cached = {}
    for session in (None, "chat-1"):
        engine = Engine(model, EngineConfig(num_blocks=12))
        first = engine.add_request(turn1, GREEDY, session_id=session)
        engine.run_to_completion()
        for ids in others:  # enough traffic to evict every unheld cached block
            engine.add_request(ids, GREEDY)
            engine.run_to_completion()
        turn2 = engine.add_request(turn1 + first.output_ids + tok.encode(" Next?"), GREEDY, session_id=session)
        engine.run_to_completion()
        cached[session] = turn2.num_cached_tokens
        engine.check_integrity()
        if session:
            assert engine.scheduler.sessions  # still held for the next turn
    assert cached[None] == 0
    # the last sampled token never went through the model, so its K/V is not cached
    assert cached["chat-1"] == (len(turn1) + GREEDY.max_tokens - 1) // model.block_size * model.block_size


def test_llm_generate_keeps_working(tiny_bundle):
    llm = LLM(str(tiny_bundle("llama")))
    outs = llm.generate(["Hello", "Paris is"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5] and all(o.finish_reason == "length" for o in outs)
    assert outs[0].token_ids == llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0,
                                                                      ignore_eos=True))[0].token_ids
