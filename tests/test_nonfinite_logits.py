"""Logits with NaN or inf (a model that overflows, a damaged weight) still give every row a token id of the
vocabulary, greedy or sampled: an id outside it would fail the next step's embedding gather (on the GPU a
device-side assert that stops the engine). Such a row takes its argmax, a NaN counting as the maximum."""
from __future__ import annotations

import torch

from engc.kernels import sampling as kernel_ref
from engc.runtime.engine import Engine
from engc.runtime.loader import load
from engc.runtime.sampler import sample_row
from engc.runtime.sampling import SamplingParams, make_generator

V = 50


def _rows():
    nan = torch.randn(V)
    nan[17] = float("nan")
    inf = torch.randn(V)
    inf[33] = float("inf")
    return {"nan": (nan, 17), "all_nan": (torch.full((V,), float("nan")), 0), "inf": (inf, 33),
            "all_neg_inf": (torch.full((V,), float("-inf")), 0)}


def test_host_sampler_takes_the_argmax_of_a_row_with_nothing_to_draw_from():
    for name, (logits, want) in _rows().items():
        for p in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=10, top_p=0.9)):
            got = sample_row(logits, p, [1, 2], [3], make_generator(0)).token
            assert got == want, (name, p, got)


def test_kernel_reference_takes_the_argmax_too():
    for name, (logits, want) in _rows().items():
        for t, k, top_p in ((0.0, 0, 1.0), (0.8, 10, 0.9), (1.5, 0, 1.0)):
            assert kernel_ref.sample_row(logits, t, k, top_p, 0.5) == want, (name, t)


def test_logprobs_go_out_as_json_numbers():
    import json
    import math
    from engc.runtime.server.openai import json_logprob
    assert [json_logprob(v) for v in (-1.5, float("-inf"), float("nan"), 0.0)] == [-1.5, -9999.0, -9999.0, 0.0]
    json.dumps([json_logprob(float("nan"))], allow_nan=False)   # what the JSON response encoder demands
    assert not math.isnan(json_logprob(float("nan")))


def test_engine_keeps_decoding_when_the_logits_turn_nan(tiny_bundle):
    model = load(tiny_bundle("llama"))
    model.executor.weights["norm.weight"] = torch.full_like(model.executor.weights["norm.weight"], float("nan"))
    engine = Engine(model)
    seqs = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=t, ignore_eos=True, seed=1))
            for t in (0.0, 0.9)]
    engine.run_to_completion()
    for s in seqs:
        assert len(s.output_ids) == 4 and all(0 <= t < model.config.vocab_size for t in s.output_ids), s.output_ids


def test_server_answers_with_logprobs_when_the_logits_turn_nan(tiny_bundle):
    import httpx
    from live_server import LiveServer
    with LiveServer(tiny_bundle("llama")) as s:
        weights = s.engine.engine.model.executor.weights
        weights["norm.weight"] = torch.full_like(weights["norm.weight"], float("nan"))
        for path, body in (("/v1/completions", {"prompt": "hi", "logprobs": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "logprobs": True, "top_logprobs": 2})):
            r = httpx.post(s.url + path, json={"model": s.model, "max_tokens": 3, "temperature": 0.7, **body},
                           timeout=60)
            assert r.status_code == 200, r.text
            assert "NaN" not in r.text and "-9999.0" in r.text
