"""The engine's step loop: schedule a batch, launch it, process the step before it.

Three roles, each in its module: the Scheduler (scheduler.py) picks a step's batch and owns the KV
blocks; the ModelRunner (runner.py) builds the step's inputs, runs the forward, samples where the logits
are and reads the tokens back, one step in flight when overlapped; the OutputProcessor (output.py) turns
tokens into text, stops sequences and emits deltas. Single-threaded by design; the async server drives
it from one worker.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from llguidance import LLTokenizer

from engc.errors import UserError
from engc.runtime.config import EngineConfig
from engc.runtime.constrained import Matchers, constraint_for, vocab_of
from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import LoadedModel
from engc.runtime.output import OutputProcessor, StepOutput
from engc.runtime.runner import InFlight, ModelRunner
from engc.runtime.sampling import SamplingParams
from engc.runtime.scheduler import Scheduler
from engc.runtime.sequence import Sequence


def context_limit(model: LoadedModel, num_blocks: int, cap: int | None = None) -> int:
    """The longest sequence the engine runs: the model's positions, the KV cache's tokens, the user's cap."""
    positions = model.config.max_position_embeddings
    if cap is not None and cap > positions:
        raise UserError(f"--max-context {cap} is more than the model's {positions} positions")
    return min(positions, num_blocks * model.block_size, cap or positions)


def check_request(prompt_ids: list[int], params: SamplingParams, max_context: int, vocab_size: int,
                  matchers: Callable[[], Matchers]) -> None:
    """Raises ValueError with a one-line reason if an engine of this context and vocabulary would refuse the
    request; a grammar is compiled by matchers() (and kept there)."""
    params.validate()
    if params.grammar is not None:
        matchers().built(params.grammar)   # a special token it names is not there: a ValueError
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= max_context:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this engine's context is {max_context} tokens")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size})")


@dataclass
class Startup:
    """Where an engine's start went, said in one line when a server starts: the operator sees which part a slow
    start is (a cold disk under the weights, graph capture) without a profiler."""
    load_s: float = 0.0      # the bundle opened, the weights read (and their digests checked meanwhile)
    kv_tokens: int = 0
    graphs: int = 0          # decode CUDA graphs captured, and the time they took
    graphs_s: float = 0.0
    total_s: float = 0.0     # until the engine served: also the imports of an engine process of its own

    def line(self) -> str:
        graphs = f", {self.graphs} decode graphs in {self.graphs_s:.1f} s" if self.graphs else ""
        return (f"engine ready in {self.total_s:.1f} s: weights {self.load_s:.1f} s, KV cache for "
                f"{self.kv_tokens:,} tokens{graphs}")


def start_engine(load: Callable[[], LoadedModel], config: EngineConfig) -> "Engine":
    """Engine(load(), config) with the load's time in its startup."""
    t = time.perf_counter()
    model = load()
    load_s = time.perf_counter() - t
    engine = Engine(model, config)
    engine.startup.load_s = load_s
    return engine


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        kv_dtype = model.kv_dtype or model.dtype
        num_blocks = config.num_blocks or KVCache.default_num_blocks(
            model.kv_config, model.block_size, kv_dtype, model.device, config.kv_memory_fraction)
        if model.tp is not None:   # the workers (runtime/tp.py) size their caches and graphs as rank 0 does
            num_blocks = model.tp.setup_workers(num_blocks, {
                "num_blocks": config.num_blocks, "kv_memory_fraction": config.kv_memory_fraction,
                "max_num_seqs": config.max_num_seqs, "cuda_graphs": config.cuda_graphs,
                "max_context": config.max_context})
        self.kv = KVCache(model.kv_config, num_blocks, model.block_size, kv_dtype, model.device, config.prefix_cache)
        self.scheduler = Scheduler(self.kv.allocator, config.max_num_seqs, config.max_batched_tokens,
                                   config.max_sessions)
        self.max_context = context_limit(model, num_blocks, config.max_context)
        self.runner = ModelRunner(model, self.kv, self.max_context, config.max_num_seqs, config.cuda_graphs,
                                  config.overlap)
        self.startup = Startup(kv_tokens=num_blocks * model.block_size, graphs=self.runner.graphs,
                               graphs_s=self.runner.graphs_s)
        self.output = OutputProcessor(model.tokenizer, self.max_context, self._finish)
        self.sequences: dict[str, Sequence] = {}

    @cached_property
    def grammar_vocab(self) -> LLTokenizer:
        """The vocabulary constraints mask (llguidance's), made at the first constrained request."""
        return vocab_of(self.model.tokenizer, self.model.config.vocab_size)

    @cached_property
    def matchers(self) -> Matchers:
        """Requests' grammars compiled over grammar_vocab (built when a request is checked)."""
        return Matchers(self.grammar_vocab)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError with a one-line reason if the engine would refuse this request.

        Reads only fixed state (and compiles the request's grammar, kept for add_request), so the server calls
        it from any thread before queueing a request, and a slow grammar is compiled there, not between steps.
        """
        check_request(prompt_ids, params, self.max_context, self.model.config.vocab_size, lambda: self.matchers)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                    request_id: str | None = None, session_id: str | None = None) -> Sequence:
        self.check_request(prompt_ids, params)
        seq = Sequence(list(prompt_ids), params, priority, session_id=session_id)
        seq.constraint = constraint_for(params, lambda: self.matchers)
        if request_id is not None:
            seq.request_id = request_id
        self.sequences[seq.request_id] = seq
        self.output.add(seq)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self.output.drop(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.sequences.pop(seq.request_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.runner.in_flight is not None

    def step(self) -> list[StepOutput]:
        """Runs one step and returns what sequences produced. With overlap, the tokens of this step stay
        on the device until the next call, so the outputs returned are mostly the previous step's."""
        batch = self.scheduler.schedule()
        launched = self.runner.launch(batch) if batch else None
        outputs = self._process(self.runner.take_in_flight())
        if launched is not None:
            self.runner.sample_after_read(launched)
            self._commit(launched)
            if not self.runner.hold(launched):
                outputs += self._process(launched)
        return outputs

    def _commit(self, step: InFlight) -> None:
        """The step's K/V count as cached and its samples as in flight. After the step before it was read:
        blocks hashed here hold known tokens only; sequences that finished in that read are left out."""
        self.scheduler.commit(step.batch)
        for seq in step.sampled:
            if not seq.finished:
                seq.num_in_flight = 1

    def _process(self, step: InFlight | None) -> list[StepOutput]:
        """The outputs of a launched step's tokens; a row whose sequence stopped (or was aborted) one step
        ago has its extra token dropped."""
        if step is None or not step.sampled:
            return []
        outputs, process = [], self.output.process
        tokens, samples = self.runner.read(step)
        for i, seq in enumerate(step.sampled):
            seq.num_in_flight = 0
            if not seq.finished:
                outputs.append(process(seq, tokens[i], samples[i] if samples is not None else None))
        return outputs

    def stats(self) -> dict:
        sched, alloc = self.scheduler, self.kv.allocator
        return {"waiting": len(sched.waiting), "running": len(sched.running),
                "kv_usage": 1 - alloc.num_free / alloc.num_blocks, "num_free_blocks": alloc.num_free,
                "num_blocks": alloc.num_blocks, "preemptions": sched.num_preemptions,
                "computed_tokens": sched.computed_tokens,
                "prefix_hit_rate": sched.cached_tokens / sched.prompt_tokens if sched.prompt_tokens else 0.0}

    def check_integrity(self) -> None:
        """Allocator and block tables agree (tests call this; it is O(blocks))."""
        self.scheduler.check_integrity()

    def run_to_completion(self) -> None:
        while self.has_work:
            self.step()
