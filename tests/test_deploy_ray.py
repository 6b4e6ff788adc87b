"""The Ray Serve deployment (engc/runtime/server/ray_serve.py) on a local one-node Ray cluster answers the
OpenAI SDK, plain and streamed, through Ray's HTTP proxy."""
import socket

import openai
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[deploy]')")


@pytest.fixture(scope="module")
def ray_url(tiny_bundle):
    import ray
    from ray import serve

    from engc.runtime.server.ray_serve import app
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 << 20)   # it moves no data
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # as `serve run engc.runtime.server.ray_serve:app bundle=... name=tiny device=cpu ...` passes them
        serve.run(app({"bundle": str(tiny_bundle("llama")), "name": "tiny", "device": "cpu", "max_replicas": "2",
                       "target_ongoing_requests": "4", "max_num_seqs": "8"}), route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_ray_serve_answers_the_openai_sdk(ray_url):
    client = openai.OpenAI(base_url=ray_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
