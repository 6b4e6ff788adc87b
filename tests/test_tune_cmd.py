"""engc tune without a GPU: the candidate grid, the winner selection (fake timer and checker), the file's
round trip through tune.check_overrides and `engc build --tune`, and the one-line refusals."""
import json

import pytest
import torch

from engc.compiler.codegen import tune
from engc.compiler.codegen.specs import model_specs
from engc.compiler.tuning import TuneOptions, plan as tp, summary
from engc.compiler.tuning import tune as run_tune
from engc.errors import UserError
from test_cli import assert_one_line_error, engc

LLAMA_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
            "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": True}
H200 = lambda: ("sm90", "fake H200", 132)  # noqa: E731


@pytest.fixture
def config_only(tmp_path):
    """A model folder with config.json and nothing else: engc tune needs no weights."""
    (tmp_path / "1b").mkdir()
    (tmp_path / "1b/config.json").write_text(json.dumps(LLAMA_1B))
    return tmp_path / "1b"


class FakeBench:
    """Times from a rule instead of a GPU; `wrong` candidates give a bad output (and are the fastest)."""

    def __init__(self, rule, wrong=lambda s, c: False):
        self.rule, self.wrong, self.timed = rule, wrong, []

    def __call__(self, plan, say):
        self.plan = plan
        return self

    def prepare(self, pairs):
        self.pairs = pairs

    def compiled(self, shape, cand):
        return True

    def check(self, shape, cand):
        return 0.3 if self.wrong(shape, cand) else 1e-3

    def time_us(self, shape, cand):
        self.timed.append((shape, cand))
        return 1.0 if self.wrong(shape, cand) else self.rule(shape, cand)


def _clock():
    t = [0.0]

    def clock():
        t[0] += 0.001
        return t[0]
    return clock


def test_shapes_and_current_choices_come_from_the_build(config_only):
    cfg = tp.model_config(json.loads((config_only / "config.json").read_text()))
    shapes = {s.name: s for s in tp.model_shapes(cfg, tp.OPS)}
    assert {n: (s.k, s.n, s.per_step) for n, s in shapes.items()} == {
        "qkv": (2048, 3072, 16), "o": (2048, 2048, 16), "gate_up": (2048, 16384, 16),
        "lm_head": (2048, 128256, 1), "down": (8192, 2048, 16)}
    cur = {n: tp.current_choice(cfg, torch.bfloat16, "sm90", s) for n, s in shapes.items()}
    # the table as commented in tune.py: o and lm_head on their classes, qkv and gate_up on cuBLAS,
    # the down on the m<=1 entry with its silu_by_n BLOCK_N 4 for N 2048
    assert [cur[n].bucket for n in ("qkv", "o", "gate_up", "lm_head")] == [
        None, "m<=1/n4k1024w4", None, "m<=1/n8k512w2"]
    assert dict(cur["down"].fields)["BLOCK_N"] == 4 and cur["down"].bucket == "m<=1"
    grid = tp.candidates(shapes["down"], cur["down"], "sm90", 132)
    assert grid[:2] == [tp.Candidate(None), cur["down"]] and len(set(grid)) == len(grid)
    for cand in grid[1:]:   # every candidate is the kernel a build under its override would compile
        spec = tp.gemv_spec(cfg, torch.bfloat16, "sm90", shapes["down"], cand)
        assert spec.constexprs["SILU"] and spec.constexprs["K"] == 8192
        assert {k: spec.tune[k] for k in dict(cand.fields)} == dict(cand.fields)
    plain = tp.candidates(shapes["qkv"], cur["qkv"], "sm90", 132)
    spec = tp.gemv_spec(cfg, torch.bfloat16, "sm90", shapes["qkv"], plain[-1])
    assert spec.variant.endswith(plain[-1].bucket.split("/")[-1]) and spec.num_stages == dict(plain[-1].fields)["num_stages"]


def test_winners_become_checked_entries_that_build_as_chosen(config_only, tmp_path):
    def rule(shape, cand):
        f = dict(cand.fields)
        if cand.bucket is None:
            return 10.0
        if shape.op == "silu_gemv":   # n8k2048w4 at 2x SMs wins by 20%
            return 8.0 if (f["BLOCK_N"], f["BLOCK_K"], f["num_warps"], f["target_programs"]) == (8, 2048, 4, 264) else 10.0
        # the n8k512w2 class at 3 stages beats everything on every shape; the rest are even with cuBLAS
        return 9.0 if cand.bucket.endswith("n8k512w2") and f["num_stages"] == 3 else 10.0
    # BLOCK_N 16 tiles would be fastest, but their output is wrong: discarded, never chosen
    bench = FakeBench(rule, wrong=lambda s, c: dict(c.fields).get("BLOCK_N") == 16)
    out = tmp_path / "tune.json"
    said = []
    result = run_tune(str(config_only), out, TuneOptions(), say=said.append, bench=bench, gpu=H200, clock=_clock())
    assert sum("WRONG OUTPUT" in s for s in said) == 18
    data = json.loads(out.read_text())
    assert data["_meta"]["gpu"] == "fake H200" and data["_meta"]["arch"] == "sm90"
    assert {"torch", "triton", "date", "measured"} <= set(data["_meta"])
    entries = tune.check_overrides(data)   # the whole file is `engc build --tune` input; _meta is dropped
    assert entries == result["entries"] and "_meta" not in entries
    down = entries["sm90/gemv/*/m<=1"]["silu_by_n"][0]
    assert down == [2048, 2048, {"BLOCK_K": 2048, "BLOCK_N": 8, "num_stages": 2, "num_warps": 4,
                                 "target_programs": 264}]
    w2 = entries["sm90/gemv/*/m<=1/n8k512w2"]
    assert w2["num_stages"] == 3 and "target_programs" not in w2   # the table's 264 was as good
    assert sorted(n for (_, _), (n, _) in w2["serves"]) == [2048, 3072, 16384, 128256]
    assert entries["sm90/gemv/*/m<=1/n4k1024w4"] == {"serves": []}
    # what a build under the file compiles: the chosen tiles, and a kernel pick for every projection
    cfg = tp.model_config(LLAMA_1B)
    with tune.overridden(entries):
        gemv = [s for s in model_specs(cfg, torch.bfloat16, "sm90", 16) if s.op == "gemv"]
    silu = next(s for s in gemv if s.constexprs["SILU"])
    assert (silu.constexprs["BLOCK_N"], silu.constexprs["BLOCK_K"], silu.num_warps) == (8, 2048, 4)
    assert [s.variant for s in gemv if not s.constexprs["SILU"]] == ["k2048_m1_n8k512w2"]
    lines = summary(result, out)
    assert any(line.startswith("silu_gemv") and "n8k2048w4s2 t264" in line for line in lines)
    assert "3 tune entries" in lines[-1]


def test_a_gain_inside_the_margin_changes_nothing(config_only, tmp_path):
    # every candidate 2% faster than the table's choice: noise at the 3% margin
    bench = FakeBench(lambda s, c: 10.0 if c == bench.plan.current[s] else 9.8)
    out = tmp_path / "tune.json"
    result = run_tune(str(config_only), out, TuneOptions(), say=lambda m: None, bench=bench, gpu=H200,
                      clock=_clock())
    assert result["entries"] == {} and list(json.loads(out.read_text())) == ["_meta"]
    assert all(not c.changed for c in result["choices"])


def test_budget_times_the_current_choice_and_cublas_first(config_only, tmp_path):
    bench = FakeBench(lambda s, c: 10.0)
    clock = _clock()
    run_tune(str(config_only), tmp_path / "t.json", TuneOptions(budget_s=0.001), say=lambda m: None,
             bench=bench, gpu=H200, clock=clock)
    assert {(s, c) for s, c in bench.timed} == {(s, c) for s in bench.plan.shapes
                                                 for c in (tp.Candidate(None), bench.plan.current[s])}


def test_tune_file_builds(tiny_dir, tmp_path):
    """The file of a (faked) run on the tiny llama goes through `engc build --tune` as it is."""
    bench = FakeBench(lambda s, c: 5.0 if c.bucket and c.bucket.endswith("n8k512w2") else 10.0)
    out = tmp_path / "tune.json"
    result = run_tune(str(tiny_dir("llama")), out, TuneOptions(), say=lambda m: None, bench=bench, gpu=H200,
                      clock=_clock())
    assert result["entries"]["sm90/gemv/*/m<=1/n8k512w2"]["serves"]
    engc("build", tiny_dir("llama"), "-o", tmp_path / "b", "--tune", out, check=True)
    manifest = json.loads((tmp_path / "b/manifest.json").read_text())
    assert manifest["tune_overrides"] == result["entries"]


def test_meta_is_skipped_by_check_overrides():
    entries = {"sm90/silu_mul/*/any": {"BLOCK": 512}}
    assert tune.check_overrides({**entries, tune.META_KEY: {"gpu": "x"}}) == entries
    assert tune.check_overrides({tune.META_KEY: {}}) == {}


def test_refusals_are_one_line(tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "t.json"
    assert_one_line_error(engc("tune", tiny_dir("llama"), "-o", out), "no CUDA GPU")   # this machine has none
    assert_one_line_error(engc("tune", tmp_path / "nope", "-o", out), "no such file")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(engc("tune", tmp_path / "empty", "-o", out), "no config.json")
    assert_one_line_error(engc("tune", tiny_dir("llama"), "-o", out, "--ops", "gemm"), "--ops", "silu_gemv")
    assert_one_line_error(engc("tune", tiny_dir("llama"), "-o", out, "--dtype", "float32"), "float32")
    assert not out.exists()
    # a GPU whose arch engc does not build for
    from engc.compiler.tuning import gpu
    from engc.runtime import cubin
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cubin, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), dict(major=7, minor=5, name="Tesla T4", multi_processor_count=40)))
    with pytest.raises(UserError, match="sm75.*sm80, sm90"):
        gpu.local_gpu()


def test_cli_help_lists_tune():
    r = engc("tune", "--help", check=True)
    assert "--budget-s" in r.stdout and "build --tune" in r.stdout
