"""Weights read into L2 on a side stream while a decode step's DRAM is idle (kernels/l2_prefetch).

A projection (Gemm, SiluMulLinear, QLinear, FP8Linear reading a bundle weight) is DRAM-bound; the nodes
between it and the previous projection (norms, rotary, attention) are latency-bound and leave DRAM idle.
The plan forks a side stream at the first node of such a window, prefetches the coming projection's
weight there, and joins before the projection: it then reads from L2 what the window had time to fetch.
Windows holding attention are long (rotary + attention, ~10 us at batch 1 on an 8B model: a whole o_proj);
the others are a norm (~2 us: the head of qkv or gate_up). The byte budgets per kind and the largest batch
that gains come from the bundle's tune entry (`l2_prefetch`).

Only decode steps prefetch (prefill projections are compute-bound). The fork and join are stream events,
so they are captured into the decode CUDA graphs like any launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels import l2_prefetch

# op -> position of its weight among the node's inputs
WEIGHT_INPUT = {("", "Gemm"): 1, (ENGC_DOMAIN, "SiluMulLinear"): 1, (ENGC_DOMAIN, "QLinear"): 1,
                (ENGC_DOMAIN, "FP8Linear"): 1}
ATTENTION_OPS = {(ENGC_DOMAIN, "PagedAttention"), (ENGC_DOMAIN, "RotaryKVWrite"),
                 (ENGC_DOMAIN, "RotaryPagedAttention")}


@dataclass(frozen=True)
class Window:
    fork: int       # node index at which the side stream starts
    join: int       # the projection's node index: the main stream waits for the prefetch before it
    weight: str
    attention: bool


def plan(nodes, weights: dict) -> list[Window]:
    """One window per projection that reads a bundle weight and has latency-bound nodes before it."""
    windows, prev = [], None
    for i, node in enumerate(nodes):
        slot = WEIGHT_INPUT.get((node.domain, node.op))
        if slot is None or len(node.inputs) <= slot or node.inputs[slot] not in weights:
            continue
        start = 0 if prev is None else prev + 1
        if start < i:
            attention = any((n.domain, n.op) in ATTENTION_OPS for n in nodes[start:i])
            windows.append(Window(start, i, node.inputs[slot], attention))
        prev = i
    return windows


class L2Prefetch:
    """Wraps the bound ops of a plan's fork and join nodes (Executor's `wrap` hook). `budget` and
    `max_rows` are read at each step, so a benchmark may change them before capturing graphs."""

    def __init__(self, nodes, weights: dict, kernels, facts, consts: dict):
        self.kernels, self.facts, self.consts = kernels, facts, consts
        c = consts["default"]
        self.budget = {True: int(c["attn_bytes"]), False: int(c["norm_bytes"])}
        self.max_rows = int(c["max_rows"])
        self.weights = weights
        self.forks = {w.fork: w for w in plan(nodes, weights)}
        self.joins = {w.join for w in self.forks.values()}
        self.out = torch.zeros(c["programs"], dtype=torch.int32, device="cuda")
        self.side = torch.cuda.Stream()
        self.pending = False

    def active(self) -> bool:
        f = self.facts
        return f.max_query_len == 1 and f.rows is not None and f.rows <= self.max_rows

    def wrap(self, i: int, impl):
        window, join = self.forks.get(i), i in self.joins
        if window is None and not join:
            return impl

        def run(*args, **kwargs):
            if join and self.pending:
                torch.cuda.current_stream().wait_stream(self.side)
                self.pending = False
            if window is not None and self.budget[window.attention] > 0 and self.active():
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    self.kernels.run("l2_prefetch", l2_prefetch.launch(
                        self.weights[window.weight], self.budget[window.attention], self.out, self.consts))
                self.pending = True
            return impl(*args, **kwargs)
        return run
