"""Continuous batching with one token budget per step: prefill chunks and decodes share a batch.

Each step takes running sequences first (their next chunk or next token), preempting the
lowest-priority, newest ones by recompute when KV blocks run out, then admits waiting sequences in
priority order while budget and blocks allow.
"""
from __future__ import annotations

from engc.runtime.kv_cache import BlockAllocator
from engc.runtime.sequence import Sequence, Status


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int = 256,
                 max_batched_tokens: int = 8192):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=_order)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget, batch = self.max_batched_tokens, []
        self.running.sort(key=_order)
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue  # preempted below to make room for a higher-priority sequence
            n = min(seq.num_pending, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, seq.num_computed + n):
                break
            self.waiting.pop(0)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.allocator.blocks_needed(num_tokens) - len(seq.block_table)
        if need > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate() for _ in range(max(need, 0)))
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: the tokens are kept, their K/V are rebuilt when it is readmitted.
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        self.num_preemptions += 1
        self.add(seq)

    def _free(self, seq: Sequence) -> None:
        self.allocator.release(seq.block_table)
        seq.block_table = []


def _order(seq: Sequence):
    return (seq.priority, seq.arrival)
