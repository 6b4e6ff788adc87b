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
from engc.cuda.cubin import Kernel
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
        refused(prepared_1b, "another sm90 tune table", "prepare it again")
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


# ------------------------------------------------------------------------------------------ the MoE op

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                 "tie_word_embeddings": False}
MOE = TuneOptions(ops=("moe",))


@pytest.fixture
def qwen3_30b(tmp_path):
    """Qwen3-30B-A3B's config.json alone: engc tune --ops moe reads no weights."""
    (tmp_path / "q30").mkdir()
    (tmp_path / "q30/config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return tmp_path / "q30"


@pytest.fixture
def untuned_moe(monkeypatch):
    """The MoE kernels at their spec's defaults, as on an arch whose table has no MoE line yet: the fake
    times below are written from that starting point."""
    for key in [k for k in tune.TUNE if "/moe/" in k]:
        monkeypatch.delitem(tune.TUNE, key)


def test_moe_shapes_and_candidates_are_the_builds_kernels(untuned_moe):
    from engc.compiler.tune import moe
    from engc.kernels.moe.specs import DEFAULTS
    cfg = tp.model_config(QWEN3_30B_A3B)
    shapes = tp.model_shapes(cfg, ("moe",))
    assert [(s.name, s.tokens) for s in shapes] == [("grouped", 32), ("grouped", 64), ("grouped", 256),
                                                    ("prefill", 4096), ("decode", 1), ("decode", 4)]
    assert {(s.k, s.n, s.per_step) for s in shapes} == {(2048, 768, 48)}
    assert tp.model_shapes(tp.model_config(LLAMA_1B), ("moe",)) == []   # a dense model has no MoE op
    sizes = {}
    for s in shapes:
        cur = tp.current_choice(cfg, torch.bfloat16, "sm90", s)
        # the current choice is the spec's defaults (no table line yet)
        gate_up = moe.CLASSES[s.name][0]
        assert dict(cur.fields) == {n: DEFAULTS[gate_up][n] for n in moe.FIELDS[s.name]}
        grid = tp.candidates(s, cur, "sm90", 132)
        assert grid[0] == cur and len(set(grid)) == len(grid) and all(c.bucket == s.name for c in grid)
        sizes[s.name] = len(grid)
        for cand in grid:
            f = dict(cand.fields)
            assert s.name == "decode" or moe.gate_up_smem(f) <= moe.SMEM["sm90"]
        for cand in grid[:: max(1, len(grid) // 6)]:   # each candidate is what a build under its entries compiles
            up, down = tp.kernel_specs(cfg, torch.bfloat16, "sm90", s, cand)
            assert (up.variant, down.variant) == moe.CLASSES[s.name]
            for spec in (up, down):
                assert {n: spec.tune[n] for n in dict(cand.fields) if n != "BLOCK_M"} == \
                    {n: v for n, v in cand.fields if n != "BLOCK_M"}
            if s.name != "decode":   # the down walks the gate_up's schedule
                assert up.constexprs["BLOCK_M"] == down.constexprs["BLOCK_M"] == dict(cand.fields)["BLOCK_M"]
    assert 30 <= sizes["grouped"] <= 60 and 30 <= sizes["prefill"] <= 60 and sizes["decode"] == 18
    # A100's smaller shared memory prunes more
    prefill = next(s for s in shapes if s.name == "prefill")
    assert len(tp.candidates(prefill, tp.current_choice(cfg, torch.bfloat16, "sm80", prefill), "sm80", 108)) < \
        sizes["prefill"]


def _moe_rule(shape, cand):
    """Fake times: per class one tile wins by 20% at every T, except where a T alone prefers another."""
    f = dict(cand.fields)
    if shape.name == "grouped":
        return 8.0 if (f["BLOCK_M"], f["BLOCK_N"], f["num_stages"]) == (32, 128, 4) and f["BLOCK_K"] == 64 \
            and f["num_warps"] == 4 else 10.0
    if shape.name == "prefill":
        return 100.0 if f["BLOCK_M"] == 128 and f["BLOCK_N"] == 128 and f["num_warps"] == 8 and \
            f["num_stages"] == 3 and f["BLOCK_K"] == 64 else 130.0
    return 5.0 if (f["BLOCK_N"], f["BLOCK_K"], f["num_warps"]) == (64, 256, 4) and shape.tokens == 4 else 5.5


def test_moe_winners_become_entries_a_build_takes(qwen3_30b, tmp_path, untuned_moe):
    from engc.compiler.tune import moe
    # 8-warp BLOCK_M 16 tiles would be fastest, but their output is wrong: discarded
    bench = FakeBench(_moe_rule, wrong=lambda s, c: dict(c.fields).get("BLOCK_M") == 16 and
                      dict(c.fields)["num_warps"] == 8)
    out, said = tmp_path / "tune.json", []
    result = run_tune(str(qwen3_30b), out, MOE, say=said.append, bench=bench, gpu=H200, clock=_clock())
    assert any("WRONG OUTPUT" in m and "grouped T=32" in m for m in said)
    entries = tune.check_overrides(json.loads(out.read_text()))
    # only the fields that differ from the defaults; the down's BLOCK_M is the gate_up's, never its own; the
    # prefill winner differs in BLOCK_M alone, so its down needs no entry; decode: 10% faster at T=4 only,
    # 5% on average over T = 1, 4, above the 3% margin
    assert entries == result["entries"] == {
        "sm90/moe/gate_up/any": {"BLOCK_M": 32, "BLOCK_N": 128, "num_stages": 4},
        "sm90/moe/down/any": {"BLOCK_N": 128, "num_stages": 4},
        "sm90/moe/gate_up_prefill/any": {"BLOCK_M": 128},
        "sm90/moe/gate_up_decode/any": {"BLOCK_N": 64, "BLOCK_K": 256},
        "sm90/moe/down_decode/any": {"BLOCK_N": 64, "BLOCK_K": 256}}
    cfg = tp.model_config(QWEN3_30B_A3B)
    with tune.overridden(entries):
        specs = {s.variant: s for s in model_specs(cfg, torch.bfloat16, "sm90", 16) if s.op == "moe"}
    assert specs["down"].constexprs["BLOCK_M"] == specs["gate_up"].constexprs["BLOCK_M"] == 32
    assert specs["down_prefill"].constexprs["BLOCK_M"] == 128 and specs["gate_up_prefill"].num_warps == 8
    assert specs["down"].num_stages == 4 and specs["gate_up_decode"].constexprs["BLOCK_K"] == 256
    assert specs["gate_up"].tune_key == "sm90/moe/gate_up/any"
    # the table after the run is the table before it
    assert "sm90/moe/gate_up/any" not in tune.TUNE
    lines = summary(result, out)
    rows = [line for line in lines if line.startswith(("grouped", "prefill", "decode"))]
    assert len(rows) == 6 and "GB/s" in lines[0] and "TFLOP/s" in lines[0]
    prefill = next(line for line in rows if line.startswith("prefill"))
    # 4096 tokens x 8 pairs x 2 x 3 x 2048 x 768 flops in 100 us: 3.1e3 TFLOP/s; every expert read: 1.2 GB
    cells = prefill.split()
    assert cells[1] == "4096" and abs(float(cells[7]) - 4096 * 8 * 6 * 2048 * 768 / 100e-6 / 1e12) < 1
    assert abs(float(cells[6]) - 128 * 3 * 2048 * 768 * 2 / 100e-6 / 1e9) < 1
    assert "m128n128k64w8s3" in prefill and "wrote" in lines[-2]


def test_moe_inside_the_margin_keeps_the_defaults(qwen3_30b, tmp_path):
    bench = FakeBench(lambda s, c: 10.0 if c == bench.plan.current[s] else 9.8)
    result = run_tune(str(qwen3_30b), tmp_path / "t.json", MOE, say=lambda m: None, bench=bench, gpu=H200,
                      clock=_clock())
    assert result["entries"] == {} and not any(c.changed for c in result["choices"])


def test_moe_prepared_candidates_load_their_records(qwen3_30b, tmp_path, monkeypatch):
    from engc.compiler.tune import gpu, moe
    from engc.cuda import records
    folder = tmp_path / "prep"
    doc = prepare(str(qwen3_30b), folder, MOE, "sm90", 132, say=lambda m: None, compiler=fake_compile)
    # the shapes of a class share their candidates' kernels: compiled and stored once
    per_class = {c: len(next(s for s in doc["shapes"] if s["name"] == c)["candidates"]) for c in moe.CLASSES}
    assert len(doc["files"]) <= 2 * sum(per_class.values())
    prep = prepared.load(folder)
    for s in prep.plan.shapes:
        assert s.tokens in moe.TOKENS[s.name] and prep.plan.current[s] == prep.plan.candidates[s][0]
        for c in prep.plan.candidates[s]:
            up, down = prep.records[(s, c)]
            assert (up["variant"], down["variant"]) == moe.CLASSES[s.name]
            f = dict(c.fields)
            assert up["tune"]["BLOCK_N"] == down["tune"]["BLOCK_N"] == f["BLOCK_N"]
            if s.name != "decode":
                assert up["launch"]["BLOCK_M"] == down["launch"]["BLOCK_M"] == f["BLOCK_M"]
    calls = []
    monkeypatch.setattr(records, "load_kernel", lambda image, name, sig, **kw: calls.append(name) or object())
    kernels = gpu.load_candidates(prep, say=lambda m: None)
    assert len(calls) == len(prep.info["files"])
    assert set(kernels) == set(prep.records)
    assert all(len(v) == 2 for v in kernels.values())
    assert sum("gate_up" in n for n in calls) > 0 and sum("down" in n for n in calls) > 0
    # a config that did not compile fails its candidate (both kernels, every T of its class)
    bad = prep.plan.candidates[prep.plan.shapes[0]][3]

    def compile_but(specs, say):
        out = fake_compile(specs, say)
        return [None if s.variant == "down" and s.constexprs["BLOCK_N"] == dict(bad.fields)["BLOCK_N"] and
                s.num_stages == dict(bad.fields)["num_stages"] and s.num_warps == dict(bad.fields)["num_warps"]
                and s.constexprs["BLOCK_K"] == dict(bad.fields)["BLOCK_K"] and
                s.constexprs["BLOCK_M"] == dict(bad.fields)["BLOCK_M"] else r for s, r in zip(specs, out)]
    prepare(str(qwen3_30b), tmp_path / "prep2", MOE, "sm90", 132, say=lambda m: None, compiler=compile_but)
    prep2 = prepared.load(tmp_path / "prep2")
    grouped = [s for s in prep2.plan.shapes if s.name == "grouped"]
    assert all(prep2.records[(s, bad)] is None for s in grouped)


class _StandIn:
    """A loaded kernel's stand-in on the CPU: the MoE kernel's arithmetic in torch over the tensors the
    launch's pointers name (what the real kernel reads and writes), so MoeBench's launch wiring (schedule,
    grids, argument order, BLOCK_M) and its check are tested without a GPU."""

    SIGNATURES = {"moe_gate_up_kernel": "p" * 8 + "i", "moe_down_kernel": "p" * 9 + "i",
                  "moe_gate_up_route_kernel": "p" * 9 + "iii", "moe_down_combine_kernel": "p" * 8}

    pointers = Kernel.pointers   # the real kernel's: it reads only the signature

    def __init__(self, record, tensors, broken=False):
        self.record, self.tensors, self.broken = record, tensors, broken
        self.signature = self.SIGNATURES[record["entry"]]
        self.grids = []

    def launch(self, grid, ptrs, stream):
        import torch.nn.functional as F
        self.grids.append(grid)
        if self.broken:
            return
        t = self.tensors()
        tensor = lambda p: t[p] if p in t else p  # noqa: E731
        if self.record["entry"] == "moe_gate_up_route_kernel":   # the routing from the logits, then the GLUs
            x, _, w, _, _, logits, weights, ids, act, softmax_first, renormalize, _ = map(tensor, ptrs)
            assert (softmax_first, renormalize) == (1, 1)   # the bench's routing, Qwen3's
            probs = torch.softmax(logits.float(), dim=-1)
            top, top_ids = torch.topk(probs, ids.shape[1], dim=-1)
            weights.copy_((top / top.sum(-1, keepdim=True)).to(x.dtype).float())
            ids.copy_(top_ids)
            for pair, e in enumerate(ids.view(-1).tolist()):
                g, u = F.linear(x[pair // ids.shape[1]], w[e]).chunk(2)
                act[pair] = F.silu(g) * u
            return
        if self.record["entry"] == "moe_down_combine_kernel":
            act, _, w, _, _, ids, weights, out = map(tensor, ptrs)
            k = ids.shape[1]
            for tok in range(out.shape[0]):
                out[tok] = sum((F.linear(act[tok * k + j], w[int(ids[tok, j])]) * weights[tok, j]).to(out.dtype)
                               for j in range(k))
            return
        bm = self.record["launch"].get("BLOCK_M", 1)
        gate_up = self.record["entry"].startswith("moe_gate_up")
        if gate_up:   # float experts: the scale and zero pointers (after x, after w) are x's and w's, unread
            x, _, w, _, _, rows, be, act, n = (t[p] if i < 8 else p for i, p in enumerate(ptrs))
        else:
            act, _, w, _, _, rows, be, weights, pairs, n = (t[p] if i < 9 else p for i, p in enumerate(ptrs))
        be = be.reshape(-1)   # a fused gate_up's ids [T, k], read flat: a block a pair
        if self.record["constexprs"]["PAIR_ORDER"]:   # the decode variants: program m is pair m, rows unread
            rows = torch.arange(be.numel())
        assert grid[0] * bm == rows.numel()
        for r, pair in enumerate(rows.tolist()):
            e = int(be[r // bm])
            if pair >= n or e < 0:
                continue
            if gate_up:   # act has a row a pair, as the kernel writes it
                g, u = F.linear(x[pair // (n // x.shape[0])], w[e]).chunk(2)
                act[pair] = F.silu(g) * u
            else:
                pairs[pair] = (F.linear(act[pair], w[e]) * weights.view(-1)[pair]).to(pairs.dtype)


@pytest.mark.parametrize("cls,fused", [("grouped", (0, 0)), ("prefill", (0, 0)), ("decode", (0, 0)),
                                       ("decode", (1, 0)), ("decode", (1, 1))])
def test_moe_bench_launches_check_against_the_reference_on_cpu(tmp_path, cls, fused, monkeypatch):
    from engc.compiler.tune import moe
    from engc.compiler.tune.gpu_moe import MoeBench
    from engc.cuda import cubin
    monkeypatch.setattr(cubin, "current_stream", lambda: 0)
    monkeypatch.setitem(moe.TOKENS, "prefill", (48,))   # the CPU reference at 4096 tokens is slow
    cfg = dict(QWEN3_30B_A3B, hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    (tmp_path / "m").mkdir()
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    # fused: which of the decode pair are the fused kernels (gate_up routing its pairs, down summing each token's)
    with tune.overridden({f"sm90/moe/{v}/any": {"fused": f} for v, f in zip(("gate_up_decode", "down_decode"), fused)}):
        prepare(str(tmp_path / "m"), tmp_path / "p", MOE, "sm90", 132, say=lambda m: None, compiler=fake_compile)
        prep = prepared.load(tmp_path / "p")   # under the table it was prepared with
    shape = [s for s in prep.plan.shapes if s.name == cls][-1]
    cand = prep.plan.candidates[shape][min(5, len(prep.plan.candidates[shape]) - 1)]
    bench = None

    def tensors():
        found = [*bench._weights["gate_up"], *bench._weights["down"]]
        found += [v for b in bench._inputs.values() for v in b.values()]
        found += [v for sched in bench._schedules.values() for v in sched if v is not None]   # decode: no rows
        return {v.data_ptr(): v for v in found}

    def kernels(broken):
        return {(shape, cand): [(_StandIn(r, tensors, broken), r) for r in prep.records[(shape, cand)]]}
    plan = prep.plan
    plan.dtype = torch.float32   # the stand-ins' torch arithmetic, compared at float32's precision
    bench = MoeBench(plan, kernels(False), ring_bytes=3 * 8 * 3 * 64 * 32 * 4, device="cpu")
    assert bench.copies == 3
    fns = bench.launches(shape, cand)
    assert len(fns) == 3
    assert bench.check(shape, cand) < 1e-5
    (up, _), (down, _) = bench.kernels[(shape, cand)]
    blocks = 2 * shape.tokens if cls == "decode" else up.grids[-1][0]
    assert up.grids[-1] == (blocks, -(-32 // dict(cand.fields)["BLOCK_N"]), 1)
    assert up.record["entry"] == ("moe_gate_up_route_kernel" if fused[0] else "moe_gate_up_kernel")
    assert down.record["entry"] == ("moe_down_combine_kernel" if fused[1] else "moe_down_kernel")
    # the fused decode down: a program a token (and N tile), summing its pairs
    assert down.grids[-1] == (shape.tokens if fused[1] else blocks, -(-64 // dict(cand.fields)["BLOCK_N"]), 1)
    bench.kernels = kernels(True)   # a kernel that writes nothing is caught (nan: over any tolerance)
    assert not bench.check(shape, cand) <= 1e-2


def test_moe_tune_file_builds(tiny_dir, tmp_path, untuned_moe):
    """A (faked) MoE run's file on the tiny Qwen3-MoE goes through `engc build --tune` as it is, and a build
    under it compiles the chosen tiles."""
    bench = FakeBench(_moe_rule)
    out = tmp_path / "tune.json"
    result = run_tune(str(tiny_dir("qwen3_moe")), out, MOE, say=lambda m: None, bench=bench, gpu=H200,
                      clock=_clock())
    assert result["entries"]["sm90/moe/gate_up/any"]["BLOCK_M"] == 32
    engc("build", tiny_dir("qwen3_moe"), "-o", tmp_path / "b", "--tune", out, check=True)
    manifest = json.loads((tmp_path / "b/manifest.json").read_text())
    assert manifest["tune_overrides"] == result["entries"]
    with tune.overridden(tune.read_tune_file(out)):
        specs = {s.variant: s for s in model_specs(result["plan"].cfg, torch.bfloat16, "sm90", 16) if s.op == "moe"}
    assert specs["down"].constexprs["BLOCK_M"] == 32 and specs["down"].constexprs["BLOCK_N"] == 128
