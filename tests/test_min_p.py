"""min-p end to end on the host: SamplingParams, the host sampler's filter (runtime/sampler.filter_logits), the
sampling kernel's torch reference (kernels/sampling.sample_row) and the CLI option. Both samplers keep the
tokens whose probability is at least min_p times the likeliest's, after top-k and top-p; the reference draws
only those, and every one of them for some uniform."""
import pytest
import torch
from click.testing import CliRunner

from engc.kernels import sampling as kernel_ref
from engc.runtime.sampler import filter_logits
from engc.runtime.sampling import SamplingParams

V = 200


def _kept_by_rule(s: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The documented order written out over a sorted row: top-k, then top-p over what top-k kept, then min-p
    against the likeliest token."""
    order = torch.argsort(s, descending=True, stable=True)
    kept = order[:top_k] if top_k else order
    probs = torch.softmax(s[kept], 0)
    before = torch.cumsum(probs, 0) - probs
    kept = kept[before < top_p] if top_p < 1 else kept
    return {int(i) for i in kept if torch.exp(s[i] - s.max()) >= min_p}


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.05), (0, 1.0, 0.3), (40, 1.0, 0.02), (0, 0.9, 0.1),
                                               (30, 0.95, 0.05), (0, 1.0, 1.0), (0, 1.0, 0.0)])
def test_the_host_filter_and_the_kernel_reference_keep_the_documented_tokens(top_k, top_p, min_p):
    s = torch.randn(V, generator=torch.Generator().manual_seed(top_k + int(100 * min_p))) * 2.5
    want = _kept_by_rule(s, top_k, top_p, min_p)
    assert 0 < len(want) < V or min_p == 0
    host = {int(i) for i in torch.nonzero(torch.isfinite(filter_logits(s.clone(), top_k, top_p, min_p)))}
    assert host == want
    # the reference's draws over a fine grid of uniforms: only kept tokens, and all of them
    drawn = {kernel_ref.sample_row(s, 1.0, top_k, top_p, (j + 0.5) / 20000, min_p) for j in range(20000)}
    assert drawn <= want
    probs = torch.softmax(s, 0)
    assert {i for i in want if probs[i] / probs[list(want)].sum() > 2 / 20000} <= drawn


def test_min_p_of_one_keeps_only_the_likeliest_token():
    s = torch.randn(V, generator=torch.Generator().manual_seed(9))
    best = int(torch.argmax(s))
    assert all(kernel_ref.sample_row(s, 1.3, 0, 1.0, u, 1.0) == best for u in (0.0, 0.3, 0.99))
    assert torch.isfinite(filter_logits(s, 0, 1.0, 1.0)).sum() == 1


def test_the_batch_reference_reads_min_p_per_row():
    s = torch.randn(2, V, generator=torch.Generator().manual_seed(4))
    args = (s, torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2), torch.full((2,), 0.7))
    off = kernel_ref.sample(*args)
    assert torch.equal(off, kernel_ref.sample(*args, torch.zeros(2)))
    only_best = kernel_ref.sample(*args, torch.tensor([1.0, 0.0]))
    assert only_best.tolist() == [int(torch.argmax(s[0])), int(off[1])]


@pytest.mark.parametrize("min_p,ok", [(0.0, True), (0.5, True), (1.0, True), (-0.1, False), (1.01, False)])
def test_params_refuse_a_min_p_outside_0_1(min_p, ok):
    p = SamplingParams(min_p=min_p)
    if ok:
        p.validate()
        assert p.device_sampleable
    else:
        with pytest.raises(ValueError, match="min_p must be in"):
            p.validate()


def test_generate_and_chat_take_min_p():
    from engc.cli import main
    for command in ("generate", "chat"):
        result = CliRunner().invoke(main, [command, "--help"])
        assert "--min-p" in result.output, result.output
    result = CliRunner().invoke(main, ["generate", "nowhere", "--prompt", "x", "--min-p", "1.5"])
    assert result.exit_code != 0 and "--min-p" in result.output
