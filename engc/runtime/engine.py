"""The engine's step loop: schedule a batch, run one program step, sample, detokenize, stop.

Single-threaded by design; the async server drives it from one worker.

Overlap (one step of lookahead): a step whose tokens can be sampled where the logits are is launched,
and its tokens are read back only during the next step, after that step is launched in turn. So on a
GPU the host's scheduling, input building, stop checks and detokenizing run while the GPU computes.
Meanwhile each sampled sequence counts one token in flight (Sequence.num_in_flight): the scheduler
plans with it, the next step's executor takes its id from the device (TokenFill), and only known
tokens are ever hashed, appended or returned. A sequence that finished in the step being read may
already be in the launched one: that row's token is dropped.
Rows are sampled where the logits are (runtime/step_sampling.py), logprobs, penalties and JSON-mode masks
included. Penalties and masks follow the token just read, so a step with such a row is launched, the
step before it read, and only then sampled (the masks made and applied while the GPU still runs the
forward); it stays overlapped. Only a row that needs a sampler the engine lacks (a non-greedy row on a
CPU engine) goes to the host sampler: its step is read at once, after the step before it, and only that
row's logits go to the host (_sample_mixed). _launch holds these rules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from engc.runtime import step_sampling
from engc.runtime.executor import TokenFill
from engc.runtime.constrained.json_mode import JsonConstraint, JsonVocab
from engc.runtime.constrained.json_schema import grammar_of
from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import LoadedModel
from engc.runtime.sampling import Sampled, SamplingParams, sample_row
from engc.runtime.scheduler import Scheduler
from engc.runtime.sequence import Sequence
from engc.runtime.step_sampling import Logprobs, follows_last_token
from engc.runtime.tokenizer import IncrementalDecoder
from engc.runtime.transfers import Readback, upload
from engc.runtime.constrained.triggered import TriggeredConstraint


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 0                 # KV blocks; 0: 512 on the CPU, kv_memory_fraction of free GPU memory
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048      # per-step token budget: bounds a prefill chunk
    prefix_cache: bool = True           # reuse the K/V of full blocks whose token prefix was seen
    max_sessions: int = 64              # chats whose KV is held between requests (session_id)
    kv_memory_fraction: float = 0.85    # of the GPU memory free after weights, when num_blocks is 0
    cuda_graphs: bool = True            # capture decode graphs at start (GPU only)
    overlap: bool = True                # launch step N+1 before reading step N's tokens (same outputs)


def default_num_blocks(model: LoadedModel, fraction: float) -> int:
    if model.device.type != "cuda":
        return 512
    free, _ = torch.cuda.mem_get_info(model.device)
    per_block = KVCache.bytes_per_block(model.config, model.block_size, model.kv_dtype or model.dtype)
    return max(16, int(free * fraction) // per_block)


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    logprobs: list = field(default_factory=list)   # the new tokens' Sampled, when logprobs were asked


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet."""
    batch: list[tuple[Sequence, int]]
    sampled: list[Sequence]                  # one row each of logits (and tokens), in order
    logits: torch.Tensor                     # sampled after the launch (after_read, the host sampler)
    tokens: torch.Tensor | None = None       # [len(sampled)] ids where the logits are, when sampled there
    host: torch.Tensor | None = None         # their pinned copy on the host, valid once `ready` passed
    ready: torch.cuda.Event | None = None
    row_of: dict[Sequence, int] = field(default_factory=dict)   # seq -> its row of tokens
    logprobs: Logprobs | None = None         # host copies (valid once `ready` passed), where rows asked
    after_read: bool = False                 # penalty or JSON rows: sampled once the step before is read


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        num_blocks = config.num_blocks or default_num_blocks(model, config.kv_memory_fraction)
        self.kv = KVCache(model.config, num_blocks, model.block_size, model.kv_dtype or model.dtype,
                          model.device, config.prefix_cache)
        self.scheduler = Scheduler(self.kv.allocator, config.max_num_seqs, config.max_batched_tokens,
                                   config.max_sessions)
        self.max_context = min(model.config.max_position_embeddings, num_blocks * model.block_size)
        self.executor = model.executor
        if model.device.type == "cuda":
            from engc.runtime.cuda_graphs import GraphedExecutor
            from engc.runtime.gpu_ops import warm_cublas
            warm_cublas(model.dtype, model.device)
            greedy = None if model.sampler is None else model.sampler.greedy
            self.executor = GraphedExecutor(model.executor, model.step_facts,
                                            -(-self.max_context // model.block_size),
                                            config.max_num_seqs, model.device, config.cuda_graphs, greedy)
            if config.cuda_graphs:
                self.executor.capture(self.kv.layers)
        self.eos_token_ids = model.tokenizer.eos_token_ids
        self.decoders: dict[Sequence, IncrementalDecoder] = {}
        self.sequences: dict[str, Sequence] = {}
        self.readback = Readback(config.max_num_seqs, model.device)
        self.in_flight: InFlight | None = None

    # --- requests -------------------------------------------------------------------------------

    @cached_property
    def json_vocab(self) -> JsonVocab:
        """The token texts JSON-mode masks read, made at the first constrained request (0.3-0.5 s for
        SmolLM2's 49,152 tokens on the CPU), one per logit: ids past the tokenizer's (Qwen2.5's and Phi-3's
        heads are wider than their tokenizers) have no text, so, like special tokens, no mask allows them."""
        texts = self.model.tokenizer.token_texts()
        width = self.model.config.vocab_size
        return JsonVocab((texts + [""] * (width - len(texts)))[:width])

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError with a one-line reason if the engine would refuse this request.

        Reads only fixed state, so the server calls it from any thread before queueing a request.
        """
        params.validate()
        if params.json_schema is not None:
            grammar_of(params.json_schema)   # a schema it cannot enforce: SchemaError, a ValueError
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this engine's context is "
                             f"{self.max_context} tokens")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                    request_id: str | None = None, session_id: str | None = None) -> Sequence:
        self.check_request(prompt_ids, params)
        seq = Sequence(list(prompt_ids), params, priority, session_id=session_id)
        if request_id is not None:
            seq.request_id = request_id
        self.sequences[seq.request_id] = seq
        self.decoders[seq] = IncrementalDecoder(self.model.tokenizer, seq.prompt_ids)
        if params.json_triggers or params.json_at_start:
            seq.constraint = TriggeredConstraint(self.json_vocab, grammar_of(params.json_schema),
                                                 params.json_triggers, params.json_at_start)
        elif params.json_object or params.json_schema is not None:
            seq.constraint = JsonConstraint(self.json_vocab, grammar_of(params.json_schema))
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self.decoders.pop(seq, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    # --- one step ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Runs one step and returns what sequences produced. With overlap, the tokens of this step stay
        on the device until the next call, so the outputs returned are mostly the previous step's."""
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch else None
        outputs = self._read(self.in_flight)
        self.in_flight = None
        if launched is not None:
            if launched.after_read:
                with torch.inference_mode():
                    self._keep(launched, *self._sample(launched.logits, launched.sampled))
            self._commit(launched)
            if self.config.overlap and launched.tokens is not None:
                self.in_flight = launched
            else:
                outputs += self._read(launched)
        return outputs

    def _launch(self, batch: list[tuple[Sequence, int]]) -> InFlight:
        inputs, sampled, fill = self._inputs(batch)
        with torch.inference_mode():
            logits = self.executor.forward(inputs, self.kv.layers, fill)
            # a graphed decode step took its greedy tokens itself, on their way to pinned memory already
            graphed = getattr(self.executor, "step_tokens", None)
            step = InFlight(batch, sampled, logits)
            if sampled and graphed is not None and all(s.params.plain_greedy for s in sampled):
                self._keep(step, graphed[0], None, graphed[1])
            elif not all(self._device_samples(s) for s in sampled):
                self._keep(step, None)    # sampled when read (_sample_mixed), at once
            elif any(follows_last_token(s) for s in sampled):
                step.after_read = True    # sampled once the step before is read (step())
            else:
                self._keep(step, *self._sample(logits, sampled) if sampled else (None, None))
        return step

    def _keep(self, step: InFlight, tokens: torch.Tensor | None, logprobs: Logprobs | None = None,
              host: torch.Tensor | None = None) -> None:
        """The step's tokens, sampled on the device: their copy to the host started (or, host given, the
        graph's own), and kept where the next graphed step's fills read them (None: no tokens to keep)."""
        if host is None and hasattr(self.executor, "keep_tokens"):
            self.executor.keep_tokens(tokens)
        if tokens is not None:
            step.tokens = tokens
            step.logprobs = logprobs.copied(self.readback.copy) if logprobs is not None else None
            step.host, step.ready = (host, self.readback.event(tokens)) if host is not None \
                else self.readback.start(tokens)    # its event follows the logprobs' copies too
            step.row_of = {seq: i for i, seq in enumerate(step.sampled)}

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence]) -> tuple[torch.Tensor, Logprobs | None]:
        return step_sampling.sample(logits, sampled, self._draw, lambda t: upload(t, logits.device))

    def _draw(self, logits: torch.Tensor, sampled: list[Sequence]) -> torch.Tensor:
        """One token a row, left where the logits are: one argmax when every row is greedy, else the GPU
        sampler (temperature, top-k, top-p; one uniform draw a row)."""
        if all(s.params.greedy for s in sampled):
            sampler = self.model.sampler
            return sampler.greedy(logits) if sampler is not None else logits.argmax(-1)
        return self.model.sampler(logits, sampled)

    def _device_samples(self, seq: Sequence) -> bool:
        """The row is sampled where the logits are: greedy, or the engine has a GPU sampler."""
        return seq.params.greedy or self.model.sampler is not None

    def _sample_mixed(self, logits: torch.Tensor, sampled: list[Sequence]) -> list[Sampled | None]:
        """A step with rows only the host sampler takes (non-greedy rows on an engine without a GPU
        sampler): those rows' logits are copied to the host and sampled there; the other rows are sampled
        where the logits are, as they would be in a step without such rows. None for rows that finished
        meanwhile."""
        samples: list[Sampled | None] = [None] * len(sampled)
        live = [i for i, s in enumerate(sampled) if not s.finished]
        on_device = [i for i in live if self._device_samples(sampled[i])]
        on_host = [i for i in live if not self._device_samples(sampled[i])]
        if on_device:
            seqs = [sampled[i] for i in on_device]
            tokens, logprobs = self._sample(logits.index_select(0, torch.tensor(on_device, device=logits.device)), seqs)
            device_samples = [Sampled(t) for t in tokens.tolist()]
            if logprobs is not None:
                logprobs.copied(torch.Tensor.cpu).fill(device_samples, seqs)
            for i, s in zip(on_device, device_samples):
                samples[i] = s
        if on_host:
            rows = logits.index_select(0, torch.tensor(on_host, device=logits.device)).float().cpu()
            for row, i in zip(rows, on_host):
                s = sampled[i]
                samples[i] = sample_row(row, s.params, s.prompt_ids, s.output_ids, s.generator,
                                        s.constraint.allowed() if s.constraint else None)
        return samples

    def _commit(self, step: InFlight) -> None:
        """The step's K/V count as cached and its samples as in flight. Runs after the step before it
        was read, so each block the scheduler hashes here holds known tokens only; sequences that
        finished in that read are left out (their blocks are already released)."""
        self.scheduler.commit([(seq, n) for seq, n in step.batch if not seq.finished])
        for seq in step.sampled:
            if not seq.finished:
                seq.num_in_flight = 1

    def _read(self, step: InFlight | None) -> list[StepOutput]:
        """Appends a launched step's tokens: from the device copy, or sampled on the host now."""
        if step is None or not step.sampled:
            return []
        if step.tokens is None:
            samples = self._sample_mixed(step.logits, step.sampled)
        else:
            if step.ready is not None:
                step.ready.synchronize()
            samples = [Sampled(t) for t in step.host.tolist()]
            if step.logprobs is not None:
                step.logprobs.fill(samples, step.sampled)
        outputs = []
        for seq, s in zip(step.sampled, samples):
            seq.num_in_flight = 0
            if not seq.finished:  # else it stopped (or was aborted) one step ago: drop the extra token
                outputs.append(self._append(seq, s))
        return outputs

    def _inputs(self, batch: list[tuple[Sequence, int]]):
        bs = self.model.block_size
        ids, positions, slots, ctx, starts, sample_at, sampled = [], [], [], [], [0], [], []
        fill_rows, fill_src = [], []   # rows whose token is still on the device, and where it is there
        width = max(len(seq.block_table) for seq, _ in batch)
        tables = []  # flat, row after row, each padded to width
        for seq, n in batch:
            start, end, table = seq.num_computed, seq.num_computed + n, seq.block_table
            ids += seq.tokens(start, end)
            if n == 1:  # a decode row: the common case, without building ranges
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slots += [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
            ctx.append(end)
            starts.append(starts[-1] + n)
            if end == seq.num_tokens:  # this chunk reaches the last token (known or in flight): sample next
                sample_at.append(starts[-1] - 1)
                sampled.append(seq)
                if seq.num_in_flight:  # its last token is the one in flight
                    fill_rows.append(starts[-1] - 1)
                    fill_src.append(self.in_flight.row_of[seq])
            tables += table
            tables += [0] * (width - len(table))
        # Built on the host; a GPU executor moves them (and reads host-side facts from them first).
        # numpy turns a list of ints into an array several times faster than torch.tensor does.
        inputs = {
            "input_ids": _host(ids, np.int64),
            "positions": _host(positions, np.int64),
            "slot_mapping": _host(slots, np.int64),
            "block_tables": _host(tables, np.int32).view(len(batch), width),
            "context_lens": _host(ctx, np.int32),
            "query_start_loc": _host(starts, np.int32),
            "logits_indices": _host(sample_at, np.int64),
        }
        fill = None
        if fill_rows:
            fill = TokenFill(_host(fill_rows, np.int64), _host(fill_src, np.int64), self.in_flight.tokens)
        return inputs, sampled, fill

    def _append(self, seq: Sequence, s: Sampled) -> StepOutput:
        p, token = seq.params, s.token
        seq.output_ids.append(token)
        if p.logprobs is not None:
            seq.logprobs.append(s)
        reason = None
        # JSON mode: the token that closes the object ends the output with its text; one that cannot
        # continue it (only where the mask was empty) ends it without, as an end-of-sequence token does
        json = seq.constraint.take(token) if seq.constraint is not None else None
        text_ends = ((not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids
                     or json == "broken")   # the token is not part of the answer
        if text_ends or json == "done":
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_context:
            reason = "length"
        decoder = self.decoders[seq]
        if not text_ends:
            seq.output_text += decoder.step([token]) + (decoder.flush() if reason else "")
        if p.stop and self._hit_stop_string(seq):
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.decoders.pop(seq, None)
            self.sequences.pop(seq.request_id, None)
        return StepOutput(seq, [s.token], self._release_text(seq, reason is not None), reason is not None,
                          [s] if p.logprobs is not None else [])

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Truncates output_text at the first stop string, if one has appeared."""
        stops = seq.params.stop
        if not stops:
            return False
        start = max(0, seq.emitted - _longest(stops))
        hits = [(i, s) for s in stops if (i := seq.output_text.find(s, start)) >= 0]
        if hits:
            i, seq.stop_string = min(hits)
            seq.output_text = seq.output_text[:i]
        return bool(hits)

    def _release_text(self, seq: Sequence, finished: bool) -> str:
        """The text a stream may show now: all of it at the end, else all but a possible stop-string start."""
        end = len(seq.output_text)
        if not finished and seq.params.stop:
            end = max(seq.emitted, end - _longest(seq.params.stop) + 1)
        delta = seq.output_text[seq.emitted:end]
        seq.emitted = end
        return delta

    # --- convenience ------------------------------------------------------------------------------

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


def _host(values: list[int], dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=dtype))


def _longest(stops) -> int:
    return max(map(len, stops))
