"""The engine's step loop: schedule a batch, run one program step, sample, detokenize, stop.

Synchronous and single-threaded by design; the async server drives it from one worker.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import LoadedModel
from engc.runtime.sampling import Sampled, SamplingParams, sample_row
from engc.runtime.scheduler import Scheduler
from engc.runtime.sequence import Sequence
from engc.runtime.tokenizer import IncrementalDecoder


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 0                 # KV blocks; 0: 512 on the CPU, kv_memory_fraction of free GPU memory
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048      # per-step token budget: bounds a prefill chunk
    prefix_cache: bool = True           # reuse the K/V of full blocks whose token prefix was seen
    max_sessions: int = 64              # chats whose KV is held between requests (session_id)
    kv_memory_fraction: float = 0.85    # of the GPU memory free after weights, when num_blocks is 0
    cuda_graphs: bool = True            # capture decode graphs at start (GPU only)


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
            self.executor = GraphedExecutor(model.executor, model.step_facts,
                                            -(-self.max_context // model.block_size),
                                            config.max_num_seqs, model.device, config.cuda_graphs)
            if config.cuda_graphs:
                self.executor.capture(self.kv.layers)
        self.eos_token_ids = model.tokenizer.eos_token_ids
        self.decoders: dict[Sequence, IncrementalDecoder] = {}
        self.sequences: dict[str, Sequence] = {}

    # --- requests -------------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError with a one-line reason if the engine would refuse this request.

        Reads only fixed state, so the server calls it from any thread before queueing a request.
        """
        params.validate()
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
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self.decoders.pop(seq, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- one step ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        inputs, sampled = self._inputs(batch)
        with torch.inference_mode():
            logits = self.executor.forward(inputs, self.kv.layers)
        outputs = []
        self.scheduler.commit(batch)
        for seq, token in zip(sampled, self._sample(logits, sampled)):
            outputs.append(self._append(seq, token))
        return outputs

    def _inputs(self, batch: list[tuple[Sequence, int]]):
        bs = self.model.block_size
        ids, positions, slots, ctx, starts, sample_at, sampled = [], [], [], [], [0], [], []
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
            if end == seq.num_tokens:  # this chunk finishes the known tokens: sample next
                sample_at.append(starts[-1] - 1)
                sampled.append(seq)
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
        return inputs, sampled

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence]) -> list[Sampled]:
        """One token per row. On a GPU, plain greedy batches take one argmax there, and batches that only
        use temperature/top-k/top-p the sampling kernel; either way one token a row comes back."""
        if logits.device.type != "cpu":
            if all(s.params.plain_greedy for s in sampled):
                return [Sampled(t) for t in logits.argmax(-1).tolist()]
            if self.model.sampler is not None and all(s.params.device_sampleable for s in sampled):
                return [Sampled(t) for t in self.model.sampler(logits, sampled)]
        rows = logits.float().cpu()
        return [sample_row(rows[i], s.params, s.prompt_ids, s.output_ids, s.generator)
                for i, s in enumerate(sampled)]

    def _append(self, seq: Sequence, s: Sampled) -> StepOutput:
        p, token = seq.params, s.token
        seq.output_ids.append(token)
        if p.logprobs is not None:
            seq.logprobs.append(s)
        reason = None
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_context:
            reason = "length"
        decoder = self.decoders[seq]
        if reason != "stop":
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
