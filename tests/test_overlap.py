"""Overlapped steps (EngineConfig.overlap) give exactly what synchronous steps give.

The same workloads run with overlap on and off on the CPU, where the lookahead logic is the one a GPU
runs: tokens, texts, finish reasons, stop strings, logprobs and prefix-cache hits must be identical,
and the allocator intact after every step. A CPU stand-in for the GPU sampler (the sampling kernel's
reference) lets seeded temperature sampling take the overlapped path too.
"""
import pytest
import torch

from engc.kernels import argmax, sampling
from engc.runtime import cuda_graphs, staged_inputs
from engc.runtime.cuda_graphs import GraphedExecutor
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.executor import Executor
from engc.runtime.gpu_ops import StepFacts
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams
from test_gpu import gpu_bundle, gpu_ready  # noqa: F401 - a fixture, used by the GPU test below

torch.set_num_threads(1)

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
        "Hello, world! How are you today? engc compiles models ahead of time. ")


def splitmix64_uniform(key: int, count: int) -> float:
    """splitmix64's output number count + 1 from the state key, its top 24 bits as a fraction of 2^24, in
    Python's integers: what the device sampler draws for a sequence's draw number `count`."""
    z = (key + (count + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ z >> 27) * 0x94D049BB133111EB % 2**64
    return ((z ^ z >> 31) >> 40) / 2**24


def reference_parameters(seqs):
    """SamplingKernels' contract on the CPU, the kernel's inputs: each row's settings, and one uniform a
    sampled row, the next of its sequence's counter-based stream (draw_key, draws; draws then advances); a
    greedy row draws nothing (0)."""
    uniform = []
    for s in seqs:
        uniform.append(0.0 if s.params.greedy else splitmix64_uniform(s.draw_key, s.draws))
        s.draws += not s.params.greedy
    p = [s.params for s in seqs]
    return (torch.tensor([q.temperature for q in p]), torch.tensor([q.top_k for q in p], dtype=torch.int32),
            torch.tensor([q.top_p for q in p]), torch.tensor(uniform), torch.tensor([q.min_p for q in p]))


def block_parameters(block, n):
    """The kernel's inputs from a parameter block (sampler.parameter_block) of n rows."""
    return tuple(torch.from_numpy(block[i, :n].view("<i4") if i == 1 else block[i, :n].copy()) for i in range(5))


class ReferenceSampler:
    """SamplingKernels on the CPU: its parameters (reference_parameters, or the block the runner made for a
    graph's draw) through the kernel's reference; draw: a decode graph's, over staged parameters."""

    def __call__(self, logits, seqs, draws=None):
        params = reference_parameters(seqs) if draws is None else block_parameters(draws, len(seqs))
        return sampling.sample(logits, *params)

    def draw(self, logits, temperature, top_k, top_p, uniform, min_p, out):
        out.copy_(sampling.sample(logits, temperature, top_k, top_p, uniform, min_p))

    def greedy(self, logits):
        return argmax.argmax(logits)


def test_sampling_kernels_upload_what_the_reference_draws(monkeypatch):
    """The device sampler's parameter block holds, row for row, what reference_parameters gives the same
    sequences, step after step, whatever the batch: rows join, leave and move, greedy rows among them."""
    from engc.runtime.sampler import SamplingKernels
    from engc.runtime.sequence import Sequence
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here

    class Kernels:
        consts = {"sampling": {"stats_fp32": {"SPLITS": 2, "NGROUPS": 8, "NCAND": 16}}}

        def run(self, op, launches):
            (_variant, (rows, _, _), args) = launches[1]    # bound: every row parameter
            self.inputs = [t[:rows].clone() for t in args[1:6]]

    kernels = Kernels()
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=1), SamplingParams(temperature=0.7, top_k=5, seed=2),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, min_p=0.1),   # unseeded
              SamplingParams(temperature=0.5, top_k=1, seed=3), SamplingParams(temperature=0.8, seed=2**70 + 5)]
    mine = [Sequence([1], p) for p in params]
    theirs = [Sequence([1], p) for p in params]
    for a, b in zip(mine, theirs):
        b.draw_key = a.draw_key   # the unseeded row's key is random
    sampler = SamplingKernels(kernels, torch.device("cpu"))
    for rows in ([0, 1, 2, 3, 4, 5], [5, 3, 0], [1], [2, 4, 1, 0, 3, 5], [3, 5, 1, 0]):
        sampler(torch.zeros(len(rows), 8), [mine[i] for i in rows])
        want = reference_parameters([theirs[i] for i in rows])
        for got, expected in zip(kernels.inputs, want):
            assert got.dtype == expected.dtype and torch.equal(got, expected.to(got.dtype)), rows
    assert [s.draws for s in mine] == [s.draws for s in theirs] == [4, 4, 0, 4, 0, 4]


@pytest.fixture(scope="module")
def model(tiny_bundle):
    return load(tiny_bundle("llama"))


@pytest.fixture
def with_sampler(model):
    model.sampler = ReferenceSampler()
    yield model
    model.sampler = None


def prompts(model, n, length=20):
    return [model.tokenizer.encode(f"{i} {TEXT}")[:length + 3 * i] for i in range(n)]


class ReplayOnCpu:
    """A captured decode graph's stand-in: replay runs what the graph holds (GraphedExecutor._step: staging
    from its turn's host buffer, the fills, the program, the argmax, the tokens' export); its logits are
    what slicing it gives, as the graph's output tensor would."""

    def __init__(self, step):
        self.run, self.out = step, None

    def replay(self):
        self.out = self.run()

    def __getitem__(self, rows):
        return self.out[rows]


def cpu_graphed(engine, max_batch=None):
    """engine's executor as the GPU's GraphedExecutor: staging, padding, device-side fills, on the CPU; its
    graphs end with the draw where the model has a (reference) sampler, else with the argmax. max_batch: the
    largest graph's rows (default the engine's max_num_seqs; larger decode batches run eagerly)."""
    sampler = engine.model.sampler
    ex = GraphedExecutor(engine.runner.executor, StepFacts(), -(-engine.max_context // engine.model.block_size),
                         max_batch or engine.config.max_num_seqs, "cpu", True,
                         draw=sampler.draw if sampler is not None else None, block_size=engine.model.block_size)

    def capture(key, kv_caches):
        graphs = [ReplayOnCpu(lambda t=turn: ex._step(key[0], ex.table_width(key[1]), t, kv_caches))
                  for turn in range(2)]
        ex.graphs[key] = [(g, g) for g in graphs]
    ex._capture = capture
    engine.runner.executor = ex


def run(model, overlap, requests, config=EngineConfig(), abort_at=None, add_later=(), graphed=False,
        max_graph_batch=None):
    """requests: [(ids, params, session_id)], all added first; add_later: [(after_step, ids, params)].

    abort_at: {request index: number of known tokens after which it is aborted}. Returns per request
    what a client sees, plus how many launched steps carried a row that had already finished."""
    engine = Engine(model, EngineConfig(**{**config.__dict__, "overlap": overlap}))
    if graphed:
        cpu_graphed(engine, max_graph_batch)
    seqs = [engine.add_request(ids, p, session_id=sid) for ids, p, sid in requests]
    later, steps, dropped = list(add_later), 0, 0
    texts = {}
    while engine.has_work or later:
        for out in engine.step():
            texts[out.seq] = texts.get(out.seq, "") + out.text_delta
            assert -1 not in out.new_token_ids
        steps += 1
        engine.check_integrity()
        if engine.runner.in_flight is not None:
            dropped += any(s.finished for s in engine.runner.in_flight.sampled)
        while later and later[0][0] <= steps:
            _, ids, p = later.pop(0)
            seqs.append(engine.add_request(ids, p))
        for i, n in (abort_at or {}).items():
            if not seqs[i].finished and len(seqs[i].output_ids) >= n:
                engine.abort(seqs[i].request_id)
    engine.check_integrity()
    results = [(s.output_ids, s.output_text, texts.get(s, ""), s.finish_reason, s.stop_string,
                [(x.token, x.logprob, x.top) for x in s.logprobs], s.num_cached_tokens) for s in seqs]
    return results, engine, dropped


def assert_same(model, requests, **kw):
    """Overlapped steps give what synchronous ones give: everything exactly but the logprob values, to float32
    rounding (the two batch rows differently; assert_match_to_rounding says why that moves the last bits)."""
    sync, _, _ = run(model, False, requests, **kw)
    overlapped, engine, dropped = run(model, True, requests, **kw)
    for a, b in zip(sync, overlapped):
        assert_match_to_rounding(a, b)
    return sync, engine, dropped


def assert_match_to_rounding(a, b):
    """Two runs' outputs agree: tokens, texts, ends, stop strings, the top ids of each logprob and prefix
    hits exactly; the logprob values to float32 rounding. A logprob is a log_softmax over the vocabulary,
    and the CPU's vectorized reduction sums a row in an order that depends on how many rows share the call
    and on the instruction set (AVX2 or AVX-512): the same row can differ in its last bits between two
    ways of batching, never in the tokens, which both paths take from the same float32 logits."""
    assert a[:5] == b[:5] and a[6] == b[6]
    assert [(x[0], [t for t, _ in x[2]]) for x in a[5]] == [(x[0], [t for t, _ in x[2]]) for x in b[5]]
    values = [[x[1]] + [v for _, v in x[2]] for x in a[5]], [[x[1]] + [v for _, v in x[2]] for x in b[5]]
    for u, v in zip(*values):
        assert torch.allclose(torch.tensor(u), torch.tensor(v), rtol=1e-6, atol=1e-5)


def stops_from(model, ids, n=12):
    """A stop string and a stop token that a greedy run of ids really produces, a few tokens in."""
    engine = Engine(model, EngineConfig(num_blocks=64, max_num_seqs=4))
    seq = engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    engine.run_to_completion()
    text = model.tokenizer.decode(seq.output_ids[4:7])
    return text.strip()[:3] or text, seq.output_ids[5]


@pytest.mark.parametrize("max_batch, width", [(256, 5), (1, 1), (7, 3), (33, 17)])
def test_staged_inputs_start_16_byte_aligned(max_batch, width, monkeypatch):
    """Kernels are compiled assuming 16-byte aligned pointers (BundleKernels.run refuses others): every
    staged field, block_tables included, must start on a 16-byte boundary whatever the batch size."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)   # no accelerator here to pin for
    staged = staged_inputs.StagedInputs(max_batch, width, "cpu")
    base = staged.device.data_ptr()
    for name, view in staged.dev.items():
        assert (view.data_ptr() - base) % 16 == 0, name
    for b in (1, max_batch):
        for name, view in staged.bucket_inputs(b, width).items():
            assert (view.data_ptr() - base) % 16 == 0, name


def test_greedy_stops_and_lengths_match(model):
    ids = prompts(model, 6)
    stop, stop_token = stops_from(model, ids[0])
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, stop=(stop,)),
              SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_token,)),
              SamplingParams(max_tokens=3, temperature=0),
              SamplingParams(max_tokens=1, temperature=0),
              SamplingParams(max_tokens=20, top_k=1, temperature=0.8, stop=(stop, "zz"))]
    requests = [(ids[0], p, None) for p in params[1:3]] + [(i, p, None) for i, p in zip(ids, params)]
    results, engine, dropped = assert_same(model, requests)
    reasons = [r[3] for r in results]
    assert reasons.count("stop") >= 2 and "length" in reasons
    assert dropped > 0  # a row that had stopped was in the next launched step, and its token dropped
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


def test_graphed_executor_fills_in_flight_ids(model, monkeypatch):
    """The GPU executor's path on the CPU: in-flight ids scattered into the staged decode inputs (and
    into eager mixed batches), two host staging buffers in turn, padded buckets."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    ids = prompts(model, 7)
    stop, stop_token = stops_from(model, ids[0])
    params = [SamplingParams(max_tokens=20, temperature=0, stop=(stop,)),
              SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(stop_token,)),
              SamplingParams(max_tokens=9, temperature=0, logprobs=1, ignore_eos=True)]
    params += [SamplingParams(max_tokens=12 + 3 * i, temperature=0, ignore_eos=True) for i in range(4)]
    requests = [(i, p, None) for i, p in zip(ids, params)]
    kw = dict(config=EngineConfig(num_blocks=16, max_num_seqs=8, max_batched_tokens=24), graphed=True,
              add_later=[(5, ids[0], params[3])])
    sync, _, _ = run(model, False, requests, **kw)
    overlapped, engine, dropped = run(model, True, requests, **kw)
    for a, b in zip(sync, overlapped):   # a row asks for logprobs: theirs agree to rounding
        assert_match_to_rounding(a, b)
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.executor.graphs  # decode batches went through the staged path
    assert [r[0] for r in sync] == [r[0] for r in run(model, False, requests, config=kw["config"],
                                                       add_later=kw["add_later"])[0]]


def test_a_decode_batch_past_the_largest_graph_runs_the_decode_form(model, monkeypatch):
    """Graphs up to 2 rows, 6 sequences decoding together: the eager decode steps of 3-6 rows run the program's
    decode form (no gather, logits as the head computes them), and every output equals the ungraphed engine's:
    greedy, seeded sampled and logprobs rows alike."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    ids = prompts(model, 6)
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.95, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, logprobs=2, ignore_eos=True)]
    params += [SamplingParams(max_tokens=8 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]
    requests = [(i, p, None) for i, p in zip(ids, params)]
    forms = []
    forward = Executor.forward

    def recording(self, inputs, kv_caches, fill=None, decode=False, draws=None):
        forms.append((inputs["input_ids"].shape[0], decode))
        return forward(self, inputs, kv_caches, fill, decode, draws)
    monkeypatch.setattr(Executor, "forward", recording)
    config = EngineConfig(num_blocks=64, max_num_seqs=8)
    graphed, _, _ = run(model, False, requests, config=config, graphed=True, max_graph_batch=2)
    eager_decode = [n for n, decode in forms if decode and n > 2]
    assert eager_decode and max(eager_decode) == 6
    forms.clear()
    plain, _, _ = run(model, False, requests, config=config)
    assert not any(decode for _, decode in forms)   # the ungraphed engine: the full form throughout
    for a, b in zip(plain, graphed):
        assert_match_to_rounding(a, b)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_of_n_tokens_runs_n_steps(model, overlap):
    """The step that would run a sequence's last in-flight token (max_tokens reached) is not launched:
    it would compute a token only to drop it (one wasted step a request, 1/128 of a 128-token reply)."""
    engine = Engine(model, EngineConfig(overlap=overlap))
    launches = []
    forward = engine.runner.executor.forward
    engine.runner.executor.forward = lambda *a, **k: launches.append(1) or forward(*a, **k)
    seq = engine.add_request(prompts(model, 1)[0], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    engine.run_to_completion()
    assert len(seq.output_ids) == 9 and seq.finish_reason == "length"
    assert len(launches) == 9       # the prefill, then 8 decode steps


def test_graphed_greedy_steps_take_the_graphs_tokens(model, monkeypatch):
    """A graphed all-greedy step's tokens are the graph's own argmax, written to its turn's host row (no
    sampling launch, no readback copy); the turns alternate; a sampled step's tokens are kept where the
    next graphed step's in-flight rows read them."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    ids = prompts(model, 3)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    cpu_graphed(engine)
    calls, turns = [], []
    sample = engine.runner.sampler.draw
    monkeypatch.setattr(engine.runner.sampler, "draw", lambda logits, seqs, draws=None: calls.append(len(seqs))
                        or sample(logits, seqs, draws))
    send = engine.runner.executor.staged.send
    monkeypatch.setattr(engine.runner.executor.staged, "send", lambda *a: turns.append(send(*a)) or turns[-1])
    seqs = [engine.add_request(i, greedy) for i in ids]
    engine.run_to_completion()
    assert turns and calls == [3]               # only the prefill step sampled outside a graph
    assert turns[:4] == [0, 1, 0, 1]
    tokens = engine.runner.executor.staged.tokens
    assert tokens[turns[-1], :3].tolist() == [s.output_ids[-1] for s in seqs]
    # the same requests again, one sampled: its steps sample outside the graph, and still match
    engine2 = Engine(model, EngineConfig(max_num_seqs=4))
    seqs2 = [engine2.add_request(i, greedy) for i in ids[:2]] + [engine2.add_request(ids[2], sampled)]
    engine2.run_to_completion()
    engine3 = Engine(model, EngineConfig(max_num_seqs=4))
    cpu_graphed(engine3)
    seqs3 = [engine3.add_request(i, greedy) for i in ids[:2]] + [engine3.add_request(ids[2], sampled)]
    engine3.run_to_completion()
    assert [s.output_ids for s in seqs3] == [s.output_ids for s in seqs2]
    assert [s.output_ids for s in seqs3[:2]] == [s.output_ids for s in seqs[:2]]


def test_large_buckets_sample_outside_their_graphs(model, monkeypatch):
    """Graphs of more than GREEDY_UP_TO rows end with the logits: the engine samples (greedy too) outside
    them and keeps the tokens for the next step's fills; the tokens match eager steps."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    n = cuda_graphs.GREEDY_UP_TO + 4
    ids = [model.tokenizer.encode(f"{i} {TEXT}")[:8 + i % 5] for i in range(n)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    config = EngineConfig(max_num_seqs=64, num_blocks=4 * n)
    eager, _, _ = run(model, True, [(i, greedy, None) for i in ids], config=config)
    engine = Engine(model, EngineConfig(**{**config.__dict__, "overlap": True}))
    cpu_graphed(engine)
    calls = []
    sample = engine.runner.sampler.draw
    monkeypatch.setattr(engine.runner.sampler, "draw", lambda logits, seqs, draws=None: calls.append(len(seqs))
                        or sample(logits, seqs, draws))
    seqs = [engine.add_request(i, greedy) for i in ids]
    engine.run_to_completion()
    assert [s.output_ids for s in seqs] == [r[0] for r in eager]
    assert n in calls[1:] and (48, None) in engine.runner.executor.graphs   # decode steps of the 48-row bucket


def one_token_rows(ids, positions, logits_indices):
    """The engine's inputs for a batch of one token a row, row i's sequence in block i (16-token blocks)."""
    n = len(ids)
    return {"input_ids": torch.tensor(ids), "positions": torch.tensor(positions),
            "slot_mapping": torch.tensor([16 * i + p for i, p in enumerate(positions)]),
            "block_tables": torch.arange(n, dtype=torch.int32)[:, None],
            "context_lens": torch.tensor(positions, dtype=torch.int32) + 1,
            "query_start_loc": torch.arange(n + 1, dtype=torch.int32),
            "logits_indices": torch.tensor(logits_indices)}


def test_decode_shaped_batch_with_an_unsampled_row_runs_eager(model, monkeypatch):
    """A one-token-a-row batch in which a row does not sample (a prompt's 1-token chunk) is not a graph's:
    the graph's logits are row for row the sampled ones."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    cpu_graphed(engine)
    ex = engine.runner.executor
    inputs = one_token_rows([5, 6], [3, 0], [0])
    logits = ex.forward(inputs, engine.kv.layers)
    assert logits.shape[0] == 1 and ex.step_tokens is None and not ex.graphs
    inputs["logits_indices"] = torch.tensor([0, 1])
    logits = ex.forward(inputs, engine.kv.layers)
    assert logits.shape[0] == 2 and ex.step_tokens is not None and ex.graphs


def test_decode_form_of_the_program_skips_the_row_gather_and_the_cast(model):
    """Executor.forward(decode=True), what the graphs run: the program's decode form (passes/decode_form),
    every row through the head without the gather by logits_indices and before the float32 cast, equal to
    the plain forward's when every row is sampled."""
    from engc.bundle.program import DECODE_OUTPUT
    ex = model.executor
    assert ex.program.outputs == ("logits", DECODE_OUTPUT)
    assert len(ex.decode_steps) == len(ex.steps) - 2
    assert not any(ins[1:] == ("logits_indices",) for _, ins, *_ in ex.decode_steps)
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    inputs = one_token_rows([5, 6, 7], [0, 0, 0], [0, 1, 2])
    plain = ex.forward(inputs, engine.kv.layers)
    decode = ex.forward(inputs, engine.kv.layers, decode=True)
    assert plain.dtype == torch.float32 and torch.equal(decode.float(), plain)


def test_graphs_take_only_batches_that_sample_every_row_in_order(model, monkeypatch):
    """logits_indices other than arange (never made by the engine for one token a row) runs eager: the
    decode form's gather would not reorder the rows."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    cpu_graphed(engine)
    ex = engine.runner.executor
    inputs = one_token_rows([5, 6], [0, 0], [1, 0])
    swapped = ex.forward(inputs, engine.kv.layers)
    assert ex.step_tokens is None and not ex.graphs
    inputs["logits_indices"] = torch.tensor([0, 1])
    in_order = ex.forward(inputs, engine.kv.layers)
    assert ex.step_tokens is not None and ex.graphs
    assert torch.equal(swapped, in_order.flip(0))


def test_a_gpu_forward_without_its_step_facts_stops(model, monkeypatch):
    """A GPU model's Executor takes its StepFacts first (before_forward=facts.take): a forward nobody set
    them for raises, where its kernels would have sized their grids for another batch and left rows
    unwritten; one describe serves one forward; GraphedExecutor's eager steps describe themselves."""
    from engc.runtime.executor import Executor
    from engc.runtime.ops_reference import REFERENCE_OPS
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    facts = StepFacts()
    ex = Executor(model.executor.program, model.executor.weights, REFERENCE_OPS, before_forward=facts.take)
    engine = Engine(model, EngineConfig(max_num_seqs=4))
    inputs = one_token_rows([5, 6], [0, 0], [0, 1])
    with pytest.raises(RuntimeError, match="step facts"):
        ex.forward(inputs, engine.kv.layers)
    facts.describe(torch.tensor([1, 1]), torch.tensor([1, 1]))
    ex.forward(inputs, engine.kv.layers)
    with pytest.raises(RuntimeError, match="step facts"):   # taken by the forward before
        ex.forward(inputs, engine.kv.layers)
    facts.for_graph(255)
    ex.forward(inputs, engine.kv.layers, decode=True)
    assert (facts.max_query_len, facts.max_context_len, facts.has_decode_rows) == (1, 255, True)
    graphed = GraphedExecutor(ex, facts, 4, 4, "cpu", enabled=False, block_size=16)
    graphed.forward(one_token_rows([5, 6], [3, 0], [0]), engine.kv.layers)
    assert (facts.max_query_len, facts.max_context_len, facts.fresh) == (1, 4, False)


def test_mapped_view_is_none_where_the_gpu_cannot_address_host_memory():
    """No CUDA here: mapped_view says so with None (then the GPU executor runs decode steps eagerly)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: test_gpu_graphed_steps_match_eager checks the mapped view")
    assert staged_inputs.mapped_view(torch.zeros(4, dtype=torch.int32)) is None


def test_the_largest_graph_holds_max_num_seqs_rows(model, monkeypatch):
    """The graphs go up to the first bucket holding max_num_seqs rows, so a full batch replays a graph (past 256
    rows too, up to the last bucket); a larger batch runs eagerly."""
    from engc.runtime import cuda_graphs
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    tops = {}
    for max_batch in (1, 3, 256, 300, 1000, 1024, 5000):
        ex = GraphedExecutor(model.executor, StepFacts(), 8, max_batch, "cpu", True, block_size=model.block_size)
        assert ex.buckets == [b for b in cuda_graphs.BUCKETS if b <= ex.buckets[-1]]
        assert ex.staged.n == ex.buckets[-1]
        tops[max_batch] = ex.buckets[-1]
    assert tops == {1: 1, 3: 4, 256: 256, 300: 384, 1000: 1024, 1024: 1024, 5000: 1024}


def test_graphs_past_256_rows_that_do_not_fit_are_dropped_with_a_warning(model, monkeypatch, capsys):
    """Out of memory capturing a bucket past ALWAYS_GRAPHED: its graphs go, one warning says what happens to its
    batches, the smaller buckets are captured; at or below it the error stands (start fails as it did)."""
    from engc.runtime import cuda_graphs
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    capacity_blocks = 2 * cuda_graphs.NARROW_CONTEXT // model.block_size   # two context buckets a batch bucket
    ex = GraphedExecutor(model.executor, StepFacts(), capacity_blocks, 1024, "cpu", True, block_size=model.block_size)
    captured = []

    def capture(key, kv):
        if key[0] in (1024, 512) and key[1] is None:   # the second context bucket of the two fails
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        captured.append(key)
        ex.graphs[key] = []
    monkeypatch.setattr(ex, "_capture", capture)
    ex.capture([])
    assert ex.buckets[-2:] == [384, 768] and 512 not in ex.buckets and 1024 not in ex.buckets
    assert {k[0] for k in ex.graphs} == set(ex.buckets)   # the failed buckets' graphs are gone
    assert (1024, cuda_graphs.NARROW_CONTEXT) in captured   # one of them was captured before its bucket failed
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "1024 rows" in err[0] and "without graphs" in err[0]
    assert "512 rows" in err[1] and "replay a larger one" in err[1]
    assert ex.graph_key(600, 100)[0] == 768
    ex = GraphedExecutor(model.executor, StepFacts(), 8, 256, "cpu", True, block_size=model.block_size)
    monkeypatch.setattr(ex, "_capture", lambda key, kv: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("oom")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        ex.capture([])
    assert cuda_graphs.ALWAYS_GRAPHED == 256


def test_graph_keys_by_batch_and_context_bucket(model, monkeypatch):
    """Small batches with short contexts replay their own graph (one KV split); the rest the batch
    bucket's graph sized for the block table's capacity; both kinds are captured at start."""
    from engc.runtime import cuda_graphs
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    ex = GraphedExecutor(model.executor, StepFacts(), 64, 16, "cpu", True, block_size=model.block_size)
    short = cuda_graphs.CTX_BUCKETS[0]
    assert ex.graph_key(1, 130) == (1, short) and ex.graph_key(3, short) == (4, short)
    assert ex.graph_key(1, short + 1) == (1, None)
    assert ex.graph_key(5, 10) == (8, None)   # above CTX_BUCKETED_UP_TO: one graph per batch bucket
    captured = []
    monkeypatch.setattr(ex, "_capture", lambda key, kv: captured.append(key))
    ex.capture([])
    assert set(captured) == {(b, None) for b in ex.buckets} | {(b, short) for b in ex.buckets
                                                               if b <= cuda_graphs.CTX_BUCKETED_UP_TO}
    # a capacity (64 blocks) above NARROW_CONTEXT: every batch bucket has that bucket too, captured at start
    monkeypatch.setattr(cuda_graphs, "NARROW_CONTEXT", 512)
    assert ex.graph_key(5, 10) == (8, 512) and ex.graph_key(1, 130) == (1, short)
    assert ex.graph_key(5, 513) == (8, None) and ex.graph_key(2, 300) == (2, 512)
    assert ex.table_width(512) == 512 // model.block_size and ex.table_width(None) == 64
    captured.clear()
    ex.capture([])
    assert set(captured) == {(b, c) for b in ex.buckets for c in (None, 512)} | {
        (b, short) for b in ex.buckets if b <= cuda_graphs.CTX_BUCKETED_UP_TO}


def test_narrow_context_graphs_stage_narrow_tables_and_match_eager(model, monkeypatch):
    """Sequences growing past NARROW_CONTEXT: their steps replay the narrow bucket's graphs (block tables staged
    as wide as that bucket's contexts need) until the longest row passes it, then the capacity's; tokens, texts
    and ends match the eager engine's, preemptions and a later request included."""
    from engc.runtime import cuda_graphs
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    monkeypatch.setattr(cuda_graphs, "NARROW_CONTEXT", 3 * model.block_size)
    ids = prompts(model, 4)
    params = [SamplingParams(max_tokens=20 + 9 * i, temperature=0, ignore_eos=True) for i in range(4)]
    requests = [(i[:12 + 5 * n], p, None) for n, (i, p) in enumerate(zip(ids, params))]
    kw = dict(config=EngineConfig(num_blocks=12, max_num_seqs=4, max_batched_tokens=32),
              add_later=[(6, ids[0][:9], params[1])])
    eager, _, _ = run(model, True, requests, **kw)
    staged_widths = []
    send = staged_inputs.StagedInputs.send

    def send_to_a_cleared_turn(self, inputs, n, b, width, *a):
        """Block 0 everywhere first, so what a row's context needs must be what this step staged: the blocks
        of its table up to its context's last token (the tiny model's tokens barely depend on them)."""
        staged_widths.append(width)
        self.tables_np[self.turn][:] = 0
        turn = send(self, inputs, n, b, width, *a)
        staged = self.tables_np[turn][:b * width].reshape(b, width)
        for row, (table, context) in enumerate(zip(inputs["block_tables"].numpy(), inputs["context_lens"].numpy())):
            need = -(-int(context) // model.block_size)
            assert need <= width and (staged[row, :need] == table[:need]).all()
        return turn
    monkeypatch.setattr(staged_inputs.StagedInputs, "send", send_to_a_cleared_turn)
    graphed, engine, _ = run(model, True, requests, graphed=True, **kw)
    assert graphed == eager and engine.scheduler.num_preemptions > 0
    keys = set(engine.runner.executor.graphs)
    assert {c for _, c in keys} >= {3 * model.block_size, None}
    assert set(staged_widths) >= {3, engine.runner.executor.staged.width}


@pytest.mark.parametrize("graphed", [False, True])
def test_seeded_sampling_on_the_device_path_matches(with_sampler, graphed, monkeypatch):
    """Graphed: the sampled tokens of a step are kept where the next graphed step's fills read them."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    model = with_sampler
    ids = prompts(model, 5)
    params = [SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=9),
               SamplingParams(max_tokens=15, temperature=0)]
    results, _, _ = assert_same(model, [(i, p, None) for i, p in zip(ids, params)], graphed=graphed)
    assert len({tuple(r[0]) for r in results[:3]}) == 3  # different seeds, different draws
    if graphed:
        eager, _, _ = assert_same(model, [(i, p, None) for i, p in zip(ids, params)])
        assert results == eager


def test_host_sampled_rows_fall_back_and_match(with_sampler):
    """Logprobs and penalty rows, joining while others decode: overlapped steps give what synchronous
    ones give (penalties read the last token, so their steps are sampled after the step before is read)."""
    model = with_sampler
    ids = prompts(model, 5)
    params = [SamplingParams(max_tokens=14, temperature=0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.8, seed=4, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=5, presence_penalty=0.5, logprobs=0),
              SamplingParams(max_tokens=20, temperature=1.0, seed=6)]
    later = [(6, ids[2], params[2]), (9, ids[4], params[1])]   # join while others decode
    results, _, _ = assert_same(model, [(i, p, None) for i, p in zip(ids, params)], add_later=later)
    assert len(results[0][5]) == 14 and all(len(top) == 3 for _, _, top in results[0][5])


def rows_with_extras():
    """(greedy, sampled) SamplingParams with penalties, logprobs and JSON masks, alone and together."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}
    from engc.runtime import constrained
    greedy = [SamplingParams(max_tokens=24, temperature=0, grammar=constrained.json_object(), logprobs=1),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
                             ignore_eos=True)]
    sampled = [SamplingParams(max_tokens=24, temperature=0.9, seed=5, grammar=constrained.json_object()),
               SamplingParams(max_tokens=24, temperature=0.8, seed=7, grammar=constrained.json_schema(schema)),
               SamplingParams(max_tokens=24, temperature=0.8, seed=8, frequency_penalty=0.4, logprobs=0)]
    return greedy, sampled


def test_a_host_sampled_row_moves_only_itself_to_the_host(model, monkeypatch):
    """Without a GPU sampler a non-greedy row needs the host sampler: its step is read at once, but only
    that row goes there (the host sampler runs once a step, not once a row); the greedy rows beside it,
    one asking for logprobs, take the tokens they take beside a greedy row in its place."""
    from engc.runtime import sampler
    ids = prompts(model, 3)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    host_rows = []
    real = sampler.sample_row
    monkeypatch.setattr(sampler, "sample_row", lambda row, p, *a: host_rows.append(p) or real(row, p, *a))
    plain, _, _ = assert_same(model, [(ids[0], greedy, None), (ids[1], greedy, None), (ids[2], greedy, None)])
    assert host_rows == []
    mixed, _, _ = assert_same(model, [(ids[0], greedy, None), (ids[1], with_logprobs, None), (ids[2], seeded, None)])
    assert [r[0] for r in mixed[:2]] == [r[0] for r in plain[:2]]
    assert len(host_rows) == 2 * 12 and all(p is seeded for p in host_rows)   # sync and overlapped runs
    assert len(mixed[1][5]) == 12 and all(len(top) == 2 for _, _, top in mixed[1][5])


@pytest.mark.parametrize("graphed", [False, True])
def test_penalty_logprobs_and_json_rows_are_sampled_where_the_logits_are(with_sampler, graphed, monkeypatch):
    """Rows with penalties, logprobs or a JSON mask take the device path (penalties and masks once the
    step before is read): no step goes to the host sampler, overlapped steps give what synchronous ones
    give, the JSON rows' outputs are JSON, and greedy rows take the tokens the host sampler gives them
    (every row sent there), and its logprobs to float rounding (assert_match_to_rounding)."""
    from engc.runtime import constrained
    from grammar_check import is_prefix
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    model = with_sampler
    ids = prompts(model, 7)
    greedy, sampled = rows_with_extras()
    from engc.runtime import sampler
    calls = []
    device_sample, sample_now = sampler.DeviceSampler.sample, sampler.sample_now
    monkeypatch.setattr(sampler.DeviceSampler, "sample",
                        lambda self, *a: calls.append("sample") or device_sample(self, *a))
    monkeypatch.setattr(sampler, "sample_now", lambda *a: calls.append("sample_now") or sample_now(*a))
    results, _, _ = assert_same(model, [(i, p, None) for i, p in zip(ids, greedy + sampled)], graphed=graphed)
    assert "sample" in calls and "sample_now" not in calls
    for r in (results[0], results[4], results[5]):
        assert is_prefix(constrained.json_object(), r[1]), r[1]
    assert [len(r[5]) for r in results] == [len(results[0][0]), 0, 24, 0, 0, 0, 24]
    device = run(model, True, [(i, p, None) for i, p in zip(ids, greedy)], graphed=graphed)[0]
    monkeypatch.setattr(sampler.DeviceSampler, "takes", lambda self, seq: False)
    monkeypatch.setattr(sampler.DeviceSampler, "takes_all", lambda self, seqs: False)
    host = run(model, True, [(i, p, None) for i, p in zip(ids, greedy)], graphed=graphed)[0]
    assert "sample_now" in calls
    for d, h in zip(device, host):
        assert_match_to_rounding(d, h)


def test_preemption_chunked_prefill_and_prefix_hits_match(model):
    ids = prompts(model, 6, length=30)
    shared = model.tokenizer.encode(TEXT * 2)
    greedy = SamplingParams(max_tokens=26, temperature=0, ignore_eos=True)
    requests = [(i, greedy, None) for i in ids] + [(shared, greedy, None), (shared + ids[1], greedy, None)]
    later = [(5, shared + ids[2], greedy), (12, shared[:40], greedy)]
    for config in (EngineConfig(num_blocks=14, max_batched_tokens=24),      # preempts, chunks, mixes
                   EngineConfig(num_blocks=14, max_batched_tokens=24, prefix_cache=False),
                   EngineConfig(max_batched_tokens=16)):                       # chunked, prefix hits
        results, engine, _ = assert_same(model, requests, config=config, add_later=later)
        if config.num_blocks:
            assert engine.scheduler.num_preemptions > 0
        if config.prefix_cache and not config.num_blocks:
            assert results[-1][6] > 0 and results[-2][6] > 0


@pytest.mark.parametrize("graphed", [False, True])
def test_rows_with_extras_through_preemption_chunks_and_aborts(with_sampler, graphed, monkeypatch):
    """Penalty, logprobs and JSON rows (sampled after the step before is read) through preemption by
    recompute, chunked prefill, joins and an abort: overlapped steps give the tokens, texts and ends
    synchronous ones give. Their logprobs agree to float rounding only: with preemption the two modes
    batch rows differently (the lookahead plans with tokens in flight), and a CPU matmul's rounding
    depends on its row count."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    model = with_sampler
    ids = prompts(model, 7, length=30)
    greedy, sampled = rows_with_extras()
    requests = [(i, p, None) for i, p in zip(ids, greedy + sampled)]
    kw = dict(config=EngineConfig(num_blocks=14, max_batched_tokens=24), graphed=graphed, abort_at={2: 5},
              add_later=[(4, ids[1], sampled[2]), (7, ids[3], greedy[0])])
    sync, _, _ = run(model, False, requests, **kw)
    overlapped, engine, _ = run(model, True, requests, **kw)
    for a, b in zip(sync, overlapped):
        assert_match_to_rounding(a, b)
    assert engine.scheduler.num_preemptions > 0 and engine.kv.allocator.num_free == engine.kv.allocator.num_blocks
    assert [len(r[5]) for r in sync[:7]] == [len(sync[0][0]), 0, 5, 0, 0, 0, len(sync[6][0])]


def test_aborts_mid_stream_match(model):
    ids = prompts(model, 5)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    results, engine, _ = assert_same(model, [(i, greedy, None) for i in ids], abort_at={0: 1, 2: 7, 4: 12})
    assert [len(r[0]) for r in results] == [1, 30, 7, 30, 12]
    assert [r[3] for r in results] == ["abort", "length", "abort", "length", "abort"]


def test_sessions_match_and_keep_their_blocks(model):
    tok = model.tokenizer
    turn1 = tok.encode(TEXT)[:40]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first, _, _ = assert_same(model, [(turn1, greedy, "chat")])
    turn2 = turn1 + first[0][0] + tok.encode(" Next?")
    traffic = [(tok.encode(f"{i} {TEXT}")[:50], greedy, None) for i in range(3)]
    results, engine, _ = assert_same(model, [(turn1, greedy, "chat")] + traffic,
                                     config=EngineConfig(num_blocks=16),
                                     add_later=[(40, turn2, greedy)])
    assert results[-1][6] > 0 and engine.scheduler.sessions


def test_placeholders_never_reach_prefix_cache_hashes(model):
    """With no eviction, both modes register exactly the same block hashes."""
    ids = prompts(model, 4, length=31)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    requests = [(i, greedy, None) for i in ids]
    _, sync_engine, _ = run(model, False, requests)
    _, overlap_engine, _ = run(model, True, requests)
    assert set(overlap_engine.kv.allocator.by_hash) == set(sync_engine.kv.allocator.by_hash)


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_overlap_matches_sync(gpu_bundle, graphs):  # noqa: F811
    """On the GPU: in-flight ids filled on the device (graph and eager paths), the GPU sampler, host
    fallbacks, stops, aborts, preemption and chunked prefill, against synchronous steps."""
    model = load(gpu_bundle, device="cuda")
    ids = prompts(model, 6)
    stop, stop_token = stops_from(model, ids[0])
    params = [SamplingParams(max_tokens=24, temperature=0, stop=(stop,)),
              SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_token,)),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.7, top_k=8, seed=2, ignore_eos=True)]
    requests = [(i, p, None) for i, p in zip(ids, params)] + [(ids[0], params[4], None)]
    config = EngineConfig(num_blocks=20, max_num_seqs=8, max_batched_tokens=24, cuda_graphs=graphs)
    kw = dict(config=config, abort_at={5: 9}, add_later=[(4, ids[3], params[0])])
    sync, _, _ = run(model, False, requests, **kw)
    overlapped, engine, dropped = run(model, True, requests, **kw)
    for a, b in zip(sync, overlapped):
        assert a[:5] == b[:5] and [x[0] for x in a[5]] == [x[0] for x in b[5]]
        assert torch.allclose(torch.tensor([x[1] for x in a[5]]), torch.tensor([x[1] for x in b[5]]))
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_rows_with_penalties_logprobs_and_masks_sampled_on_the_device(gpu_bundle, graphs, monkeypatch):  # noqa: F811
    """On the GPU: JSON-mode, penalty and logprobs rows beside plain and sampled ones take the device
    path (penalties and masks once the step before is read): overlapped steps give what synchronous ones
    give, the JSON outputs are JSON, and greedy rows take the tokens the host sampler gives them (every
    row sent there), with logprobs within float tolerance of its CPU ones."""
    from engc.runtime import constrained
    from grammar_check import is_prefix
    model = load(gpu_bundle, device="cuda")
    ids = prompts(model, 7)
    greedy, sampled = rows_with_extras()
    config = EngineConfig(num_blocks=64, max_num_seqs=8, cuda_graphs=graphs)
    results, _, _ = assert_same(model, [(i, p, None) for i, p in zip(ids, greedy + sampled)], config=config)
    for r in (results[0], results[4], results[5]):
        assert is_prefix(constrained.json_object(), r[1]), r[1]
    device = run(model, True, [(i, p, None) for i, p in zip(ids, greedy)], config=config)[0]
    from engc.runtime.sampler import DeviceSampler
    monkeypatch.setattr(DeviceSampler, "takes", lambda self, seq: False)
    monkeypatch.setattr(DeviceSampler, "takes_all", lambda self, seqs: False)
    host = run(model, True, [(i, p, None) for i, p in zip(ids, greedy)], config=config)[0]
    for a, b in zip(device, host):
        assert a[:5] == b[:5] and [x[0] for x in a[5]] == [x[0] for x in b[5]]
        for x, y in zip(a[5], b[5]):
            assert abs(x[1] - y[1]) < 1e-4 and torch.allclose(torch.tensor([v for _, v in x[2]]),
                                                             torch.tensor([v for _, v in y[2]]), atol=1e-4)


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
def test_gpu_graphed_steps_match_eager(gpu_bundle):  # noqa: F811
    """On the GPU: decode graphs that stage their inputs from pinned memory, fill in-flight ids, take the
    greedy tokens and write them to pinned memory themselves give what eager steps give, greedy and
    sampled rows, batches joining and leaving."""
    from engc.runtime.staged_inputs import mapped_view
    model = load(gpu_bundle, device="cuda")
    probe = torch.arange(4, dtype=torch.int64).pin_memory()
    view = mapped_view(probe)   # without it, decode steps would run without graphs
    assert view is not None and view.is_cuda and view.sum().item() == 6
    ids = prompts(model, 5)
    params = [SamplingParams(max_tokens=26, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=22, temperature=0.7, top_k=8, seed=2, ignore_eos=True)]
    requests = [(i, p, None) for i, p in zip(ids, params)]
    runs = {}
    for graphs in (False, True):
        config = EngineConfig(num_blocks=40, max_num_seqs=8, max_batched_tokens=64, cuda_graphs=graphs)
        runs[graphs], engine, _ = run(model, True, requests, config=config, add_later=[(6, ids[3], params[0])])
        assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks
    assert runs[True] == runs[False]


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
def test_gpu_large_buckets_match_eager(gpu_bundle):  # noqa: F811
    """On the GPU: more rows than GREEDY_UP_TO, so the graphs end with the logits and the engine samples and
    keeps the tokens outside them; greedy and sampled rows give what eager steps give."""
    model = load(gpu_bundle, device="cuda")
    n = cuda_graphs.GREEDY_UP_TO + 4
    ids = [model.tokenizer.encode(f"{i} {TEXT}")[:8 + i % 5] for i in range(n)]
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True) if i % 3 else
              SamplingParams(max_tokens=8, temperature=0.8, seed=i, ignore_eos=True) for i in range(n)]
    runs = {}
    for graphs in (False, True):
        config = EngineConfig(num_blocks=8 * n, max_num_seqs=64, cuda_graphs=graphs)
        runs[graphs], _, _ = run(model, True, [(i, p, None) for i, p in zip(ids, params)], config=config)
    assert runs[True] == runs[False]


def test_graphs_draw_the_sampled_rows_themselves(with_sampler, monkeypatch):
    """With the sampling kernels the decode graphs end with the draw: a sampled decode step stages its rows'
    parameters with the inputs and takes the graph's tokens (the eager sampler sees only prefill steps and the
    rows with penalties), and every row gets what eager steps give it."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    model = with_sampler
    ids = prompts(model, 6)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(4)]
    params += [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
               SamplingParams(max_tokens=10, temperature=0.7, min_p=0.05, seed=11, ignore_eos=True)]
    eager, _, _ = run(model, True, [(i, p, None) for i, p in zip(ids, params)])
    drawn, eager_rows = [], []
    draw = model.sampler.draw
    monkeypatch.setattr(model.sampler, "draw", lambda logits, t, *rest: drawn.append(int((t > 0).sum()))
                        or draw(logits, t, *rest))
    engine = Engine(model, EngineConfig(overlap=True))
    cpu_graphed(engine)
    sample = engine.runner.sampler.draw
    monkeypatch.setattr(engine.runner.sampler, "draw", lambda logits, seqs, draws=None:
                        eager_rows.append(len(seqs)) or sample(logits, seqs, draws))
    seqs = [engine.add_request(i, p) for i, p in zip(ids, params)]
    engine.run_to_completion()
    assert [s.output_ids for s in seqs] == [r[0] for r in eager]
    assert max(drawn) == 5 and sum(drawn) >= 5 * 9     # the graphs drew the five sampled rows, step after step
    assert len(eager_rows) <= 2                         # the prefill steps only


def test_max_context_caps_each_sequence_and_narrows_the_staged_tables(model, monkeypatch):
    """EngineConfig.max_context (`engc run --max-context`): prompts reaching it are refused with the engine's
    line, a sequence stops at it with finish reason length, graphed and not alike, and the decode graphs
    stage block tables of its width, not the model's positions' (a cap above those is refused)."""
    from engc.errors import UserError
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here
    ids = prompts(model, 1, length=60)[0][:40]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for graphed in (False, True):
        (out,), engine, _ = run(model, True, [(ids, params, None)], config=EngineConfig(max_context=48),
                                graphed=graphed)
        assert engine.max_context == 48 and len(out[0]) == 48 - len(ids) and out[3] == "length"
        assert not graphed or engine.runner.executor.graphs   # its decode steps went through the graphs
        with pytest.raises(ValueError, match="context is 48 tokens"):
            engine.check_request(ids + ids[:8], params)
    assert engine.runner.executor.staged.width == -(-48 // model.block_size)   # the graphed run's
    with pytest.raises(UserError, match="more than the model's"):
        Engine(model, EngineConfig(max_context=model.config.max_position_embeddings + 1))
