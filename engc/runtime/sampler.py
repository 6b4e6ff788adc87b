"""The sampler: a step's logits and their sequences in, one token a row (and logprobs where asked) out.

Sampler.sample is the one entry point, with two implementations: DeviceSampler draws where the logits are
(an argmax, or on a GPU the bundle's sampling kernel: one uniform a sampled row, counter-based on the sequence's
key (sampling.uniforms), so a seeded row draws the same way whatever shares its batch); HostSampler draws on
the host row by row (sample_row, from the sequence's torch generator), for the rows no device sampler takes
(non-greedy rows on a CPU engine).

Logits processors run before the draw, on a copy: repetition, presence and frequency penalties (in float32
on the row's float32 logits, the host sampler's arithmetic, so a greedy row takes the same token on either
path) and grammar masks (runtime/constrained; ignored where they allow nothing). Logprobs are the model's
distribution's, before processors. Processors follow the sequence's last token (follows_last_token), so the engine samples a
step with such a row only once the step before it is read; logprobs do not.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, compress
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

from engc.kernels import argmax, sampling
from engc.runtime.constrained import Constraint, fill_masks, mask_words, unpack
from engc.runtime.sampling import Sampled, SamplingParams, uniforms
from engc.runtime.sequence import Sequence
from engc.runtime.transfers import upload

if TYPE_CHECKING:
    from engc.runtime.gpu_ops import BundleKernels

Upload = Callable[[torch.Tensor], torch.Tensor]   # a host tensor on the logits' device, without waiting


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


@dataclass
class HostLogprobs:
    """Logprobs the host sampler computed row by row (Logprobs' interface)."""
    samples: list[Sampled]

    def copied(self, copy) -> HostLogprobs:
        return self

    def fill(self, samples: list[Sampled], seqs: list[Sequence]) -> None:
        for i, s in enumerate(self.samples):
            if seqs[i].params.logprobs is not None:
                samples[i] = s


# --- logits processors -------------------------------------------------------------------------------

class Penalties:
    """sample_row's apply_penalties, every penalized row at once: the repetition penalty over the prompt's
    and output's tokens, then presence + frequency x count subtracted over the output's (the subtrahends
    computed in float32 as there)."""
    float32 = True

    @staticmethod
    def rows(live: list[tuple[int, Sequence]]) -> list[tuple[int, Sequence]]:
        return [(i, s) for i, s in live if s.params.penalized]

    @staticmethod
    def apply(out: torch.Tensor, penalized: list[tuple[int, Sequence]], up: Upload) -> None:
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
            where = (up(torch.tensor(rep_rows)), up(torch.cat(rep_ids)))
            by = up(torch.cat(rep_by))
            vals = out[where]
            out[where] = torch.where(vals > 0, vals / by, vals * by)
        if sub_rows:
            where = (up(torch.tensor(sub_rows)), up(torch.cat(sub_ids)))
            out[where] = out[where] - up(torch.cat(sub_by))


class GrammarMasks:
    """The constraints' masks of allowed tokens: every row's bitmask filled on the host at once (llguidance's
    threads, without the GIL), uploaded as bits and unpacked where the logits are. A mask that allows nothing
    is ignored (the token drawn then ends the output: OutputProcessor)."""
    float32 = False

    @staticmethod
    def rows(live: list[tuple[int, Sequence]]) -> list[tuple[int, Constraint]]:
        return [(i, s.constraint) for i, s in live if s.constraint is not None]

    @staticmethod
    def apply(out: torch.Tensor, rows: list[tuple[int, Constraint]], up: Upload) -> None:
        constraints = [c for _, c in rows]
        bits = torch.empty((len(rows), mask_words(constraints[0].size)), dtype=torch.int32)
        fill_masks(constraints, bits)
        some = bits.ne(0).any(1)
        if not bool(some.all()):
            bits, rows = bits[some], [r for r, ok in zip(rows, some.tolist()) if ok]
            if not rows:
                return
        index = up(torch.tensor([i for i, _ in rows]))
        allowed = unpack(up(bits), out.shape[1])
        out.index_copy_(0, index, out.index_select(0, index).masked_fill(~allowed, float("-inf")))


PROCESSORS = (Penalties, GrammarMasks)


def processed(logits: torch.Tensor, seqs: list[Sequence], up: Upload) -> torch.Tensor:
    """The logits the draw reads: the processors applied to the live rows on a copy (float32 where a row is
    penalized, as on the host); the logits themselves where no processor has a row."""
    # every processor's rows follow their last token: the others are left out at once (most rows, most steps)
    live = [(i, s) for i, s in enumerate(seqs) if follows_last_token(s) and not s.finished]
    work = [(p, rows) for p in PROCESSORS if live and (rows := p.rows(live))]
    if not work:
        return logits
    float32 = any(p.float32 for p, _ in work)
    out = logits.to(torch.float32, copy=True) if float32 else logits.clone()   # logprobs read the logits
    for p, rows in work:
        p.apply(out, rows, up)
    return out


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence], up: Upload
                ) -> Logprobs | None:
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    index = up(torch.tensor(rows))
    logp = torch.log_softmax(logits.index_select(0, index).float(), -1)
    chosen = logp.gather(1, tokens.index_select(0, index)[:, None])[:, 0]
    k = max(seqs[i].params.logprobs for i in rows)
    values, ids = torch.topk(logp, k) if k else (logp[:, :0], torch.zeros(len(rows), 0, dtype=torch.int64,
                                                                          device=logp.device))
    return Logprobs(rows, chosen, values, ids)


# --- the two samplers -------------------------------------------------------------------------------

class Sampler(Protocol):
    """What DeviceSampler and HostSampler both are."""

    def takes(self, seq: Sequence) -> bool:
        """Whether this sampler can sample the sequence's row."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]
               ) -> tuple[torch.Tensor, Logprobs | HostLogprobs | None]:
        """One token a row ([rows] int64) and the logprobs of the rows that asked for them."""


class DeviceSampler:
    """Samples where the logits are. kernels: the bundle's argmax and sampling kernels (a GPU whose bundle
    has them), else torch's argmax, which takes greedy rows only."""

    def __init__(self, kernels: SamplingKernels | None = None):
        self.kernels = kernels

    def takes(self, seq: Sequence) -> bool:
        return seq.params.greedy or self.kernels is not None

    def takes_all(self, seqs: list[Sequence]) -> bool:
        return self.kernels is not None or all(s.params.greedy for s in seqs)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], draws: np.ndarray | None = None
               ) -> tuple[torch.Tensor, Logprobs | None]:
        """(tokens [rows] int64, logprobs or None) where the logits are; nothing here waits for the GPU.
        draws: the rows' parameter_block where one was made for them already."""
        def up(t):
            return upload(t, logits.device)
        tokens = self.draw(processed(logits, seqs, up), seqs, draws)
        return tokens, logprobs_of(logits, tokens, seqs, up)

    def draw(self, logits: torch.Tensor, seqs: list[Sequence], draws: np.ndarray | None = None) -> torch.Tensor:
        """One argmax when every row is greedy, else the sampling kernel."""
        if all(s.params.greedy for s in seqs):
            return self.kernels.greedy(logits) if self.kernels is not None else logits.argmax(-1)
        return self.kernels(logits, seqs, draws)


class HostSampler:
    """Samples on the host, row by row (sample_row): what a device sampler does not take."""

    @staticmethod
    def takes(seq: Sequence) -> bool:
        return True

    @staticmethod
    def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, HostLogprobs | None]:
        rows = logits.float().cpu()
        samples = [sample_row(row, s.params, s.prompt_ids, s.output_ids, s.generator,
                              s.constraint.allowed() if s.constraint else None) for row, s in zip(rows, seqs)]
        logprobs = HostLogprobs(samples) if any(s.params.logprobs is not None for s in seqs) else None
        return torch.tensor([s.token for s in samples], dtype=torch.int64), logprobs


def sample_now(logits: torch.Tensor, seqs: list[Sequence], device: DeviceSampler) -> list[Sampled | None]:
    """A step with rows only the host sampler takes: those rows' logits go to the host and are sampled
    there; the others are sampled by `device`, as in a step without such rows. None for finished rows."""
    samples: list[Sampled | None] = [None] * len(seqs)
    live = [i for i, s in enumerate(seqs) if not s.finished]
    for sampler, rows in ((device, [i for i in live if device.takes(seqs[i])]),
                          (HostSampler, [i for i in live if not device.takes(seqs[i])])):
        if not rows:
            continue
        chosen = [seqs[i] for i in rows]
        tokens, logprobs = sampler.sample(logits.index_select(0, torch.tensor(rows, device=logits.device)),
                                          chosen)
        part = [Sampled(t) for t in tokens.tolist()]
        if logprobs is not None:
            logprobs.copied(torch.Tensor.cpu).fill(part, chosen)
        for i, s in zip(rows, part):
            samples[i] = s
    return samples


# --- the host sampler's rows -------------------------------------------------------------------------

def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]):
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.float()
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Temperature-scaled logits with top-k, then top-p, then min-p applied (-inf where dropped), the order of
    Hugging Face transformers' warpers and of the sampling kernel (kernels/sampling). min-p keeps the tokens
    whose probability is at least min_p times the likeliest token's; top-k and top-p always keep that token,
    so the ratio is the same whether min-p comes before or after them."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p; the first token always stays, also
        # where top_p is below float32's smallest number (1e-300 compares as 0, which would drop them all)
        drop = (cum - torch.softmax(sorted_logits, -1)) >= top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    if min_p > 0.0:
        logits = logits.masked_fill(torch.exp(logits - logits.max()) < min_p, float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
               generator: torch.Generator, allowed: torch.Tensor | None = None) -> Sampled:
    """One token for a row of logits. allowed: a bool mask of the tokens it may be (a grammar's, as wide as the
    logits or wider); logprobs stay those of the model's distribution."""
    raw = logits
    logits = apply_penalties(logits.clone(), p, prompt, output)
    if allowed is not None and bool(allowed.any()):
        logits.masked_fill_(~allowed[:logits.shape[-1]], float("-inf"))
    if p.greedy or not torch.isfinite(logits.max()):   # NaN (torch's max is NaN then), +inf, or all -inf:
        token = int(torch.argmax(logits))                # nothing to draw from; argmax is still a valid id
    else:
        logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
    if p.logprobs is None:
        return Sampled(token)
    logp = torch.log_softmax(raw.float(), -1)
    top = torch.topk(logp, p.logprobs) if p.logprobs else None
    return Sampled(token, float(logp[token]),
                   [(int(i), float(v)) for v, i in zip(top.values, top.indices)] if top else [])


# --- the GPU's kernels -------------------------------------------------------------------------------

class SamplingKernels:
    """The bundle's argmax and sampling kernels (temperature, top-k, top-p and min-p per row). Only the row
    parameters and one uniform draw per row cross to the device, and one token id per row comes back,
    instead of a [batch, vocab] float32 block (32 MB a step at batch 64 for a 128k vocab)."""

    def __init__(self, kernels: BundleKernels, device: torch.device):
        self.kernels = kernels
        self.device = device

    def greedy(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Argmax per row, [rows] int64 on the device (the bundle's split kernel: torch.argmax gives a row to
        one block), into
        out where given (a decode graph's last_tokens)."""
        if out is None:
            out = torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
        if "argmax" not in self.kernels.consts:
            return torch.argmax(logits, -1, out=out)
        self.kernels.run("argmax", argmax.launch(logits.contiguous(), out, self.kernels.consts["argmax"]))
        return out

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], draws: np.ndarray | None = None) -> torch.Tensor:
        """The sampled ids, [len(seqs)] int64 on the device; nothing here waits for the GPU. draws: the rows'
        parameter_block where one was made for them already (each makes the rows' next uniforms)."""
        params = upload(torch.from_numpy(parameter_block(seqs) if draws is None else draws), self.device)
        # the block's rows are the kernel's arguments as they are: views, no device work before the launch
        temperature, top_p, uniform, min_p = params[0], params[2], params[3], params[4]
        top_k = params[1].view(torch.int32)   # the int32 bits parameter_block wrote
        out = torch.empty(len(seqs), dtype=torch.int64, device=self.device)
        self.draw(logits, temperature, top_k, top_p, uniform, min_p, out)
        return out

    def draw(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             uniform: torch.Tensor, min_p: torch.Tensor, out: torch.Tensor) -> None:
        """The sampling kernels over rows whose parameters are on the device (uploaded, or staged with a decode
        graph's inputs), the tokens into out."""
        # the kernels' workspaces come from the caching allocator: no host sync, and a graph keeps its own
        self.kernels.run("sampling", sampling.launch(logits.contiguous(), temperature, top_k, top_p, uniform,
                                                     min_p, out, self.kernels.consts["sampling"]))


# a padding column: temperature 1, top_k 0 (int32 0 has float32 0.0's bits), top_p 1, no draw, min_p 0
_PADDING = np.array([[1.0], [0.0], [1.0], [0.0], [0.0]], dtype=np.float32)


def parameter_block(seqs: list[Sequence]) -> np.ndarray:
    """The sampling kernel's row parameters as it reads them, one block to upload: [5, rows padded to a
    multiple of 4] float32, its rows temperature, top_k (int32 bits), top_p, the uniform draws, min_p.

    Padded so that each parameter's row starts 16 bytes aligned, as the kernel assumes (BundleKernels.run
    refuses a misaligned argument; unpadded, one sequence's block would put top_p 8 bytes off)."""
    n = len(seqs)
    block = np.empty((5, n + -n % 4), dtype=np.float32)
    block[:, n:] = _PADDING
    settings = np.fromiter(chain.from_iterable([s.params.kernel_row for s in seqs]), dtype=np.float64,
                           count=4 * n).reshape(n, 4)
    block[0, :n], block[2, :n], block[4, :n] = settings[:, 0], settings[:, 2], settings[:, 3]
    block[1].view(np.int32)[:n] = settings[:, 1]
    block[3, :n] = draw_uniforms(seqs)
    return block


def draw_uniforms(seqs: list[Sequence]) -> np.ndarray:
    """[len(seqs)] float32: a sampled row's next uniform (sampling.uniforms of its draw_key and draws, which
    then counts it); 0 for a greedy row, which draws nothing."""
    sampled = [not s.params.greedy for s in seqs]
    drawing = list(compress(seqs, sampled))
    keys = np.fromiter([s.draw_key for s in drawing], dtype=np.uint64, count=len(drawing))
    counts = np.fromiter([s.draws for s in drawing], dtype=np.uint64, count=len(drawing))
    for s in drawing:
        s.draws += 1
    drawn = uniforms(keys, counts)
    if len(drawing) == len(seqs):
        return drawn
    out = np.zeros(len(seqs), dtype=np.float32)
    out[np.array(sampled, dtype=bool)] = drawn
    return out
