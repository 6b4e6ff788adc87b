"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once, replayed per step.

Small batches also get a graph per context bucket: the split-KV decode sizes its grid from the longest
context a graph may see, and a graph captured for the block table's full capacity (8k tokens) runs
30+ splits even for a 130-token chat (6.1 us a layer on an H200 against 3.2 us with one split, measured
when a reduce launch followed; the decode now reduces in-kernel and empty splits only count themselves).
Large batches fill the GPU with (sequence, head) pairs anyway, so they keep one graph.

A decode step of a small model is a few hundred short launches; replaying them as one graph removes
the host from the critical path. Graphs read fixed buffers, so a step writes its inputs into one
pinned host staging area, sends it with a single copy, and pads up to the bucket: padded rows write
no KV (slot -1), read a one-token context, and their logits are dropped.

Overlapped steps (engine.py) launch step N+1 before the host has read step N's tokens: rows whose input
id is such a token get it on the device, from the indices staged with the other inputs. The host
stages into two pinned buffers in turn, since a buffer's copy may still be queued behind the GPU's
current step when the host writes the next one.
"""
from __future__ import annotations

import torch

from engc.runtime.executor import Executor, TokenFill
from engc.runtime.gpu_ops import StepFacts

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Longest context of the short-context graphs (255: at most 4 one-tile KV splits), and the batch buckets
# that get them.
# Few on purpose: each is one more graph to capture at start (an 8B graph takes ~50 ms), and on the H200
# the 1B batch-1 step gained 24 us (1.082 -> 1.058 ms) while the 8B one did not move.
CTX_BUCKETS = (255,)
CTX_BUCKETED_UP_TO = 4
# int64 fields first (two int32 words each), then int32 fields; block_tables last so a step copies
# only the rows it uses.
I64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices", "fill_rows", "fill_src")
I32_FIELDS = ("context_lens", "query_start_loc")


def _aligned(words: int) -> int:
    """The first int32 offset at or after words that lies on a 16-byte boundary."""
    return -(-words // 4) * 4


class StagedInputs:
    """The decode graphs' input tensors as views of one device buffer, mirrored by pinned host ones."""

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
        self.offsets["block_tables"] = at = _aligned(at)
        self.size = at + max_batch * max_blocks
        self.hosts = [torch.zeros(self.size, dtype=torch.int32).pin_memory() for _ in range(2)]
        self.turn = 0                                   # which host buffer the next step writes
        self.device = torch.zeros(self.size, dtype=torch.int32, device=device)
        self.dev = self._views(self.device)
        cpus = [self._views(host) for host in self.hosts]
        self.cpu_np = [{name: view.numpy() for name, view in cpu.items()} for cpu in cpus]
        for views in (*cpus, self.dev):
            views["query_start_loc"].copy_(torch.arange(max_batch + 1, dtype=torch.int32))
            views["logits_indices"].copy_(torch.arange(max_batch))
            views["context_lens"].fill_(1)
            views["slot_mapping"].fill_(-1)

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        o, n = self.offsets, self.n
        views = {name: buf[o[name]:o[name] + 2 * n].view(torch.int64) for name in I64_FIELDS}
        views.update({name: buf[o[name]:o[name] + n + 1] for name in I32_FIELDS})
        views["context_lens"] = views["context_lens"][:n]
        views["block_tables"] = buf[o["block_tables"]:].view(n, self.width)
        return views

    def bucket_inputs(self, b: int) -> dict[str, torch.Tensor]:
        return {name: (t[:b + 1] if name == "query_start_loc" else t[:b]) for name, t in self.dev.items()
                if not name.startswith("fill_")}

    def send(self, inputs: dict[str, torch.Tensor], n: int, b: int, fill: TokenFill | None) -> None:
        # Written through numpy views of the pinned buffer: a numpy slice assignment costs a fraction
        # of a torch copy_ call, and this runs every decode step.
        host, cpu = self.hosts[self.turn], self.cpu_np[self.turn]
        self.turn ^= 1
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            cpu[name][:n] = inputs[name].numpy()
        cpu["input_ids"][n:b] = 0       # padded rows: a valid id (a buffer may hold an in-flight -1)
        cpu["slot_mapping"][n:b] = -1   # no KV write
        cpu["context_lens"][n:b] = 1
        if fill is not None:
            cpu["fill_rows"][:len(fill.rows)] = fill.rows.numpy()
            cpu["fill_src"][:len(fill.src)] = fill.src.numpy()
        width = inputs["block_tables"].shape[1]
        cpu["block_tables"][:n, :width] = inputs["block_tables"].numpy()
        used = self.offsets["block_tables"] + b * self.width
        self.device[:used].copy_(host[:used], non_blocking=True)
        if fill is not None:
            k = len(fill.rows)
            fill.apply(self.dev["input_ids"], self.dev["fill_rows"][:k], self.dev["fill_src"][:k])


class GraphedExecutor:
    """Executor.forward with decode batches served from captured graphs, everything else eager."""

    def __init__(self, executor: Executor, facts: StepFacts, max_blocks_per_seq: int,
                 max_batch: int = 256, device: str | torch.device = "cuda", enabled: bool = True):
        self.executor = executor
        self.facts = facts
        self.device = device
        self.enabled = enabled
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        self.staged = StagedInputs(self.buckets[-1], max_blocks_per_seq, device)
        # (batch bucket, context bucket or None for the block table's capacity) -> (graph, logits)
        self.graphs: dict[tuple[int, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket now (largest first, so the smaller ones reuse its memory pool)."""
        for b in reversed(self.buckets):
            for c in self._ctx_buckets(b):
                self._capture((b, c), kv_caches)

    @staticmethod
    def _ctx_buckets(b: int) -> list[int | None]:
        return [None] + (list(CTX_BUCKETS) if b <= CTX_BUCKETED_UP_TO else [])

    def graph_key(self, n: int, max_context: int) -> tuple[int, int | None]:
        """The graph a decode batch of n rows whose longest context is max_context replays."""
        b = next(x for x in self.buckets if x >= n)
        c = next((c for c in self._ctx_buckets(b)[1:] if c >= max_context), None)
        return b, c

    def forward(self, inputs: dict[str, torch.Tensor], kv_caches: list[torch.Tensor],
                fill: TokenFill | None = None) -> torch.Tensor:
        """inputs are host tensors (the engine builds them there); they cross to the GPU here without
        a sync, so the host can go on while earlier steps still run."""
        n = inputs["input_ids"].shape[0]
        decode = (self.enabled and n == inputs["block_tables"].shape[0] and n <= self.buckets[-1]
                  and inputs["block_tables"].shape[1] <= self.staged.width)
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
        self.staged.send(inputs, n, key[0], fill)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n]

    def _capture(self, key: tuple[int, int | None], kv_caches: list[torch.Tensor]) -> None:
        b, max_context = key
        inputs = self.staged.bucket_inputs(b)
        # The warm-up below really runs: on inputs left by an earlier step (a lazy capture while serving)
        # it would write K/V into slots that may belong to another sequence now. Padded rows write none.
        inputs["slot_mapping"].fill_(-1)
        inputs["context_lens"].fill_(1)
        # Decode kernels size their split-KV grid from the longest context the graph may see: the
        # context bucket, or the block table's capacity.
        self.facts.max_query_len, self.facts.max_context_len, self.facts.has_decode_rows = 1, max_context, True
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.executor.forward(inputs, kv_caches)  # warm-up: allocator and cuBLAS handles
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.executor.forward(inputs, kv_caches)
        self.pool = graph.pool()
        self.graphs[key] = (graph, out)


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    # From pageable memory a copy waits for the GPU to finish its queued work; from pinned it does not.
    return t.pin_memory().to(device, non_blocking=True)
