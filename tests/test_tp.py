"""Tensor parallelism on the CPU: bundles built with --tp 2 run over gloo in two processes and decode the same
greedy tokens as the --tp 1 bundle; the shard layout; refusals; a rank that dies makes the server answer 503
and exit."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from safetensors import safe_open

from engc.compiler.build import BuildOptions, build
from test_cli import assert_one_line_error, engc

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Hello"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "ENGC_TP_TIMEOUT_S": "60"}
# a dense model with one KV head (replicated on both ranks), a tied head and an odd vocabulary (the last
# rank's lm_head rows padded); Mixtral's experts; Qwen2-MoE's shared expert beside a dense layer; DeepSeek's
# latent attention (V2 without q_lora, V3 with it: q_a replicated, q_b by heads) and shared experts; OLMoE's
# q/k norm over the whole projection, q's rows split and k's one head shared by both ranks; Gemma 2's soft-caps
# and sandwich norms, Gemma 3's per-head q/k norm and local layers; Phi-3's fused qkv and gate_up; SmolLM3's
# NoPE layers (their rope table of zeros on every rank); Granite's multipliers (residual_multiplier folded into
# o and down before they are split); OLMo 2's residual sums in place of pre-norms; GLM-4's interleaved rotary
# rows permuted before q and k are split by heads; EXAONE 4's local layers and global NoPE one; Cohere's
# LayerNorm and parallel block (both outputs all-reduced, then added) with Command R+'s per-head q/k LayerNorm
# (each rank its heads' weight rows); Granite MoE's stacked experts, their residual multiplier folded in; GLM-4.5's
# partial rotary rows and q/k norm weights permuted, its grouped routing and shared expert; ERNIE 4.5 MoE's
# correction bias (replicated) in its range of MoE layers
CASES = {"llama": dict(num_key_value_heads=1, vocab_size=321), "mixtral": {}, "qwen2_moe": {},
         "deepseek_v2": {}, "deepseek_v3": {}, "olmoe": dict(num_key_value_heads=1), "gemma2": {},
         "gemma3_text": {}, "phi3": {}, "smollm3": {}, "granite": {}, "olmo2": {}, "glm4": {}, "exaone4": {},
         "cohere": {"use_qk_norm": True}, "cohere2": {}, "olmo3": {}, "granitemoe": {},
         "glm4_moe": {"use_qk_norm": True}, "ernie4_5_moe": {}}


def _greedy(bundle, **kw):
    """Each prompt's greedy tokens and their log-probabilities (and the top two's)."""
    import engc as engc_api
    llm = engc_api.LLM(str(bundle), device="cpu", **kw)
    try:
        params = engc_api.SamplingParams(temperature=0, max_tokens=10, logprobs=2)
        seqs = [llm.engine.add_request(llm.encode(p, False), params) for p in PROMPTS]
        llm.engine.run_to_completion()
        return [(s.output_ids, [[x.logprob] + [v for _, v in x.top] for x in s.logprobs]) for s in seqs]
    finally:
        llm.close()


# int4 from engc quantize (RTN): llama's projections in groups of 32 (o and down split by words and groups) and
# of 64 (o's 64 inputs are one group: each rank keeps the scales); Qwen3-MoE's experts (an intermediate of 64,
# 32 a rank: the int4 layout's chunk and the group); OLMoE's whole-projection q/k norm after int4 q and k
INT4_CASES = {"llama-int4": ("llama", {}, 32), "llama-int4-g64": ("llama", {}, 64),
              "qwen3_moe-int4": ("qwen3_moe", dict(moe_intermediate_size=64), 32),
              "olmoe-int4": ("olmoe", dict(intermediate_size=64), 32)}


@pytest.fixture(scope="module")
def tp_bundles(tiny_dir, tmp_path_factory):
    made = {}

    def make(case: str):
        if case not in made:
            root = tmp_path_factory.mktemp(f"tp_{case}")
            if case in INT4_CASES:
                from engc.compiler.quantize import QuantOptions
                from engc.compiler.quantize.stream import quantize_checkpoint
                family, overrides, group = INT4_CASES[case]
                src = root / "int4"
                quantize_checkpoint(str(tiny_dir(family, **overrides)), src, QuantOptions(method="rtn", group_size=group))
            else:
                src = tiny_dir(case, **CASES[case])
            build(str(src), root / "tp1", BuildOptions())
            build(str(src), root / "tp2", BuildOptions(tp=2))
            made[case] = root / "tp1", root / "tp2"
        return made[case]
    return make


@pytest.mark.parametrize("family", [*CASES, *INT4_CASES])
def test_tp2_decodes_the_tokens_of_tp1(family, tp_bundles, monkeypatch):
    monkeypatch.setenv("ENGC_TP_TIMEOUT_S", "60")
    tp1, tp2 = tp_bundles(family)
    import torch
    expected = _greedy(tp1)
    for (tokens, logprobs), (tokens1, logprobs1) in zip(_greedy(tp2, tp=2), expected):
        # the ranks' partial sums add in another order than one GEMM's: the same tokens, logprobs to rounding
        assert tokens == tokens1
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(logprobs1), atol=1e-4)


def test_rank_files_hold_the_shards(tp_bundles):
    tp1, tp2 = tp_bundles("qwen2_moe")
    manifest = json.loads((tp2 / "manifest.json").read_text())
    assert manifest["tp"] == 2 and manifest["weights"] == ["weights/rank0.safetensors", "weights/rank1.safetensors"]

    def shapes(path):
        with safe_open(str(path), "pt") as f:
            return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    whole, ranks = shapes(tp1 / "weights/rank0.safetensors"), [shapes(tp2 / manifest["weights"][r]) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    part = ranks[0]
    assert part["layers.0.qkv.weight"][0] == whole["layers.0.qkv.weight"][0] // 2   # 2 of 4 q heads, 1 of 2 kv
    assert part["layers.0.o.weight"] == (64, whole["layers.0.o.weight"][1] // 2)
    assert part["layers.0.experts.gate_up"] == (4, 32 // 2 * 2, 64)                   # each expert's I halved
    assert part["layers.0.experts.down"] == (4, 64, 16)
    # the shared expert (a dense MLP) as the dense layer's: gate and up by rows, down by columns
    assert part["layers.0.shared_expert.gate_up.weight"] == (48, 64) and part["layers.0.router.weight"] == (4, 64)
    assert part["layers.0.shared_expert.down.weight"] == (64, 24)
    assert part["embed.weight"] == whole["embed.weight"]                               # replicated
    assert part["lm_head.weight"][0] == whole["lm_head.weight"][0] // 2               # vocab-parallel
    with safe_open(str(tp2 / "weights/rank0.safetensors"), "pt") as a, \
            safe_open(str(tp2 / "weights/rank1.safetensors"), "pt") as b:
        assert not a.get_tensor("layers.0.o.weight").equal(b.get_tensor("layers.0.o.weight"))
    shown = engc("inspect", tp2, check=True).stdout
    assert "tp layout  2 ranks" in shown and "experts 4 each 16 wide" in shown and "160 of 320" in shown
    assert engc("verify", tp2).returncode == 0


def test_what_does_not_shard_is_refused_in_one_line(tiny_dir, tp_bundles, tmp_path):
    assert_one_line_error(engc("build", tiny_dir("qwen2"), "-o", tmp_path / "b", "--tp", "3"),
                          "--tp 3", "4 attention heads do not divide over 3 ranks")
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.stream import quantize_checkpoint
    act_order = tmp_path / "act_order"
    quantize_checkpoint(str(tiny_dir("llama")), act_order, QuantOptions(
        method="gptq", group_size=32, act_order=True, static_groups=False, calib_samples=2, calib_seqlen=16))
    assert_one_line_error(engc("build", act_order, "-o", tmp_path / "b", "--tp", "2"),
                          "is act-order int4 (desc_act)")
    wide_groups = tmp_path / "wide_groups"   # down's 192 inputs, 96 a rank, in groups of 64
    quantize_checkpoint(str(tiny_dir("llama", intermediate_size=192)), wide_groups,
                        QuantOptions(method="rtn", group_size=64))
    assert_one_line_error(engc("build", wide_groups, "-o", tmp_path / "b", "--tp", "2"),
                          "not a multiple of 32 and of its int4 group size 64")
    _, tp2 = tp_bundles("mixtral")
    assert_one_line_error(engc("generate", tp2, "--prompt", "hi", "--tp", "4", "--device", "cpu"),
                          "built for 2 ranks")
    from engc.errors import BundleError
    from engc.runtime.loader import load
    with pytest.raises(BundleError, match="built for 2 tensor-parallel ranks"):
        load(tp2)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_a_dead_rank_makes_the_server_answer_503_and_exit(tp_bundles):
    _, tp2 = tp_bundles("llama")
    proc = subprocess.Popen([sys.executable, "-m", "engc.cli", "run", str(tp2), "--port", "0", "--device", "cpu",
                             "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "ENGC_DOWN_DRAIN_S": "5"})
    try:
        assert proc.stdout.readline().startswith("engc: engine ready in ")   # where the start went, then the address
        url = proc.stdout.readline().split()[-1]
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        for _ in range(600):   # the socket is bound before the ranks load; it answers once they have
            try:
                status, answer = _post(f"{url}/v1/completions", body)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.1)
        assert status == 200, answer
        workers = [w for child in _children(proc.pid) for w in _children(child)]   # the engine's process's
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=10)
                time.sleep(0.1)
            except urllib.error.HTTPError as e:
                assert e.code == 503 and "rank 1" in json.loads(e.read())["reason"]
                break
        else:
            raise AssertionError("/health never said the engine is down")
        status, answer = _post(f"{url}/v1/completions", body)
        assert status == 503 and "rank 1" in answer["error"]["message"], answer
        assert proc.wait(timeout=60) == 1   # after the drain (ENGC_DOWN_DRAIN_S), on its own
        err = proc.stderr.read()
        assert "Traceback" not in err and err.rstrip().splitlines()[-1].startswith("engc: error: the server stopped: "
                                                                                   "rank 1"), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ranks_started_by_an_outside_launcher(tp_bundles):
    """torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): every process runs the same
    command, rank 0 answers, the other serves as a worker and exits with it."""
    import socket
    tp1, tp2 = tp_bundles("mixtral")
    args = ["--prompt", "Hello", "--raw", "--max-tokens", "8", "--temperature", "0", "--device", "cpu"]
    expected = engc("generate", tp1, *args, check=True).stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "engc.cli", "generate", str(tp2), *args], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**ENV, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r in (0, 1)]
    try:
        (out0, err0), (out1, err1) = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err0 + err1
    assert out0 == expected and out1 == ""


def test_what_a_rank_holds():
    import dataclasses
    from engc.bundle.model_config import ModelConfig
    from engc.bundle.tp import kv_head_of, rank_config, shard_problem, vocab_rows
    cfg = ModelConfig(family="llama", vocab_size=1001, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=True)
    assert shard_problem(cfg, 4) is None and shard_problem(cfg, 1) is None
    assert [kv_head_of(cfg, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]   # replicated
    assert [kv_head_of(cfg, 2, r) for r in range(2)] == [(0, 1), (1, 1)]                   # split
    r4 = rank_config(cfg, 4)
    assert (r4.num_heads, r4.num_kv_heads, r4.intermediate_size, r4.vocab_size) == (2, 1, 24, 1001)
    assert vocab_rows(cfg, 4) == 251   # 4 x 251 = 1004: the last rank's three extra rows are padding
    assert "do not divide over 3 ranks" in shard_problem(cfg, 3)
    assert "KV heads" in shard_problem(dataclasses.replace(cfg, num_heads=12, num_kv_heads=3), 4)
    assert "moe_intermediate_size" in shard_problem(dataclasses.replace(cfg, num_experts=4, moe_intermediate_size=30), 4)
