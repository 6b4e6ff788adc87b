"""ModelRunner: a step's inputs, the forward, the sampling where the logits are and the tokens' read-back.

It owns the executor (on a GPU the GraphedExecutor and its CUDA graphs), the step in flight and the
sampler. Eager and graphed executors share one interface: step_tokens (a graphed step's own tokens, drawn
in the graph from the rows' parameters the runner staged, else None), draws_in_graph (whether graphs draw)
and keep_tokens (tokens the next graphed step's fills read).

Overlap (one step of lookahead): a step whose tokens can be sampled where the logits are is launched,
and its tokens are read back only during the next step, after that step is launched in turn. So on a
GPU the host's scheduling, input building, stop checks and detokenizing run while the GPU computes.
Meanwhile each sampled sequence counts one token in flight (Sequence.num_in_flight): the scheduler
plans with it, the next step's executor takes its id from the device (TokenFill), and only known
tokens are ever hashed, appended or returned. A sequence that finished in the step being read may
already be in the launched one: that row's token is dropped.
A prefill chunk can also score its prompt rows (runtime/scoring.py: prompt logprobs): they are computed
in the same forward, after the sampled rows, and read back at its launch.
Rows are sampled where the logits are (sampler.DeviceSampler), logprobs, penalties and JSON-mode masks
included. Penalties and masks follow the token just read, so a step with such a row is launched, the
step before it read, and only then sampled (the masks made and applied while the GPU still runs the
forward); it stays overlapped. Only a row that needs a sampler the device lacks (a non-greedy row on a
CPU engine) goes to the host sampler: its step is read at once, after the step before it, and only that
row's logits go to the host (sampler.sample_now). launch holds these rules.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from engc.runtime import sampler, scoring
from engc.runtime.executor import TokenFill
from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import LoadedModel
from engc.runtime.sampler import DeviceSampler, Logprobs, follows_last_token
from engc.runtime.sampling import Sampled
from engc.runtime.sequence import Sequence
from engc.runtime.transfers import Readback


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


class ModelRunner:
    def __init__(self, model: LoadedModel, kv: KVCache, max_context: int, max_num_seqs: int,
                 cuda_graphs: bool, overlap: bool):
        self.model = model
        self.kv = kv
        self.overlap = overlap
        self.executor = model.executor
        self.graphs, self.graphs_s = 0, 0.0   # decode graphs captured at start, and the seconds they took
        if model.device.type == "cuda":
            from engc.runtime.cuda_graphs import GraphedExecutor
            from engc.runtime.gpu_ops import warm_cublas
            warm_cublas(model.dtype, model.device)
            greedy, draw = (None, None) if model.sampler is None else (model.sampler.greedy, model.sampler.draw)
            self.executor = GraphedExecutor(model.executor, model.step_facts, -(-max_context // model.block_size),
                                            max_num_seqs, model.device, cuda_graphs, greedy, draw,
                                            block_size=model.block_size)
            if cuda_graphs:   # every tensor-parallel rank captures the same graphs, collectives included
                started = time.perf_counter()
                self.executor.capture(kv.layers)
                self.graphs_s = time.perf_counter() - started
                self.graphs = sum(len(turns) for turns in self.executor.graphs.values())
        if model.tp is not None and model.tp.rank == 0:   # each forward's inputs go to the workers first
            from engc.runtime.tp import Leader
            self.executor = Leader(self.executor, model.tp)
        self.sampler = DeviceSampler(model.sampler)
        self.readback = Readback(max_num_seqs, model.device)
        self.in_flight: InFlight | None = None

    def follow(self) -> None:
        """A tensor-parallel worker's loop (runtime/tp.py): every forward rank 0 runs, on the inputs it sends,
        with this rank's weights and KV cache, until rank 0 says stop. Its outputs are rank 0's too (the
        logits are gathered whole on every rank); only rank 0 samples them."""
        from engc.runtime.tp import step_inputs
        while (message := self.model.tp.receive()) is not None:
            with torch.inference_mode():
                self.executor.forward(step_inputs(message), self.kv.layers, None)

    def launch(self, batch: list[tuple[Sequence, int]]) -> InFlight:
        """Runs the batch's forward and, where its rows allow, samples it (tokens left on the device)."""
        inputs, sampled, fill = self.inputs(batch)
        scored = scoring.rows_of(batch)
        if scored is not None:   # prompt rows to score: their logits come after the sampled rows'
            inputs["logits_indices"] = torch.cat([inputs["logits_indices"], _host(scored.rows, np.int64)])
        draws = self._graph_draws(sampled)
        with torch.inference_mode():
            logits = self.executor.forward(inputs, self.kv.layers, fill, draws=draws)
            if scored is not None:
                logits, prompt_logits = logits[:len(sampled)], logits[len(sampled):]
            step = InFlight(batch, sampled, logits)
            graphed = self.executor.step_tokens   # a graphed decode step's tokens, already on their way
            if sampled and graphed is not None and (draws is not None or all(s.params.plain_greedy
                                                                              for s in sampled)):
                self._keep(step, graphed[0], None, graphed[1])
            elif not self.sampler.takes_all(sampled):
                self._keep(step, None)    # sampled when read (sampler.sample_now), at once
            elif any(map(follows_last_token, sampled)):
                step.after_read = True    # sampled once the step before is read (sample_after_read)
            else:
                self._keep(step, *self.sampler.sample(logits, sampled, draws) if sampled else (None, None))
            if scored is not None:   # after the step's sampling is queued: this reads results back
                scoring.score(prompt_logits, scored)
        return step

    def _graph_draws(self, sampled: list[Sequence]):
        """The rows' parameters for a graph that samples, where its kernels draw every row and not every row
        is greedy (a greedy step needs none: the graph stages its rows greedy). Made once: where the step
        runs eagerly after all, its sampler takes these (each block makes the rows' next draws)."""
        if not sampled or not self.executor.draws_in_graph or all(s.params.plain_greedy for s in sampled):
            return None
        if not all(s.params.device_sampleable for s in sampled):
            return None
        return sampler.parameter_block(sampled)

    def sample_after_read(self, step: InFlight) -> None:
        """Samples a step whose rows follow their last token, now that the step before it is read."""
        if step.after_read:
            with torch.inference_mode():
                self._keep(step, *self.sampler.sample(step.logits, step.sampled))

    def hold(self, step: InFlight) -> bool:
        """Keeps the step in flight, its tokens read during the next step; False: it is to be read now."""
        if self.overlap and step.tokens is not None:
            self.in_flight = step
            return True
        return False

    def take_in_flight(self) -> InFlight | None:
        step, self.in_flight = self.in_flight, None
        return step

    def read(self, step: InFlight) -> tuple[list[int | None], list[Sampled | None] | None]:
        """The step's tokens, row for row, from the device copy or sampled on the host now (None: a row that
        finished meanwhile); and their Sampled where rows carry more than the token (logprobs, the host
        sampler's rows), else None: most steps need no object a row."""
        if step.tokens is None:
            samples = sampler.sample_now(step.logits, step.sampled, self.sampler)
            return [s.token if s is not None else None for s in samples], samples
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.host.tolist()
        if step.logprobs is None:
            return tokens, None
        samples = [Sampled(t) for t in tokens]
        step.logprobs.fill(samples, step.sampled)
        return tokens, samples

    def _keep(self, step: InFlight, tokens: torch.Tensor | None, logprobs: Logprobs | None = None,
              host: torch.Tensor | None = None) -> None:
        """The step's tokens, sampled on the device: their copy to the host started (or, host given, the
        graph's own), and kept where the next graphed step's fills read them (None: no tokens to keep)."""
        if host is None:
            self.executor.keep_tokens(tokens)
        if tokens is not None:
            step.tokens = tokens
            step.logprobs = logprobs.copied(self.readback.copy) if logprobs is not None else None
            step.host, step.ready = (host, self.readback.event(tokens)) if host is not None \
                else self.readback.start(tokens)    # its event follows the logprobs' copies too
            step.row_of = {seq: i for i, seq in enumerate(step.sampled)}

    def inputs(self, batch: list[tuple[Sequence, int]]
               ) -> tuple[dict[str, torch.Tensor], list[Sequence], TokenFill | None]:
        """The batch's program inputs (host tensors), the sequences sampled (one logits row each) and the
        rows whose input id is a token still in flight."""
        # One pass over the sequences gathers what only they know; the arithmetic over rows and tokens is
        # numpy's, at once for the whole batch (this runs every step, over every sequence).
        ids, computed, counts, tables, sample_at, sampled = [], [], [], [], [], []
        fill_rows, fill_src = [], []   # rows whose token is still on the device, and where it is there
        row_of = self.in_flight.row_of if self.in_flight is not None else None
        end = 0
        for seq, n in batch:
            start = seq.num_computed
            ids += seq.tokens(start, start + n)
            computed.append(start)
            counts.append(n)
            tables.append(seq.block_table)
            end += n
            if start + n == seq.num_tokens:  # this chunk reaches the last token (known or in flight): sample next
                sample_at.append(end - 1)
                sampled.append(seq)
                if seq.num_in_flight:  # its last token is the one in flight
                    fill_rows.append(end - 1)
                    fill_src.append(row_of[seq])
        # numpy turns a list of ints into an array several times faster than torch.tensor does
        computed = np.array(computed, dtype=np.int64)
        if end == len(batch):   # a token a row (every row has one at least): a decode step
            starts = np.arange(end + 1, dtype=np.int32)
            rows, positions = starts[:-1], computed   # each token's row, and position
            context = np.add(computed, 1, dtype=np.int32, casting="unsafe")
        else:
            counts = np.array(counts, dtype=np.int64)
            starts = np.zeros(len(batch) + 1, dtype=np.int32)
            np.cumsum(counts, out=starts[1:])
            rows = np.repeat(np.arange(len(batch)), counts)
            positions = np.arange(end) + (computed - starts[:-1])[rows]
            context = np.add(computed, counts, dtype=np.int32, casting="unsafe")
        block_tables = _padded(tables)
        block, offset = np.divmod(positions, self.model.block_size)
        slots = np.multiply(block_tables[rows, block], self.model.block_size, dtype=np.int64)
        slots += offset
        # Built on the host; a GPU executor moves them (and reads host-side facts from them first).
        inputs = {
            "input_ids": _host(ids, np.int64),
            "positions": torch.from_numpy(positions),
            "slot_mapping": torch.from_numpy(slots),
            "block_tables": torch.from_numpy(block_tables),
            "context_lens": torch.from_numpy(context),
            "query_start_loc": torch.from_numpy(starts),
            "logits_indices": _host(sample_at, np.int64),
        }
        fill = None
        if fill_rows:
            fill = TokenFill(_host(fill_rows, np.int64), _host(fill_src, np.int64), self.in_flight.tokens)
        return inputs, sampled, fill


def _padded(tables: list[list[int]]) -> np.ndarray:
    """The block tables as one int32 array, each row padded with zeros to the longest."""
    lengths = [len(t) for t in tables]
    width = max(lengths)
    if min(lengths) == width:
        return np.array(tables, dtype=np.int32).reshape(len(tables), width)
    out = np.zeros((len(tables), width), dtype=np.int32)
    out[np.arange(width) < np.array(lengths)[:, None]] = np.fromiter(chain.from_iterable(tables), np.int32,
                                                                     sum(lengths))
    return out


def _host(values: list[int], dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=dtype))
