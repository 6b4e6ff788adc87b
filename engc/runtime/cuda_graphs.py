"""CUDA graphs for decode steps: one graph per batch-size bucket, captured once, replayed per step.

A decode step of a small model is a few hundred short launches; replaying them as one graph removes
the host from the critical path. Graphs read fixed buffers, so a step copies its inputs into them and
pads up to the bucket: padded rows write no KV (slot -1) and their logits are dropped.
"""
from __future__ import annotations

import torch

from engc.runtime.executor import Executor
from engc.runtime.gpu_ops import StepFacts

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class GraphedExecutor:
    """Executor.forward with decode batches served from captured graphs, everything else eager."""

    def __init__(self, executor: Executor, facts: StepFacts, max_blocks_per_seq: int, block_size: int,
                 max_batch: int = 256, device: str | torch.device = "cuda", enabled: bool = True):
        self.executor = executor
        self.device = device
        self.enabled = enabled
        self.facts = facts
        self.block_size = block_size
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        n = self.buckets[-1]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.buf = {
            "input_ids": torch.zeros(n, **i64), "positions": torch.zeros(n, **i64),
            "slot_mapping": torch.full((n,), -1, **i64),
            "block_tables": torch.zeros(n, max_blocks_per_seq, **i32),
            "context_lens": torch.ones(n, **i32),
            "query_start_loc": torch.arange(n + 1, **i32), "logits_indices": torch.arange(n, **i64),
        }
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket now (largest first, so the smaller ones reuse its memory pool)."""
        for b in reversed(self.buckets):
            self._capture(b, kv_caches)

    def forward(self, inputs: dict[str, torch.Tensor], kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """inputs are host tensors (the engine builds them there); they cross to the GPU here."""
        n = inputs["input_ids"].shape[0]
        decode = (self.enabled and n == inputs["block_tables"].shape[0] and n <= self.buckets[-1]
                  and inputs["block_tables"].shape[1] <= self.buf["block_tables"].shape[1])
        if not decode:
            query_lens = inputs["query_start_loc"][1:] - inputs["query_start_loc"][:-1]
            self.facts.max_query_len = int(query_lens.max())
            self.facts.has_decode_rows = bool((query_lens == 1).any())
            self.facts.max_context_len = int(inputs["context_lens"].max())
            on_device = {k: v.to(self.device) for k, v in inputs.items()}
            return self.executor.forward(on_device, kv_caches)
        b = next(x for x in self.buckets if x >= n)
        if b not in self.graphs:
            self._capture(b, kv_caches)
        buf = self.buf
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            buf[name][:n].copy_(inputs[name])
        width = inputs["block_tables"].shape[1]
        buf["block_tables"][:n, :width].copy_(inputs["block_tables"])
        if n < b:  # padded rows: no KV write, a one-token context of block 0, output ignored
            buf["slot_mapping"][n:b].fill_(-1)
            buf["context_lens"][n:b].fill_(1)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]

    def _capture(self, b: int, kv_caches: list[torch.Tensor]) -> None:
        inputs = {name: t[:b] if name != "query_start_loc" else t[:b + 1] for name, t in self.buf.items()}
        # Decode kernels size their split-KV grid from the block table's capacity: fixed for a graph.
        self.facts.max_query_len, self.facts.max_context_len, self.facts.has_decode_rows = 1, None, True
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.executor.forward(inputs, kv_caches)  # warm-up: allocator and cuBLAS handles
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.executor.forward(inputs, kv_caches)
        self.pool = graph.pool()
        self.graphs[b] = (graph, out)
