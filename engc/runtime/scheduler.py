"""Continuous batching with one token budget per step: prefill chunks and decodes share a batch.

Each step takes running sequences first (their next chunk or next token), preempting the
lowest-priority, newest ones by recompute when KV blocks run out, then admits waiting sequences in
priority order while budget and blocks allow. A sequence being admitted first takes whatever full
blocks of its tokens the prefix cache holds, so it prefills only the rest.

Sessions: a finished request with a session_id leaves its full blocks held under that id, so the next
turn of the chat finds them even under eviction pressure; held blocks are the first given up when
blocks run short.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from operator import attrgetter

from engc.runtime import scoring
from engc.runtime.kv_cache import BlockAllocator
from engc.runtime.sequence import Sequence, Status


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int = 256,
                 max_batched_tokens: int = 8192, max_sessions: int = 64):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_sessions = max_sessions
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.sessions: OrderedDict[str, list[int]] = OrderedDict()
        self.num_preemptions = 0
        self.prompt_tokens = 0          # over first admissions: the prefix cache's hit rate
        self.cached_tokens = 0
        self.computed_tokens = 0        # tokens run through the model, prefill and decode

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=_order)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget, batch = self.max_batched_tokens, []
        scored = scoring.MAX_ROWS   # rows left this step for prompt logprobs (runtime/scoring.py)
        bs = self.allocator.block_size
        for seq in list(self.running):   # in _order: kept sorted as sequences join
            if budget == 0:
                break
            if seq.status is not _RUNNING or seq.ends_in_flight:
                continue  # preempted below to make room for a higher-priority sequence, or done once read
            n = seq.num_pending
            if n > budget:
                n = budget
            if scoring.wants(seq):
                n = min(n, scored)
                if n == 0:
                    continue
                scored -= n
            end = seq.num_computed + n
            # most decode steps: the last block still has room, and nothing is reserved
            while end > len(seq.block_table) * bs and not self._reserve(seq, end):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self._match_prefix(seq)
            n = min(seq.num_pending, budget)
            if scoring.wants(seq):
                n = min(n, scored)
                if n == 0:
                    break
                scored -= n
            if not self._reserve(seq, seq.num_computed + n):
                self._free(seq)
                break
            self.waiting.pop(0)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_computed
                self.prompt_tokens += len(seq.prompt_ids)
                self.cached_tokens += seq.num_computed
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=_order)
            batch.append((seq, n))
            budget -= n
        return batch

    def commit(self, batch: list[tuple[Sequence, int]]) -> None:
        """After a step ran the batch: its tokens are in the cache, and newly full blocks are hashed. A sequence
        that finished meanwhile is left out (its blocks are gone)."""
        bs, total, hashed = self.allocator.block_size, 0, self.allocator.prefix_cache
        for seq, n in batch:
            if seq.status is _FINISHED:
                continue
            seq.num_computed += n
            total += n
            full = seq.num_computed // bs
            if hashed and full > len(seq.block_hashes):  # a block filled: its tokens are known
                self.allocator.register(seq.tokens(len(seq.block_hashes) * bs, full * bs), seq.block_table,
                                        seq.block_hashes)
        self.computed_tokens += total

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.session_id is not None:
            keep = len(seq.block_hashes)
            self._hold(seq.session_id, seq.block_table[:keep])
            seq.block_table = seq.block_table[keep:]
        self._free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_integrity(self) -> None:
        tables = [s.block_table for s in self.running + self.waiting] + list(self.sessions.values())
        self.allocator.check_integrity(tables)
        assert all(not s.block_table for s in self.waiting), "a waiting sequence holds blocks"

    def _match_prefix(self, seq: Sequence) -> None:
        # a sequence whose prompt is still to be scored prefills from its first token: the cache holds no logits
        if not seq.block_table and not scoring.wants(seq):
            seq.block_table = self.allocator.match(seq.token_ids, seq.block_hashes)
            seq.num_computed = len(seq.block_table) * self.allocator.block_size

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.allocator.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True  # most decode steps: the last block still has room
        while need > self.allocator.num_free and self.sessions:
            self.allocator.release(self.sessions.popitem(last=False)[1])
        if need > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate() for _ in range(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: the tokens are kept; on readmission the prefix cache gives back
        # whatever full blocks survived, and the rest is prefilled again.
        self.running.remove(seq)
        self._free(seq)
        self.num_preemptions += 1
        self.add(seq)

    def _free(self, seq: Sequence) -> None:
        self.allocator.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def _hold(self, session_id: str, blocks: list[int]) -> None:
        old = self.sessions.pop(session_id, None)
        self.sessions[session_id] = blocks
        if old:
            self.allocator.release(old)
        while len(self.sessions) > self.max_sessions:
            self.allocator.release(self.sessions.popitem(last=False)[1])


_RUNNING, _FINISHED = Status.RUNNING, Status.FINISHED   # module globals read faster than enum members
_order = attrgetter("priority", "arrival")   # (priority, arrival): lower runs first, then older
