"""MLAAttention's Triton kernels under TRITON_INTERPRET=1 against the op's reference (kernels/mla_attention).

As test_moe_kernels.py: the checks run in one child process (this file as a script) with the interpreter on,
through the specs codegen builds for a small latent-attention model and the op's forward(), which is what the
GPU binding runs: decode (one row a sequence, split-KV over pages), prefill/extend (causal rows over earlier
context), bfloat16, and an fp8 latent cache. The kernels also compile for sm80 and sm90.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from interpreted import interpreted_report, print_report
from test_codegen import launch_checker
from test_kernels import _rel, _run

ROOT = Path(__file__).resolve().parents[1]

CASES = ["decode_split_fp32", "decode_one_split_fp32", "extend_fp32", "prefill_and_decode_fp32", "decode_bf16",
         "decode_fp8_cache_fp32", "gpu_binding_fp32", "decode_query_tiles_fp32", "prefill_decompressed_fp32",
         "prefill_decompressed_fp8_cache_fp32"]


@pytest.fixture(scope="module")
def report():
    return interpreted_report(__file__, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_mla_kernel_matches_reference(report, case):
    assert case in report, f"{case} did not run"
    assert report[case]["ok"], report[case]


def test_op_contract_does_not_import_triton():
    import subprocess
    code = ("import sys, engc.kernels.mla_attention, engc.kernels.mla_attention.bind; "
            "assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("kv_cache", ["auto", "fp8"])
def test_mla_kernels_compile_for_sm80_and_sm90_and_match_the_launch_rule(kv_cache):
    """Both kernels compile ahead of time (no GPU); forward()'s launches pass the compiled kernels' parameters
    in order, with the recorded types. Dense models get no MLA kernels."""
    import torch
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    from engc.kernels import mla_attention as op
    assert not [s for s in model_specs(_cfg(kv_lora_rank=0), torch.bfloat16, "sm90", 16) if s.op == "mla_attention"]
    # nor do latent-attention models get the per-head cache's rotary and paged-attention kernels
    assert not {"rotary", "paged_attention"} & {s.op for s in model_specs(_cfg(), torch.bfloat16, "sm90", 16)}
    archs = ("sm90",) if kv_cache == "fp8" else ("sm80", "sm90")   # an fp8 cache needs sm89+
    specs = [s for arch in archs for s in model_specs(_cfg(), torch.bfloat16, arch, 16, kv_cache=kv_cache)
             if s.op == "mla_attention"]
    result = compile_specs(specs, jobs=1)
    records = {(r["arch"], r["variant"]): r for r in result.records}
    assert set(records) == {(a, v) for a in archs for v in ("write", "query", "decode", "reduce")}
    for r in result.records:
        assert result.files[r["cubin"]][:4] == b"\x7fELF" and f".entry {r['entry']}(" in result.files[r["ptx"]].decode()
    consts = {v: r["launch"] for (a, v), r in records.items() if a == "sm90"}
    check = launch_checker(records)

    case = _case(torch.bfloat16, [(1, 40), (1, 7)], kv=torch.float8_e4m3fn if kv_cache == "fp8" else None)
    op.forward(check, *case["inputs"], kv_scale=case["kv_scale"], **case["attrs"], max_context_len=40, consts=consts)
    # a CUDA graph's capture knows no context length: the block table's capacity stands in
    op.forward(check, *case["inputs"], kv_scale=case["kv_scale"], **case["attrs"], max_context_len=None, consts=consts)
    assert check.seen == {"write", "query", "decode", "reduce"}


def test_deepseek_v2_lite_shape_compiles():
    """The real widths (16 heads, a 512 latent, a 64-wide rope key) fit the tiles on both archs: the latent tile
    and the 16-head accumulator in shared memory and registers (about 56 KB of shared memory, opted into above
    48 KB at load time)."""
    import torch
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    cfg = _cfg(hidden_size=2048, num_heads=16, num_kv_heads=16, head_dim=192, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    specs = [s for arch in ("sm80", "sm90") for s in model_specs(cfg, torch.bfloat16, arch, 16)
             if s.op == "mla_attention"]
    records = compile_specs(specs, jobs=1).records
    assert {(r["arch"], r["variant"]) for r in records} == {(a, v) for a in ("sm80", "sm90")
                                                            for v in ("write", "query", "decode", "reduce")}
    assert all(r["shared_mem"] <= 100 * 1024 for r in records)


# ---------------------------------------------------------------- the child process (TRITON_INTERPRET=1)

def _cfg(**kw):
    from engc.bundle.model_config import ModelConfig
    base = dict(family="deepseek_v2", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=1,
                num_heads=4, num_kv_heads=4, head_dim=24, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=512, tie_word_embeddings=False, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16)
    base.update(kw)
    return ModelConfig(**base)


def _case(dtype, seqs, kv=None, heads=4, page=16, seed=0):
    """seqs: (query rows, context length) per sequence; the context's earlier tokens already cached."""
    import torch
    g = torch.Generator().manual_seed(seed)
    r, rope, nope, v = 32, 8, 16, 16
    rnd = lambda *s, std=1.0: (torch.randn(*s, generator=g) * std)  # noqa: E731
    blocks_per = max((c + page - 1) // page for _, c in seqs)
    num_blocks = blocks_per * len(seqs) + 3
    perm = torch.randperm(num_blocks, generator=g)[:blocks_per * len(seqs)]
    tables = perm.reshape(len(seqs), blocks_per).to(torch.int32)
    cache = torch.zeros(1, num_blocks, page, 1, r + rope, dtype=kv or dtype)
    kv_scale = torch.zeros(1, num_blocks, page, 1) if kv is not None else None
    positions, slots, starts = [], [], [0]
    for b, (n, ctx) in enumerate(seqs):
        past = torch.arange(ctx - n)
        past_slots = tables[b, past // page].long() * page + past % page
        rows = rnd(ctx - n, r + rope)
        if kv is None:
            cache.view(-1, r + rope)[past_slots] = rows.to(dtype)
        else:
            from engc.kernels import kv_quant
            codes, scales = kv_quant.quantize(rows, kv)
            cache.view(-1, r + rope)[past_slots] = codes
            kv_scale.view(-1)[past_slots] = scales
        pos = torch.arange(ctx - n, ctx)
        positions.append(pos)
        slots.append(tables[b, pos // page].long() * page + pos % page)
        starts.append(starts[-1] + n)
    t = starts[-1]
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rope, 2).float() / rope))
    inputs = [rnd(t, heads * (nope + rope)).to(dtype), rnd(t, r + rope).to(dtype), (1 + 0.1 * rnd(r)).to(dtype),
              torch.cat(positions), inv_freq, cache, torch.cat(slots), tables,
              torch.tensor([c for _, c in seqs], dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
              rnd(heads, nope, r, std=0.2).to(dtype), rnd(heads, v, r, std=0.2).to(dtype)]
    attrs = dict(num_heads=heads, kv_lora_rank=r, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
                 scale=(nope + rope) ** -0.5, eps=1e-6)
    return {"inputs": inputs, "attrs": attrs, "kv_scale": kv_scale}


def _specs(dtype, overrides=None, kv_cache="auto"):
    from engc.compiler.codegen.specs import model_specs
    return {s.variant: s for s in model_specs(_cfg(), dtype, "sm90", 16,
                                              {"mla_attention": overrides} if overrides else None, kv_cache=kv_cache)
            if s.op == "mla_attention"}


def _runner(specs):
    """test_kernels' _run (launch-rule output through the interpreter, as the runtime launches it), recording
    the variants it ran."""
    def run(launches):
        launches = list(launches)
        _run(specs, launches)
        run.variants += [variant for variant, _, _ in launches]
    run.variants = []
    return run


def check_forward(dtype, seqs, min_split_tokens=16, kv=None, kv_cache="auto", query_tiles=None):
    """forward() (torch + the interpreted kernels) against the reference on a copy of the same cache; the
    cache rows each writes must agree too. query_tiles: the query kernel's BLOCK_T / BLOCK_R / BLOCK_S instead of
    its defaults (which fit the small model's rows and latent in one program)."""
    import dataclasses
    import torch
    from engc.kernels import mla_attention as op
    case = _case(dtype, seqs, kv=kv)
    specs = _specs(dtype, {"min_split_tokens": min_split_tokens, "target_programs": 64}, kv_cache)
    if query_tiles:
        q = specs["query"]
        specs["query"] = dataclasses.replace(q, constexprs={**q.constexprs, **query_tiles},
                                             launch={**q.launch, **query_tiles})
    consts = {v: s.launch for v, s in specs.items()}
    inputs, scale = case["inputs"], case["kv_scale"]
    ref_inputs = list(inputs)
    ref_inputs[5] = inputs[5].clone()
    ref_scale = None if scale is None else scale.clone()
    op.mla_attention(*ref_inputs, kv_scale=ref_scale, **case["attrs"])   # the rows the reference writes
    run = _runner(specs)
    out = op.forward(run, *inputs, kv_scale=scale, **case["attrs"], max_context_len=max(c for _, c in seqs),
                     consts=consts, max_query_len=max(n for n, _ in seqs))
    # the rows written: float32 equal up to cos/sin's last bits; bf16 within the interpreter's truncating
    # conversions (the GPU and torch round to nearest). A quantized cache: the same float32 scales, and the same
    # codes but for a few the interpreter's float -> fp8 conversion sends to the binade below where a rounding
    # carries into the next (Triton 3.9 interpreted, 124.5 becomes 64, not 128)
    if kv is None:
        limit = 5e-3 if dtype == torch.bfloat16 else 1e-6
        assert _rel(inputs[5].float(), ref_inputs[5].float()) < limit, "the latent rows written differ"
    else:
        assert torch.allclose(scale, ref_scale, rtol=1e-6, atol=0), "the row scales written differ"
        agree = (inputs[5].float() == ref_inputs[5].float()).float().mean()
        assert agree > 0.97, ("the latent codes written differ", float(agree))
    # the attention against the reference over the rows the kernel wrote (its slots -1: it writes none again)
    kept = list(inputs)
    kept[6] = torch.full_like(inputs[6], -1)
    ref = op.mla_attention(*kept, kv_scale=scale, **case["attrs"])
    splits = op.splits_for(inputs[0].shape[0], max(c for _, c in seqs), consts)
    return _rel(out, ref), {"variants": run.variants, "splits": splits}


def check_binding(dtype):
    """bind.py's GPU op as the executor calls it, its kernels run by a stand-in for the runtime's context."""
    from engc.bundle.program import ENGC_DOMAIN
    from engc.kernels.mla_attention import bind
    specs = _specs(dtype)

    class Context:
        def __init__(self):
            self.ran = _runner(specs)

        class facts:
            max_context_len = 37
            max_query_len = 3

        def run(self, name, launches):
            assert name == "mla_attention"
            self.ran(launches)

        def has(self, name):
            return name == "mla_attention"

        def consts(self, name):
            return {v: s.launch for v, s in specs.items()}

    ctx = Context()
    case = _case(dtype, [(1, 37), (3, 9)])
    ref_inputs = list(case["inputs"])
    ref_inputs[5] = ref_inputs[5].clone()
    (out,) = bind.gpu_ops(ctx)[(ENGC_DOMAIN, "MLAAttention")](*case["inputs"], **case["attrs"])
    (ref,) = bind.CPU_OPS[(ENGC_DOMAIN, "MLAAttention")](*ref_inputs, **case["attrs"])
    return _rel(out, ref), ctx.ran.variants


def main():
    import torch
    from test_kernels import _patch_interpreter_bf16_dot
    _patch_interpreter_bf16_dot()
    f32, bf16 = torch.float32, torch.bfloat16
    # bf16: the interpreter truncates float -> bf16 where the GPU rounds, and the absorbed form rounds q_lat and
    # p in bf16 where the reference stays float32; fp8: the kernel rounds the dequantized rows to q's dtype
    tol = {f32: 1e-5, bf16: 3e-2}
    checks = {
        # decode rows over 2-3 pages, cut into splits of one BLOCK_N tile or more
        "decode_split_fp32": (lambda: check_forward(f32, [(1, 70), (1, 7), (1, 33)]), tol[f32]),
        "decode_one_split_fp32": (lambda: check_forward(f32, [(1, 20), (1, 5)], min_split_tokens=4096), tol[f32]),
        # extend: several causal rows after earlier context (a prefix-cache hit, chunked prefill)
        "extend_fp32": (lambda: check_forward(f32, [(5, 21), (3, 3)]), tol[f32]),
        "prefill_and_decode_fp32": (lambda: check_forward(f32, [(9, 9), (1, 30), (2, 17)]), tol[f32]),
        "decode_bf16": (lambda: check_forward(bf16, [(1, 40), (1, 18)]), tol[bf16]),
        # the query kernel cut into two row blocks, two latent blocks and three chunks of query_start_loc
        "decode_query_tiles_fp32": (lambda: check_forward(f32, [(1, 3 + 2 * i) for i in range(20)] + [(2, 9)],
                                                          query_tiles={"BLOCK_T": 16, "BLOCK_R": 16, "BLOCK_S": 8}),
                                    tol[f32]),
        "decode_fp8_cache_fp32": (lambda: check_forward(f32, [(1, 35), (2, 12)], kv=torch.float8_e4m3fn,
                                                        kv_cache="fp8"), tol[f32]),
        "gpu_binding_fp32": (lambda: check_binding(f32), tol[f32]),
        # a step with a long prefill row (absorbs() says no): the decompressed form's batched torch ops, one
        # sequence starting fresh, one extending earlier context, one decoding
        "prefill_decompressed_fp32": (lambda: check_forward(f32, [(40, 40), (35, 50), (1, 9)]), tol[f32]),
        "prefill_decompressed_fp8_cache_fp32": (lambda: check_forward(f32, [(40, 45), (2, 7)], kv=torch.float8_e4m3fn,
                                                                      kv_cache="fp8"), tol[f32]),
    }
    print_report(checks)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(ROOT))
    main()
