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
memory. Each operation outside a graph leaves a
gap on the GPU (copy-engine hand-offs, the start of the graph after a kernel), while back-to-back graphs
follow one another with almost none (bench/results/HISTORY.md). The two copies are kernels reading and writing pinned host memory over PCIe
(mapped_view; unified addressing, every 64-bit CUDA platform); where torch cannot address it so, decode
steps run eagerly, with a warning.

Graphs read fixed buffers, so the host writes a step's inputs into one of two pinned staging buffers in
turn (the GPU may still be reading the other one, for the step before) and replays that turn's graph;
padded rows write no KV (slot -1), read a one-token context, and their logits are dropped.

Every row of a graphed step is sampled, so the program runs its decode form (Executor.forward(decode=True)):
no gather of the sampled rows, and the logits stay in the head's dtype (no float32 cast) for the argmax and
the sampler, which read either; the host sampler casts what it reads. A row the kernels cannot draw for
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

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
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
# int64 fields first (two int32 words each), then int32 fields; block_tables last so a step copies
# only the rows it uses, each as wide as its graph's context bucket (a [rows, width] block at the region's
# start). fill_sel: where each row's input id comes from (see StagedInputs.pool).
I64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices", "fill_sel")
I32_FIELDS = ("context_lens", "query_start_loc")
# The sampling kernels' row parameters (kernels/sampling), float32 but top_k (int32), one word a row; a
# greedy row has temperature 0, the value every row is staged with when the engine sends none.
DRAW_FIELDS = ("temperature", "top_k", "top_p", "uniform", "min_p")
TURNS = 2


def _aligned(words: int) -> int:
    """The first int32 offset at or after words that lies on a 16-byte boundary."""
    return -(-words // 4) * 4


_TYPESTR = {torch.int32: "<i4", torch.int64: "<i8"}


class _Mapped:
    """A pinned host tensor as a CUDA array (__cuda_array_interface__): its host address, which the GPU can
    address too (unified addressing maps pinned memory), so torch makes a CUDA tensor over the same bytes."""

    def __init__(self, t: torch.Tensor):
        self.t = t   # kept alive by the CUDA tensor made from this object
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": _TYPESTR[t.dtype],
                                         "data": (t.data_ptr(), False), "version": 2}


def mapped_view(host: torch.Tensor) -> torch.Tensor | None:
    """host (pinned, contiguous) as a CUDA tensor over the same memory, for kernels to read and write over
    PCIe; None where torch or the driver will not make one."""
    try:
        view = torch.as_tensor(_Mapped(host), device="cuda")
    except Exception:   # no unified addressing, or a torch that refuses host memory
        return None
    return view if view.data_ptr() == host.data_ptr() else None


def _kernel_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src with an elementwise kernel: copy_ between two CUDA tensors would be a copy-engine memcpy,
    the hand-off the in-graph staging is there to avoid."""
    torch.bitwise_or(src, 0, out=dst)


class StagedInputs:
    """The decode graphs' input tensors as views of one device buffer, filled by the graph itself from one
    of two pinned host buffers; and where the step's tokens go (`last_tokens` on the device, `tokens` on
    the host, per turn)."""

    def __init__(self, max_batch: int, max_blocks: int, device):
        self.n, self.width = max_batch, max_blocks
        self.offsets, at = {}, 0
        # Every field starts on a 16-byte boundary: the kernels are compiled assuming their pointer
        # arguments are (BundleKernels.run checks it; an odd max_batch + 1 put the tables 8 bytes off).
        for name in I64_FIELDS:
            self.offsets[name] = at = _aligned(at)
            at += 2 * max_batch
        for name in I32_FIELDS:
            self.offsets[name] = at = _aligned(at)
            at += max_batch + 1
        for name in DRAW_FIELDS:
            self.offsets[name] = at = _aligned(at)
            at += max_batch
        self.offsets["block_tables"] = at = _aligned(at)
        self.size = _aligned(at + max_batch * max_blocks)   # whole 16-byte lines: turn 1's row aligned too
        cuda = torch.device(device).type == "cuda"
        stack = torch.zeros(TURNS, self.size, dtype=torch.int32)
        stack = stack.pin_memory() if cuda else stack
        self.host_stack = mapped_view(stack) if cuda else stack   # row t: turn t's inputs, as the graphs read them
        self.turn = 0                                   # which host buffer the next step writes
        # One device buffer: the previous step's tokens (last_tokens), then the staged fields. The int64
        # pool over [last_tokens | input_ids] is what fill_sel indexes: an index below n takes that row of
        # the previous step's tokens, ids_base + i the staged id of row i.
        lead = _aligned(2 * max_batch)
        self.ids_base = lead // 2
        whole = torch.zeros(lead + self.size, dtype=torch.int32, device=device)
        self.device = whole[lead:]
        self.pool = whole[:lead + 2 * max_batch].view(torch.int64)
        self.last_tokens = self.pool[:max_batch]
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=device)    # after the fill
        self.dev = self._views(self.device)
        self.draw_dev = self._draw_views(self.device)
        tokens = torch.zeros(TURNS, max_batch, dtype=torch.int64)
        self.tokens = tokens.pin_memory() if cuda else tokens     # each turn's greedy tokens, for the host
        self.tokens_dev = mapped_view(self.tokens) if cuda else self.tokens
        cpus = [self._views(host) for host in stack]    # where the host writes each turn's inputs
        self.cpu_np = [{name: view.numpy() for name, view in cpu.items()} for cpu in cpus]
        self.draw_np = [{name: view.numpy() for name, view in self._draw_views(host).items()} for host in stack]
        self.tables_np = [self._tables(host).numpy() for host in stack]
        self.own_ids = (self.ids_base + torch.arange(max_batch)).numpy()
        for views in (*cpus, self.dev):
            views["query_start_loc"].copy_(torch.arange(max_batch + 1, dtype=torch.int32))
            views["logits_indices"].copy_(torch.arange(max_batch))
            views["context_lens"].fill_(1)
            views["slot_mapping"].fill_(-1)
            views["fill_sel"].copy_(torch.from_numpy(self.own_ids))

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        o, n = self.offsets, self.n
        views = {name: buf[o[name]:o[name] + 2 * n].view(torch.int64) for name in I64_FIELDS}
        views.update({name: buf[o[name]:o[name] + n + 1] for name in I32_FIELDS})
        views["context_lens"] = views["context_lens"][:n]
        return views

    def _tables(self, buf: torch.Tensor) -> torch.Tensor:
        """The block tables' region of buf, flat: a step's rows are its first rows x width words."""
        o = self.offsets["block_tables"]
        return buf[o:o + self.n * self.width]

    def _draw_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        o, n = self.offsets, self.n
        return {name: buf[o[name]:o[name] + n] if name == "top_k" else buf[o[name]:o[name] + n].view(torch.float32)
                for name in DRAW_FIELDS}

    def draw_inputs(self, b: int) -> list[torch.Tensor]:
        """The bucket's staged sampling parameters, in the sampling kernels' order."""
        return [self.draw_dev[name][:b] for name in DRAW_FIELDS]

    def used(self, b: int, width: int) -> int:
        """int32 words a bucket of b rows reads: every field, and b rows of block tables width blocks wide."""
        return self.offsets["block_tables"] + b * width

    def bucket_inputs(self, b: int, width: int) -> dict[str, torch.Tensor]:
        views = {name: (t[:b + 1] if name == "query_start_loc" else t[:b]) for name, t in self.dev.items()
                 if name != "fill_sel"}
        views["input_ids"] = self.ids[:b]
        views["block_tables"] = self._tables(self.device)[:b * width].view(b, width)
        return views

    def stage(self, b: int, turn: int, width: int) -> None:
        """Inside the graph: turn's host buffer into the device one, then each row's input id from the
        staged ids or the previous step's tokens."""
        used = self.used(b, width)
        _kernel_copy(self.device[:used], self.host_stack[turn, :used])
        torch.index_select(self.pool, 0, self.dev["fill_sel"][:b], out=self.ids[:b])

    def export(self, b: int, turn: int) -> None:
        """Inside the graph: the step's tokens (last_tokens) into turn's pinned host row."""
        _kernel_copy(self.tokens_dev[turn, :b], self.last_tokens[:b])

    def send(self, inputs: dict[str, torch.Tensor], n: int, b: int, width: int, fill: TokenFill | None,
             draws: np.ndarray | None = None) -> int:
        """Writes a step's inputs into the next host buffer; returns its turn (the graph to replay). width: the
        graph's block-table width, which holds every block of the rows' contexts (blocks past them, reserved
        for tokens to come, are left out: no kernel reads them). draws: the rows' sampling parameters
        (sampler.parameter_block), None for greedy rows."""
        # Written through numpy views of the pinned buffer: a numpy slice assignment costs a fraction
        # of a torch copy_ call, and this runs every decode step.
        turn, cpu = self.turn, self.cpu_np[self.turn]
        self.turn = (self.turn + 1) % TURNS
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            cpu[name][:n] = inputs[name].numpy()
        cpu["input_ids"][n:b] = 0       # padded rows: a valid id (a buffer may hold an in-flight -1)
        cpu["slot_mapping"][n:b] = -1   # no KV write
        cpu["context_lens"][n:b] = 1
        sel = cpu["fill_sel"]
        sel[:b] = self.own_ids[:b]
        if fill is not None:
            sel[fill.rows.numpy()] = fill.src.numpy()
        cols = min(width, inputs["block_tables"].shape[1])
        self.tables_np[turn][:b * width].reshape(b, width)[:n, :cols] = inputs["block_tables"].numpy()[:, :cols]
        draw = self.draw_np[turn]
        if draws is None:
            draw["temperature"][:b] = 0.0
        else:
            for i, name in enumerate(DRAW_FIELDS):
                draw[name][:n] = draws[i, :n].view(np.int32) if name == "top_k" else draws[i, :n]
            draw["temperature"][n:b] = 0.0
        return turn


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
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
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
        """Capture every bucket now (largest first, so the smaller ones reuse its memory pool)."""
        with collector_paused():
            for b in reversed(self.buckets):
                for c in self._ctx_buckets(b):
                    self._capture((b, c), kv_caches)

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
        decode = (self.enabled and n == inputs["block_tables"].shape[0] == inputs["logits_indices"].shape[0]
                  and n <= self.buckets[-1] and inputs["block_tables"].shape[1] <= self.staged.width
                  and (fill is None or self.tokens_kept)
                  and (inputs["logits_indices"].numpy() == np.arange(n)).all())
        if not decode:
            self.facts.describe(inputs["query_start_loc"][1:] - inputs["query_start_loc"][:-1], inputs["context_lens"])
            on_device = {k: _to_device(v, self.device) for k, v in inputs.items()}
            if fill is not None:
                fill.apply(on_device["input_ids"], _to_device(fill.rows, self.device),
                           _to_device(fill.src, self.device))
            return self.executor.forward(on_device, kv_caches)
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
