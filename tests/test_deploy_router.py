"""Two `engc run` replicas behind sglang-router, as examples/replicas.sh starts them: requests sharing a
prompt prefix land on one replica (its prefix-cache hits in /metrics), and when that replica is killed with
requests on their way to it, the router retries every one on the other."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e '.[dev]')")
ROOT = Path(__file__).resolve().parents[1]
PREFIX = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. Hello, world! "
          "How are you today? engc compiles models ahead of time. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {k: float(v) for k, v in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def completions(metrics: dict) -> float:
    return metrics.get('engc_requests_total{route="/v1/completions",status="200"}', 0.0)


@pytest.fixture(scope="module")
def replicas(tiny_bundle):
    port = free_port()
    proc = subprocess.Popen(["bash", str(ROOT / "examples/replicas.sh"), str(tiny_bundle("llama")), "2", str(port),
                             "--", "--served-model-name", "tiny", "--device", "cpu"],   # a CPU bundle, GPUs or not
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    workers, router, deadline = [], None, time.time() + 120
    try:
        for line in proc.stdout:   # "replica I pid PID url URL" each, then "router url URL"
            assert time.time() < deadline, "replicas did not start"
            if line.startswith("replica"):
                _, _, _, pid, _, url = line.split()
                workers.append((int(pid), url))
            elif line.startswith("router"):
                router = line.split()[-1]
                break
        assert router and len(workers) == 2, "replicas.sh ended before its router served"
        yield router, workers
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def ask(client: httpx.Client, prompt: str) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0})


def test_shared_prefix_sticks_and_a_dead_replica_loses_nothing(replicas):
    router, workers = replicas
    with httpx.Client(base_url=router, timeout=60) as client:
        for i in range(6):
            r = ask(client, PREFIX + f"Question {i}?")
            assert r.status_code == 200, r.text
        counts = [completions(scrape(url)) for _, url in workers]
        assert sorted(counts) == [0, 6], counts      # cache-aware: all six on one replica
        hot = counts.index(6)
        assert scrape(workers[hot][1])["engc_cached_prompt_tokens_total"] >= 5 * 32   # 2+ blocks each reused

        # the replica holding the prefix freezes with requests on their way to it, then dies: each request,
        # whether the router had sent it there or not yet, is answered by the other replica
        os.kill(workers[hot][0], signal.SIGSTOP)
        with ThreadPoolExecutor(8) as pool:
            pending = [pool.submit(ask, client, PREFIX + f"Again {i}?") for i in range(8)]
            time.sleep(1)   # not needed for the outcome; makes it likely the router has sent them
            os.kill(workers[hot][0], signal.SIGKILL)
            answers = [f.result() for f in pending]
        assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]
        assert completions(scrape(workers[1 - hot][1])) == 8
        assert ask(client, PREFIX + "And now?").status_code == 200
