"""CUDA graphs for decode steps: one graph per batch-size bucket (and staging turn), captured once.

Each batch bucket also gets graphs for shorter contexts than the block table's capacity (the model's
positions, 128k for many): the split-KV decode sizes its grid from the longest context a graph may see,
and a graph captured for the capacity would run 30+ splits even for a 130-token chat, each costing
latency; and the graph stages each row's block table only as wide as its context bucket needs, so a batch
of 256 short chats copies 256 KB of tables over PCIe, not 8 MB (256 rows of 8,192 blocks). Small batches
have a 255-token bucket (one KV tile a split); every batch a NARROW_CONTEXT one.

A decode step of a small model is a few hundred short launches; replaying them as one graph removes
the host from the critical path. The whole step is in the graph, not only the forward pass: the graph
reads its inputs from pinned host memory (the host writes them there; nothing is copied before the
replay), puts the previous step's tokens into the rows still waiting for them, runs the program, takes
the step's tokens (drawn by the bundle's sampling kernels from the sampling parameters staged with the
inputs, or the greedy argmax where a bundle has no sampling kernels) and writes them back into pinned host
memory. Each operation outside a graph leaves a gap on the GPU (copy-engine hand-offs, the start of the
graph after a kernel), while back-to-back graphs follow one another with almost none
(bench/results/HISTORY.md). Where torch cannot address pinned memory from the GPU, decode steps run
eagerly, with a warning.

The host writes a step's inputs into one of two pinned staging buffers in turn and replays that turn's
graph (staged_inputs.py); padded rows write no KV (slot -1), read a one-token context, and their logits are
dropped.

Every row of a graphed step is sampled, so the program runs its decode form (Executor.forward(decode=True)):
no gather of the sampled rows, and the logits stay in the head's dtype (no float32 cast) for the argmax and
the sampler, which read either; the host sampler casts what it reads. A decode batch larger than the largest
bucket runs eagerly in the same form. A row the kernels cannot draw for
(penalties, a grammar, logprobs) is staged greedy and sampled again after the replay, where the logits are.

Overlapped steps (runner.py) launch step N+1 before the host has read step N's tokens: rows whose input
id is such a token take it from `last_tokens`, where every step leaves its tokens on the device (the
graph's draw writes them there; keep_tokens copies those of other steps).
"""
from __future__ import annotations

import gc
import sys
from contextlib import contextmanager
from typing import Callable

import numpy as np
import torch

from engc.runtime.executor import Executor, TokenFill
from engc.runtime.gpu_ops import StepFacts
from engc.runtime.staged_inputs import TURNS, StagedInputs

# Batch buckets; the largest graph is the first bucket holding max_num_seqs rows. Those past 256 serve a larger
# --max-batch-size: an eager step of 1,024 rows took 1.3-1.4x a graphed one's time (8B fp8, H100;
# bench/results/HISTORY.md). Each holds its graphs' logits (four graphs a bucket: 1 MB a row at a 128k vocabulary
# in bf16), so they stay few; batches past the last run eagerly.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
ALWAYS_GRAPHED = 256   # the buckets past it are dropped, not fatal, where their graphs do not fit at start
# Longest context of the short-context graphs (255: at most 4 one-tile KV splits), and the batch buckets
# that get them.
# Few on purpose: each is one more graph to capture at start, and only a small model's small batches gain
# from them (bench/results/HISTORY.md).
CTX_BUCKETS = (255,)
CTX_BUCKETED_UP_TO = 4
# The context bucket of every batch bucket, where the capacity is larger: most chats fit it, and its graphs
# stage 256 blocks a row (page 16) where a 128k-position model's capacity is 8,192.
NARROW_CONTEXT = 4096
# Without the bundle's sampling kernels, the largest bucket whose graphs end with the greedy argmax and the
# tokens' write-back (a sampled step runs it for nothing: cheap up to here, not at 256 rows of a small model's
# short steps); larger buckets end with the logits, sampled outside the graph. With the kernels every graph
# ends with the draw.
GREEDY_UP_TO = 32
class GraphedExecutor:
    """Executor.forward with decode batches served from captured graphs, everything else eager.

    draw(logits, temperature, top_k, top_p, uniform, min_p, out): the bundle's sampling kernels, which every
    graph ends with (draws_in_graph), over the parameters the engine stages with a step's inputs; without
    them, greedy(logits, out): the argmax the graphs of up to GREEDY_UP_TO rows end with. After such a replay
    `step_tokens` holds its tokens (device rows, pinned host rows) for the engine, which uses them when it
    staged the rows' draws or the step was all greedy, and samples from the logits otherwise."""

    def __init__(self, executor: Executor, facts: StepFacts, max_blocks_per_seq: int,
                 max_batch: int = 256, device: str | torch.device = "cuda", enabled: bool = True,
                 greedy: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 draw: Callable[..., None] | None = None, *, block_size: int):
        self.executor = executor
        self.block_size = block_size
        self.draw = draw
        self.facts = facts
        self.device = device
        self.enabled = enabled
        self.greedy = greedy or (lambda logits, out: torch.argmax(logits, -1, out=out))
        top = next((b for b in BUCKETS if b >= max_batch), BUCKETS[-1])   # max_batch rows replay a graph
        self.buckets = [b for b in BUCKETS if b <= top]
        self.staged = StagedInputs(self.buckets[-1], max_blocks_per_seq, device)
        if enabled and (self.staged.host_stack is None or self.staged.tokens_dev is None):
            print("engc: warning: torch cannot address pinned host memory from the GPU here; decode steps run "
                  "without CUDA graphs (slower at small batches)", file=sys.stderr)
            self.enabled = False
        # (batch bucket, context bucket or None for the block table's capacity) -> per staging turn
        # (graph, logits)
        self.graphs: dict[tuple[int, int | None], list[tuple[torch.cuda.CUDAGraph, torch.Tensor]]] = {}
        self.pool = None
        self.step_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tokens_kept = True   # last_tokens holds the previous step's tokens (fills can read them)

    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket now (largest first, so the smaller ones reuse its memory pool). A bucket past
        ALWAYS_GRAPHED whose graphs do not fit in the memory the KV cache left is dropped, with one warning:
        batches of its size replay a larger bucket's graphs, or past the largest left run eagerly."""
        with collector_paused():
            for b in reversed(list(self.buckets)):
                try:
                    for c in self._ctx_buckets(b):
                        self._capture((b, c), kv_caches)
                except torch.cuda.OutOfMemoryError:
                    if b <= ALWAYS_GRAPHED:
                        raise
                    for key in [k for k in self.graphs if k[0] == b]:
                        del self.graphs[key]
                    self.buckets.remove(b)
                    torch.cuda.empty_cache()
                    instead = "replay a larger one" if b < self.buckets[-1] else "decode without graphs (slower)"
                    print(f"engc: warning: no room beside the KV cache for the decode graphs of {b} rows: batches "
                          f"that would replay them {instead}; a lower --cache-max-entry-count leaves room",
                          file=sys.stderr)

    def _ctx_buckets(self, b: int) -> list[int | None]:
        """The context buckets of batch bucket b, shortest first, then None (the block table's capacity)."""
        short = list(CTX_BUCKETS) if b <= CTX_BUCKETED_UP_TO else []
        capacity = self.staged.width * self.block_size
        return [c for c in (*short, NARROW_CONTEXT) if c < capacity] + [None]

    def graph_key(self, n: int, max_context: int) -> tuple[int, int | None]:
        """The graph a decode batch of n rows whose longest context is max_context replays."""
        b = next(x for x in self.buckets if x >= n)
        c = next((c for c in self._ctx_buckets(b)[:-1] if c >= max_context), None)
        return b, c

    def table_width(self, max_context: int | None) -> int:
        """Blocks a row of a context bucket's graph stages: its contexts' blocks (the capacity for None)."""
        return self.staged.width if max_context is None else -(-max_context // self.block_size)

    def forward(self, inputs: dict[str, torch.Tensor], kv_caches: list[torch.Tensor],
                fill: TokenFill | None = None, draws: np.ndarray | None = None) -> torch.Tensor:
        """inputs are host tensors (the engine builds them there); they reach the GPU without a sync, so
        the host can go on while earlier steps still run. draws: the rows' sampling parameters for a graph's
        draw (sampler.parameter_block), None: greedy rows."""
        n = inputs["input_ids"].shape[0]
        self.step_tokens = None
        # one token a row, each sampled: the graph's logits and tokens are row for row the sampled ones
        one_each = (n == inputs["block_tables"].shape[0] == inputs["logits_indices"].shape[0]
                    and (inputs["logits_indices"].numpy() == np.arange(n)).all())
        decode = (self.enabled and one_each and n <= self.buckets[-1]
                  and inputs["block_tables"].shape[1] <= self.staged.width and (fill is None or self.tokens_kept))
        if not decode:
            self.facts.describe(inputs["query_start_loc"][1:] - inputs["query_start_loc"][:-1], inputs["context_lens"])
            on_device = {k: _to_device(v, self.device) for k, v in inputs.items()}
            if fill is not None:
                fill.apply(on_device["input_ids"], _to_device(fill.rows, self.device),
                           _to_device(fill.src, self.device))
            # a decode batch past the largest graph runs eagerly, in the decode form all the same (no gather of
            # its rows, no float32 copy of its logits: 0.4 ms a step at 1,024 rows of an 8B model)
            return self.executor.forward(on_device, kv_caches, decode=one_each)
        key = self.graph_key(n, int(inputs["context_lens"].max()))
        if key not in self.graphs:
            self._capture(key, kv_caches)
        turn = self.staged.send(inputs, n, key[0], self.table_width(key[1]), fill, draws)
        graph, out = self.graphs[key][turn]
        graph.replay()
        if self._ends_with_tokens(key[0]):
            self.step_tokens = (self.staged.last_tokens[:n], self.staged.tokens[turn, :n])
            self.tokens_kept = True
        return out[:n]

    def keep_tokens(self, tokens: torch.Tensor | None) -> None:
        """A step outside the graphs sampled `tokens` (on the device): keep them where the next graphed
        step's in-flight rows read them."""
        self.tokens_kept = tokens is not None and tokens.shape[0] <= self.staged.n
        if self.tokens_kept:
            self.staged.last_tokens[:tokens.shape[0]].copy_(tokens)

    def _step(self, b: int, width: int, turn: int, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """One decode step of bucket b (block tables width wide) from host buffer `turn`: what a graph holds."""
        self.staged.stage(b, turn, width)
        logits = self.executor.forward(self.staged.bucket_inputs(b, width), kv_caches, decode=True)
        if self._ends_with_tokens(b):
            self._tokens(logits, b, self.staged.last_tokens[:b])
            self.staged.export(b, turn)
        return logits

    @property
    def draws_in_graph(self) -> bool:
        return self.draw is not None

    def _ends_with_tokens(self, b: int) -> bool:
        return self.draw is not None or b <= GREEDY_UP_TO

    def _tokens(self, logits: torch.Tensor, b: int, out: torch.Tensor) -> None:
        """A graph's tokens into out: drawn from the staged parameters, or the greedy argmax."""
        if self.draw is not None:
            self.draw(logits, *self.staged.draw_inputs(b), out)
        else:
            self.greedy(logits, out)

    def _capture(self, key: tuple[int, int | None], kv_caches: list[torch.Tensor]) -> None:
        b, max_context = key
        inputs = self.staged.bucket_inputs(b, self.table_width(max_context))
        # The warm-up below really runs: on inputs left by an earlier step (a lazy capture while serving)
        # it would write K/V into slots that may belong to another sequence now. Padded rows write none.
        inputs["slot_mapping"].fill_(-1)
        inputs["context_lens"].fill_(1)
        # Decode kernels size their split-KV grid from the longest context the graph may see: the
        # context bucket, or the block table's capacity (set before each forward, which takes them).
        self.facts.for_graph(max_context)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # warm-up: allocator and cuBLAS handles (the forward only: the staging would read a host
            # buffer the engine may be writing)
            logits = self.executor.forward(inputs, kv_caches, decode=True)
            if self._ends_with_tokens(b):
                self._tokens(logits, b, torch.empty(b, dtype=torch.int64, device=self.device))
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        with collector_paused():
            for turn in range(TURNS):
                graph = torch.cuda.CUDAGraph()
                self.facts.for_graph(max_context)
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._step(b, self.table_width(max_context), turn, kv_caches)
                self.pool = graph.pool()
                graphs.append((graph, out))
        self.graphs[key] = graphs


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while graphs record, after one collection. An object the
    collector frees mid-capture (an earlier engine's graphs, pools or pinned buffers, left in a reference
    cycle) makes CUDA calls a capture forbids, and the capture fails with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    at the next launch. torch.cuda.graph no longer collects before capturing; this does. Nested: a no-op."""
    if not gc.isenabled():
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    # From pageable memory a copy waits for the GPU to finish its queued work; from pinned it does not.
    return t.pin_memory().to(device, non_blocking=True)
