"""Codegen compiles every kernel of a tiny model for sm80 and sm90 with no GPU, deterministically, and its
records agree with the op launch rules the runtime uses."""
from __future__ import annotations

import json

import pytest
import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.codegen.cuda import nvcc_path

ARCHS = ["sm80", "sm90"]
TINY = ModelConfig(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                   max_position_embeddings=256, tie_word_embeddings=True, qk_norm=True)
EXPECTED = {("rms_norm", "rms_norm"), ("rms_norm", "add_rms_norm"), ("silu_mul", "default"),
            ("qk_norm", "default"), ("rotary", "pos_i64"), ("rotary", "pos_i32"),
            ("paged_attention", "decode"), ("paged_attention", "decode_rotary"), ("paged_attention", "prefill"),
            *[("sampling", f"{stage}_{lt}") for stage in ("stats", "bound", "compact", "finish") for lt in ("bf16", "fp32")],
            ("gemv", "silu_k128_m1"), ("gemv", "k64_m1_n4k1024w4"),
            ("argmax", "partial_bf16"), ("argmax", "partial_fp32"), ("argmax", "final")}


@pytest.fixture(scope="module")
def runs():
    from engc.compiler.codegen import compile_kernels
    # The second run compiles in child processes: identical bytes also prove the parallel path.
    first = compile_kernels(TINY, torch.bfloat16, ARCHS, block_size=16, jobs=1)
    second = compile_kernels(TINY, torch.bfloat16, list(reversed(ARCHS)), block_size=16, jobs=2)
    return first, second


def test_every_kernel_compiled_per_arch(runs):
    result, _ = runs
    got = {(r["op"], r["variant"], r["arch"]) for r in result.records}
    cluster = {("paged_attention", "decode_rotary_cluster", "sm90")} if nvcc_path() else set()   # CUDA C++
    assert got == {(op, v, a) for op, v in EXPECTED for a in ARCHS} | cluster
    for r in (r for r in result.records if "nvcc_version" not in r):   # Triton's (nvcc's: test_cuda_codegen)
        cubin, ptx = result.files[r["cubin"]], result.files[r["ptx"]].decode()
        assert r["source"] in result.files
        assert cubin[:4] == b"\x7fELF"
        assert f".entry {r['entry']}(" in ptx
        assert ".version 8.7" in ptx
        assert f".target {r['ptx_target']}" in ptx
        assert r["ptx_target"] == {"sm80": "sm_80", "sm90": "sm_90a"}[r["arch"]]
        assert r["cubin"].startswith(f"kernels/{r['arch']}/") and r["ptx"].startswith(f"kernels/{r['arch']}/")
        assert r["args"][-2:] == [{"name": "global_scratch", "type": "*i8"},
                                  {"name": "profile_scratch", "type": "*i8"}]
        assert r["tune_key"].startswith(f"{r['arch']}/{r['op']}/")
        assert r["num_ctas"] == 1 and r["num_warps"] in (1, 2, 4, 8, 16) and r["shared_mem"] >= 0


def test_records_are_json_and_paths_are_clean(runs):
    result, _ = runs
    json.dumps(result.records, sort_keys=True)
    for path, data in result.files.items():
        assert not path.startswith("/") and ".." not in path
        for marker in (b"/work/", b"/root/", b"/home/", b"/tmp/", b"site-packages"):
            assert marker not in data, f"{path} embeds a machine path ({marker!r})"


def test_byte_identical_across_runs(runs):
    first, second = runs
    assert sorted(first.files) == sorted(second.files)
    for path in first.files:
        assert first.files[path] == second.files[path], path
    assert json.dumps(first.records, sort_keys=True) == json.dumps(second.records, sort_keys=True)


def _example_launches(consts):
    """One call of every launch rule on small CPU tensors (only shapes and dtypes matter here)."""
    from engc.kernels import paged_attention, qk_norm, rms_norm, rotary, sampling, silu_mul
    H, KV, D, T = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim, 3
    bf = torch.bfloat16
    x = torch.randn(T, TINY.hidden_size, dtype=bf)
    w = torch.ones(TINY.hidden_size, dtype=bf)
    qkv = torch.randn(T, (H + 2 * KV) * D, dtype=bf)
    cache = torch.zeros(2, 4, 16, KV, D, dtype=bf)
    q = torch.randn(T, H * D, dtype=bf)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    yield "rms_norm", rms_norm.launch(x, w, 1e-6, torch.empty_like(x))
    yield "rms_norm", rms_norm.launch(x, w, 1e-6, torch.empty_like(x), residual=x.clone())
    yield "silu_mul", silu_mul.launch(torch.randn(T, 2 * TINY.intermediate_size, dtype=bf),
                                      torch.empty(T, TINY.intermediate_size, dtype=bf), consts=consts["silu_mul"])
    yield "qk_norm", qk_norm.launch(qkv, torch.ones(D, dtype=bf), torch.ones(D, dtype=bf), 1e-6, qkv)
    for idx in (torch.int64, torch.int32):
        yield "rotary", rotary.launch(qkv, torch.arange(T).to(idx), torch.ones(D // 2), cache,
                                      torch.arange(T).to(idx), torch.empty_like(q))
    for max_q in (1, 2):
        qsl = torch.tensor([0, 1, 1 + max_q], dtype=torch.int32)
        yield "paged_attention", paged_attention.launch(
            q, cache, bt, torch.tensor([5, 9], dtype=torch.int32), qsl, torch.empty_like(q), num_heads=H,
            num_kv_heads=KV, head_dim=D, scale=0.25, max_query_len=max_q, max_context_len=4096,
            consts=consts["paged_attention"])
    for ctx_len in (1, 4096):   # one split (null partials and counters), then many
        yield "paged_attention", paged_attention.launch_rotary_decode(
            qkv[:2], torch.arange(2), torch.ones(D // 2), cache, torch.arange(2), bt,
            torch.tensor([5, 9], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.empty(2, H * D, dtype=bf), num_heads=H, num_kv_heads=KV, head_dim=D, scale=0.25,
            max_context_len=ctx_len, consts=consts["paged_attention"])
    if "decode_rotary_cluster" in consts["paged_attention"]:   # sm90 with nvcc: one short sequence
        yield "paged_attention", paged_attention.launch_rotary_decode(
            qkv[:1], torch.arange(1), torch.ones(D // 2), cache, torch.arange(1), bt[:1],
            torch.tensor([5], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.empty(1, H * D, dtype=bf), num_heads=H, num_kv_heads=KV, head_dim=D, scale=0.25,
            max_context_len=255, consts=consts["paged_attention"])
    from engc.kernels import gemv
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32)
    table = gemv.variant_table(consts["gemv"])
    assert gemv.pick(table, TINY.hidden_size, False, 2, 64) is None   # plain projections: M=1 only
    # SiLU-fused down; o (K = q_size, N = hidden: the per-N plain kernel of K <= 2048, N <= 2048)
    for silu, k, n in ((True, TINY.intermediate_size, 64), (False, TINY.q_size, TINY.hidden_size)):
        for m in (1,):
            variant = gemv.pick(table, k, silu, m, n)
            x = torch.randn(m, 2 * k if silu else k, dtype=bf)
            yield "gemv", gemv.launch(x, torch.randn(n, k, dtype=bf), torch.empty(m, n, dtype=bf), variant,
                                      consts["gemv"][variant], counters)
    from engc.kernels import argmax
    for dt in (bf, torch.float32):
        yield "argmax", argmax.launch(torch.randn(2, TINY.vocab_size, dtype=dt), torch.empty(2, dtype=torch.int64),
                                      consts["argmax"])
    for dt in (bf, torch.float32):
        yield "sampling", sampling.launch(torch.randn(2, TINY.vocab_size, dtype=dt), torch.ones(2),
                                          torch.zeros(2, dtype=torch.int32), torch.ones(2), torch.rand(2),
                                          torch.zeros(2), torch.empty(2, dtype=torch.int64), consts["sampling"])


def test_launch_rules_match_records(runs):
    result, _ = runs
    records = {(r["op"], r["variant"]): r for r in result.records if r["arch"] == "sm90"}
    consts = {}
    for (op, variant), r in records.items():
        consts.setdefault(op, {})[variant] = r["launch"]
    seen = set()
    for op, launches in _example_launches(consts):
        assert launches
        for variant, grid, args in launches:
            seen.add((op, variant))
            check_launch(grid, args, records[(op, variant)])
    assert seen == set(records)


_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "i32": torch.int32,
          "i64": torch.int64, "fp8e4nv": torch.float8_e4m3fn, "u8": torch.uint8}


def check_launch(grid, args, rec: dict, null_pointers: bool = True) -> None:
    """One launch of a launch rule's output against the kernel record it launches: a 3-D grid of positive ints,
    and every parameter in order with its recorded type (a pointer: a tensor of that dtype, or 0 for the scratch
    pointers and, with null_pointers, for an unused one; fp32: a float; the integers: an int)."""
    where = (rec["op"], rec["variant"])
    assert len(grid) == 3 and all(isinstance(g, int) and g >= 1 for g in grid), where
    assert len(args) == len(rec["args"]), where
    for value, spec in zip(args, rec["args"]):
        if spec["type"] == "*i8" or (null_pointers and spec["type"].startswith("*") and isinstance(value, int)):
            assert value == 0, (where, spec)    # scratch or an unused (null) pointer
        elif spec["type"].startswith("*"):
            assert isinstance(value, torch.Tensor), (where, spec)
            assert value.dtype == _TORCH[spec["type"][1:]], (where, spec)
        elif spec["type"] == "fp32":
            assert isinstance(value, float), (where, spec)
        else:
            assert isinstance(value, int) and not isinstance(value, bool), (where, spec)


def launch_checker(records: dict, arch: str = "sm90", stand_in=None):
    """A run(launches) for an op's forward() that check_launch-es every launch against records[(arch, variant)]
    (null pointers allowed) and notes its variant in .seen; stand_in(variant, args), where given, then does what
    a launch's kernel would where the next launch rule needs its outputs."""
    def run(launches):
        for variant, grid, args in launches:
            run.seen.add(variant)
            check_launch(grid, args, records[(arch, variant)], null_pointers=False)
            if stand_in is not None:
                stand_in(variant, args)
    run.seen = set()
    return run


def test_tune_entry_recorded_and_unknown_arch_refused():
    from engc.compiler.codegen import model_specs
    from engc.errors import UserError
    specs = model_specs(TINY, torch.float16, "sm90", 16)
    decode = next(s for s in specs if s.variant == "decode")
    assert decode.constexprs["BLOCK_N"] == decode.tune["BLOCK_N"]
    assert decode.launch["target_programs"] == decode.tune["target_programs"]
    with pytest.raises(UserError, match="unsupported arch 'sm70'"):
        model_specs(TINY, torch.float16, "sm70", 16)


def test_pdl_kernels_wait_on_sm90_only(runs):
    """Kernels written for programmatic dependent launch are compiled with it on sm90 (the record tells the
    runtime to launch them so, and the PTX waits before touching step data) and without it on sm80."""
    result, _ = runs
    pdl_ops = {"rms_norm", "silu_mul", "qk_norm", "rotary", "paged_attention", "gemv", "argmax"}
    for r in result.records:
        if r["op"] not in pdl_ops:
            continue
        ptx = result.files[r["ptx"]].decode()
        on = r["arch"] == "sm90"
        assert r["launch"].get("PDL") == int(on), (r["op"], r["variant"], r["arch"])
        assert ("griddepcontrol.wait" in ptx) == on, (r["op"], r["variant"], r["arch"])


def test_smem_carveout_is_a_launch_constant_where_an_entry_names_one():
    """An entry's smem_carveout reaches its kernels' records as a launch constant (Triton's and the CUDA
    templates'), never the compiled kernel's constants; entries without one record none (the driver picks)."""
    from engc.compiler import tune
    from engc.compiler.codegen import cuda, model_specs
    from engc.kernels.int4_linear.cuda_specs import int4_gemv_spec
    from engc.compiler.codegen.record import kernel_record
    meta = {"name": "k", "ptx_target": "sm_90", "num_warps": 4, "num_ctas": 1, "shared": 0, "triton_version": "t"}
    silu = lambda: next(s for s in model_specs(TINY, torch.bfloat16, "sm90", 16) if s.op == "silu_mul")  # noqa: E731
    int4 = lambda: int4_gemv_spec(128, "bf16", "sm90")[0]  # noqa: E731
    triton_launch = lambda: kernel_record(silu(), meta, "c", "p", "s")["launch"]  # noqa: E731
    cuda_launch = lambda: cuda.kernel_record(int4(), ".target sm_90\n", "c", "p", "s", "13.0")["launch"]  # noqa: E731
    assert "smem_carveout" not in triton_launch() and "smem_carveout" not in cuda_launch()
    entries = tune.check_overrides({"sm90/silu_mul/*/any": {"smem_carveout": 40},
                                    "sm90/int4_linear/cuda/gemv": {"smem_carveout": 25}})
    with tune.overridden(entries):
        assert triton_launch()["smem_carveout"] == 40 and cuda_launch()["smem_carveout"] == 25
        assert "smem_carveout" not in silu().constexprs
    for bad in (101, -2, "40", True):
        with tune.overridden({"sm90/silu_mul/*/any": {"smem_carveout": bad}}), \
                pytest.raises(ValueError, match="smem_carveout"):
            triton_launch()


def test_sources_recorded_with_the_helpers_they_import(runs):
    """A cubin is compiled from its triton.py and from the modules whose @triton.jit helpers it calls
    (kernels/pdl.py; paged_attention/tiles.py; gemm_tiles.py and the silu_rows.py it imports): the bundle records
    each of them beside the kernel's source, as the file reads, and the kernel cache's key covers every one."""
    from pathlib import Path

    import engc
    from engc.compiler.kernel_cache import source_files
    result, _ = runs
    root = Path(engc.__file__).parent
    digested = {f.relative_to(root).as_posix() for f in source_files()}
    attention = next(r for r in result.records if r["op"] == "paged_attention")
    assert attention["imports"] == ["kernels/src/paged_attention/tiles.py", "kernels/src/pdl.py"]
    gemv = next(r for r in result.records if r["op"] == "gemv")
    assert gemv["imports"] == ["kernels/src/gemm_tiles.py", "kernels/src/pdl.py", "kernels/src/silu_rows.py"]
    for r in result.records:
        if "nvcc_version" in r:     # a CUDA C++ kernel: its source is the rendered template (test_cuda_codegen)
            continue
        assert f"kernels/{r['op']}/triton.py" in digested
        assert result.files[r["source"]] == (root / "kernels" / r["op"] / "triton.py").read_bytes()
        for path in r["imports"]:
            rel = "kernels/" + path.removeprefix("kernels/src/")
            assert result.files[path] == (root / rel).read_bytes() and rel in digested, path
        if "PDL" in r["constexprs"]:
            assert "kernels/src/pdl.py" in r["imports"], (r["op"], r["variant"])


def test_cache_key_ignores_comments_in_python_but_not_in_triton_code(tmp_path):
    """The kernel cache's key covers Python without its comments (a note in codegen, a spec builder or a
    contract keeps prepared caches), Triton code and templates by their bytes (the bundle records them as
    they read, and Triton's line info follows their lines); a folder's bind.py (the runtime's) not at all."""
    from engc.compiler.kernel_cache import digested_form, source_files
    forms = {}
    for kind, head in (("python", ""), ("triton", "import triton\n")):
        for name, text in (("a", "X = 1\n"), ("b", "# measured on an H200\n\nX = 1  # why\n"), ("c", "X = 2\n")):
            f = tmp_path / kind / f"{name}.py"
            f.parent.mkdir(exist_ok=True)
            f.write_text(head + text)
            forms[kind, name] = digested_form(f)
    assert forms["python", "a"] == forms["python", "b"] != forms["python", "c"]
    assert len({forms["triton", n] for n in "abc"}) == 3
    names = {(f.parent.name, f.name) for f in source_files()}
    assert ("rms_norm", "specs.py") in names and ("rms_norm", "triton.py") in names
    assert not any(name == "bind.py" for _, name in names)


def test_cache_key_of_codegen_is_the_same_under_every_python(tmp_path):
    """A cache filled under this Python must serve a build under another (the GPU machine runs 3.12): the
    key is codegen's text without comments, which no Python version changes, where a syntax-tree dump did
    (3.12 adds type_params). A '#' inside a string is code, not a comment."""
    from engc.compiler.kernel_cache import code_without_comments
    src = 'def f(x):  # why\n\n    return "#1" + x   \n# note\nY = f"{1 + 2}#"\n'
    assert code_without_comments(src) == 'def f(x):\n    return "#1" + x\nY = f"{1 + 2}#"'


def test_decode_split_rule_of_the_sm90_table():
    """The decode's split rule with the table's sm90 entries (H200 measurements in the tune table): a lone sequence
    splits down to one tile a program; a busy batch (8B batch 32: 256 (sequence, KV head) pairs) takes the
    two splits it wants from two tiles of context, in an eager step as in a graph sized for the block table;
    batch 64 fills the GPU with one."""
    from engc.compiler import tune
    from engc.kernels.paged_attention import decode_splits
    d128 = tune.lookup("sm90", "paged_attention", "decode", "d<=128")[1]
    assert d128["BLOCK_N"] == 32 and d128["min_split_tokens_busy"] == 64
    assert decode_splits(1, 8, 255, d128) == 7                  # the b<=4 graphs' context bucket
    assert decode_splits(1, 8, 8192, d128) == 33                # 264 programs
    for ctx in (128, 192, 1000, 8192):                          # 8B batch 32: eager contexts and the graph's
        assert decode_splits(32, 8, ctx, d128) == 2
    assert decode_splits(32, 8, 100, d128) == 1                 # under two tiles a split
    assert decode_splits(64, 8, 8192, d128) == 1
    d64 = tune.lookup("sm90", "paged_attention", "decode", "d<=64")[1]
    assert d64["min_split_tokens_busy"] == 2 * d64["BLOCK_N"]
