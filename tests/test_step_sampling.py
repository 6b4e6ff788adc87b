"""runtime/sampler.py's DeviceSampler against the host sampler (sample_row / apply_penalties): the same
penalized and masked logits, bit for bit, and the same tokens and logprobs, rows of any kind side by side;
grammar masks go through llguidance's bitmask form and back (constrained.unpack)."""
from types import SimpleNamespace

import pytest
import torch

from engc.runtime import constrained, sampler
from engc.runtime.sampler import DeviceSampler, HostSampler, apply_penalties, sample_row
from engc.runtime.sampling import SamplingParams
from engc.runtime.sequence import Sequence, Status

V = 300
OBJECT = constrained.json_object()   # the rows' own masks stand in for its


class Mask:
    """A constraint with a given mask (constrained.Constraint's interface as the samplers read it)."""
    def __init__(self, allowed):
        self.mask, self.size = allowed, len(allowed)

    def allowed(self):
        return self.mask


def pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as llguidance's bitmask: bit j of int32 word w is id 32 w + j."""
    bits = torch.zeros(-(-len(mask) // 32) * 32, dtype=torch.int64)
    bits[:len(mask)] = mask.long()
    words = (bits.view(-1, 32) << torch.arange(32)).sum(1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


@pytest.fixture(autouse=True)
def given_masks(monkeypatch):
    """GrammarMasks fills its bitmasks from the fake constraints' masks, as llguidance fills them."""
    def fill(constraints, out):
        for i, c in enumerate(constraints):
            out[i] = pack(c.mask)
    monkeypatch.setattr(sampler, "fill_masks", fill)


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
            seq(SamplingParams(temperature=0, grammar=OBJECT, logprobs=2), [1], [2], mask=some),
            seq(SamplingParams(temperature=0, grammar=OBJECT, repetition_penalty=1.1), [1], [2, 3], mask=some),
            seq(SamplingParams(temperature=0, grammar=OBJECT), [1], [], mask=torch.zeros(V, dtype=torch.bool))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_and_masks_match_the_host_sampler_bit_for_bit(dtype):
    seqs = rows_of_every_kind()
    logits = (torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    got = sampler.processed(logits, seqs, lambda t: t)
    for i, s in enumerate(seqs):
        want = apply_penalties(logits[i].float().clone(), s.params, s.prompt_ids, s.output_ids)
        if s.constraint is not None and bool(s.constraint.mask.any()):
            want.masked_fill_(~s.constraint.mask, float("-inf"))
        assert torch.equal(got[i], want), i
    assert got.dtype == torch.float32   # a row has penalties: all in float32, as on the host


def test_tokens_and_logprobs_match_the_host_sampler():
    seqs = rows_of_every_kind() + [seq(SamplingParams(temperature=0, logprobs=5), [1], [2], finished=True)]
    logits = (torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    tokens, logprobs = DeviceSampler().sample(logits, seqs)
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
    assert sampler.processed(logits, seqs, lambda t: t) is logits
    assert not any(sampler.follows_last_token(s) for s in seqs)
    assert sampler.follows_last_token(rows_of_every_kind()[2])


def test_seen_ids_follow_the_output():
    s = seq(SamplingParams(temperature=0, repetition_penalty=1.2), [1, 2, 2, 3], [4])
    assert s.seen_ids() == {1, 2, 3, 4}
    s.output_ids += [9, 1]
    assert s.seen_ids() == {1, 2, 3, 4, 9}


def test_host_and_device_samplers_share_one_interface_and_agree():
    """HostSampler (row by row, on the host) gives the tokens and logprobs the DeviceSampler gives greedy
    rows of every kind, through the same sample(logits, seqs) -> (tokens, logprobs)."""
    seqs = rows_of_every_kind()
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(3)) * 4
    got = []
    for s in (DeviceSampler(), HostSampler()):
        tokens, logprobs = s.sample(logits, seqs)
        samples = [SimpleNamespace(token=t) for t in tokens.tolist()]
        logprobs.copied(torch.Tensor.cpu).fill(samples, seqs)
        got.append([(x.token, getattr(x, "logprob", None), getattr(x, "top", None)) for x in samples])
    assert got[0] == got[1]
    assert all(HostSampler.takes(s) for s in seqs) and all(DeviceSampler().takes(s) for s in seqs)


def test_sample_now_sends_only_the_rows_the_device_cannot_take_to_the_host():
    """Without sampling kernels a seeded row goes to the host sampler (the draws of sample_row from its own
    generator); the greedy rows beside it are the device sampler's; a finished row gets nothing."""
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    seqs = [seq(SamplingParams(temperature=0, logprobs=2), [1], [2]), seq(params, [1, 2], [3]),
            seq(SamplingParams(temperature=0), [1], [], finished=True)]
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(4))
    device = DeviceSampler()
    assert [device.takes(s) for s in seqs] == [True, False, True]
    got = sampler.sample_now(logits, seqs, device)
    want = sample_row(logits[1].clone(), params, [1, 2], [3], seq(params, [1, 2], [3]).generator)
    assert got[1].token == want.token and got[2] is None
    tokens, logprobs = device.sample(logits[:1], seqs[:1])
    assert got[0].token == int(tokens[0]) and len(got[0].top) == 2


def test_bitmasks_unpack_to_the_masks_llguidance_computes():
    """fill_masks (llguidance's threads) and unpack give each row the mask its Constraint.allowed gives,
    over a vocabulary wider than one word and not a multiple of 32."""
    from grammar_check import vocab
    voc = vocab(("ab", "abc", "12", " "))
    rows = [constrained.Constraint(voc, g) for g in (constrained.regex("[a-c]+1?"), constrained.choice(["ab", "12"]),
                                                     constrained.json_object())]
    rows[0].take(ord("a"))
    bits = torch.zeros(len(rows), constrained.mask_words(voc.vocab_size), dtype=torch.int32)
    constrained.fill_masks(rows, bits)
    got = constrained.unpack(bits, voc.vocab_size)
    assert voc.vocab_size % 32 and got.shape == (3, voc.vocab_size)
    for i, c in enumerate(rows):
        assert torch.equal(got[i], c.allowed()) and got[i].any(), i
    assert torch.equal(pack(got[2]), bits[2])   # the test's packing is llguidance's
