"""L2 prefetch tables: the weights a decode step reads next, for a latency-bound kernel to ask L2 for.

At batch 1 the decode attention of a layer moves under a megabyte of KV cache: DRAM idles for its few
microseconds, then the o projection's GEMV starts cold and pays DRAM latency on every load. The cluster
decode kernel (templates/paged_decode_cluster.cu.j2) can instead issue L2 prefetches, right after its PDL
wait, of the ranges in a small table: the weights that the nodes after the attention read, in program order
(the o projection, then the MLP's), up to a byte budget that L2 (50 MB on the H200) holds with room to spare.
The table is made once at load, one per attention node, and stays at one address (CUDA graphs replay it).
A hint only: no result depends on it, so a stale or empty table costs speed, never correctness.
"""
from __future__ import annotations

import os

import torch

from engc.bundle.program import ENGC_DOMAIN, Program

MAX_RANGES = 16         # the kernel's MAX_PREFETCH
MIN_RANGE_BYTES = 1 << 16   # norm weights and biases are not worth a table slot
ENV = "ENGC_L2_PREFETCH_MB"
# Nodes whose weight rows come in halves that one program reads together: the SiLU-out int4 GEMV pairs gate
# row a with up row I + a (templates/int4_gemv.cu.j2), so a partial prefetch takes the same rows of each half.
HALVES = {"QLinearSiluMul"}


def budget_bytes(launch: dict | None) -> int:
    """The budget for a bundle whose cluster decode launch constants are `launch` (None: no such kernel):
    ENGC_L2_PREFETCH_MB when set (an A/B on one bundle), else the launch's l2_prefetch_mb; 0 where the kernel
    takes no table."""
    if launch is None or "l2_prefetch_mb" not in launch:
        return 0
    value = os.environ.get(ENV)
    try:
        mb = float(value) if value not in (None, "") else float(launch["l2_prefetch_mb"])
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected a number of megabytes") from None
    return max(0, int(mb * (1 << 20)))


def ranges_after(program: Program, weights: dict[str, torch.Tensor], index: int, budget: int) -> list[tuple[int, int]]:
    """(address, bytes) of the weights the nodes after node `index` read, in order, until the next attention
    node, MAX_RANGES ranges or `budget` bytes. A node that would overrun the budget gets the same leading
    fraction of each of its weights (rows first: every weight here is row-major with the output rows first,
    so those are the rows the first programs of its kernel read; of each half, for HALVES), then the table
    ends. Ranges start and end on 16-byte boundaries (the instruction's unit)."""
    ranges, left = [], budget
    for node in program.nodes[index + 1:]:
        if node.domain == ENGC_DOMAIN and node.op in ("RotaryPagedAttention", "PagedAttention"):
            break
        ws = [weights[n] for n in node.inputs if n in weights and _nbytes(weights[n]) >= MIN_RANGE_BYTES]
        total = sum(_nbytes(w) for w in ws)
        if not ws:
            continue
        parts = 2 if node.op in HALVES else 1
        fraction = min(1.0, left / total)
        for w in ws:
            part_rows = w.shape[0] // parts if w.shape[0] % parts == 0 else w.shape[0]
            row_bytes = _nbytes(w) // w.shape[0]
            rows = int(part_rows * fraction) if fraction < 1 else part_rows
            for p in range(w.shape[0] // part_rows):
                begin = w.data_ptr() + p * part_rows * row_bytes
                first, last = (begin + 15) & ~15, (begin + rows * row_bytes) & ~15
                if last > first and len(ranges) < MAX_RANGES:
                    ranges.append((first, last - first))
                    left -= last - first
        if fraction < 1 or len(ranges) == MAX_RANGES:
            break
    return ranges


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def node_tables(program: Program, weights: dict[str, torch.Tensor], budget: int,
                device: torch.device) -> dict[int, dict]:
    """Executor node attributes: {node index: {"l2_prefetch": int64 [R, 2] table on `device`}} for every
    RotaryPagedAttention node, or {} for a zero budget."""
    if budget <= 0:
        return {}
    tables = {}
    for i, node in enumerate(program.nodes):
        if node.domain == ENGC_DOMAIN and node.op == "RotaryPagedAttention":
            ranges = ranges_after(program, weights, i, budget)
            if ranges:
                if os.environ.get("ENGC_L2_PREFETCH_LINES") == "1":   # experiment: prefetch.global a line
                    ranges = [(a, -b) for a, b in ranges]
                tables[i] = {"l2_prefetch": torch.tensor(ranges, dtype=torch.int64, device=device)}
    return tables
