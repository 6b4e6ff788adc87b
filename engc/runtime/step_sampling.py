"""A step's tokens sampled where its logits are (the GPU, or the CPU of a CPU engine), with what the plain
draw lacks applied to the rows that ask for it: repetition, presence and frequency penalties and JSON-mode
masks before the draw, logprobs after it.

The host sampler's rules (runtime/sampling.py sample_row), on the device: penalties in float32 on the
row's float32 logits (the same float32 operations, so a greedy row takes the same token), a mask ignored
where it allows nothing, logprobs those of the model's distribution (before penalties and masks). The
draw is the engine's (an argmax, or the GPU sampler: one uniform a row), so a seeded row draws the same
way whatever else it asks for and whatever shares its batch.

Penalties and masks follow the sequence's last token (follows_last_token), so the engine samples a step
with such a row only once the step before it is read; logprobs do not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engc.runtime.sampling import Sampled
from engc.runtime.sequence import Sequence


def follows_last_token(seq: Sequence) -> bool:
    return seq.constraint is not None or seq.params.penalized


@dataclass
class Logprobs:
    """Of the rows that asked for logprobs: the sampled token's logprob and the top K of each row (K the
    largest any of them asked for); device tensors, or their host copies."""
    rows: list[int]
    chosen: torch.Tensor   # [len(rows)] float32
    values: torch.Tensor   # [len(rows), K] float32
    ids: torch.Tensor      # [len(rows), K] int64

    def copied(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> Logprobs:
        return Logprobs(self.rows, copy(self.chosen), copy(self.values), copy(self.ids))

    def fill(self, samples: list[Sampled], seqs: list[Sequence]) -> None:
        """samples' rows that asked for logprobs get them (from host copies)."""
        chosen, values, ids = self.chosen.tolist(), self.values.tolist(), self.ids.tolist()
        for r, i in enumerate(self.rows):
            k = seqs[i].params.logprobs
            samples[i] = Sampled(samples[i].token, chosen[r], list(zip(ids[r][:k], values[r][:k])))


def sample(logits: torch.Tensor, seqs: list[Sequence], draw: Callable, upload: Callable
           ) -> tuple[torch.Tensor, Logprobs | None]:
    """(tokens [rows] int64, logprobs or None) where the logits are. draw(logits, seqs): the engine's plain
    draw; upload(host tensor): the tensor on the logits' device without waiting for the GPU."""
    work = _penalized_and_masked(logits, seqs, upload)
    tokens = draw(work, seqs)
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return tokens, None
    index = upload(torch.tensor(rows))
    logp = torch.log_softmax(logits.index_select(0, index).float(), -1)
    chosen = logp.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    k = max(seqs[i].params.logprobs for i in rows)
    values, ids = torch.topk(logp, k) if k else (logp[:, :0], torch.zeros(len(rows), 0, dtype=torch.int64,
                                                                          device=logp.device))
    return tokens, Logprobs(rows, chosen, values, ids)


def _penalized_and_masked(logits: torch.Tensor, seqs: list[Sequence], upload: Callable) -> torch.Tensor:
    """The logits the draw reads: the rows' penalties (then float32, as the host sampler) and masks
    applied, on a copy; the logits themselves where no row has either."""
    live = [(i, s) for i, s in enumerate(seqs) if not s.finished]
    penalized = [(i, s) for i, s in live if s.params.penalized]
    masks = [(i, m) for i, s in live if s.constraint is not None
             for m in [s.constraint.allowed()] if m is not None and bool(m.any())]
    if not penalized and not masks:
        return logits
    out = logits.to(torch.float32, copy=True) if penalized else logits.clone()   # logprobs read the logits
    if penalized:
        _apply_penalties(out, penalized, upload)
    if masks:
        index = upload(torch.tensor([i for i, _ in masks]))
        allowed = upload(torch.stack([m for _, m in masks]))
        out.index_copy_(0, index, out.index_select(0, index).masked_fill(~allowed, float("-inf")))
    return out


def _apply_penalties(out: torch.Tensor, penalized: list[tuple[int, Sequence]], upload: Callable) -> None:
    """sampling.apply_penalties on the device, every penalized row at once: the repetition penalty over
    the prompt's and output's tokens, then presence + frequency x count subtracted over the output's (the
    subtrahends computed here in float32 as there)."""
    rep_rows, rep_ids, rep_by = [], [], []
    sub_rows, sub_ids, sub_by = [], [], []
    for i, s in penalized:
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = s.seen_ids()   # any order: each id once
            rep_rows += [i] * len(seen)
            rep_ids.append(torch.from_numpy(np.fromiter(seen, dtype=np.int64, count=len(seen))))
            rep_by.append(torch.full((len(seen),), p.repetition_penalty, dtype=torch.float32))
        if s.output_ids and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(s.output_ids, dtype=torch.long).unique(return_counts=True)
            sub_rows += [i] * len(ids)
            sub_ids.append(ids)
            sub_by.append(p.presence_penalty + p.frequency_penalty * counts.float())
    if rep_rows:
        where = (upload(torch.tensor(rep_rows)), upload(torch.cat(rep_ids)))
        by = upload(torch.cat(rep_by))
        vals = out[where]
        out[where] = torch.where(vals > 0, vals / by, vals * by)
    if sub_rows:
        where = (upload(torch.tensor(sub_rows)), upload(torch.cat(sub_ids)))
        out[where] = out[where] - upload(torch.cat(sub_by))
