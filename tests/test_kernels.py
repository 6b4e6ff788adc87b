"""Triton kernels under TRITON_INTERPRET=1 against their plain-torch references (the op contracts).

The interpreter must be switched on before triton is first imported, and other test modules import
triton for real, so the checks run in one child process (this file run as a script) and the tests here
assert on its report. Every launch goes through the op's launch rule with the constexprs codegen picks
for a small model, so the rules, the argument orders and the specializations are what is tested.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from interpreted import interpreted_report, print_report

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    return interpreted_report(__file__, timeout=600)


CASES = ["rms_norm_fp32", "rms_norm_bf16", "silu_mul_fp32", "silu_mul_bf16", "qk_norm_fp32", "qk_norm_bf16",
         "qk_norm_projection_fp32", "qk_norm_projection_bf16",
         "rotary_fp32_i64", "rotary_bf16_i32", "attention_mixed_fp32", "attention_mixed_bf16",
         "attention_gqa3_d64_fp32", "attention_prefill_only_fp32", "attention_decode_split_fp32",
         "attention_decode_bf16", "attention_window_fp32", "attention_window_long_fp32",
         "decode_reduce_b1_d128_fp32", "decode_reduce_b3_d64_gqa8_fp32", "decode_reduce_graph_sized_fp32",
         "decode_reduce_b2_d128_bf16", "decode_reduce_window_fp32", "rotary_decode_b1_d128_fp32",
         "rotary_decode_gqa_d64_fp32", "rotary_decode_one_split_bf16", "rotary_decode_window_fp32",
         "rotary_decode_int8_bf16", "rotary_decode_fp8_fp32", "rotary_decode_early_kv1_gqa_d64_fp32",
         "rotary_decode_early_kv2_one_split_bf16", "rotary_decode_early_kv1_window_fp32",
         "rotary_decode_early_kv2_int8_bf16", "decode_reduce_early_kv2_graph_sized_fp32",
         "attention_mixed_early_kv1_fp32", "gelu_tanh_mul_fp32", "gelu_tanh_mul_bf16", "attention_d256_fp32",
         "attention_d256_window_bf16", "unit_offset_norm_fp32", "unit_offset_norm_bf16", "rotary_d256_bf16", "rotary_decode_d256_window_bf16",
         "attention_softcap_fp32", "attention_softcap_window_bf16", "rotary_decode_softcap_fp32",
         "rotary_decode_softcap_early_kv_bf16", "argmax_fp32", "argmax_bf16", "argmax_small_vocab_fp32",
         "decode_prefetch_one_split_fp32", "decode_prefetch_early_kv2_bf16", "decode_prefetch_window_fp32",
         "decode_prefetch_splits_fp32", "attention_mixed_prefetch_fp32"]


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(report, case):
    assert case in report, f"{case} did not run"
    assert report[case]["ok"], report[case]


def test_op_contracts_do_not_import_triton():
    code = ("import sys; import engc.kernels.rms_norm, engc.kernels.silu_mul, engc.kernels.qk_norm, "
            "engc.kernels.rotary, engc.kernels.paged_attention, engc.kernels.sampling, engc.kernels.argmax, "
            "engc.kernels.logit_softcap; "
            "assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def _cdiv(a, b):
    return (a + b - 1) // b


def _rel(out, ref):
    import torch
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _specs(cfg, dtype, page=16, overrides=None, kv=None):
    import torch
    from engc.compiler.codegen.specs import model_specs
    by_op = {}
    kw = {} if kv is None else {"kv_cache": {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}[kv]}
    for s in model_specs(cfg, dtype, "sm90", page, overrides, **kw):
        by_op.setdefault(s.op, {})[s.variant] = s
    return by_op


def _run(specs: dict, launches):
    """Run launch-rule output the way the runtime does, through the interpreter."""
    for variant, grid, args in launches:
        spec = specs[variant]
        assert args[-2:] == [0, 0], "launch rule must end with the two scratch params"
        n_params = len([n for n, t in spec.signature().items() if t != "constexpr"])
        assert len(args) - 2 == n_params, (variant, len(args), n_params)
        spec.fn()[grid](*args[:-2], **spec.constexprs)


def _consts(specs: dict):
    return {v: s.launch for v, s in specs.items()}


def _cfg(**kw):
    from engc.bundle.model_config import ModelConfig
    base = dict(family="llama", vocab_size=3000, hidden_size=96, intermediate_size=1500, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=4096, tie_word_embeddings=False, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


def check_rms_norm(dtype):
    import torch
    from engc.kernels import rms_norm as op
    cfg = _cfg(hidden_size=200)
    specs = _specs(cfg, dtype)["rms_norm"]
    x, r = torch.randn(7, 200, dtype=dtype), torch.randn(7, 200, dtype=dtype)
    w = torch.randn(200, dtype=dtype)
    out = torch.full_like(x, float("nan"))
    _run(specs, op.launch(x, w, 1e-6, out))
    e1 = _rel(out, op.rms_norm(x, w, 1e-6))
    y_ref, s_ref = op.add_rms_norm(x, r, w, 1e-6)
    out = torch.full_like(x, float("nan"))
    res = r.clone()
    _run(specs, op.launch(x, w, 1e-6, out, residual=res))      # in place into the residual
    e2 = max(_rel(out, y_ref), _rel(res, s_ref))
    # a split-K GEMV's fp32 partials in place of x (QLinearAddRMSNorm): summed in split order, rounded to the
    # dtype, then as above; in float32 the residual sum is exact (the same adds in the same order; the
    # interpreter's bf16 conversions do not round as the GPU's do, so bf16 gets the tolerance)
    from engc.compiler.codegen.kernel_spec import TRITON_DTYPE
    from engc.kernels.rms_norm.specs import rms_norm_specs
    specs = {s.variant: s for s in rms_norm_specs(cfg, TRITON_DTYPE[dtype], "sm90", partials=True)}
    parts = torch.randn(3, 7, 200)
    summed = (parts[0] + parts[1] + parts[2]).to(dtype)
    y_ref, s_ref = op.add_rms_norm(summed, r, w, 1e-6)
    out, res = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    _run(specs, op.launch(parts, w, 1e-6, out, residual=r, residual_out=res, partials=True))
    exact = 0.0 if dtype != torch.float32 or torch.equal(res, s_ref) else float("inf")
    e3 = _rel(out, y_ref)
    # DeepSeek's q_a_layernorm (LatentRMSNorm): the plain norm's variant of q_lora_rank's width, 40 here
    specs = {s.variant: s for s in rms_norm_specs(_cfg(hidden_size=200, q_lora_rank=40), TRITON_DTYPE[dtype], "sm90")}
    latent, lw = torch.randn(5, 40, dtype=dtype), torch.randn(40, dtype=dtype)
    out = torch.full_like(latent, float("nan"))
    _run(specs, op.launch(latent, lw, 1e-6, out, latent=True))
    return max(e1, e2, e3, exact, _rel(out, op.rms_norm(latent, lw, 1e-6)))


def check_gelu_tanh_mul(dtype):
    import torch
    from engc.kernels import silu_mul as op
    specs = _specs(_cfg(hidden_act="gelu_pytorch_tanh"), dtype)["silu_mul"]
    gu = 3 * torch.randn(5, 3000, dtype=dtype)    # wide enough to reach tanh's saturated ends
    out = torch.full((5, 1500), float("nan"), dtype=dtype)
    _run(specs, op.launch(gu, out, _consts(specs), "gelu_tanh"))
    return _rel(out, op.gelu_tanh_mul(gu))


def check_unit_offset_norm(dtype):
    """Gemma's (1 + weight) norm, residual-add norm (in place) and q/k norm at head_dim 256 (in place, and
    into another buffer with v copied): the rms_norm and qk_norm kernels' unit-offset variants."""
    import torch
    from engc.compiler.codegen.kernel_spec import TRITON_DTYPE
    from engc.kernels import qk_norm, rms_norm
    from engc.kernels.qk_norm.specs import qk_norm_specs
    from engc.kernels.rms_norm.specs import rms_norm_specs
    cfg = _cfg(hidden_size=200, num_heads=4, num_kv_heads=2, head_dim=256, norm_unit_offset=True)
    specs = {s.variant: s for s in rms_norm_specs(cfg, TRITON_DTYPE[dtype], "sm90", unit_offset=True)}
    specs.update({s.variant: s for s in qk_norm_specs(cfg, TRITON_DTYPE[dtype], "sm90", unit_offset=True)})
    x, r, w = torch.randn(7, 200, dtype=dtype), torch.randn(7, 200, dtype=dtype), 0.3 * torch.randn(200, dtype=dtype)
    out = torch.full_like(x, float("nan"))
    _run(specs, rms_norm.launch(x, w, 1e-6, out, unit_offset=True))
    errs = [_rel(out, rms_norm.rms_norm_unit_offset(x, w, 1e-6))]
    y_ref, s_ref = rms_norm.add_rms_norm_unit_offset(x, r, w, 1e-6)
    out, res = torch.full_like(x, float("nan")), r.clone()
    _run(specs, rms_norm.launch(x, w, 1e-6, out, residual=res, unit_offset=True))
    errs += [_rel(out, y_ref), _rel(res, s_ref)]
    qkv = torch.randn(5, (4 + 4) * 256, dtype=dtype)
    qw, kw = 0.3 * torch.randn(256, dtype=dtype), 0.3 * torch.randn(256, dtype=dtype)
    ref = qk_norm.qk_norm_unit_offset(qkv, qw, kw, 4, 2, 256, 1e-6)
    out = torch.full_like(qkv, float("nan"))
    _run(specs, qk_norm.launch(qkv, qw, kw, 1e-6, out, variant="unit_offset"))
    inplace = qkv.clone()
    _run(specs, qk_norm.launch(inplace, qw, kw, 1e-6, inplace, variant="unit_offset"))
    return max(*errs, _rel(out, ref), _rel(inplace, ref))


def check_silu_mul(dtype):
    """The model's intermediate size, and a shared expert's other width (an MoE model's dense GLU beside its
    experts), which the launch sends to the variant specialized on it."""
    import torch
    from engc.kernels import silu_mul as op
    specs = _specs(_cfg(family="qwen2_moe", shared_expert_intermediate_size=200, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=64), dtype)["silu_mul"]
    assert set(specs) == {"default", "default_i200"}, set(specs)
    errs = []
    for inter in (1500, 200):
        gu = torch.randn(5, 2 * inter, dtype=dtype)
        out = torch.full((5, inter), float("nan"), dtype=dtype)
        launches = op.launch(gu, out, consts=_consts(specs))
        assert [v for v, _, _ in launches] == ["default" if inter == 1500 else "default_i200"]
        _run(specs, launches)
        errs.append(_rel(out, op.silu_mul(gu)))
    return max(errs)


def check_qk_norm(dtype):
    import torch
    from engc.kernels import qk_norm as op
    cfg = _cfg(num_heads=6, num_kv_heads=2, head_dim=32)
    specs = _specs(cfg, dtype)["qk_norm"]
    qkv = torch.randn(5, (6 + 4) * 32, dtype=dtype)
    qw, kw = torch.randn(32, dtype=dtype), torch.randn(32, dtype=dtype)
    ref = op.qk_norm(qkv, qw, kw, 6, 2, 32, 1e-6)
    out = torch.full_like(qkv, float("nan"))
    _run(specs, op.launch(qkv, qw, kw, 1e-6, out))
    inplace = qkv.clone()
    _run(specs, op.launch(inplace, qw, kw, 1e-6, inplace))
    return max(_rel(out, ref), _rel(inplace, ref))


def check_qk_norm_projection(dtype):
    """OLMoE's q and k each normed over the whole projection (GQA: k narrower than q), in place and into another
    buffer; against the op's reference and against the two RMSNorms the frontend lowers (the unfused program)."""
    import torch
    from engc.kernels import qk_norm as op
    from engc.kernels.rms_norm import rms_norm
    cfg = _cfg(family="olmoe", qk_norm=False, qk_norm_projection=True, num_heads=6, num_kv_heads=2, head_dim=24)
    specs = _specs(cfg, dtype)["qk_norm"]
    assert set(specs) == {"projection"}
    qkv = 3 * torch.randn(5, (6 + 4) * 24, dtype=dtype)
    qw, kw = torch.randn(6 * 24, dtype=dtype), torch.randn(2 * 24, dtype=dtype)
    ref = op.qk_norm_projection(qkv, qw, kw, 1e-6)
    q, k, v = qkv.split([6 * 24, 2 * 24, 2 * 24], dim=-1)
    assert torch.equal(ref, torch.cat([rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6), v], dim=-1))
    out = torch.full_like(qkv, float("nan"))
    _run(specs, op.launch(qkv, qw, kw, 1e-6, out, variant="projection"))
    inplace = qkv.clone()
    _run(specs, op.launch(inplace, qw, kw, 1e-6, inplace, variant="projection"))
    return max(_rel(out, ref), _rel(inplace, ref))


def check_rotary(dtype, idx_dtype, D=32):
    import torch
    from engc.kernels import rotary as op
    H, KV, page = 6, 2, 4
    cfg = _cfg(num_heads=H, num_kv_heads=KV, head_dim=D)
    specs = _specs(cfg, dtype, page)["rotary"]
    T = 9
    qkv = torch.randn(T, (H + 2 * KV) * D, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 7, 100, 4000, 5, 6, 70000]).to(idx_dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    slots = torch.randperm(6 * page)[:T].to(idx_dtype)
    cache = torch.randn(2, 6, page, KV, D, dtype=dtype)
    ref_cache = cache.clone()
    ref_q = op.rotary_kv_write(qkv, positions, inv_freq, ref_cache, slots, H, KV, D)
    q_out = torch.full((T, H * D), float("nan"), dtype=dtype)
    _run(specs, op.launch(qkv, positions, inv_freq, cache, slots, q_out))
    return max(_rel(q_out, ref_q), _rel(cache, ref_cache))


def _attention_batch(seqs, H, KV, D, page, dtype, gen):
    import torch
    blocks_per = [_cdiv(ctx, page) for ctx, _ in seqs]
    total = sum(blocks_per) + 3
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    bt = torch.full((len(seqs), max(blocks_per) + 1), total - 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per):
        bt[b, :n] = perm[used:used + n]
        used += n
    kv_cache = torch.randn(2, total, page, KV, D, generator=gen).to(dtype)
    ctx = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    qsl = torch.tensor([0] + [q for _, q in seqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), H * D, generator=gen).to(dtype)
    return q, kv_cache, bt, ctx, qsl


def check_attention(dtype, seqs, H=4, KV=2, D=32, page=16, window=0, overrides=None, decode_rows=True,
                    max_context_len=None, softcap=0.0):
    import torch
    from engc.kernels import paged_attention as op
    gen = torch.Generator().manual_seed(len(seqs) * 1000 + H * 10 + D)
    cfg = _cfg(num_heads=H, num_kv_heads=KV, head_dim=D, attn_logit_softcap=softcap)
    specs = _specs(cfg, dtype, page, {"paged_attention": overrides or {}})["paged_attention"]
    q, kv_cache, bt, ctx, qsl = _attention_batch(seqs, H, KV, D, page, dtype, gen)
    scale = D ** -0.5
    ref = op.paged_attention(q, kv_cache, bt, ctx, qsl, H, KV, D, scale, window, softcap=softcap)
    out = torch.full_like(q, float("nan"))
    launches = op.launch(q, kv_cache, bt, ctx, qsl, out, num_heads=H, num_kv_heads=KV, head_dim=D, scale=scale,
                         sliding_window=window, max_query_len=max(n for _, n in seqs),
                         max_context_len=max_context_len, decode_rows=decode_rows, consts=_consts(specs))
    _run(specs, launches)
    return _rel(out, ref), [(v, list(g)) for v, g, _ in launches]


def check_decode_reduce(dtype, contexts, H, KV, D, page=16, block_n=16, max_context_len=None, window=0,
                        expect_splits=None, early_kv=0, prefetch=0, target_programs=128):
    """The decode kernel's in-kernel reduce: many splits of one or two tiles, launched twice on one
    counters array, which each launch must leave zero (a CUDA graph replays on it). target_programs=1: one
    split a sequence, its whole context one program's loop."""
    import torch
    from engc.kernels import paged_attention as op
    gen = torch.Generator().manual_seed(sum(contexts) + H + D)
    cfg = _cfg(num_heads=H, num_kv_heads=KV, head_dim=D)
    overrides = {"decode": {"BLOCK_N": block_n, "target_programs": target_programs, "min_split_tokens": block_n,
                            "EARLY_KV": early_kv, "PREFETCH": prefetch, "num_stages": 1 if prefetch else 2}}
    specs = _specs(cfg, dtype, page, {"paged_attention": overrides})["paged_attention"]
    q, kv_cache, bt, ctx, qsl = _attention_batch([(c, 1) for c in contexts], H, KV, D, page, dtype, gen)
    scale = D ** -0.5
    ref = op.paged_attention(q, kv_cache, bt, ctx, qsl, H, KV, D, scale, window)
    counters = torch.zeros(64, dtype=torch.int32)
    err, launches = 0.0, []
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        launches = op.launch(q, kv_cache, bt, ctx, qsl, out, num_heads=H, num_kv_heads=KV, head_dim=D, scale=scale,
                             sliding_window=window, max_query_len=1, max_context_len=max_context_len,
                             consts=_consts(specs), counters=counters)
        _run(specs, launches)
        err = max(err, _rel(out, ref))
        if int(counters.abs().sum()) != 0:
            return float("inf"), "counters not left zero"
    splits = [g[2] for v, g, _ in launches]
    if [v for v, _, _ in launches] != ["decode"] or (expect_splits and splits != [expect_splits]):
        return float("inf"), [(v, list(g)) for v, g, _ in launches]
    return err, [(v, list(g)) for v, g, _ in launches]


def rotary_decode_batch(contexts, H, KV, D, page, dtype, gen, kv_dtype=None):
    """A decode step's inputs for RotaryPagedAttention: one token per sequence at position ctx - 1, its
    slot from the block table; a last padded row (context 1, slot -1) that must write nothing."""
    import torch
    q, kv_cache, bt, ctx, qsl = _attention_batch([(c, 1) for c in contexts] + [(1, 1)], H, KV, D, page, dtype, gen)
    pos = (ctx - 1).long()
    slots = (bt[torch.arange(len(ctx)), pos // page].long() * page + pos % page)
    slots[-1] = -1
    qkv = torch.randn(len(ctx), (H + 2 * KV) * D, generator=gen).to(dtype)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, D, 2).float() / D))
    kv_scale = None
    if kv_dtype is not None:
        from engc.kernels import kv_quant
        codes, scales = kv_quant.quantize(kv_cache.float(), kv_dtype)
        kv_cache, kv_scale = codes, scales
    return qkv, pos, inv_freq, kv_cache, slots, bt, ctx, qsl, kv_scale


def check_rotary_decode(dtype, contexts, H, KV, D, page=16, block_n=16, max_context_len=None, window=0,
                        kv_dtype=None, target_programs=128, early_kv=0, softcap=0.0):
    """decode_rotary (RotaryPagedAttention on a decode step) against the rotary then attention references:
    the outputs of the real rows, and the whole cache (the new k/v written once, the padded row's none)."""
    import torch
    from engc.kernels import paged_attention as op
    gen = torch.Generator().manual_seed(sum(contexts) * 7 + H + D)
    cfg = _cfg(num_heads=H, num_kv_heads=KV, head_dim=D, attn_logit_softcap=softcap)
    overrides = {"decode": {"BLOCK_N": block_n, "target_programs": target_programs, "min_split_tokens": block_n,
                            "EARLY_KV": early_kv}}
    specs = _specs(cfg, dtype, page, {"paged_attention": overrides}, kv=kv_dtype)["paged_attention"]
    qkv, pos, inv_freq, kv_cache, slots, bt, ctx, qsl, kv_scale = rotary_decode_batch(contexts, H, KV, D, page,
                                                                                     dtype, gen, kv_dtype)
    scale = D ** -0.5
    ref_cache = kv_cache.clone()
    ref_scale = None if kv_scale is None else kv_scale.clone()
    ref = op.rotary_paged_attention(qkv, pos, inv_freq, ref_cache, slots, bt, ctx, qsl, H, KV, D, scale, window,
                                    kv_scale=ref_scale, softcap=softcap)
    out = torch.full((qkv.shape[0], H * D), float("nan"), dtype=dtype)
    counters = torch.zeros(64, dtype=torch.int32)
    launches = op.launch_rotary_decode(qkv, pos, inv_freq, kv_cache, slots, bt, ctx, qsl, out, num_heads=H,
                                       num_kv_heads=KV, head_dim=D, scale=scale, sliding_window=window,
                                       max_context_len=max_context_len, consts=_consts(specs), kv_scale=kv_scale,
                                       counters=counters)
    _run(specs, launches)
    n = len(contexts)
    if kv_scale is not None:
        # A new k code may flip a step against the reference where cos/sin round differently (an fp8 step
        # moves the output ~2%); so the oracle here is the unfused kernels, rotary then decode, which
        # tests/test_kv_cache_quant.py holds to the references.
        from engc.kernels import rotary
        all_specs = _specs(cfg, dtype, page, {"paged_attention": overrides}, kv=kv_dtype)
        _, _, _, ref_cache, _, _, _, _, ref_scale = rotary_decode_batch(
            contexts, H, KV, D, page, dtype, torch.Generator().manual_seed(sum(contexts) * 7 + H + D), kv_dtype)
        q = torch.empty(qkv.shape[0], H * D, dtype=dtype)
        _run(all_specs["rotary"], rotary.launch(qkv, pos, inv_freq, ref_cache, slots, q, kv_scale=ref_scale))
        ref = torch.full_like(out, float("nan"))
        _run(specs, op.launch(q, ref_cache, bt, ctx, qsl, ref, num_heads=H, num_kv_heads=KV, head_dim=D, scale=scale,
                              sliding_window=window, max_query_len=1, max_context_len=max_context_len,
                              consts=_consts(specs), kv_scale=ref_scale))
        err = max(_rel(ref_scale, kv_scale), _rel(ref_cache.float(), kv_cache.float()))
        return max(err, _rel(out[:n], ref[:n])), [(v, list(g)) for v, g, _ in launches]
    err = max(_rel(out[:n], ref[:n]), _rel(kv_cache.float(), ref_cache.float()))
    if int(counters.abs().sum()) != 0:
        return float("inf"), "counters not left zero"
    return err, [(v, list(g)) for v, g, _ in launches]


def check_argmax(dtype, vocab=3000, block=None):
    import torch
    from engc.kernels import argmax as op
    ov = {"argmax": {"block": block}} if block else None
    specs = _specs(_cfg(vocab_size=vocab), dtype, overrides=ov)["argmax"]
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, vocab, generator=gen) * 3).to(dtype)
    logits[1, :] = 0.5                          # all tied: the first index wins
    logits[2, vocab - 1] = 100.0                # the last element of the last chunk
    logits[3, 7], logits[3, vocab - 3] = 50.0, 50.0   # tie across chunks
    logits[4, :] = float("-inf")
    logits[5, 1:] = float("-inf")
    logits[6, vocab - 2] = float("nan")         # a NaN is the maximum, as for torch.argmax
    logits[7, :] = float("nan")                 # a NaN-only row still gets an id of the vocabulary
    out = torch.full((8,), -1, dtype=torch.int64)
    _run(specs, op.launch(logits, out, _consts(specs)))
    assert out[6:].tolist() == [vocab - 2, 0] == torch.argmax(logits[6:].float(), -1).tolist(), out
    return int((out != op.argmax(logits)).sum()), [list(g) for _, g, _ in op.launch(logits, out, _consts(specs))]


def _patch_interpreter_bf16_dot():
    """Triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 storage; widen them first."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp
    original = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar == tl.bfloat16:
                data = interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interp.TensorHandle(data, tl.float32)
            return h
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot


def main():
    import torch
    _patch_interpreter_bf16_dot()
    torch.manual_seed(0)
    f32, bf16 = torch.float32, torch.bfloat16
    tol = {f32: 1e-5, bf16: 1.5e-2}
    attn_tol = {f32: 1e-5, bf16: 2e-2}
    mixed = [(37, 37), (50, 13), (1, 1), (70, 1), (16, 16), (33, 1), (20, 2)]
    small_tiles = {"decode": {"BLOCK_N": 16, "target_programs": 64, "min_split_tokens": 16},
                   "prefill": {"BLOCK_M": 16, "BLOCK_N": 16}}
    checks = {
        "rms_norm_fp32": (lambda: check_rms_norm(f32), tol[f32]),
        "rms_norm_bf16": (lambda: check_rms_norm(bf16), tol[bf16]),
        "silu_mul_fp32": (lambda: check_silu_mul(f32), tol[f32]),
        "gelu_tanh_mul_fp32": (lambda: check_gelu_tanh_mul(f32), tol[f32]),
        "unit_offset_norm_fp32": (lambda: check_unit_offset_norm(f32), tol[f32]),
        "unit_offset_norm_bf16": (lambda: check_unit_offset_norm(bf16), tol[bf16]),
        "gelu_tanh_mul_bf16": (lambda: check_gelu_tanh_mul(bf16), tol[bf16]),
        # Gemma's head_dim (256): prefill, extend and decode rows; a local layer's window in bf16
        "attention_d256_fp32": (lambda: check_attention(f32, mixed, H=4, KV=2, D=256, overrides=small_tiles),
                                attn_tol[f32]),
        "attention_d256_window_bf16": (lambda: check_attention(bf16, [(40, 40), (70, 1), (33, 3)], H=2, KV=1,
                                                               D=256, window=16, overrides=small_tiles),
                                       attn_tol[bf16]),
        "rotary_d256_bf16": (lambda: check_rotary(bf16, torch.int64, D=256), tol[bf16]),
        # Gemma 2's score cap (|score| ~ 1 here, so a cap of 1.5 bends them): prefill, extend and split decode
        "attention_softcap_fp32": (lambda: check_attention(f32, mixed, softcap=1.5, overrides=small_tiles),
                                   attn_tol[f32]),
        "attention_softcap_window_bf16": (lambda: check_attention(bf16, [(40, 40), (70, 1), (33, 3)], D=256,
                                                                  window=16, softcap=1.5, overrides=small_tiles),
                                          attn_tol[bf16]),
        "rotary_decode_softcap_fp32": (lambda: check_rotary_decode(f32, [203, 17], H=8, KV=2, D=128, softcap=1.5),
                                       attn_tol[f32]),
        "rotary_decode_softcap_early_kv_bf16": (lambda: check_rotary_decode(bf16, [45, 7], H=4, KV=2, D=64,
                                                                            softcap=1.5, early_kv=1),
                                                attn_tol[bf16]),
        "rotary_decode_d256_window_bf16": (lambda: check_rotary_decode(bf16, [45, 7], H=4, KV=2, D=256, window=16),
                                           attn_tol[bf16]),
        "silu_mul_bf16": (lambda: check_silu_mul(bf16), tol[bf16]),
        "qk_norm_fp32": (lambda: check_qk_norm(f32), tol[f32]),
        "qk_norm_bf16": (lambda: check_qk_norm(bf16), tol[bf16]),
        "qk_norm_projection_fp32": (lambda: check_qk_norm_projection(f32), tol[f32]),
        "qk_norm_projection_bf16": (lambda: check_qk_norm_projection(bf16), tol[bf16]),
        "rotary_fp32_i64": (lambda: check_rotary(f32, torch.int64), tol[f32]),
        "rotary_bf16_i32": (lambda: check_rotary(bf16, torch.int32), tol[bf16]),
        "attention_mixed_fp32": (lambda: check_attention(f32, mixed, overrides=small_tiles), attn_tol[f32]),
        "attention_mixed_bf16": (lambda: check_attention(bf16, mixed, overrides=small_tiles), attn_tol[bf16]),
        "attention_gqa3_d64_fp32": (lambda: check_attention(f32, mixed, H=6, KV=2, D=64, page=8,
                                                            overrides=small_tiles), attn_tol[f32]),
        "attention_prefill_only_fp32": (lambda: check_attention(f32, mixed, decode_rows=False,
                                                                overrides=small_tiles), attn_tol[f32]),
        "attention_decode_split_fp32": (lambda: check_attention(f32, [(1, 1), (45, 1), (130, 1), (64, 1)],
                                                                overrides=small_tiles), attn_tol[f32]),
        "attention_decode_bf16": (lambda: check_attention(bf16, [(5, 1), (200, 1)], H=8, KV=1, D=64, page=32,
                                                          max_context_len=32), attn_tol[bf16]),
        "attention_window_fp32": (lambda: check_attention(f32, mixed, window=9, overrides=small_tiles),
                                  attn_tol[f32]),
        "attention_window_long_fp32": (lambda: check_attention(f32, [(150, 40), (100, 1), (90, 90)], window=33,
                                                               overrides=small_tiles), attn_tol[f32]),
        # contexts not multiples of the tile or page; splits of one tile (16 tokens)
        "decode_reduce_b1_d128_fp32": (lambda: check_decode_reduce(f32, [203], H=8, KV=2, D=128,
                                                                   expect_splits=14), attn_tol[f32]),
        "decode_reduce_b3_d64_gqa8_fp32": (lambda: check_decode_reduce(f32, [1, 77, 130], H=8, KV=1, D=64, page=8,
                                                                       expect_splits=9), attn_tol[f32]),
        # a graph sized for 400 tokens: 25 splits, most of them empty for these contexts
        "decode_reduce_graph_sized_fp32": (lambda: check_decode_reduce(f32, [5, 40], H=4, KV=2, D=64,
                                                                       max_context_len=400, expect_splits=25),
                                           attn_tol[f32]),
        "decode_reduce_b2_d128_bf16": (lambda: check_decode_reduce(bf16, [100, 33], H=8, KV=2, D=128, page=32,
                                                                   block_n=32), attn_tol[bf16]),
        "decode_reduce_window_fp32": (lambda: check_decode_reduce(f32, [150, 61], H=6, KV=2, D=64, window=37,
                                                                  max_context_len=160), attn_tol[f32]),
        # RotaryPagedAttention's decode kernel: the new token in the last tile of the last used split
        "rotary_decode_b1_d128_fp32": (lambda: check_rotary_decode(f32, [203], H=8, KV=2, D=128), attn_tol[f32]),
        "rotary_decode_gqa_d64_fp32": (lambda: check_rotary_decode(f32, [1, 77, 130, 16], H=8, KV=2, D=64, page=8,
                                                                   max_context_len=400), attn_tol[f32]),
        "rotary_decode_one_split_bf16": (lambda: check_rotary_decode(bf16, [100, 33], H=8, KV=2, D=128, page=32,
                                                                     block_n=32, target_programs=1), attn_tol[bf16]),
        "rotary_decode_window_fp32": (lambda: check_rotary_decode(f32, [150, 61], H=6, KV=2, D=64, window=37),
                                      attn_tol[f32]),
        "rotary_decode_int8_bf16": (lambda: check_rotary_decode(bf16, [150, 61], H=8, KV=2, D=64,
                                                                kv_dtype=torch.int8), attn_tol[bf16]),
        "rotary_decode_fp8_fp32": (lambda: check_rotary_decode(f32, [150, 9], H=8, KV=2, D=64,
                                                               kv_dtype=torch.float8_e4m3fn), attn_tol[f32]),
        # EARLY_KV 1/2 (the first KV tile loaded before the rotary / before the PDL wait, a no-op here):
        # empty splits and a padded row, several tiles a program, a window, a quantized cache, mixed batches
        "rotary_decode_early_kv1_gqa_d64_fp32": (lambda: check_rotary_decode(
            f32, [1, 77, 130, 16], H=8, KV=2, D=64, page=8, max_context_len=400, early_kv=1), attn_tol[f32]),
        "rotary_decode_early_kv2_one_split_bf16": (lambda: check_rotary_decode(
            bf16, [100, 33], H=8, KV=2, D=128, page=32, block_n=32, target_programs=1, early_kv=2), attn_tol[bf16]),
        "rotary_decode_early_kv1_window_fp32": (lambda: check_rotary_decode(
            f32, [150, 61], H=6, KV=2, D=64, window=37, target_programs=4, early_kv=1), attn_tol[f32]),
        "rotary_decode_early_kv2_int8_bf16": (lambda: check_rotary_decode(
            bf16, [150, 61], H=8, KV=2, D=64, kv_dtype=torch.int8, early_kv=2), attn_tol[bf16]),
        "decode_reduce_early_kv2_graph_sized_fp32": (lambda: check_decode_reduce(
            f32, [5, 40], H=4, KV=2, D=64, max_context_len=400, expect_splits=25, early_kv=2), attn_tol[f32]),
        "attention_mixed_early_kv1_fp32": (lambda: check_attention(
            f32, mixed, overrides={**small_tiles, "decode": {**small_tiles["decode"], "EARLY_KV": 1,
                                                            "target_programs": 8}}), attn_tol[f32]),
        # PREFETCH (the decode loop pipelined by hand): whole contexts in one program's loop, with and without
        # the first tile loaded early, a window, splits of one tile (nothing left to prefetch), a mixed batch
        "decode_prefetch_one_split_fp32": (lambda: check_decode_reduce(
            f32, [203, 77, 1, 130, 16], H=8, KV=2, D=64, page=8, prefetch=1, target_programs=1, expect_splits=1),
            attn_tol[f32]),
        "decode_prefetch_early_kv2_bf16": (lambda: check_decode_reduce(
            bf16, [100, 33, 250], H=8, KV=2, D=128, page=32, block_n=32, prefetch=1, early_kv=2, target_programs=1),
            attn_tol[bf16]),
        "decode_prefetch_window_fp32": (lambda: check_decode_reduce(
            f32, [150, 61], H=6, KV=2, D=64, window=37, prefetch=1, target_programs=1), attn_tol[f32]),
        "decode_prefetch_splits_fp32": (lambda: check_decode_reduce(
            f32, [203], H=8, KV=2, D=128, prefetch=1, early_kv=2, expect_splits=14), attn_tol[f32]),
        "attention_mixed_prefetch_fp32": (lambda: check_attention(
            f32, mixed, overrides={**small_tiles, "decode": {**small_tiles["decode"], "PREFETCH": 1, "num_stages": 1,
                                                            "target_programs": 8}}), attn_tol[f32]),
        "argmax_fp32": (lambda: check_argmax(f32, block=128), 0),
        "argmax_bf16": (lambda: check_argmax(bf16, vocab=5000), 0),
        "argmax_small_vocab_fp32": (lambda: check_argmax(f32, vocab=37), 0),
    }
    print_report(checks)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    main()
