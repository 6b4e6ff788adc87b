"""The CUDA C++ decode GEMV (templates/gemv.cu.j2): rendered per K, built by nvcc for sm80 and sm90 through
codegen/cuda.py's build.ninja, recorded as op "gemv" variants that kernels/gemv picks before the Triton
ones, launched with the record's own arguments. Correctness needs a GPU, and no tune entry
turns the kernel on, so no GPU test launches it. Tests that compile skip where nvcc is missing."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler import tune
from engc.compiler.codegen import cuda
from engc.kernels.gemv import cuda_specs as cuda_gemv
from engc.compiler.codegen.record import CodegenResult
from engc.kernels.paged_attention.specs import paged_attention_specs
from engc.kernels import gemv
from engc.kernels.gemv import specs as gemv_kernels

ARCHS = ["sm80", "sm90"]
SHAPE = ModelConfig(family="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=1,
                    num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=256, tie_word_embeddings=True, qk_norm=False)
CLASS = gemv_kernels.CUDA_M_CLASSES[-1]
TURN_ON = {CLASS: {"plain": True, "silu": True}}
needs_nvcc = pytest.mark.skipif(cuda.nvcc_path() is None, reason="nvcc is not installed")


def _triton(*archs):
    """The Triton specs the CUDA selection reads (the decode's: arch and model dtype)."""
    return [s for arch in archs for s in paged_attention_specs(SHAPE, "bf16", arch, 16)]


def _spec(k=256, silu=False, t="bf16", arch="sm90", **ov):
    spec, why = cuda_gemv.gemv_spec(k, silu, t, arch, CLASS, ov or None)
    assert spec is not None, why
    return spec


@pytest.fixture(scope="module")
def built():
    specs, notes = cuda_gemv.cuda_specs(_triton(*ARCHS), SHAPE, TURN_ON)
    assert notes == []
    return specs, cuda.compile_cuda(specs)


@needs_nvcc
def test_split_accumulators_compile_for_sm80_and_sm90():
    specs = [_spec(512, silu, arch=arch, TILES=1, UNROLL=8, ACC_SPLIT=2) for arch in ARCHS for silu in (False, True)]
    result = cuda.compile_cuda(specs)
    assert sorted(r["entry"] for r in result.records) == sorted(s.entry for s in specs)


def test_template_renders_the_shape_as_constants():
    spec = _spec(512, True, t="fp16", TILES=1, UNROLL=2, num_warps=8, min_blocks=2)
    src = cuda.render(spec.template, **spec.render)
    assert "{{" not in src and "{%" not in src
    for line in ("typedef __half T;", "constexpr int K = 512;", "constexpr bool SILU = true;",
                 "constexpr int NUM_WARPS = 8;", "constexpr int TILES = 1;", "constexpr int UNROLL = 2;",
                 "constexpr int MIN_BLOCKS = 2;", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                 f'extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {spec.entry}('):
        assert line in src
    # 8 warps x 2 steps of 32 -> BLOCK_K 512; one 16-row tile per warp -> BLOCK_N 16
    assert spec.launch["BLOCK_K"] == 512 and spec.launch["BLOCK_N"] == 16 and spec.launch["impl"] == "cuda"
    assert spec.variant == "cuda_silu_k512_m8" and spec.stem == "gemv.cuda_silu_k512_m8"
    assert "constexpr int ACC_SPLIT = 1;" in src and "griddepcontrol.wait;" in src
    split = _spec(512, False, TILES=1, UNROLL=8, ACC_SPLIT=2)
    assert split.entry.endswith("s2") and "constexpr int ACC_SPLIT = 2;" in cuda.render(split.template, **split.render)
    assert "does not divide UNROLL 2" in cuda_gemv.gemv_spec(512, False, "bf16", "sm90", CLASS,
                                                             {"UNROLL": 2, "ACC_SPLIT": 4})[1]


def test_what_the_template_does_not_cover_is_refused_with_a_reason():
    assert cuda_gemv.gemv_spec(100, False, "bf16", "sm90", CLASS)[1] == \
        "K 100 is not a multiple of 8 (the kernel reads W in 16-byte pieces)"
    assert "bf16 or fp16" in cuda_gemv.gemv_spec(256, False, "fp32", "sm90", CLASS)[1]
    assert "outside 1..8" in cuda_gemv.gemv_spec(256, False, "bf16", "sm90", CLASS, {"max_m": 16})[1]
    odd = ModelConfig(**{**SHAPE.to_dict(), "intermediate_size": 500})
    specs, notes = cuda_gemv.gemv_specs(odd, "bf16", "sm90", TURN_ON)
    assert [(s.render["k"], s.render["silu"]) for s in specs] == [(256, False), (512, False)]
    assert notes == ["sm90: no CUDA GEMV for K=500 (K 500 is not a multiple of 8 (the kernel reads W in "
                     "16-byte pieces)); the Triton GEMV or cuBLAS runs"]
    assert cuda_gemv.gemv_specs(SHAPE, "fp32", "sm90", TURN_ON) == ([], [])


def test_the_tune_table_builds_it_only_where_turned_on():
    specs = _triton(*ARCHS)
    assert cuda_gemv.cuda_specs(specs, SHAPE) == ([], [])       # not yet measured ahead anywhere
    only_down = cuda_gemv.cuda_specs(specs, SHAPE, {CLASS: {"silu": True}})[0]
    assert [(s.arch, s.variant) for s in only_down] == [(a, "cuda_silu_k512_m8") for a in ARCHS]


def test_without_nvcc_the_build_keeps_the_triton_gemv_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cuda, "nvcc_path", lambda: None)
    specs = _triton("sm90")
    result = cuda.add_selected(CodegenResult(), specs, SHAPE, overrides={"gemv": TURN_ON})
    assert result.records == [] and result.files == {}
    assert capsys.readouterr().err.strip().splitlines() == [   # one line an op, in folder order (the second:
        "engc: note: nvcc not found: the CUDA GEMV is skipped, the Triton GEMV or cuBLAS runs",   # sm90's cluster
        "engc: note: nvcc not found: the CUDA decode kernel is skipped, Triton's decode is used"]   # decode)


def test_pick_prefers_cuda_then_triton_then_cublas():
    consts = {"silu_k64_m1": {"K": 64, "SILU": True, "max_m": 1},
              "cuda_silu_k64_m8": {"K": 64, "SILU": True, "max_m": 8, "max_n": 0, "impl": "cuda"},
              "k64_m4": {"K": 64, "SILU": False, "max_m": 4},
              "cuda_k64_m2": {"K": 64, "SILU": False, "max_m": 2, "max_n": 1000, "impl": "cuda"}}
    table = gemv.variant_table(consts)
    assert [gemv.pick(table, 64, True, m, 4096) for m in (1, 8, 9)] == ["cuda_silu_k64_m8"] * 2 + [None]
    assert [gemv.pick(table, 64, False, m, 512) for m in (1, 2, 3, 5)] == ["cuda_k64_m2"] * 2 + ["k64_m4", None]
    assert gemv.pick(table, 64, False, 1, 4096) == "k64_m4"           # past the CUDA entry's max_n
    del consts["cuda_silu_k64_m8"]                                     # a bundle built without nvcc
    assert gemv.pick(gemv.variant_table(consts), 64, True, 1, 4096) == "silu_k64_m1"


def test_launch_rule_splits_k_and_passes_no_scratch():
    launch = _spec(256, target_programs=64, max_splits=16, min_split_k_tiles=1).launch
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32)
    x, w = torch.zeros(3, 256, dtype=torch.bfloat16), torch.zeros(40, 256, dtype=torch.bfloat16)
    ((variant, grid, args),) = gemv.launch(x, w, torch.empty(3, 40, dtype=torch.bfloat16), "v", launch, counters)
    # 40 rows -> 2 CTAs of 32; K 256 = 1 tile of 512 -> no split possible
    assert grid == (2, 1, 1) and args[3] == 0 and args[4] == 0 and args[5:] == [3, 40, 1, 1]
    wide = _spec(4096, target_programs=64, max_splits=16, min_split_k_tiles=1).launch
    x, w = torch.zeros(2, 4096, dtype=torch.bfloat16), torch.zeros(40, 4096, dtype=torch.bfloat16)
    ((_, grid, args),) = gemv.launch(x, w, torch.empty(2, 40, dtype=torch.bfloat16), "v", wide, counters)
    # 8 K tiles of 512: splits double while 2 CTAs * splits < 64 -> 8 splits of one tile each
    assert grid == (2, 8, 1) and args[3].shape == (8, 2, 40) and args[4] is counters and args[5:] == [2, 40, 1, 8]
    assert len(args) == 9                                              # the record's 9 parameters


@needs_nvcc
def test_records_follow_the_kernel_table_schema(built):
    specs, result = built
    assert [(r["arch"], r["variant"]) for r in result.records] == \
        [(a, v) for a in ARCHS for v in ("cuda_k256_m8", "cuda_k512_m8", "cuda_silu_k512_m8")]
    json.dumps(result.records, sort_keys=True)
    for r in result.records:
        cubin, ptx = result.files[r["cubin"]], result.files[r["ptx"]].decode()
        assert r["op"] == "gemv" and cubin[:4] == b"\x7fELF" and r["entry"].encode() in cubin
        assert f".entry {r['entry']}(" in ptx and ".version 8.7" in ptx
        assert r["ptx_target"] == {"sm80": "sm_80", "sm90": "sm_90"}[r["arch"]]
        assert r["scratch_params"] == 0 and r["shared_mem"] == 0 and r["num_warps"] == r["tune"]["num_warps"]
        assert [a["name"] for a in r["args"]] == ["x_ptr", "w_ptr", "out_ptr", "partial_ptr", "counter_ptr",
                                                  "M", "N", "k_tiles_per_split", "splits"]
        assert set(r["launch"]) == set(cuda_gemv.LAUNCH_KEYS) | {"impl", "PDL"}
        assert r["launch"]["PDL"] == {"sm80": 0, "sm90": 1}[r["arch"]]   # the template waits first on sm90
        assert r["tune_key"] == f"{r['arch']}/gemv/cuda/{CLASS}+override"
        # the launch rule's arguments line up with the record's parameters, pointer for pointer
        k, silu = r["launch"]["K"], r["launch"]["SILU"]
        x = torch.zeros(2, 2 * k if silu else k, dtype=torch.bfloat16)
        w = torch.zeros(100, k, dtype=torch.bfloat16)
        counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32)
        ((_, grid, args),) = gemv.launch(x, w, torch.empty(2, 100, dtype=torch.bfloat16), r["variant"],
                                         r["launch"], counters)
        assert len(args) == len(r["args"]) and grid[0] == -(-100 // r["launch"]["BLOCK_N"])
        for value, arg in zip(args, r["args"]):
            assert isinstance(value, torch.Tensor) <= arg["type"].startswith("*")   # tensors only where pointers


@needs_nvcc
def test_every_w_load_is_in_flight_before_the_first_mma(built, tmp_path):
    """The point of the kernel: ptxas keeps UNROLL * TILES * 2 loads per lane outstanding (MIN_BLOCKS), here
    for a K that is a multiple of BLOCK_K, as in every Llama projection (no per-step K predicate)."""
    _, result = built
    cuobjdump = shutil.which("cuobjdump") or _triton_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump is not installed")
    r = next(r for r in result.records if r["arch"] == "sm90" and r["variant"] == "cuda_k512_m8")
    path = tmp_path / "k.cubin"
    path.write_bytes(result.files[r["cubin"]])
    sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"\b(LDG\.E\.NA\S*|HMMA\S*)", sass)
    loads = 2 * r["tune"]["TILES"] * r["tune"]["UNROLL"]
    assert ops[:loads] == [ops[0]] * loads and ops[0].startswith("LDG.E.NA") and ops[loads].startswith("HMMA")


@needs_nvcc
def test_selected_gemv_joins_the_build_with_the_triton_kernels(built):
    specs = _triton("sm90")
    result = cuda.add_selected(CodegenResult(), specs, SHAPE, overrides={"gemv": {CLASS: {"silu": True}}})
    assert [(r["op"], r["variant"]) for r in result.records] == [("gemv", "cuda_silu_k512_m8"),
                                                                  ("paged_attention", "decode_rotary_cluster")]
    assert "kernels/src/gemv.cuda_silu_k512_m8.cu" in result.files


def _triton_tool(name):
    try:
        import triton
    except ImportError:
        return None
    from pathlib import Path
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.is_file() else None
