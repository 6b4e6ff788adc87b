"""No request gets a 5xx for bad input (edge.py): a lone surrogate on every POST route, a body over the size
limit (refused before anything parses it), a huge prompt tokenized off the event loop while /health answers,
an invalid tool schema under every tool_choice; a failure of the server is a 500 in the API's shape, counted
in /metrics, logged with its request id, on a connection that stays usable. And the OpenAPI document
declares what the server answers (schemathesis, in test_server_fuzz.py)."""
import http.client
import json
import logging
import threading
import time

import httpx
import pytest
import torch

from engc.runtime.server import edge
from live_server import LiveServer

torch.set_num_threads(1)

CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
LONE = "\\ud800"   # as it stands in the JSON text: a string escape of a lone high surrogate
BODIES = {
    "/v1/chat/completions": '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "%s"}]}',
    "/v1/completions": '{"model": "tiny", "max_tokens": 2, "prompt": "a%sb"}',
    "/v1/messages": '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "%s"}]}',
    "/v1/messages/count_tokens": '{"model": "tiny", "messages": [{"role": "user", "content": "%s"}]}',
}


def counted(srv, route: str, status: int) -> float:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(f'engc_requests_total{{route="{route}",status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


def on_one_connection(srv, requests: list[tuple[str, str, bytes]]) -> list[tuple[int, dict]]:
    """Sends the requests one after another on one keep-alive connection; fails if the server closed it."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    out, sock = [], None
    for method, path, body in requests:
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        out.append((r.status, json.loads(r.read() or b"null")))
        assert not r.will_close, f"{path}: the server closed the connection"
        assert sock is None or conn.sock is sock, "the connection was replaced"
        sock = conn.sock
    conn.close()
    return out


@pytest.mark.parametrize("path", list(BODIES))
def test_a_lone_surrogate_is_a_400_on_every_post_route(srv, path):
    before = counted(srv, path, 400)
    ok_body = json.dumps(dict(CHAT, messages=[{"role": "user", "content": "hi \ud83d\ude42"}]), ensure_ascii=True)
    (status, err), (ok_status, _) = on_one_connection(srv, [
        ("POST", path, (BODIES[path] % LONE).encode()),
        ("POST", "/v1/chat/completions", ok_body.encode())])   # an escaped pair is one character: fine
    assert status == 400 and ok_status == 200
    message = err["error"]["message"]
    assert "surrogate" in message
    assert (err.get("type") == "error") == path.startswith("/v1/messages")
    assert counted(srv, path, 400) == before + 1


def test_surrogate_escapes_are_read_as_json_reads_them():
    """edge.lone_surrogate against Python's JSON parser on escapes, escaped backslashes and pairs."""
    pieces = ["\\ud800", "\\udc00", "\\ud83d\\ude42", "\\\\", "\\\\ud800", "\\\\\\ud800", "\\ud83d", "x",
              "\\uD83D\\uDE42", "\\n", '\\"']
    import itertools
    for combo in itertools.product(pieces, repeat=3):
        text = '"' + "".join(combo) + '"'
        try:
            json.loads(text).encode("utf-8")
            lone = False
        except UnicodeEncodeError:
            lone = True
        assert edge.lone_surrogate(text.encode()) == lone, text


def test_ids_are_uuid4s_that_do_not_repeat():
    """edge.uuid4_hex: uuid.uuid4().hex's form; random.seed() elsewhere and a fork do not make it repeat ids."""
    import os
    import random
    import uuid
    ids = set()
    for _ in range(2000):
        h = edge.uuid4_hex()
        u = uuid.UUID(h)
        assert (u.hex, u.version, u.variant, len(h)) == (h, 4, uuid.RFC_4122, 32)
        ids.add(h)
    random.seed(0)
    ids.add(edge.uuid4_hex())
    random.seed(0)
    ids.add(edge.uuid4_hex())
    assert len(ids) == 2002
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: its first id, to the parent
        os.write(write, edge.uuid4_hex().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert len(child) == 32 and child != edge.uuid4_hex()


def test_a_body_over_the_limit_is_refused_unread(srv, monkeypatch):
    """A 20 MB chat message: 413 from the size limit, before anything parses or tokenizes it, whether the
    client declares the length or streams the body chunked; /health answers meanwhile and after."""
    tokenized = []
    tok = srv.engine.engine.model.tokenizer
    real = tok.encode_chat
    monkeypatch.setattr(tok, "encode_chat", lambda *a, **k: tokenized.append(len(str(a))) or real(*a, **k))
    big = json.dumps(dict(CHAT, messages=[{"role": "user", "content": "ab " * 7_000_000}])).encode()
    limit = srv.app.state.engc.max_body_bytes
    assert len(big) > 20_000_000 > limit
    health = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            health.append(httpx.get(srv.url + "/health", timeout=30).status_code)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            start = time.perf_counter()
            r = c.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
            declared = time.perf_counter() - start
            assert r.status_code == 413 and str(limit) in r.json()["error"]["message"], r.text
            chunks = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20))   # no Content-Length
            r = c.post("/v1/chat/completions", content=chunks, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200   # the client's next request
    finally:
        stop.set()
        poller.join()
    assert len(tokenized) == 1 and tokenized[0] < 1000   # only the small request reached the tokenizer
    assert health and set(health) == {200}
    assert declared < 10, declared   # generous: it is refused unread, in well under a second when idle


def test_a_client_that_expects_100_continue_gets_the_413_before_it_sends(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    for name, value in (("content-type", "application/json"), ("content-length", str(20_000_000)),
                        ("expect", "100-continue")):
        conn.putheader(name, value)
    conn.endheaders()   # and no body
    r = conn.getresponse()
    assert r.status == 413 and "limit" in json.loads(r.read())["error"]["message"]
    conn.close()


def test_tokenizing_runs_off_the_event_loop(tiny_bundle):
    """With the limit raised, a 2 MB message reaches the tokenizer, which runs in a worker thread: /health
    answers while it is held there, then the prompt gets its 400 (longer than the context)."""
    with LiveServer(tiny_bundle("llama"), max_body_bytes=64 << 20) as s:
        tok = s.engine.engine.model.tokenizer
        real, entered, release = tok.encode_chat, threading.Event(), threading.Event()

        def held(*args, **kwargs):
            entered.set()
            assert release.wait(60), "the test never released the tokenizer"
            return real(*args, **kwargs)
        tok.encode_chat = held
        result = {}
        body = dict(CHAT, messages=[{"role": "user", "content": "ab " * 700_000}])
        worker = threading.Thread(target=lambda: result.update(
            r=httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)))
        worker.start()
        try:
            assert entered.wait(60)
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200   # served while it tokenizes
            assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 200
        finally:
            release.set()
            worker.join()
        r = result["r"]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_an_unexpected_failure_is_a_counted_500_on_a_live_connection(srv, monkeypatch, caplog):
    from engc.runtime.server import openai

    def broken(*args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(openai, "read_prompts", broken)
    before = counted(srv, "/v1/completions", 500)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    with caplog.at_level(logging.ERROR, logger="engc.server"):
        (status, err), (after_status, _) = on_one_connection(srv, [
            ("POST", "/v1/completions", body), ("GET", "/health", None)])
    assert status == 500 and after_status == 200
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["type"] == "server_error"
    request_id = err["error"]["message"].rsplit(" ", 1)[-1].rstrip(")")
    assert request_id.startswith("req-")
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
    assert counted(srv, "/v1/completions", 500) == before + 1
    r = httpx.post(srv.url + "/v1/messages", json=dict(CHAT, messages=[{"role": "user", "content": "x"}]),
                   headers={"x-request-id": "client-7"})
    assert r.headers["x-request-id"] == "client-7"


BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "strin"}}}


@pytest.mark.parametrize("choice", [None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
def test_an_invalid_tool_schema_is_a_400_under_every_tool_choice(srv, choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]
    body = dict(CHAT, tools=tools, **({"tool_choice": choice} if choice is not None else {}))
    r = httpx.post(srv.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "properties.city.type" in r.json()["error"]["message"]
    anthropic_choice = {None: None, "auto": {"type": "auto"}, "none": {"type": "none"},
                        "required": {"type": "any"}}.get(choice if isinstance(choice, (str, type(None))) else "x",
                                                          {"type": "tool", "name": "f"})
    body = dict(CHAT, tools=[{"name": "f", "input_schema": BAD_SCHEMA}],
                **({"tool_choice": anthropic_choice} if anthropic_choice else {}))
    r = httpx.post(srv.url + "/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_405_names_the_allowed_methods_and_the_document_declares_the_errors(srv):
    r = httpx.request("TRACE", srv.url + "/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET" and r.json()["error"]["message"]
    r = httpx.delete(srv.url + "/v1/messages")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["type"] == "error"
    doc = httpx.get(srv.url + "/openapi.json").json()
    paths = doc["paths"]
    assert set(paths["/v1/completions"]["post"]["responses"]) == {"200", "400", "404", "413", "500", "503"}
    assert "text/event-stream" in paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "422" not in json.dumps(doc) or "HTTPValidationError" not in json.dumps(doc)


def test_a_top_p_below_float32s_range_samples_the_likeliest_token(srv):
    """top_p 1e-300 is 0 in float32, where every token's preceding mass reaches it; the likeliest token
    always stays, so it answers as greedy does (and the step, with every request in it, goes on)."""
    body = {"model": "tiny", "prompt": "Paris is", "max_tokens": 4}
    greedy = httpx.post(srv.url + "/v1/completions", json=dict(body, temperature=0)).json()["choices"][0]["text"]
    for top_p in (1e-300, 5e-324):
        r = httpx.post(srv.url + "/v1/completions", json=dict(body, top_p=top_p, seed=1))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, r.text


def test_min_p_of_one_samples_the_likeliest_token_and_outside_0_1_is_refused(srv):
    """min_p keeps the tokens at least min_p times as likely as the likeliest: at 1 only that one, so a sampled
    completion or chat answers as greedy does."""
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "Paris is", "max_tokens": 4}),
                       ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "Paris is"}]})):
        def answer(**kw):
            r = httpx.post(srv.url + path, json=dict(body, **kw))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"] if "text" in choice else choice["message"]["content"]
        assert answer(temperature=1.0, min_p=1.0, seed=3) == answer(temperature=0)
        r = httpx.post(srv.url + path, json=dict(body, min_p=1.5))
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_numbers_json_cannot_hold_are_refused(srv, literal):
    """Python's JSON parser reads NaN and Infinity (no JSON) and 1e400 as inf: a number field refuses them."""
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "repetition_penalty": %s}' % literal
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
