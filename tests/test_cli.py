"""The command line: one clear line and a non-zero exit for every bad input, never a traceback."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def engc(*args, check=False, env=None):
    r = subprocess.run([sys.executable, "-m", "engc.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), **(env or {})})
    if check:
        assert r.returncode == 0, r.stderr
    return r


def marked_processes(mark: str, command: str = "") -> list[int]:
    """The processes whose environment holds ENGC_TEST_MARK=mark (an engc started with it and every process it
    started: they inherit it) and whose command line holds command."""
    found, entry = [], f"ENGC_TEST_MARK={mark}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and entry in (proc / "environ").read_bytes().split(b"\0")
                    and command.encode() in (proc / "cmdline").read_bytes()):
                found.append(int(proc.name))
        except OSError:   # gone meanwhile
            pass
    return found


def assert_one_line_error(r, *fragments):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    # progress lines may precede it; the error itself is exactly one line
    lines = [line for line in r.stderr.splitlines() if line.startswith("engc: error")]
    assert len(lines) == 1 and r.stderr.rstrip().endswith(lines[0]), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_build_generate_inspect_verify(tiny_dir, tmp_path):
    out = tmp_path / "b"
    summary = json.loads(engc("build", tiny_dir("qwen3"), "-o", out, "--json", check=True).stdout)
    assert summary["family"] == "qwen3" and summary["dtype"] == "float32"
    r = engc("generate", out, "--prompt", "Hello", "--max-tokens", "5", "--raw", check=True)
    assert r.stdout.strip()
    r = engc("generate", out, "--prompt", "Hello", "--max-tokens", "24", "--json-object", check=True)
    assert r.stdout.startswith("{")   # JSON mode (the object's close may be past 24 tokens)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    r = engc("generate", out, "--prompt", "Hello", "--max-tokens", "24", "--json-schema", schema, check=True)
    assert r.stdout.startswith('{') and '"ok"' in r.stdout   # the required key comes first whatever the model
    schema.write_text(json.dumps({"type": "object", "properties": {"d": {"type": "string", "not": {"const": "x"}}}}))
    assert_one_line_error(engc("generate", out, "--prompt", "x", "--json-schema", schema), 'Unimplemented keys: ["not"]')
    assert_one_line_error(engc("generate", out, "--prompt", "x", "--json-schema", tmp_path / "no.json"), "no.json")
    assert "qwen3" in engc("inspect", out, check=True).stdout
    assert engc("verify", out, check=True).stdout.startswith("OK")


def test_verify_fails_on_flipped_byte(tiny_bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(tiny_bundle("llama"), b)
    w = b / "weights/rank0.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x80
    w.write_bytes(bytes(data))
    r = engc("verify", b)
    assert r.returncode == 1 and "weights/rank0.safetensors" in r.stderr


def test_missing_path(tmp_path):
    assert_one_line_error(engc("build", tmp_path / "nope", "-o", tmp_path / "b"), "no such file")


def test_unsupported_architecture(tiny_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_dir("llama"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (src / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(engc("build", src, "-o", tmp_path / "b"), "MambaForCausalLM", "llama", "qwen3")


def test_unknown_arch(tiny_dir, tmp_path):
    assert_one_line_error(engc("build", tiny_dir("llama"), "-o", tmp_path / "b", "--arch", "sm75"),
                          "sm75", "sm90")


def test_corrupted_and_future_bundles(tiny_bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(tiny_bundle("llama"), b)
    (b / "program.onnx").write_bytes(b"garbage")
    assert_one_line_error(engc("generate", b, "--prompt", "hi"), "program.onnx")
    shutil.rmtree(b)
    shutil.copytree(tiny_bundle("llama"), b)
    m = json.loads((b / "manifest.json").read_text())
    m["format_version"] = [9, 1]
    (b / "manifest.json").write_text(json.dumps(m))
    assert_one_line_error(engc("generate", b, "--prompt", "hi"), "9.1")
    assert_one_line_error(engc("generate", tmp_path / "nothing", "--prompt", "hi"), "nothing")


def test_tune_file_is_checked_in_one_line(tiny_dir, tmp_path):
    src, out = tiny_dir("llama"), tmp_path / "b"
    assert_one_line_error(engc("build", src, "-o", out, "--tune", tmp_path / "none.json"), "none.json",
                          "cannot read")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert_one_line_error(engc("build", src, "-o", out, "--tune", bad), "not JSON")
    bad.write_text(json.dumps({"sm90/silu_mul/*/anything": {"BLOCK": 512}}))
    assert_one_line_error(engc("build", src, "-o", out, "--tune", bad), "no tune entry", "sm90/silu_mul/*/any")
    bad.write_text(json.dumps({"sm90/silu_mul/*/any": {"BLOK": 512}}))
    assert_one_line_error(engc("build", src, "-o", out, "--tune", bad), "no field 'BLOK'", "BLOCK")
    assert not out.exists()


def test_tune_overrides_reach_the_kernels_and_the_manifest(tiny_dir, tmp_path):
    import torch
    from engc.bundle.reader import open_bundle
    from engc.compiler.build import BuildOptions, build
    from engc.compiler import tune
    from engc.compiler.codegen.specs import model_specs
    from engc.compiler.frontend.decoder import lower
    from engc.compiler.build import read_source
    entries = tune.check_overrides({"sm90/silu_mul/*/any": {"BLOCK": 512}})
    cfg, _ = lower(read_source(str(tiny_dir("llama"))), torch.bfloat16)
    block = lambda: next(s for s in model_specs(cfg, torch.bfloat16, "sm90", 16) if s.op == "silu_mul").launch  # noqa: E731
    stock = block()["BLOCK"]
    with tune.overridden(entries):
        assert block()["BLOCK"] == 512
    assert block()["BLOCK"] == stock != 512                        # the table is restored after the build
    build(str(tiny_dir("llama")), tmp_path / "b", BuildOptions(tune=entries))
    assert open_bundle(tmp_path / "b").manifest["tune_overrides"] == entries


def test_bad_values_are_one_line(tiny_bundle):
    """click's own refusals (a value out of range, a missing argument, an unknown command) are one
    `engc: error:` line too, not a page of usage."""
    b = tiny_bundle("llama")
    assert_one_line_error(engc("generate", b, "--prompt", "hi", "--max-tokens", "-5"), "--max-tokens", "-5")
    assert_one_line_error(engc("build", "-o", "x"), "SRC")
    assert_one_line_error(engc("frobnicate"), "frobnicate")
    assert engc("--help", check=True).stdout.startswith("Usage:")


def test_verify_and_inspect_of_a_cut_short_weight_file(tiny_bundle, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(tiny_bundle("llama"), b)
    w = b / "weights/rank0.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    assert_one_line_error(engc("verify", b), "weights/rank0.safetensors", "damaged")
    r = engc("inspect", b)
    assert "llama" in r.stdout   # still described, then refused
    assert_one_line_error(r, "weights/rank0.safetensors", "cut short")


def test_run_on_a_busy_port_refuses_before_loading(tmp_path, tiny_bundle):
    """The port is checked first: a damaged bundle behind a busy port is refused for the port, and a good one is
    refused before the engine's process is spawned (none is left behind)."""
    import socket
    import uuid
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        assert_one_line_error(engc("run", tmp_path / "no-bundle", "--port", port), f"port {port}", "in use",
                              "--port 0")
        for process in ("--engine-process", "--no-engine-process"):
            mark = uuid.uuid4().hex
            r = engc("run", tiny_bundle("llama"), "--port", port, process, env={"ENGC_TEST_MARK": mark})
            assert_one_line_error(r, f"port {port}", "in use")
            assert marked_processes(mark) == []
    finally:
        busy.close()


def test_run_on_port_0_says_which_port_it_took(tiny_bundle):
    import time
    import urllib.request
    proc = subprocess.Popen([sys.executable, "-m", "engc.cli", "run", str(tiny_bundle("llama")), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        # where the start went (no graphs on the CPU), then the address
        ready = proc.stdout.readline().strip()
        assert re.fullmatch(r"engc: engine ready in \d+\.\d s: weights \d+\.\d s, KV cache for [\d,]+ tokens", ready), ready
        line = proc.stdout.readline()
        assert line.startswith("engc: serving ") and "http://127.0.0.1:" in line, line
        url = line.split()[-1]
        for _ in range(600):   # the socket is bound at once; it answers once the app has started
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, "the server exited"
                time.sleep(0.1)
        else:
            raise AssertionError("no answer from the server")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
