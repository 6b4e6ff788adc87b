"""Prompt logprobs (runtime/scoring.py) against HF float32 on a tiny model: whole prefills, chunked prefills,
a step's row cap, a prompt the prefix cache holds, preemption by recompute; and the server's forms of them:
`echo` with `logprobs` (streamed too), `max_tokens: 0` (scoring only) and vLLM's `prompt_logprobs`."""
import httpx
import pytest
import torch

from engc.runtime import scoring
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams

torch.set_num_threads(1)
TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
        "Hello, world! How are you today?")


@pytest.fixture(scope="module")
def model(tiny_bundle):
    return load(tiny_bundle("llama"))


@pytest.fixture(scope="module")
def reference(tiny_dir, model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir("llama"), dtype=torch.float32).eval()
    ids = model.tokenizer.encode(TEXT)
    with torch.no_grad():
        return ids, torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def check(seq, reference, k):
    ids, ref = reference
    lp = seq.prompt_logprobs
    assert len(lp) == len(ids) and lp[0] is None
    for i in range(1, len(ids)):
        row, s = ref[i - 1], lp[i]
        assert s.token == ids[i]
        assert abs(s.logprob - float(row[ids[i]])) < 1e-4
        assert s.rank == int((row > row[ids[i]]).sum()) + 1
        assert [t for t, _ in s.top] == row.topk(k).indices.tolist()


@pytest.mark.parametrize("config,rows", [(EngineConfig(), 512), (EngineConfig(max_batched_tokens=7), 512),
                                         (EngineConfig(), 5)], ids=["whole", "chunked", "row-cap"])
def test_prompt_logprobs_equal_hf(model, reference, config, rows, monkeypatch):
    monkeypatch.setattr(scoring, "MAX_ROWS", rows)
    engine = Engine(model, config)
    ids = reference[0]
    engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0))   # the prefix cache now holds the prompt
    engine.run_to_completion()
    seqs = [engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)) for _ in range(2)]
    plain = engine.add_request(ids, SamplingParams(max_tokens=3, temperature=0))
    engine.run_to_completion()
    for seq in seqs:
        check(seq, reference, 3)
        assert seq.num_cached_tokens == 0 and seq.output_ids == plain.output_ids
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs == []
    engine.check_integrity()


def test_prompt_logprobs_survive_preemption(model, reference):
    engine = Engine(model, EngineConfig(num_blocks=8, max_batched_tokens=16))   # 128 tokens for two of 87
    ids = reference[0]
    seqs = [engine.add_request(ids, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=2))
            for _ in range(2)]
    engine.run_to_completion()
    assert engine.scheduler.num_preemptions > 0
    for seq in seqs:
        check(seq, reference, 2)
        assert len(seq.output_ids) == 20


def complete(srv, **body):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs(srv, reference):
    ids, ref = reference
    tok = srv.engine.engine.model.tokenizer
    scored = complete(srv, prompt=TEXT, max_tokens=0, echo=True, logprobs=1)   # as lm-eval scores
    choice = scored["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) < 1e-4
        assert list(lp["top_logprobs"][i].values()) == pytest.approx([float(ref[i - 1].max())], abs=1e-4)
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]

    generated = complete(srv, prompt=ids, max_tokens=3, echo=True, logprobs=2)["choices"][0]
    plain = complete(srv, prompt=ids, max_tokens=3, logprobs=2)["choices"][0]
    assert generated["text"] == tok.decode(ids, skip_special_tokens=False) + plain["text"]
    assert generated["logprobs"]["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"],
                                                                               abs=1e-5)   # another batch shape
    assert len(generated["logprobs"]["tokens"]) == len(ids) + 3

    chunks = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": TEXT, "max_tokens": 3,
                                                            "temperature": 0, "echo": True, "stream": True}).text
    texts = [c["choices"][0]["text"] for c in map(_json, chunks.split("\n\n")) if c and c.get("choices")]
    assert texts[0] == TEXT and "".join(texts) == TEXT + plain["text"]


def test_vllm_prompt_logprobs(srv, reference):
    ids, ref = reference
    choice = complete(srv, prompt=ids, max_tokens=1, prompt_logprobs=2)["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        entry = entries[i]
        assert entry[str(ids[i])]["rank"] == int((row > row[ids[i]]).sum()) + 1
        assert abs(entry[str(ids[i])]["logprob"] - float(row[ids[i]])) < 1e-4
        top = row.topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]
    assert choice["text"] and "logprobs" in choice and choice["logprobs"] is None


@pytest.mark.parametrize("body,param", [({"max_tokens": 0}, "max_tokens"),
                                        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                                        ({"prompt_logprobs": 21}, "prompt_logprobs")])
def test_scoring_requests_it_refuses(srv, body, param):
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _json(event: str):
    import json
    data = event.removeprefix("data: ").strip()
    return json.loads(data) if data and data != "[DONE]" else None
