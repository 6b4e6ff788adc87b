"""The engine in a process of its own (engc run's default): streams through it, aborts reach it, its death
ends every open stream with the engine's error, and a start-up error in it is one line."""
import json
import os
import signal
import time

import httpx
import pytest

from engc.runtime.engine import Engine
from live_server import LiveServer
from test_cli import assert_one_line_error, engc, marked_processes

CHAT = {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture(scope="module")
def psrv(tiny_bundle):
    with LiveServer(tiny_bundle("llama"), process=True) as s:
        yield s


def record_finishes(engine) -> None:
    """From now on the engine keeps why each sequence ended (run in the engine's process)."""
    engine.finish_reasons = []
    finish = engine.scheduler.finish

    def recorded(seq, reason):
        engine.finish_reasons.append(reason)
        return finish(seq, reason)
    engine.scheduler.finish = recorded


def finish_reasons(engine) -> list:
    return engine.finish_reasons


def slow_steps(engine) -> None:
    """Each step takes 50 ms more, as a slow device's would: an answer to the end of the context outlasts a
    client's read of its first token."""
    step = engine.step

    def slow():
        time.sleep(0.05)
        return step()
    engine.step = slow


def engine_pid(engine) -> int:
    return os.getpid()


def events(lines) -> list:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def test_a_chat_streams_through_the_engine_process(psrv):
    assert psrv.call(engine_pid) == psrv.engine.process.pid != os.getpid()
    body = {**CHAT, "model": psrv.model, "max_tokens": 12}
    text = httpx.post(psrv.url + "/v1/chat/completions", json=body, timeout=60).text
    chunks = events(text.split("\n\n"))
    assert text.rstrip().endswith("data: [DONE]")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    plain = httpx.post(psrv.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    assert plain["choices"][0]["message"]["content"] == "".join(
        c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    stats = psrv.wait_idle()
    assert stats["running"] == 0 and stats["waiting"] == 0
    psrv.call(Engine.check_integrity)
    metrics = httpx.get(psrv.url + "/metrics").text
    assert "engc_num_requests_running 0.0" in metrics and "engc_generation_tokens_total 24.0" in metrics


def test_a_client_that_leaves_aborts_its_request_in_the_engine_process(psrv):
    psrv.call(record_finishes)
    psrv.call(slow_steps)
    body = {**CHAT, "model": psrv.model}   # to the end of the context
    with httpx.stream("POST", psrv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content"' in line:
                break   # one token read, then the connection closes
    psrv.wait_idle()
    assert psrv.call(finish_reasons) == ["abort"]
    psrv.call(Engine.check_integrity)


def test_a_dead_engine_process_ends_open_streams_and_health_says_so(tiny_bundle):
    with LiveServer(tiny_bundle("llama"), process=True) as srv:
        srv.call(slow_steps)
        body = {**CHAT, "model": srv.model}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if '"content"' in line:
                    os.kill(srv.engine.process.pid, signal.SIGKILL)
                    break
            rest = list(lines)
        error = events(rest)[-1]["error"]
        assert error["type"] == "server_error" and "killed by SIGKILL" in error["message"], rest
        assert [x for x in rest if x][-1] == "data: [DONE]"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["reason"]
        again = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False})
        assert again.status_code == 503 and "the engine is down" in again.json()["error"]["message"]
        assert httpx.get(srv.url + "/v1/models").status_code == 200   # the server keeps answering


def test_a_bundle_the_engine_process_cannot_load_is_one_line(tiny_bundle, tmp_path):
    """The server's process reads the small files; the weights are the engine process's, whose refusal
    reaches the command line as the one line it would be in one process."""
    import shutil
    bad = tmp_path / "b"
    shutil.copytree(tiny_bundle("llama"), bad)
    weights = bad / "weights" / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    r = engc("run", bad, "--port", "0", "--device", "cpu")
    assert_one_line_error(r, "rank0.safetensors")


def test_engc_run_streams_and_its_sigterm_stops_the_engine_process(tiny_bundle):
    """The command itself: a chat streamed through engc run, then SIGTERM: the server shuts down and stops the
    engine's process on its way out."""
    import subprocess
    import sys
    from pathlib import Path
    proc = subprocess.Popen([sys.executable, "-m", "engc.cli", "run", str(tiny_bundle("llama")), "--port", "0",
                             "--served-model-name", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert proc.stdout.readline().startswith("engc: engine ready in ")
        url = proc.stdout.readline().split()[-1]   # printed once the engine serves; it answers once uvicorn has
        body = {**CHAT, "model": "tiny", "max_tokens": 8}
        deadline = time.monotonic() + 120
        while True:
            try:
                text = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).text
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.1)
        assert events(text.split("\n\n"))[-1]["usage"]["completion_tokens"] == 8
        children = [int(c) for task in Path(f"/proc/{proc.pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
        engine = [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(engine) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert not Path(f"/proc/{engine[0]}").exists()   # stopped and reaped by the server before it exited
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_while_engc_run_starts_kills_the_engine_process(tiny_bundle):
    """engc run spawns the engine's process before it imports the server: Ctrl-C meanwhile (while it imports,
    or waits for the engine) is one line and status 130, the engine's process killed and reaped, not left
    loading."""
    import subprocess
    import sys
    import uuid
    from pathlib import Path
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "engc.cli", "run", str(tiny_bundle("llama")), "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "ENGC_TEST_MARK": mark})
    try:
        deadline = time.monotonic() + 60
        while not marked_processes(mark, "spawn_main"):
            assert proc.poll() is None and time.monotonic() < deadline, "no engine process was spawned"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        stderr = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # 130, or a death by SIGINT once it has said so: CPython's exit when the interrupt fell in code that a native
    # module's import runs through PyRun_String (a flag no handler clears)
    assert proc.returncode in (130, -signal.SIGINT) and stderr.rstrip().endswith("engc: interrupted"), stderr
    assert "Traceback" not in stderr, stderr
    assert marked_processes(mark, "spawn_main") == []


def test_ctrl_c_while_the_engine_process_is_started_stops_it_whole(monkeypatch, capfd):
    """A Ctrl-C that lands while the engine's process has been created but not yet sent its target waits until
    the child has it all, then the child is killed at once: no half-read target (the child's own traceback after
    engc's one line), no child left running."""
    import multiprocessing.util
    from engc.runtime import engine_spawn
    spawnv = multiprocessing.util.spawnv_passfds

    def spawned_then_interrupted(*args):
        pid = spawnv(*args)
        os.kill(os.getpid(), signal.SIGINT)   # the child exists; its target is not written yet
        return pid
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawned_then_interrupted)
    processes = []
    monkeypatch.setattr(engine_spawn, "kill", lambda p: processes.append(p) or p.kill() or p.join())
    with pytest.raises(KeyboardInterrupt):
        engine_spawn.spawn(print)
    assert len(processes) == 1 and processes[0].exitcode == -signal.SIGKILL
    assert "Traceback" not in capfd.readouterr().err
