"""runtime/step_sampling.py against the host sampler (sampling.sample_row / apply_penalties): the same
penalized and masked logits, bit for bit, and the same tokens and logprobs, rows of any kind side by side."""
from types import SimpleNamespace

import pytest
import torch

from engc.runtime import step_sampling
from engc.runtime.sampling import SamplingParams, apply_penalties, sample_row
from engc.runtime.sequence import Sequence, Status

V = 300


class Mask:
    def __init__(self, allowed):
        self.mask = allowed

    def allowed(self):
        return self.mask


def seq(params, prompt, output, mask=None, finished=False):
    s = Sequence(list(prompt), params)
    s.output_ids, s.constraint = list(output), None if mask is None else Mask(mask)
    if finished:
        s.status = Status.FINISHED
    return s


def rows_of_every_kind():
    g = torch.Generator().manual_seed(0)
    some = torch.rand(V, generator=g) < 0.2
    return [seq(SamplingParams(temperature=0), [5, 6, 7], [8, 9]),
            seq(SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=3), [1, 2, 3, 2, 250], [4, 4, 9]),
            seq(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=-0.7), [10], [11, 11, 12, 11]),
            seq(SamplingParams(temperature=0, repetition_penalty=0.6, presence_penalty=-1.5, frequency_penalty=2,
                               logprobs=0), list(range(40)), [3, 3, 299]),
            seq(SamplingParams(temperature=0, json_object=True, logprobs=2), [1], [2], mask=some),
            seq(SamplingParams(temperature=0, json_object=True, repetition_penalty=1.1), [1], [2, 3], mask=some),
            seq(SamplingParams(temperature=0, json_object=True), [1], [], mask=torch.zeros(V, dtype=torch.bool))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_and_masks_match_the_host_sampler_bit_for_bit(dtype):
    seqs = rows_of_every_kind()
    logits = (torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    got = step_sampling._penalized_and_masked(logits, seqs, lambda t: t)
    for i, s in enumerate(seqs):
        want = apply_penalties(logits[i].float().clone(), s.params, s.prompt_ids, s.output_ids)
        if s.constraint is not None and bool(s.constraint.mask.any()):
            want.masked_fill_(~s.constraint.mask, float("-inf"))
        assert torch.equal(got[i], want), i
    assert got.dtype == torch.float32   # a row has penalties: all in float32, as on the host


def test_tokens_and_logprobs_match_the_host_sampler():
    seqs = rows_of_every_kind() + [seq(SamplingParams(temperature=0, logprobs=5), [1], [2], finished=True)]
    logits = (torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    tokens, logprobs = step_sampling.sample(logits, seqs, lambda x, _: x.argmax(-1), lambda t: t)
    samples = [SimpleNamespace(token=t) for t in tokens.tolist()]
    logprobs.fill(samples, seqs)
    for i, s in enumerate(seqs[:-1]):
        want = sample_row(logits[i].float(), s.params, s.prompt_ids, s.output_ids, s.generator,
                          s.constraint.allowed() if s.constraint else None)
        assert samples[i].token == want.token, i
        if s.params.logprobs is not None:
            assert (samples[i].logprob, samples[i].top) == (want.logprob, want.top), i
    assert logprobs.rows == [1, 3, 4, 7] and len(samples[7].top) == 5


def test_rows_without_extras_leave_the_logits_alone():
    seqs = [seq(SamplingParams(temperature=0), [1], [2]), seq(SamplingParams(temperature=0.7), [1], [])]
    logits = torch.randn(2, V)
    assert step_sampling._penalized_and_masked(logits, seqs, lambda t: t) is logits
    assert not any(step_sampling.follows_last_token(s) for s in seqs)
    assert step_sampling.follows_last_token(rows_of_every_kind()[2])


def test_seen_ids_follow_the_output():
    s = seq(SamplingParams(temperature=0, repetition_penalty=1.2), [1, 2, 2, 3], [4])
    assert s.seen_ids() == {1, 2, 3, 4}
    s.output_ids += [9, 1]
    assert s.seen_ids() == {1, 2, 3, 4, 9}
