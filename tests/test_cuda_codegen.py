"""The CUDA C++ decode template: rendered per shape, built by nvcc for sm80 and sm90 through a generated
build.ninja, recorded like the Triton kernels and chosen by the launch rule only where the tune table
says so. Tests that compile skip where nvcc is missing (it is optional for engc build)."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess

import pytest
import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.codegen import cuda
from engc.kernels.paged_attention import cuda_specs as attention_cuda
from engc.compiler.codegen.record import CodegenResult
from engc.compiler.codegen.specs import model_specs
from engc.kernels import paged_attention as pa

ARCHS = ["sm80", "sm90"]
SHAPE = ModelConfig(family="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=1,
                    num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=256, tie_word_embeddings=True, qk_norm=False)
PICK_CUDA = {"paged_attention": {"decode": {"impl": "cuda"}}}
needs_nvcc = pytest.mark.skipif(cuda.nvcc_path() is None, reason="nvcc is not installed")


def _specs():
    return [attention_cuda.decode_spec(SHAPE, "bf16", arch, 16)[0] for arch in ARCHS]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvcc")
    first = cuda.compile_cuda(_specs(), build_dir=root / "a")
    second = cuda.compile_cuda(list(reversed(_specs())), build_dir=root / "b")
    return root, first, second


def test_template_renders_the_shape_as_constants():
    spec = attention_cuda.decode_spec(SHAPE, "bf16", "sm90", 16)[0]
    src = cuda.render(spec.template, **spec.render)
    assert "{{" not in src and "{%" not in src
    for line in ("typedef __nv_bfloat16 T;", "constexpr int NUM_HEADS = 8;", "constexpr int NUM_KV_HEADS = 2;",
                 "constexpr int HEAD_DIM = 64;", "constexpr int PAGE = 16;",
                 f'extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) {spec.entry}('):
        assert line in src
    # d=64 bf16: 8 threads per 128-byte row, 4 rows per warp, 4 warps, 4 tokens each -> 64-token tiles
    assert spec.launch["BLOCK_N"] == 64 and spec.render["block_n"] == 64


def test_shapes_the_template_does_not_cover_are_refused_with_a_reason():
    odd = ModelConfig(**{**SHAPE.to_dict(), "head_dim": 72})
    spec, why = attention_cuda.decode_spec(odd, "bf16", "sm90", 16)
    assert spec is None and "head_dim 72" in why
    spec, why = attention_cuda.decode_spec(SHAPE, "bf16", "sm90", 2)
    assert spec is None and "block size 2" in why


@needs_nvcc
def test_build_ninja_has_one_rule_per_arch_and_one_edge_per_output(built):
    root, _, _ = built
    text = (root / "a" / "build.ninja").read_text()
    for arch, cap in (("sm80", 80), ("sm90", 90)):
        assert re.search(rf"^rule cubin_{arch}\n  command = \$nvcc \$flags -cubin -arch=sm_{cap} -o \$out \$in$",
                         text, re.MULTILINE)
        assert re.search(rf"^rule ptx_{arch}\n  command = \$nvcc \$flags -ptx -arch=compute_{cap} ", text, re.MULTILINE)
        assert f"build {arch}/paged_attention.decode_cuda.cubin: cubin_{arch} src/paged_attention.decode_cuda.cu" in text
    assert len(re.findall(r"^build ", text, re.MULTILINE)) == 4
    assert "use_fast_math" not in text and "-lineinfo" not in text and " -G" not in text
    # A second ninja run over the same tree has nothing to do: the edges name their real outputs.
    ninja = shutil.which("ninja") or cuda._ninja()[0]
    again = subprocess.run([ninja, "-C", str(root / "a"), "-n"], capture_output=True, text=True, check=True)
    assert "no work to do" in again.stdout


@needs_nvcc
def test_records_follow_the_kernel_table_schema(built):
    _, result, _ = built
    assert [(r["arch"], r["op"], r["variant"]) for r in result.records] == \
        [(a, "paged_attention", "decode_cuda") for a in ARCHS]
    json.dumps(result.records, sort_keys=True)
    for r in result.records:
        cubin, ptx = result.files[r["cubin"]], result.files[r["ptx"]].decode()
        assert cubin[:4] == b"\x7fELF" and r["entry"].encode() in cubin
        assert f".entry {r['entry']}(" in ptx and ".version 8.7" in ptx and r["ptx_version"] == 87
        assert r["ptx_target"] == {"sm80": "sm_80", "sm90": "sm_90"}[r["arch"]]   # portable, JIT-able PTX
        assert r["source"] == "kernels/src/paged_attention.decode_cuda.cu" and r["source"] in result.files
        assert r["scratch_params"] == 0 and r["shared_mem"] == 0 and r["num_ctas"] == 1
        assert [a["name"] for a in r["args"]] == [
            "q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "context_lens_ptr", "query_start_loc_ptr",
            "out_ptr", "part_acc_ptr", "part_ml_ptr", "scale", "sliding_window", "block_table_stride", "num_splits"]
        assert r["tune_key"] == f"{r['arch']}/paged_attention/decode_cuda/d<=64"
        # sm90's decode entries prefer a 25% shared-memory split (the tune table)
        assert set(r["launch"]) == {"BLOCK_N", "target_programs", "max_splits", "min_split_tokens",
                                    "min_split_tokens_busy"} | ({"smem_carveout"} if r["arch"] == "sm90" else set())
        assert r["launch"].get("smem_carveout", 25) == 25
        assert r["nvcc_version"]


@needs_nvcc
def test_pinned_ptx_still_assembles(built, tmp_path):
    _, result, _ = built
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas is not installed")
    for r in result.records:
        src = tmp_path / f"{r['arch']}.ptx"
        src.write_bytes(result.files[r["ptx"]])
        subprocess.run([ptxas, f"-arch={r['ptx_target']}", str(src), "-o", str(tmp_path / "x.cubin")], check=True)


@needs_nvcc
def test_byte_identical_and_free_of_machine_paths(built):
    _, first, second = built
    assert first.records == second.records
    assert first.files.keys() == second.files.keys()
    for path, data in first.files.items():
        assert second.files[path] == data, path
        for marker in (b"/work/", b"/root/", b"/home/", b"/tmp/", b"site-packages"):
            assert marker not in data, f"{path} embeds a machine path ({marker!r})"


def test_triton_stays_the_default_decode():
    specs = model_specs(SHAPE, torch.bfloat16, "sm90", 16)
    decode = next(s for s in specs if s.variant == "decode")
    assert decode.launch["impl"] == "triton"
    selected, notes = attention_cuda.cuda_specs(specs, SHAPE)     # only sm90's cluster decode (test_decode_cluster.py)
    assert [s.variant for s in selected] == ["decode_rotary_cluster"] and notes == []


def test_without_nvcc_the_build_keeps_triton_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cuda, "nvcc_path", lambda: None)
    specs = model_specs(SHAPE, torch.bfloat16, "sm90", 16, PICK_CUDA)
    result = cuda.add_selected(CodegenResult(), specs, SHAPE)
    assert result.records == [] and result.files == {}
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["engc: note: nvcc not found: the CUDA decode kernel is skipped, Triton's decode is used"]
    consts = _consts(specs, result.records)
    assert [v for v, _, _ in _decode_launch(consts)] == ["decode"]     # Triton's decode reduces in-kernel


@needs_nvcc
def test_selected_template_is_built_and_launched_with_its_own_args():
    specs = model_specs(SHAPE, torch.bfloat16, "sm90", 16, PICK_CUDA)
    result = cuda.add_selected(CodegenResult(), specs, SHAPE)
    assert [(r["arch"], r["variant"]) for r in result.records] == [("sm90", "decode_cuda"),
                                                                    ("sm90", "decode_rotary_cluster")]
    record = result.records[0]
    launches = _decode_launch(_consts(specs, result.records))
    assert [v for v, _, _ in launches] == ["decode_cuda", "decode_reduce"]
    variant, grid, args = launches[0]
    assert grid[0] == 3 and grid[1] == SHAPE.num_kv_heads and grid[2] > 1
    assert len(args) == len(record["args"])         # no Triton scratch zeros
    for value, arg in zip(args, record["args"]):
        assert isinstance(value, torch.Tensor) == arg["type"].startswith("*")


def _consts(triton_specs, cuda_records):
    consts = {s.variant: s.launch for s in triton_specs if s.op == "paged_attention"}
    consts.update({r["variant"]: r["launch"] for r in cuda_records})
    return consts


def _decode_launch(consts):
    H, KV, D = SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    q = torch.zeros(3, H * D, dtype=torch.bfloat16)
    cache = torch.zeros(2, 40, 16, KV, D, dtype=torch.bfloat16)
    tables = torch.zeros(3, 40, dtype=torch.int32)
    return pa.launch(q, cache, tables, torch.tensor([5, 300, 600], dtype=torch.int32),
                     torch.arange(4, dtype=torch.int32), torch.empty_like(q), num_heads=H, num_kv_heads=KV,
                     head_dim=D, scale=D ** -0.5, max_query_len=1, consts=consts)


@needs_nvcc
def test_a_kernel_whose_parameters_differ_from_its_spec_is_refused(tmp_path):
    # the launcher packs the spec's arg_types: a template parameter the spec lacks would read past the
    # arguments (the streaming int4 GEMV's has_bias did, on the H200)
    spec = attention_cuda.decode_spec(SHAPE, "bf16", "sm90", 16)[0]
    short = dataclasses.replace(spec, arg_types=dict(list(spec.arg_types.items())[:-1]))
    with pytest.raises(ValueError, match="takes parameters"):
        cuda.compile_cuda([short], build_dir=tmp_path / "short")
    swapped = dict(spec.arg_types)
    first = next(iter(swapped))
    swapped[first] = "i32"   # a pointer parameter declared as a scalar
    with pytest.raises(ValueError, match="takes parameters of"):
        cuda.compile_cuda([dataclasses.replace(spec, arg_types=swapped)], build_dir=tmp_path / "swapped")
    assert cuda.compile_cuda([spec], build_dir=tmp_path / "ok").records


def test_check_params_reads_the_entry_of_the_ptx():
    spec = attention_cuda.decode_spec(SHAPE, "bf16", "sm90", 16)[0]
    params = "".join(f".param .{'u64' if t.startswith('*') else 'u32'} p{i},\n"
                     for i, t in enumerate(spec.arg_types.values())).rstrip(",\n")
    cuda.check_params(spec, f".visible .entry {spec.entry}(\n{params}\n)\n{{ ret; }}")
    with pytest.raises(ValueError, match="takes parameters of None bytes"):
        cuda.check_params(spec, ".visible .entry other_kernel(\n.param .u64 p0\n)")
    # widths the launcher packs other than 4 and 8: a bf16 scalar (nvcc: a 2-byte aggregate), an i8, a u16
    small = dataclasses.replace(spec, arg_types={"x_ptr": "*bf16", "alpha": "bf16", "flag": "i8", "n": "u16",
                                                 "scale": "fp32"})
    cuda.check_params(small, f".visible .entry {spec.entry}(\n.param .u64 p0,\n.param .align 2 .b8 p1[2],\n"
                             f".param .u8 p2,\n.param .u16 p3,\n.param .f32 p4\n)\n{{ ret; }}")
    with pytest.raises(ValueError, match=r"\[8, 4, 1, 2, 4\] bytes"):   # the bf16 declared as a 32-bit int
        cuda.check_params(small, f".visible .entry {spec.entry}(\n.param .u64 p0,\n.param .u32 p1,\n"
                                 f".param .u8 p2,\n.param .u16 p3,\n.param .f32 p4\n)\n{{ ret; }}")
