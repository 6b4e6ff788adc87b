"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-probability given the tokens
before it, what scoring clients read (OpenAI's `echo` with `logprobs`, vLLM's `prompt_logprobs`; lm-eval's
loglikelihood tasks).

They are computed in the prefill, where the logits are: the rows of a prefill chunk that predict a prompt
token join the program's logits_indices after the rows the step samples, so the lm_head runs over them in
the same forward, and only each row's chosen logprob, its rank and its top k leave the device.

Two rules keep them right and bounded. A sequence that still needs them is prefilled from its first token:
the prefix cache holds K/V, not logits, so the Scheduler skips its prefix match (wants()). And a step scores
at most MAX_ROWS rows over all its sequences (the Scheduler shortens their chunks), which bounds the
[rows, vocab] float32 block the log-softmax makes.

Entry i of Sequence.prompt_logprobs is prompt token i's Sampled (entry 0 is None: nothing predicts the first
token). Row q of a sequence predicts token q + 1; entries already filled are not scored again when a
preempted sequence recomputes its prefill.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engc.runtime.sampling import Sampled
from engc.runtime.sequence import Sequence

MAX_ROWS = 512   # scored rows a step: 512 x a 128k vocabulary in float32 is 256 MB


def wants(seq: Sequence) -> bool:
    """Whether the sequence still has prompt tokens to score."""
    return seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt_ids)


@dataclass
class ScoredRows:
    """A step's rows to score: flat batch rows (in order), the token each predicts, and per sequence how
    many of them are its next entries."""
    rows: list[int]
    targets: list[int]
    spans: list[tuple[Sequence, int]]
    k: int   # top logprobs a row: the most any of the sequences asked for


def rows_of(batch: list[tuple[Sequence, int]]) -> ScoredRows | None:
    """The rows of a batch (before its step runs: num_computed is where each chunk starts) that predict a
    prompt token not scored yet; None if there are none."""
    rows, targets, spans, k, flat = [], [], [], 0, 0
    for seq, n in batch:
        if wants(seq):
            start, end = seq.num_computed, seq.num_computed + n
            first = max(start, max(1, len(seq.prompt_logprobs)) - 1)
            last = min(end, len(seq.prompt_ids) - 1)
            if last > first:
                rows += range(flat + first - start, flat + last - start)
                targets += seq.prompt_ids[first + 1:last + 1]
                spans.append((seq, last - first))
                k = max(k, seq.params.prompt_logprobs)
            elif not seq.prompt_logprobs and len(seq.prompt_ids) == 1:
                seq.prompt_logprobs.append(None)   # a one-token prompt: nothing to score
        flat += n
    return ScoredRows(rows, targets, spans, k) if rows else None


def score(logits: torch.Tensor, scored: ScoredRows) -> None:
    """Fills the spans' sequences' entries from logits (one row per scored row, any float dtype, on any
    device). Reads the results back to the host: the one wait for the device a scoring step adds."""
    targets = torch.tensor(scored.targets, dtype=torch.int64).to(logits.device, non_blocking=True)
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(1, targets[:, None])[:, 0]
    rank = (logp > chosen[:, None]).sum(-1) + 1
    if scored.k:
        values, ids = torch.topk(logp, scored.k)
    else:
        values, ids = logp[:, :0], torch.zeros(len(scored.rows), 0, dtype=torch.int64, device=logp.device)
    chosen, rank, values, ids = chosen.tolist(), rank.tolist(), values.tolist(), ids.tolist()
    r = 0
    for seq, count in scored.spans:
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)
        k = seq.params.prompt_logprobs
        for i in range(r, r + count):
            seq.prompt_logprobs.append(Sampled(scored.targets[i], chosen[i], list(zip(ids[i][:k], values[i][:k])),
                                               rank[i]))
        r += count
