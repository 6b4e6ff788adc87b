"""Two different tiny models behind LiteLLM's proxy, configured by examples/litellm.yaml: requests by model
name reach their server, the "chat" A/B split lands within 10 points of its 4:1 weights over 200
requests, and with the small model's queue full (--max-waiting) a request for it spills to the big one."""
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engc.runtime.engine import EngineConfig
from live_server import LiveServer

pytest.importorskip("litellm_cli", reason="LiteLLM is not installed (pip install -e '.[deploy]')")
ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-engc-proxy-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answered(srv: LiveServer, status: int = 200) -> int:
    """Chat completions this server answered with status, from its /metrics."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(rf'^engc_requests_total{{route="/v1/chat/completions",status="{status}"}} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


@pytest.fixture(scope="module")
def stack(tiny_bundle):
    # small: four sequences at a time and at most two waiting, so six requests fill it
    with LiveServer(tiny_bundle("llama"), EngineConfig(max_num_seqs=4, max_waiting=2), model_name="small") as small, \
            LiveServer(tiny_bundle("qwen2"), model_name="big") as big:
        port = free_port()
        litellm = shutil.which("litellm", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        assert litellm, "litellm is importable but its `litellm` command is not beside this Python or on PATH"
        env = dict(os.environ, ENGC_SMALL_URL=small.url + "/v1", ENGC_BIG_URL=big.url + "/v1",
                   LITELLM_MASTER_KEY=KEY, LITELLM_LOCAL_MODEL_COST_MAP="True")
        proc = subprocess.Popen([litellm, "--config", str(ROOT / "examples/litellm.yaml"), "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 90
            while True:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.time() < deadline, "the proxy did not start"
                try:
                    if httpx.get(url + "/health/liveliness", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
                yield client, small, big
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def chat(client: httpx.Client, model: str) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": model, "max_tokens": 1, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Hello"}]})


def test_by_model_name(stack):
    client, small, big = stack
    before = answered(small), answered(big)
    for model, expect in [("small", (1, 0)), ("big", (1, 1)), ("big", (1, 2))]:
        r = chat(client, model)
        assert r.status_code == 200, r.text
        assert (answered(small) - before[0], answered(big) - before[1]) == expect


def test_ab_split_within_ten_points_of_its_weights(stack):
    client, small, big = stack
    before = answered(small), answered(big)
    with ThreadPoolExecutor(4) as pool:   # never more than small's batch holds: none is refused
        codes = list(pool.map(lambda _: chat(client, "chat").status_code, range(200)))
    assert codes == [200] * 200
    to_small, to_big = answered(small) - before[0], answered(big) - before[1]
    assert to_small + to_big == 200
    print(f"A/B split over 200 requests: {to_small} small, {to_big} big (weights 4:1)")
    assert abs(to_small / 200 - 0.8) <= 0.10, (to_small, to_big)


def test_full_queue_spills_to_the_big_model(stack):
    client, small, big = stack
    gate = threading.Event()
    small.engine.submit_call(lambda e: gate.wait(60))   # small's engine holds still: what arrives queues
    direct = httpx.Client(base_url=small.url, timeout=60)
    with ThreadPoolExecutor(6) as pool:
        try:
            held = [pool.submit(chat, direct, "small") for _ in range(6)]   # four for the batch, two waiting
            deadline = time.time() + 30
            while small.engine.queued() < 2:
                assert time.time() < deadline, "the two requests did not reach small's engine"
                time.sleep(0.02)
            before = answered(small), answered(big), answered(small, 429)
            r = chat(client, "small")
            assert r.status_code == 200, r.text
            assert answered(big) - before[1] == 1 and answered(small) == before[0]
            assert answered(small, 429) - before[2] == 1     # small said its queue was full; the proxy went on
        finally:
            gate.set()
        assert [f.result().status_code for f in held] == [200] * 6
    direct.close()
