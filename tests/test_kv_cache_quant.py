"""engc build --kv-cache int8|fp8: the quantized paged KV cache, end to end on the CPU.

Kernels (rotary write, decode with splits, prefill over a cached prefix) run under TRITON_INTERPRET=1 in a
child process (this file as a script, like test_kernels.py) against the op references; tiny-model bundles
built with each setting give logits close to the unquantized bundle and decode through the engine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from interpreted import interpreted_report, print_report

ROOT = Path(__file__).resolve().parents[1]
KV = ("int8", "fp8")


# ---------------------------------------------------------------- kernels vs references (interpreter)

@pytest.fixture(scope="module")
def report():
    return interpreted_report(__file__)


CASES = [f"{case}_{kv}" for kv in KV for case in
         ("rotary_fp32_i64", "rotary_bf16_i32", "attention_mixed_fp32", "attention_mixed_bf16",
          "attention_gqa3_d64_fp32", "attention_prefill_only_fp32", "attention_decode_split_fp32",
          "attention_decode_bf16", "attention_window_fp32", "attention_mixed_fp16",
          "attention_decode_prefetch_bf16")] + [
         "widen_fp8_bf16_every_code", "widen_fp8_fp16_every_code"]


@pytest.mark.parametrize("case", CASES)
def test_quantized_kernel_matches_reference(report, case):
    assert case in report, f"{case} did not run"
    assert report[case]["ok"], report[case]


def test_quantize_round_trip_error_is_bounded():
    """int8: half a step of absmax/127 per value; fp8 e4m3: 2^-4 of the value (3 mantissa bits) or,
    below e4m3's normal range, half its smallest subnormal step."""
    from engc.kernels import kv_quant
    x = torch.randn(64, 4, 128) * torch.logspace(-3, 2, 64)[:, None, None]
    x[3, 1] = 0.0                                             # an all-zero row: scale 0, codes 0
    for name, dtype in kv_quant.KV_CACHE_DTYPES.items():
        codes, scales = kv_quant.quantize(x, dtype)
        assert codes.dtype == dtype and scales.shape == x.shape[:-1] and scales.dtype == torch.float32
        back = kv_quant.dequantize(codes, scales)
        assert torch.isfinite(back).all() and float(back[3, 1].abs().max()) == 0.0
        step = scales[..., None]
        if dtype == torch.int8:
            bound = 0.5 * step * (1 + 1e-5)
        else:
            bound = torch.maximum(x.abs() * 2.0 ** -4, step * 2.0 ** -10) * (1 + 1e-5)
        assert bool(((back - x).abs() <= bound).all()), name


# ---------------------------------------------------------------- bundles on the CPU

@pytest.fixture(scope="module")
def bundles(tiny_dir, tmp_path_factory):
    from engc.compiler.build import BuildOptions, build
    from engc.runtime.loader import load
    src = tiny_dir("llama")
    out = {}
    for kv in ("auto", *KV):
        path = tmp_path_factory.mktemp(f"kv_{kv}") / "b"
        build(str(src), path, BuildOptions(kv_cache=kv))
        out[kv] = load(path)
    return out


def _prefill_logits(model, ids):
    from engc.runtime.kv_cache import KVCache
    n, bs = len(ids), model.block_size
    inputs = {"input_ids": torch.tensor(ids), "positions": torch.arange(n), "slot_mapping": torch.arange(n),
              "block_tables": torch.arange(-(-n // bs), dtype=torch.int32)[None],
              "context_lens": torch.tensor([n], dtype=torch.int32),
              "query_start_loc": torch.tensor([0, n], dtype=torch.int32), "logits_indices": torch.arange(n)}
    kv = KVCache(model.config, -(-n // bs), bs, model.kv_dtype, "cpu")
    with torch.inference_mode():
        return model.executor.forward(inputs, kv.layers)


def test_manifest_program_and_memory(bundles):
    from engc.runtime.kv_cache import KVCache
    cfg = bundles["auto"].config
    bf16 = KVCache.bytes_per_block(cfg, 16, torch.bfloat16)
    for kv in KV:
        m = bundles[kv]
        assert m.bundle.manifest["kv_cache"] == kv and m.kv_dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
        assert f"quantize_kv_cache_{kv}" in m.bundle.manifest["passes"]
        assert {f"kv_scale.{i}" for i in range(cfg.num_layers)} <= set(m.executor.program.inputs)
        # head_dim 16 codes + a 4-byte scale against 32 bytes of bf16: 0.625 here, (128+4)/256 at d=128
        ratio = KVCache.bytes_per_block(cfg, 16, m.kv_dtype) / bf16
        assert ratio == (cfg.head_dim + 4) / (2 * cfg.head_dim)
    assert bundles["auto"].bundle.manifest["kv_cache"] == "auto"


def test_logits_close_to_the_unquantized_bundle(bundles):
    """Prefill logits over 115 tokens (the last ones attend over 8 quantized blocks). Measured: relative
    error (Frobenius) 1.5e-3 for int8 and 6.8e-3 for fp8, top-1 identical. The limits, 1e-2 and 3e-2, sit
    a few times above that, and far below what a wrong scale or a swapped K/V would give (order 1)."""
    ids = list(range(5, 120))
    ref = _prefill_logits(bundles["auto"], ids)
    for kv, limit in (("int8", 1e-2), ("fp8", 3e-2)):
        got = _prefill_logits(bundles[kv], ids)
        rel = float((got - ref).norm() / ref.norm())
        assert rel < limit, (kv, rel)
        assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95, kv


@pytest.mark.parametrize("kv", KV)
def test_engine_prefix_cache_and_preemption(bundles, kv):
    """Through the engine with the prefix cache on and a pool small enough to preempt: each request's
    greedy tokens equal those it gets alone on a fresh engine of the same quantized bundle."""
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.sampling import SamplingParams
    model = bundles[kv]
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    base = [(7 * i) % 300 + 2 for i in range(40)]
    prompts = [base + [5, 6, 7], base + [9], base[:20] + [11, 12], list(range(30, 60))]

    def alone(ids):
        engine = Engine(model, EngineConfig(prefix_cache=False))
        seq = engine.add_request(ids, p)
        engine.run_to_completion()
        return seq.output_ids

    expected = [alone(ids) for ids in prompts]
    engine = Engine(model, EngineConfig(num_blocks=12, prefix_cache=True))   # 4 x ~4 blocks do not fit
    seqs = [engine.add_request(ids, p) for ids in prompts]
    engine.run_to_completion()
    assert [s.output_ids for s in seqs] == expected
    assert engine.stats()["preemptions"] > 0
    first = engine.add_request(base + [5, 6, 7], p)   # the prefix cache serves base's full blocks again
    engine.run_to_completion()
    assert first.num_cached_tokens >= 32 and first.output_ids == expected[0]
    engine.check_integrity()


def test_unknown_kv_cache_in_manifest_is_refused(bundles, tmp_path):
    import shutil
    from engc.errors import BundleError
    from engc.runtime.loader import load
    b = tmp_path / "b"
    shutil.copytree(bundles["int8"].bundle.path, b)
    manifest = json.loads((b / "manifest.json").read_text())
    manifest["kv_cache"] = "int4"
    (b / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="unknown kv-cache setting 'int4'") as e:
        load(b)
    assert "\n" not in str(e.value)


def test_cli_refuses_a_bad_value(tiny_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "engc.cli", "build", str(tiny_dir("llama")), "-o",
                           str(tmp_path / "b"), "--kv-cache", "int4"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kv-cache 'int4'" in lines[0] and "int8" in lines[0], proc.stderr


# ---------------------------------------------------------------- codegen for sm80 / sm90

def test_codegen_compiles_the_quantized_variants():
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    from engc.errors import UserError
    from test_codegen import TINY
    specs = []
    for arch, kv in (("sm80", "int8"), ("sm90", "int8"), ("sm90", "fp8")):
        got = [s for s in model_specs(TINY, torch.bfloat16, arch, 16, kv_cache=kv)
               if s.op in ("rotary", "paged_attention")
               and s.variant in ("pos_i32", "decode", "decode_rotary", "prefill")]
        assert len(got) == 4
        specs += got
    result = compile_specs(specs, jobs=1)
    code = {"int8": "*i8", "fp8": "*fp8e4nv"}
    for r, spec in zip(result.records, sorted(specs, key=lambda s: (s.arch, s.op, s.variant))):
        types = {a["name"]: a["type"] for a in r["args"]}
        kv = "int8" if spec.constexprs["KV_QUANT"] == 1 else "fp8"
        assert types["k_cache_ptr"] == types["v_cache_ptr"] == code[kv]
        assert types["k_scale_ptr"] == types["v_scale_ptr"] == "*fp32"
        assert result.files[r["cubin"]][:4] == b"\x7fELF"
    # the unquantized kernels keep their arguments: no scale pointers
    plain = [s for s in model_specs(TINY, torch.bfloat16, "sm90", 16)
             if s.op in ("rotary", "paged_attention") and s.variant != "decode_reduce"]
    assert all("k_scale_ptr" not in s.arg_types and s.constexprs["KV_QUANT"] == 0 for s in plain)
    with pytest.raises(UserError, match="--kv-cache fp8 needs sm89"):
        model_specs(TINY, torch.bfloat16, "sm80", 16, kv_cache="fp8")


def test_an_fp8_cache_decodes_with_its_own_tune_line():
    """sm90 8B-class heads: the fp8 cache's decode takes the table's 'd<=128,kv-fp8' line, whose register cap
    reaches ptxas; the fused rotary decode takes its tiles without the cap; other caches keep the head size's."""
    import dataclasses
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    from test_codegen import TINY
    cfg = dataclasses.replace(TINY, head_dim=128)
    keys = {}
    for kv in ("auto", "int8", "fp8"):
        for s in model_specs(cfg, torch.bfloat16, "sm90", 16, kv_cache=kv):
            if s.op == "paged_attention":
                keys[(kv, s.variant)] = s
    assert {v: s.tune_key for (kv, v), s in keys.items() if kv == "fp8"} == {
        "decode": "sm90/paged_attention/decode/d<=128,kv-fp8",
        "decode_rotary": "sm90/paged_attention/decode/d<=128,kv-fp8",
        "prefill": "sm90/paged_attention/prefill/d<=128"}
    plain = "sm90/paged_attention/decode/d<=128"
    assert keys[("auto", "decode")].tune_key == keys[("int8", "decode")].tune_key == plain
    decode, rotary = keys[("fp8", "decode")], keys[("fp8", "decode_rotary")]
    assert decode.tune["maxnreg"] == 128 and "maxnreg" not in rotary.tune
    assert decode.num_stages == rotary.num_stages == 2
    result = compile_specs([decode, rotary], jobs=1)
    ptx = {r["variant"]: result.files[r["ptx"]].decode() for r in result.records}
    assert ".maxnreg 128" in ptx["decode"] and ".maxnreg" not in ptx["decode_rotary"]


def test_the_plain_decode_pipelines_its_loop_by_hand_where_its_line_says():
    """sm90 8B-class heads, a bf16 or int8 cache: the line sets PREFETCH, so the plain decode is compiled with one
    stage and loads each tile a loop iteration ahead into registers (no cp.async left in it); the fused rotary decode
    drops the constexpr and keeps the line's stages and Triton's pipelining. The fp8 cache's line does not set it."""
    import dataclasses
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    from test_codegen import TINY
    cfg = dataclasses.replace(TINY, head_dim=128)
    specs = {(kv, s.variant): s for kv in ("auto", "int8", "fp8")
             for s in model_specs(cfg, torch.bfloat16, "sm90", 16, kv_cache=kv) if s.op == "paged_attention"}
    for kv in ("auto", "int8"):
        decode, rotary = specs[(kv, "decode")], specs[(kv, "decode_rotary")]
        assert decode.constexprs["PREFETCH"] == 1 and decode.num_stages == 1
        assert "PREFETCH" not in rotary.constexprs and rotary.num_stages == decode.tune["num_stages"] == 3
    assert specs[("fp8", "decode")].constexprs["PREFETCH"] == 0 and specs[("fp8", "decode")].num_stages == 2
    result = compile_specs([specs[("auto", "decode")], specs[("auto", "decode_rotary")]], jobs=1)
    ptx = {r["variant"]: result.files[r["ptx"]].decode() for r in result.records}
    assert "cp.async" not in ptx["decode"] and "cp.async" in ptx["decode_rotary"]


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def check_rotary(dtype, idx_dtype, kv_dtype):
    from engc.kernels import kv_quant, rotary as op
    from test_kernels import _cfg, _rel, _run
    H, KV_HEADS, D, page, T = 6, 2, 32, 4, 9
    cfg = _cfg(num_heads=H, num_kv_heads=KV_HEADS, head_dim=D)
    kv = "int8" if kv_dtype == torch.int8 else "fp8"
    specs = _specs_kv(cfg, dtype, page, kv)["rotary"]
    qkv = torch.randn(T, (H + 2 * KV_HEADS) * D, dtype=dtype) * 3
    qkv[4, H * D:(H + 1) * D] = 0.0                                      # a zero k row
    positions = torch.tensor([0, 1, 2, 7, 100, 4000, 5, 6, 70000]).to(idx_dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    slots = torch.randperm(6 * page)[:T].to(idx_dtype)
    slots[2] = -1                                                         # padding: no write
    codes, scales = kv_quant.quantize(torch.randn(2, 6, page, KV_HEADS, D), kv_dtype)
    ref_codes, ref_scales = codes.clone(), scales.clone()
    ref_q = op.rotary_kv_write(qkv, positions, inv_freq, ref_codes, slots, H, KV_HEADS, D, kv_scale=ref_scales)
    q_out = torch.full((T, H * D), float("nan"), dtype=dtype)
    _run(specs, op.launch(qkv, positions, inv_freq, codes, slots, q_out, kv_scale=scales))
    # the same arithmetic, so codes agree but for a rare 1-step flip where cos/sin round differently
    back, ref_back = kv_quant.dequantize(codes, scales), kv_quant.dequantize(ref_codes, ref_scales)
    return max(_rel(q_out, ref_q), _rel(scales, ref_scales), _rel(back, ref_back))


def _specs_kv(cfg, dtype, page, kv, overrides=None):
    from engc.compiler.codegen.specs import model_specs
    by_op = {}
    for s in model_specs(cfg, dtype, "sm90", page, overrides, kv_cache=kv):
        by_op.setdefault(s.op, {})[s.variant] = s
    return by_op


def check_attention(dtype, kv_dtype, seqs, H=4, KV_HEADS=2, D=32, page=16, window=0, overrides=None,
                    decode_rows=True, max_context_len=None):
    from engc.kernels import kv_quant, paged_attention as op
    from test_kernels import _attention_batch, _cfg, _consts, _rel, _run
    gen = torch.Generator().manual_seed(len(seqs) * 1000 + H * 10 + D)
    cfg = _cfg(num_heads=H, num_kv_heads=KV_HEADS, head_dim=D)
    kv = "int8" if kv_dtype == torch.int8 else "fp8"
    specs = _specs_kv(cfg, dtype, page, kv, {"paged_attention": overrides or {}})["paged_attention"]
    q, kv_float, bt, ctx, qsl = _attention_batch(seqs, H, KV_HEADS, D, page, torch.float32, gen)
    q = q.to(dtype)
    # rows of very different magnitudes, so a scale applied to the wrong token would show
    kv_float = kv_float * torch.rand(kv_float.shape[:-1], generator=gen)[..., None] * 4
    codes, scales = kv_quant.quantize(kv_float, kv_dtype)
    scale = D ** -0.5
    ref = op.paged_attention(q, codes, bt, ctx, qsl, H, KV_HEADS, D, scale, window, kv_scale=scales)
    out = torch.full_like(q, float("nan"))
    launches = op.launch(q, codes, bt, ctx, qsl, out, num_heads=H, num_kv_heads=KV_HEADS, head_dim=D, scale=scale,
                         sliding_window=window, max_query_len=max(n for _, n in seqs),
                         max_context_len=max_context_len, decode_rows=decode_rows, consts=_consts(specs),
                         kv_scale=scales)
    _run(specs, launches)
    return _rel(out, ref), [(v, list(g)) for v, g, _ in launches]


def check_widen(dtype):
    """The attention kernels widen fp8 codes by placing their bits in a bf16 / fp16 (tiles._widen): every one of
    the 254 finite codes must come out as the code times the power of two the kernels undo (_fp8_units)."""
    global tiles   # a jit function's names resolve in its module's globals
    import triton
    import triton.language as tl
    from engc.kernels.paged_attention import tiles

    @triton.jit
    def widen_kernel(codes_ptr, out_ptr, BF16: tl.constexpr):
        i = tl.arange(0, 256)
        codes = tl.load(codes_ptr + i)
        if BF16:
            tl.store(out_ptr + i, tiles._widen(codes, tl.bfloat16, 2, True))
        else:
            tl.store(out_ptr + i, tiles._widen(codes, tl.float16, 2, True))

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    out = torch.empty(256, dtype=dtype)
    widen_kernel[(1,)](codes, out, dtype == torch.bfloat16)
    unit = 2.0 ** -120 if dtype == torch.bfloat16 else 2.0 ** -8
    finite = codes.float().isfinite()
    assert int(finite.sum()) == 254
    return (out.float()[finite] - codes.float()[finite] * unit).abs().max().item() / unit


def _patch_interpreter_fp8_convert():
    """Triton 3.9's interpreter rounds fp32 -> e4m3 without carrying a mantissa overflow into the exponent
    (127.9 -> 64); convert with torch instead: round to nearest even, as the GPU's cvt.rn.satfinite does
    for the +-448-clamped values the kernel converts."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp
    original = interp._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    interp._convert_float = convert


def main():
    from test_kernels import _patch_interpreter_bf16_dot
    _patch_interpreter_bf16_dot()
    _patch_interpreter_fp8_convert()
    torch.manual_seed(0)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    tol = {f32: 1e-5, bf16: 2e-2, f16: 3e-3}
    rotary_tol = {f32: 1e-3, bf16: 2e-2}   # dequantized caches: a rare one-step code flip is allowed
    mixed = [(37, 37), (50, 13), (1, 1), (70, 1), (16, 16), (33, 1), (20, 2)]   # (50, 13): a cached prefix
    small_tiles = {"decode": {"BLOCK_N": 16, "target_programs": 64, "min_split_tokens": 16},
                   "prefill": {"BLOCK_M": 16, "BLOCK_N": 16}}
    checks = {}
    for name, kv in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        checks.update({
            f"rotary_fp32_i64_{name}": (lambda kv=kv: check_rotary(f32, torch.int64, kv), rotary_tol[f32]),
            f"rotary_bf16_i32_{name}": (lambda kv=kv: check_rotary(bf16, torch.int32, kv), rotary_tol[bf16]),
            f"attention_mixed_fp32_{name}": (lambda kv=kv: check_attention(f32, kv, mixed, overrides=small_tiles),
                                             tol[f32]),
            f"attention_mixed_bf16_{name}": (lambda kv=kv: check_attention(bf16, kv, mixed, overrides=small_tiles),
                                             tol[bf16]),
            f"attention_gqa3_d64_fp32_{name}": (lambda kv=kv: check_attention(
                f32, kv, mixed, H=6, KV_HEADS=2, D=64, page=8, overrides=small_tiles), tol[f32]),
            f"attention_prefill_only_fp32_{name}": (lambda kv=kv: check_attention(
                f32, kv, mixed, decode_rows=False, overrides=small_tiles), tol[f32]),
            f"attention_decode_split_fp32_{name}": (lambda kv=kv: check_attention(
                f32, kv, [(1, 1), (45, 1), (130, 1), (64, 1)], overrides=small_tiles), tol[f32]),
            f"attention_decode_bf16_{name}": (lambda kv=kv: check_attention(
                bf16, kv, [(5, 1), (200, 1)], H=8, KV_HEADS=1, D=64, page=32, max_context_len=32), tol[bf16]),
            f"attention_window_fp32_{name}": (lambda kv=kv: check_attention(
                f32, kv, [(150, 40), (100, 1), (90, 90)], window=33, overrides=small_tiles), tol[f32]),
            f"attention_mixed_fp16_{name}": (lambda kv=kv: check_attention(f16, kv, mixed, overrides=small_tiles),
                                             tol[f16]),
            # the decode loop pipelined by hand (PREFETCH): whole contexts in one program, codes and scales ahead
            f"attention_decode_prefetch_bf16_{name}": (lambda kv=kv: check_attention(
                bf16, kv, [(5, 1), (200, 1), (77, 1), (40, 40)], H=8, KV_HEADS=2, D=64, page=8, overrides={
                    **small_tiles, "decode": {**small_tiles["decode"], "target_programs": 1, "PREFETCH": 1,
                                              "num_stages": 1}}), tol[bf16]),
        })
    checks.update({f"widen_fp8_{name}_every_code": (lambda dt=dt: check_widen(dt), 0.0)
                   for name, dt in (("bf16", bf16), ("fp16", f16))})
    print_report(checks)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    main()
