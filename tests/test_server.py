"""The HTTP server on a tiny model: official SDKs, concurrency, prefix cache, disconnects, KV exhaustion,
bad requests, auth, health/metrics/openapi. Loopback only; the server runs in this process."""
import asyncio
import json

import anthropic
import httpx
import openai
import pytest
import torch

from engc.runtime.engine import EngineConfig
from live_server import LiveServer

torch.set_num_threads(1)  # tiny models: threads only contend

LONG = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
        "Hello, world! How are you today? engc compiles models ahead of time. ")


def tok(srv):
    return srv.engine.engine.model.tokenizer


def assert_clean(srv):
    stats = srv.wait_idle()
    srv.call(lambda e: e.check_integrity())
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_openai_sdk_chat_and_completions(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    prompt_len = len(tok(srv).encode_chat(messages))
    r = client.chat.completions.create(model=srv.model, messages=messages, max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 7, prompt_len + 7)

    chunks = list(client.chat.completions.create(model=srv.model, messages=messages, max_tokens=7, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == prompt_len

    r = client.completions.create(model=srv.model, prompt="Paris is", max_tokens=5, temperature=0, n=2,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    assert len(r.choices[0].logprobs.token_logprobs) == 5 and len(r.choices[0].logprobs.top_logprobs[0]) == 2
    assert r.usage.prompt_tokens == len(tok(srv).encode("Paris is")) and r.usage.completion_tokens == 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=srv.model, prompt="Paris is", max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == r.choices[0].text
    assert [m.id for m in client.models.list().data] == [srv.model]
    assert client.models.retrieve(srv.model).id == srv.model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("nope")
    assert_clean(srv)


def test_anthropic_sdk_models(srv):
    """The model list and card in Anthropic's shapes for its SDK (it sends anthropic-version), errors too."""
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    page = client.models.list()
    assert [m.id for m in page.data] == [srv.model] and page.data[0].type == "model"
    card = client.models.retrieve(srv.model)
    assert card.id == srv.model and card.created_at.year >= 2026
    with pytest.raises(anthropic.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["type"] == "error" and "does not exist" in e.value.body["error"]["message"]


def test_anthropic_sdk_messages(srv):
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    kw = dict(model=srv.model, max_tokens=6, extra_body={"temperature": 0}, system="Be brief.",
              messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    prompt_len = len(tok(srv).encode_chat([{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hello"}]))
    assert client.messages.count_tokens(model=srv.model, system=kw["system"],
                                        messages=kw["messages"]).input_tokens == prompt_len
    m = client.messages.create(**kw)
    assert m.role == "assistant" and m.content[0].type == "text" and m.stop_reason in ("max_tokens", "end_turn")
    u = m.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == prompt_len and 1 <= u.output_tokens <= 6

    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.usage.output_tokens == u.output_tokens
    body = {k: v for k, v in kw.items() if k != "extra_body"}
    raw = httpx.post(srv.url + "/v1/messages", json=dict(body, stream=True, temperature=0), timeout=60).text
    order = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    deltas = order[3:-3]
    assert order[:3] == ["message_start", "content_block_start", "ping"]
    assert order[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(deltas) <= {"content_block_delta"} and "message_stop" in kinds
    assert_clean(srv)


def test_anthropic_final_assistant_message_is_continued(srv, http):
    """A final assistant message is the reply's start: the prompt ends with its text, not with the end of a
    turn, and the response holds only what the model adds. Consecutive turns of one role are one turn."""
    t = tok(srv)
    user, start = {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My answer is"}
    body = {"model": srv.model, "max_tokens": 6, "temperature": 0, "messages": [user, start]}
    finished = t.apply_chat_template([user, start], add_generation_prompt=False)   # "...: My answer is</s>"
    assert finished.endswith("My answer is</s>")
    expected = t.encode(finished[:-len("</s>")], add_special_tokens=False)
    assert http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"] == len(expected)
    m = http.post("/v1/messages", json=body).json()
    c = http.post("/v1/completions", json={"model": srv.model, "prompt": expected, "max_tokens": 6,
                                            "temperature": 0}).json()
    assert m["content"][0]["text"] == c["choices"][0]["text"]
    o = http.post("/v1/chat/completions", json={"model": srv.model, "max_tokens": 6, "temperature": 0,
                                                 "messages": [user, start], "continue_final_message": True}).json()
    assert o["choices"][0]["message"]["content"] == m["content"][0]["text"]
    assert o["usage"]["prompt_tokens"] == len(expected)
    split = [{"role": "user", "content": "Name"}, {"role": "user", "content": "a color."}]
    joined = [{"role": "user", "content": "Name\n\na color."}]
    n = http.post("/v1/messages/count_tokens", json={"model": srv.model, "messages": split}).json()
    assert n["input_tokens"] == len(t.encode_chat(joined))
    assert_clean(srv)


def test_json_object_mode_answers_json(srv, http):
    """response_format json_object: every choice is a JSON object or, cut by max_tokens, a prefix of one."""
    from engc.runtime import constrained
    from grammar_check import feed
    body = {"model": srv.model, "max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 8,
            "response_format": {"type": "json_object"}, "messages": [{"role": "user", "content": "JSON please"}]}
    choices = http.post("/v1/chat/completions", json=body).json()["choices"]
    assert len(choices) == 8
    for c in choices:
        read = feed(constrained.json_object(), c["message"]["content"])
        assert read != "refused" and (read == "done") == (c["finish_reason"] == "stop"), c
    assert any(c["finish_reason"] == "stop" for c in choices)
    r = http.post("/v1/chat/completions", json=dict(body, continue_final_message=True, messages=[
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert_clean(srv)


def test_json_schema_outputs_follow_the_schema(srv, http):
    """response_format json_schema (OpenAI's structured outputs): every choice is a prefix of an instance, and
    those that stop are valid ones; a schema engc cannot enforce, or none, is a 400."""
    import jsonschema
    from engc.runtime import constrained
    from grammar_check import feed
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    body = {"model": srv.model, "max_tokens": 60, "temperature": 1.0, "seed": 5, "n": 6, "response_format": fmt,
            "messages": [{"role": "user", "content": "JSON please"}]}
    choices = http.post("/v1/chat/completions", json=body).json()["choices"]
    g = constrained.json_schema(schema)
    for c in choices:
        read = feed(g, c["message"]["content"])
        assert read != "refused" and (read == "done") == (c["finish_reason"] == "stop"), c
        if c["finish_reason"] == "stop":
            jsonschema.validate(json.loads(c["message"]["content"]), schema)
    assert any(c["finish_reason"] == "stop" for c in choices)
    for bad, fragment in ((dict(fmt, json_schema={"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "not": {"const": "x"}}}}}), 'Unimplemented keys: ["not"]'),
                          ({"type": "json_schema"}, "needs json_schema.schema")):
        r = http.post("/v1/chat/completions", json=dict(body, response_format=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        assert fragment in r.json()["error"]["message"]
    assert_clean(srv)


def test_stop_sequences_and_logprobs(srv, http):
    body = {"model": srv.model, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[3:5]
    r = http.post("/v1/completions", json=dict(body, stop=[stop])).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == full[:full.index(stop)]
    m = http.post("/v1/messages", json={"model": srv.model, "max_tokens": 12, "temperature": 0,
                                        "stop_sequences": [stop], "messages": [{"role": "user", "content": "Hi"}]})
    assert m.status_code == 200
    chat = http.post("/v1/chat/completions", json={"model": srv.model, "max_tokens": 3, "logprobs": True,
                                                    "top_logprobs": 3, "messages": [{"role": "user", "content": "x"}]})
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1 and len(content[0]["top_logprobs"]) == 3


def test_any_integer_seed_is_accepted_and_reproducible(srv, http):
    """OpenAI's seed is any integer: past 64 bits (and seed + j for n > 1 at the edge) it is reduced, not a 500
    (torch's generator takes [-2^63, 2^64) only); the same seed gives the same text, and a seed torch already
    took draws as before."""
    from engc.runtime.sampling import make_generator
    body = {"model": srv.model, "prompt": "Once", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    for seed in (10 ** 23, -(10 ** 23), 2 ** 64 - 1):
        texts = [http.post("/v1/completions", json=dict(body, seed=seed, n=2)) for _ in range(2)]
        assert all(r.status_code == 200 for r in texts), texts[0].text
        assert [c["text"] for c in texts[0].json()["choices"]] == [c["text"] for c in texts[1].json()["choices"]]
    for seed in (0, 7, -1, 2 ** 63, 2 ** 64 - 1):
        reference = torch.Generator()
        reference.manual_seed(seed)
        assert torch.equal(torch.rand(4, generator=make_generator(seed)), torch.rand(4, generator=reference))
    assert torch.equal(torch.rand(4, generator=make_generator(2 ** 64 + 5)), torch.rand(4, generator=make_generator(5)))


def test_32_concurrent_equal_one_at_a_time(srv):
    bodies = [{"model": srv.model, "prompt": f"{i} {LONG[: 10 + 7 * i]}", "max_tokens": 12, "temperature": 0,
               "ignore_eos": True} for i in range(32)]

    async def run(concurrent: bool):
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            async def one(b):
                r = await c.post("/v1/completions", json=b)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            if concurrent:
                return await asyncio.gather(*(one(b) for b in bodies))
            return [await one(b) for b in bodies]
    together = asyncio.run(run(True))
    alone = asyncio.run(run(False))
    assert together == alone
    assert_clean(srv)


def test_shared_prefix_reports_cached_tokens_and_prefills_less(srv, http):
    base = "Shared prefix test. " + LONG
    first = http.post("/v1/completions", json={"model": srv.model, "prompt": base, "max_tokens": 2})
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    before = srv.wait_idle()["computed_tokens"]
    second = http.post("/v1/completions", json={"model": srv.model, "prompt": base + " More.", "max_tokens": 1})
    usage = second.json()["usage"]
    prefilled = srv.wait_idle()["computed_tokens"] - before
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 64
    assert prefilled == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert "engc_prefix_cache_hit_rate" in http.get("/metrics").text


def test_client_disconnect_mid_stream_frees_blocks(srv):
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": LONG}]})]:
        body = dict(body, model=srv.model, max_tokens=150, stream=True, ignore_eos=True)
        before = srv.wait_idle()["computed_tokens"]
        for _ in range(3):
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                with c.stream("POST", path, json=body) as r:
                    lines = r.iter_lines()
                    for _ in range(6):
                        next(lines)
            # the connection is closed here, long before 150 tokens
        assert_clean(srv)
        assert srv.wait_idle()["computed_tokens"] - before < 3 * 150  # really cut short


def test_kv_exhaustion_completes(tiny_bundle):
    config = EngineConfig(num_blocks=8, max_batched_tokens=64)  # 128 tokens of KV for ~400 tokens of work
    with LiveServer(tiny_bundle("llama"), config) as s:
        async def run():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json={
                    "model": s.model, "prompt": f"{i} {LONG[:60]}", "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True}) for i in range(6)))
        results = asyncio.run(run())
        assert [r.status_code for r in results] == [200] * 6
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in results)
        assert s.wait_idle()["preemptions"] > 0
        s.call(lambda e: e.check_integrity())


BAD = [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 10 ** 9}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 400}]}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "temperature": "hot"}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": [10 ** 6]}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/messages", b"not json", 400),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 400),
    ("/v1/messages", {"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/messages", {"model": "tiny", "max_tokens": -3, "messages": [{"role": "user", "content": "hi"}]}, 400),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": []}, 400),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["", "x"]}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"50": 100}}, 400),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "stop_sequences": [""],
                      "messages": [{"role": "user", "content": "hi"}]}, 400),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400),
    # JSON types as the APIs define them, not coerced: a string flag or count, a fractional count
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2.5}, 400),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "stream": "true",
                      "messages": [{"role": "user", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "continue_final_message": True}, 400),
    # Anthropic's conversation rules: a user turn first, no empty turn, a final reply without trailing blanks
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "assistant", "content": "Hi"},
                                                                     {"role": "user", "content": "hi"}]}, 400),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": ""},
                                                                     {"role": "user", "content": "hi"}]}, 400),
    ("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                                                                     {"role": "assistant", "content": "Sure "}]}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_4xx_in_the_right_shape(srv, http, path, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = http.post(path, **kw)
    assert r.status_code == status, r.text
    err = r.json()
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"} and err["error"]["message"]
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    ok = http.post("/v1/completions", json={"model": srv.model, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_image_parts_are_refused_by_name(http):
    """A content part the server cannot read gets one line naming its type (not pydantic's union message)."""
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "messages.0.content: content parts of type 'image_url' are not supported: this server takes text only")
    r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    assert r.status_code == 400 and "type 'image' are not supported" in r.json()["error"]["message"]


def test_numbers_keep_their_json_types(srv, http):
    """Strict typing refuses strings for flags and counts, but an integer is still a valid number (as in JSON)."""
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("stream:")
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_api_key(tiny_bundle):
    with LiveServer(tiny_bundle("llama"), api_key="sekret") as s:
        body = {"model": s.model, "prompt": "hi", "max_tokens": 2}
        msg = {"model": s.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.get(s.url + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            r = httpx.post(s.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = httpx.post(s.url + "/v1/messages", json=msg, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert httpx.get(s.url + "/metrics", headers=headers).status_code == 401
            r = httpx.get(s.url + "/v1/models", headers={**headers, "anthropic-version": "2023-06-01"})
            assert r.status_code == 401 and r.json()["type"] == "error"    # an Anthropic client's shape
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0).completions.create(
            **body).usage.completion_tokens >= 1
        assert anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0).messages.create(
            **msg).usage.output_tokens >= 1


def test_health_metrics_openapi(srv, http):
    assert http.get("/health").json() == {"status": "ok"}
    http.post("/v1/completions", json={"model": srv.model, "prompt": "hi", "max_tokens": 3})
    text = http.get("/metrics").text
    for name in ("engc_requests_total", "engc_generation_tokens_total", "engc_num_requests_waiting",
                 "engc_kv_cache_usage_ratio", "engc_prefix_cache_hit_rate", "engc_time_to_first_token_seconds_bucket",
                 "engc_time_per_output_token_seconds_bucket"):
        assert name in text, name
    paths = json.loads(http.get("/openapi.json").text)["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
            "/v1/models", "/health", "/metrics"} <= set(paths)
