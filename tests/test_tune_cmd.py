"""engc tune without a GPU: the candidate grid, --prepare's folder (real AOT compiles on a reduced grid; the
rest with a fake compiler), --from's loading and checks (the GPU, timer and checker faked), the winner
selection, the file's round trip through tune.check_overrides and `engc build --tune`, and the one-line
refusals."""
import hashlib
import json

import pytest
import torch

from engc.compiler import tune
from engc.compiler.codegen.specs import model_specs
from engc.compiler.tune import plan as tp, prepared
from engc.compiler.tune.search import TuneOptions, prepare, summary, tune_from
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


def fake_compile(specs, say):
    """compile_spec's results without Triton: a distinct 'cubin' per distinct kernel (as num_warps, stages and
    constexprs make one), so tests of everything after the compile run in milliseconds."""
    out = []
    for spec in specs:
        key = repr((sorted(spec.constexprs.items()), spec.num_warps, spec.num_stages)).encode()
        out.append((b"CUBIN" + key, "", {"name": spec.fn_name, "num_warps": spec.num_warps, "num_ctas": 1,
                                         "shared": 0, "ptx_target": "sm_90a", "triton_version": "fake"}))
    return out


def run_tune(src, out, opts, say, bench, gpu, clock, folder=None):
    """--prepare (fake compile) then --from (fake GPU): the two halves as the two machines run them."""
    folder = folder or out.parent / "prepared"
    prepare(str(src), folder, opts, "sm90", 132, say=say, compiler=fake_compile)
    return tune_from(folder, out, opts, say=say, bench=bench, gpu=gpu, clock=clock)


class FakeBench:
    """Times from a rule instead of a GPU; `wrong` candidates give a bad output (and are the fastest)."""

    def __init__(self, rule, wrong=lambda s, c: False):
        self.rule, self.wrong, self.timed = rule, wrong, []

    def __call__(self, prep, say):
        self.plan, self.records = prep.plan, prep.records
        return self

    def ready(self, shape, cand):
        return cand.bucket is None or self.records[(shape, cand)] is not None

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
    # the table as commented in the tune table: o and lm_head on their classes, qkv and gate_up on cuBLAS,
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
    import triton
    meta = data["_meta"]
    assert meta["gpu"] == "fake H200" and meta["arch"] == "sm90" and meta["model"] == "1b"
    assert meta["triton"] == triton.__version__   # the compiler of the timed kernels: --prepare's
    assert {"torch", "triton"} <= set(meta["gpu_machine"]) and "cold L2" in meta["note"]
    assert {"date", "measured"} <= set(meta)
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
    assert "3 tune entries" in lines[-2] and "end to end" in lines[-1]


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
    out, src = tmp_path / "t.json", tiny_dir("llama")
    assert_one_line_error(engc("tune", src, "-o", out), "no CUDA GPU")   # this machine has none
    assert_one_line_error(engc("tune", tmp_path / "nope", "--prepare", tmp_path / "p"), "no such file")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(engc("tune", tmp_path / "empty", "--prepare", tmp_path / "p"), "no config.json")
    assert_one_line_error(engc("tune", src, "--prepare", tmp_path / "p", "--ops", "gemm"), "--ops", "silu_gemv")
    assert_one_line_error(engc("tune", src, "--prepare", tmp_path / "p", "--dtype", "float32"), "float32")
    assert_one_line_error(engc("tune", src, "--prepare", tmp_path / "p", "--arch", "sm75"), "sm75", "sm80, sm90")
    # the two halves take their own options
    assert_one_line_error(engc("tune", src, "--prepare", tmp_path / "p", "-o", out), "drop -o")
    assert_one_line_error(engc("tune", src, "--prepare", tmp_path / "p", "--margin", "0.1"), "--margin", "--from")
    assert_one_line_error(engc("tune", src, "--prepare", tmp_path / "p", "--from", tmp_path / "p"), "give one")
    assert_one_line_error(engc("tune", src, "--from", tmp_path / "p", "-o", out), "drop SRC")
    assert_one_line_error(engc("tune", "--from", tmp_path / "p", "-o", out, "--arch", "sm80"), "--arch", "--prepare")
    assert_one_line_error(engc("tune", "-o", out), "SRC", "--from DIR")
    assert_one_line_error(engc("tune", src, "-o", out, "--sms", "100"), "--sms", "--prepare")
    assert not out.exists() and not (tmp_path / "p").exists()
    # a GPU whose arch engc does not build for
    from engc.compiler.tune import gpu
    from engc.cuda import cubin
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cubin, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), dict(major=7, minor=5, name="Tesla T4", multi_processor_count=40)))
    with pytest.raises(UserError, match="sm75.*sm80, sm90"):
        gpu.local_gpu()


@pytest.fixture
def prepared_1b(config_only, tmp_path):
    """A 1B tune-prepare folder with fake cubins (the folder as --prepare writes it otherwise)."""
    folder = tmp_path / "prep"
    prepare(str(config_only), folder, TuneOptions(), "sm90", 132, say=lambda m: None, compiler=fake_compile)
    return folder


def test_from_refuses_a_folder_it_cannot_trust(prepared_1b, tmp_path):
    out, opts = tmp_path / "t.json", TuneOptions()

    def refused(folder, *fragments, gpu=H200):
        with pytest.raises(UserError) as e:
            tune_from(folder, out, opts, say=lambda m: None, bench=FakeBench(lambda s, c: 1.0), gpu=gpu)
        for f in fragments:
            assert f in str(e.value), str(e.value)
        assert "\n" not in str(e.value) and not out.exists()

    refused(tmp_path / "nope", "no such folder", "--prepare")
    (tmp_path / "other").mkdir()
    refused(tmp_path / "other", "not a folder written by engc tune --prepare")
    refused(prepared_1b, "prepared for sm90", "is sm80", "--arch sm80", gpu=lambda: ("sm80", "fake A100", 108))
    refused(prepared_1b, "132 multiprocessors", "has 114", "--sms 114", gpu=lambda: ("sm90", "fake H100 PCIe", 114))
    with tune.overridden({"sm90/gemv/*/m<=1/n8k512w2": {"num_stages": 4}}):   # another checkout's table
        refused(prepared_1b, "another sm90 gemv tune table", "prepare it again")
    plan = json.loads((prepared_1b / prepared.PLAN_FILE).read_text())
    (prepared_1b / prepared.PLAN_FILE).write_text(json.dumps({**plan, "version": 99}))
    refused(prepared_1b, "format 99")
    assert_one_line_error(engc("tune", "--from", tmp_path / "other", "-o", out), "not a folder written by")


def test_from_loads_each_cubin_once_and_checks_it(prepared_1b, monkeypatch):
    from engc.compiler.tune import gpu
    from engc.cuda import records
    prep = prepared.load(prepared_1b)
    calls = []
    # the loader a bundle's kernels go through too (engc.cuda.records.load_record)
    monkeypatch.setattr(records, "load_kernel", lambda image, name, sig, **kw: calls.append((image, name, sig, kw))
                        or f"kernel{len(calls)}")
    kernels = gpu.load_candidates(prep, say=lambda m: None)
    # cuBLAS has no kernel; every other candidate has one, and each distinct cubin file was loaded once
    pairs = [(s, c) for s in prep.plan.shapes for c in prep.plan.candidates[s]]
    assert set(kernels) == {(s, c) for s, c in pairs if c.bucket}
    assert len(calls) == len(prep.info["files"]) == len({r["cubin"] for _, r in kernels.values()})
    image, name, sig, kw = calls[0]
    assert name == "gemv_kernel" and sig == "pppppiiii" and kw["scratch_params"] == 2 and kw["pdl"] is True
    # the launch constants of a candidate are its own (target_programs differs among sharers of one cubin)
    down = next(s for s in prep.plan.shapes if s.op == "silu_gemv")
    for cand in prep.plan.candidates[down][1:]:
        assert kernels[(down, cand)][1]["launch"]["target_programs"] == dict(cand.fields)["target_programs"]
    # the plan file holds each cubin's record once; its candidates keep their launch/tune differences only
    doc = json.loads((prepared_1b / prepared.PLAN_FILE).read_text())
    assert set(doc["kernels"]) == set(prep.info["files"])
    assert {k for s in doc["shapes"] for c in s["candidates"] for k in c} <= {"bucket", "fields", "kernel", "launch",
                                                                                "tune", "failed"}
    # a cubin altered after --prepare is refused before the driver sees it
    path = prepared_1b / next(iter(prep.info["files"]))
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(UserError, match="differs from what --prepare wrote"):
        gpu.load_candidates(prepared.load(prepared_1b), say=lambda m: None)
    # the driver refusing one image fails its candidates only
    path.write_bytes(path.read_bytes()[:-1])
    monkeypatch.setattr(records, "load_kernel", lambda image, *a, **kw: (_ for _ in ()).throw(RuntimeError("bad image"))
                        if image == path.read_bytes() else "k")
    said = []
    kernels = gpu.load_candidates(prepared.load(prepared_1b), say=said.append)
    assert len(said) == 1 and "LOAD FAILED" in said[0]
    assert 0 < len(kernels) < len([p for p in pairs if p[1].bucket])


def test_prepare_compiles_what_a_build_ships(config_only, tmp_path, monkeypatch):
    """Real AOT compiles (a reduced grid): the records are the build's, the current choice's cubin is the one a
    stock build ships, and two runs write identical folders."""
    from engc.compiler.codegen.aot import compile_spec
    from engc.compiler.codegen.record import compile_specs
    monkeypatch.setattr(tp, "SILU_TILES", [(8, 2048, 4)])
    monkeypatch.setattr(tp, "STAGES", (2,))
    monkeypatch.setattr(tp, "TARGET_MULTS", (2,))
    opts = TuneOptions()
    a, b = tmp_path / "a", tmp_path / "b"
    doc = prepare(str(config_only), a, opts, "sm90", say=lambda m: None)
    prepare(str(config_only), b, opts, "sm90", say=lambda m: None)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert doc["sms"] == 132 and doc["arch"] == "sm90" and doc["model"] == "1b"
    assert len(doc["files"]) == len(files) - 1 <= 4   # silu: current + 1 tile; plain: two classes at 2 stages
    for path, digest in doc["files"].items():
        assert hashlib.sha256((a / path).read_bytes()).hexdigest() == digest
    prep = prepared.load(a)
    down = next(s for s in prep.plan.shapes if s.op == "silu_gemv")
    current = prep.records[(down, prep.plan.current[down])]
    stock = next(s for s in model_specs(prep.plan.cfg, torch.bfloat16, "sm90", 16)
                 if s.op == "gemv" and s.constexprs["SILU"])
    shipped = compile_specs([stock], jobs=1).records[0]
    assert (a / current["cubin"]).read_bytes() == compile_spec(stock)[0]
    same = ("entry", "args", "constexprs", "launch", "num_warps", "shared_mem", "scratch_params", "variant")
    assert {k: current[k] for k in same} == {k: shipped[k] for k in same}


def test_read_tune_warns_of_another_compiler(tmp_path, capsys):
    import triton
    from engc.compiler.tune import read_tune_file as read_tune
    f = tmp_path / "t.json"
    entries = {"sm90/silu_mul/*/any": {"BLOCK": 512}}
    f.write_text(json.dumps({**entries, "_meta": {"triton": "3.6.0"}}))
    assert read_tune(f) == entries
    assert "Triton 3.6.0" in capsys.readouterr().err
    f.write_text(json.dumps({**entries, "_meta": {"triton": triton.__version__}}))
    assert read_tune(f) == entries and capsys.readouterr().err == ""


def test_cli_help_lists_tune():
    r = engc("tune", "--help", check=True)
    assert all(o in r.stdout for o in ("--prepare", "--from", "--arch", "--budget-s", "build --tune"))
    assert "tune default --prepare" in engc("--help", check=True).stdout
