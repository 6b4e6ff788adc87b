"""What gateways and proxies read from one engc server: the Gateway API Inference Extension's gauges in
/metrics under vLLM's names, and the 429 a full queue (--max-waiting) answers at once in each API's shape.
Also: examples/kubernetes.yaml parses and its container runs a command line `engc run` accepts."""
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from engc.cli import main
from engc.runtime.engine import EngineConfig
from live_server import LiveServer

ROOT = Path(__file__).resolve().parents[1]


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {k: float(v) for k, v in re.findall(r"^(vllm:\S+) (\S+)$", text, re.M)}


def test_gateway_gauges_under_vllm_names(tiny_bundle):
    with LiveServer(tiny_bundle("llama"), EngineConfig(num_blocks=64), model_name="tiny") as srv:
        httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
        stats = srv.wait_idle()
        g = gauges(srv.url)
        label = '{model_name="tiny"}'
        assert g[f"vllm:num_requests_waiting{label}"] == stats["waiting"] == 0
        assert g[f"vllm:num_requests_running{label}"] == 0
        # KV in use as a fraction (vLLM's "perc"), under the current name and the one older pickers read
        assert g[f"vllm:kv_cache_usage_perc{label}"] == g[f"vllm:gpu_cache_usage_perc{label}"] == stats["kv_usage"]
        assert g['vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="64"}'] == 1


def test_a_full_queue_is_a_429_at_once(tiny_bundle):
    config = EngineConfig(max_num_seqs=1, max_waiting=0)   # one running, none may wait
    with LiveServer(tiny_bundle("llama"), config, model_name="tiny") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        gate = threading.Event()
        srv.engine.submit_call(lambda e: gate.wait(60))   # the engine holds still
        try:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            first = pool.submit(http.post, "/v1/completions", json=body)   # takes the batch's one place
            deadline = time.time() + 30
            while srv.engine.queued(1) == 0:
                assert time.time() < deadline, "the first request did not arrive"
                time.sleep(0.02)
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
            r = http.post("/v1/messages", json={"model": "tiny", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        finally:
            gate.set()
        assert first.result().status_code == 200
        assert http.post("/v1/completions", json=body).status_code == 200   # room again
        paths = http.get("/openapi.json").json()["paths"]
        assert "429" in paths["/v1/completions"]["post"]["responses"]
        assert "429" in paths["/v1/messages"]["post"]["responses"]


def test_kubernetes_example_runs_engc_run():
    docs = list(yaml.safe_load_all((ROOT / "examples/kubernetes.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Deployment", "InferencePool", "HTTPRoute"]
    container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["engc", "run"]
    ctx = main.make_context("engc", container["command"][1:])   # click parses it as `engc run ...` would
    run = main.get_command(ctx, "run")
    params = run.make_context("run", container["command"][2:]).params
    assert params["port"] == docs[1]["spec"]["targetPorts"][0]["number"] and params["host"] == "0.0.0.0"
    assert docs[1]["spec"]["selector"]["matchLabels"] == docs[0]["spec"]["template"]["metadata"]["labels"]
    assert docs[2]["spec"]["rules"][0]["backendRefs"][0]["name"] == docs[1]["metadata"]["name"]
