"""DeepSeek-V2/V3: multi-head latent attention over the latent cache, and DeepSeek's MoE routings.

Tiny seeded models (tests/tiny_models.py) against HF transformers float32 on the CPU: greedy tokens identical,
log-probabilities within 1e-4; the MLA reference's two forms against each other; the KV cache's size.
"""
from __future__ import annotations

import pytest
import torch

from engc.kernels.mla_attention import absorbs, attend_absorbed, attend_decompressed
from engc.kernels.moe import route

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox", "Paris is the capital of France. Hello, world! How are you today? engc compiles",
           "0123"]


@pytest.mark.parametrize("family,overrides", [
    ("deepseek_v2", {}), ("deepseek_v3", {}),
    ("deepseek_v2", {"topk_method": "greedy", "first_k_dense_replace": 0}),   # plain top-k, every layer MoE
    ("deepseek_v3", {"rope_interleave": False, "n_group": 1, "topk_group": 1}),   # rotate-half rope, one group
], ids=["v2", "v3", "v2-greedy", "v3-rotate-half"])
def test_greedy_matches_hf(family, overrides, tiny_dir, tiny_bundle):
    from test_hf_parity import hf_greedy
    from engc.runtime.engine import Engine
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    model = load(tiny_bundle(family, **overrides))
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    engine = Engine(model)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(ids, greedy) for ids in prompts]
    engine.run_to_completion()
    cfg = model.config
    # the long prompt's prefill takes the decompressed form, decode steps the absorbed one
    assert not absorbs(len(prompts[1]), cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim)
    assert absorbs(1, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim)
    for ids, seq in zip(prompts, seqs):
        expected, hf_logits = hf_greedy(tiny_dir(family, **overrides), ids, 16)
        assert seq.output_ids == expected
        ours = torch.tensor([s.logprob for s in seq.logprobs])
        theirs = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0]
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_absorbed_equals_decompressed():
    torch.manual_seed(0)
    n, ctx, heads, nope, rope, v, r = 5, 11, 3, 16, 8, 12, 32
    q_nope, q_pe = torch.randn(n, heads, nope), torch.randn(n, heads, rope)
    rows = torch.randn(ctx, r + rope)
    w_uk, w_uv = torch.randn(heads, nope, r) * 0.2, torch.randn(heads, v, r) * 0.2
    a = attend_absorbed(q_nope, q_pe, rows, w_uk, w_uv, 0.1, r)
    d = attend_decompressed(q_nope, q_pe, rows, w_uk, w_uv, 0.1, r)
    assert a.shape == (n, heads, v) and torch.allclose(a, d, atol=1e-4, rtol=1e-4)
    # the last query row sees every key; the first sees ctx - n + 1
    k = torch.einsum("cr,hdr->hcd", rows[:, :r], w_uk)
    s = (torch.einsum("hd,hcd->hc", q_nope[0], k) + q_pe[0] @ rows[:, r:].T) * 0.1
    p = torch.softmax(s[:, :ctx - n + 1], -1)
    want = torch.einsum("hc,hcv->hv", p, torch.einsum("cr,hvr->hcv", rows[:ctx - n + 1, :r], w_uv))
    assert torch.allclose(a[0], want, atol=1e-4, rtol=1e-4)


def test_deepseek_routings():
    torch.manual_seed(2)
    t, h, e = 6, 16, 8
    x, router = torch.randn(t, h), torch.randn(e, h)
    # V2 group-limited greedy: the experts of the two best groups (by their best softmax score) only
    w, ids = route(x, router, 2, n_group=4, topk_group=2, routed_scaling_factor=1.5)
    probs = torch.softmax(x @ router.T, -1)
    best_groups = probs.view(t, 4, 2).amax(-1).topk(2).indices
    assert all(set((ids[i] // 2).tolist()) <= set(best_groups[i].tolist()) for i in range(t))
    assert torch.allclose(w, 1.5 * probs.gather(1, ids))
    # V3 noaux_tc: chosen on sigmoid + bias, weighted by the unbiased sigmoid, renormalized, scaled
    bias = torch.randn(e)
    w, ids = route(x, router, 2, renormalize=1, sigmoid_scores=1, bias=bias, n_group=4, topk_group=2,
                   group_top2=1, routed_scaling_factor=2.5)
    scores = torch.sigmoid(x @ router.T)
    chosen = scores.gather(1, ids)
    assert torch.allclose(w, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    group_scores = (scores + bias).view(t, 4, 2).sum(-1)   # best two of two: the group's sum
    best_groups = group_scores.topk(2).indices
    for i in range(t):
        allowed = [j for j in range(e) if j // 2 in best_groups[i].tolist()]
        top = sorted(allowed, key=lambda j: -(scores[i, j] + bias[j]))[:2]
        assert sorted(ids[i].tolist()) == sorted(top)


def test_latent_cache_bytes(tiny_bundle):
    from engc.bundle.inspect import describe
    from engc.bundle.reader import open_bundle
    from engc.runtime.kv_cache import KVCache
    from engc.runtime.loader import load
    model = load(tiny_bundle("deepseek_v2"))
    cfg = model.config
    kv = KVCache(cfg, 4, 16, torch.float32)
    assert kv.layers[0].shape == (1, 4, 16, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    per_token = KVCache.bytes_per_block(cfg, 16, torch.float32) // 16
    assert per_token == cfg.num_layers * (32 + 8) * 4
    text = describe(open_bundle(tiny_bundle("deepseek_v2")))
    mha = cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim) * 4
    assert f"kv bytes   {per_token:,} a token (latent {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim}" in text
    assert f"MHA-equivalent {mha:,}" in text


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_fp8_latent_cache(family, tiny_dir, tmp_path):
    """--kv-cache fp8: one e4m3 row and a float32 scale a token's latent and rope key; decodes as HF within the
    rounding of the cached rows."""
    from test_hf_parity import hf_greedy
    from engc.compiler.build import BuildOptions, build
    from engc.runtime.engine import Engine
    from engc.runtime.kv_cache import KVCache
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    build(str(tiny_dir(family)), tmp_path / "b", BuildOptions(kv_cache="fp8"))
    model = load(tmp_path / "b")
    engine = Engine(model)
    codes, scales = engine.kv.layers[0]
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == codes.shape[:-1] and codes.shape[-2:] == (1, 40)
    assert KVCache.bytes_per_block(model.config, 16, torch.float8_e4m3fn) == 16 * 2 * (40 + 4)
    ids = model.tokenizer.encode(PROMPTS[1])
    seq = engine.add_request(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    engine.run_to_completion()
    expected, hf_logits = hf_greedy(tiny_dir(family), ids, 12)
    # a tiny random model's near-ties can flip under fp8 rounding: up to the first difference (the third token
    # at the earliest), the same tokens at log-probabilities within 2e-2
    same = next((i for i, (a, b) in enumerate(zip(seq.output_ids, expected)) if a != b), len(expected))
    assert same >= 3, (seq.output_ids, expected)
    theirs = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(expected)[:, None])[:same, 0]
    assert torch.allclose(torch.tensor([s.logprob for s in seq.logprobs[:same]]), theirs, atol=2e-2)


@pytest.mark.parametrize("family,overrides", [
    ("deepseek_v2", {}), ("deepseek_v3", {}),
    # widths _scaled_mm takes (multiples of 16): kv_a's kv_lora_rank + qk_rope_head_dim, q_lora_rank
    ("deepseek_v2", {"kv_lora_rank": 56}), ("deepseek_v3", {"kv_lora_rank": 56, "q_lora_rank": 32}),
], ids=["v2-cpu", "v3-cpu", "v2-sm90", "v3-sm90"])
def test_fp8_bundle_close_to_float_bundle(family, overrides, tiny_dir, tiny_bundle, tmp_path):
    """--quant fp8: the routed experts float8 (W8A8), the latent attention's projections (q or q_a and
    q_b, kv_a, o) and the dense first layer's MLP FP8Linear (W8A8); the absorbed decode's w_uk / w_uv, the
    router and the shared experts stay in the model dtype. Logits and greedy tokens near the float bundle's."""
    from test_moe import check_fp8_close, fp8_experts_bundle
    from engc.runtime.loader import load
    archs = ("cpu", "sm90") if overrides else ("cpu",)
    r = fp8_experts_bundle(tiny_dir(family, **overrides), tiny_bundle(family, **overrides), tmp_path / "b", archs)
    check_fp8_close(r)
    model = load(tmp_path / "b")
    cfg, w = model.config, model.executor.weights
    fp8 = {n.outputs[0] for n in model.executor.program.nodes if n.op in ("FP8Linear", "FP8LinearQ")}
    attention = ["q_a", "q_b"] if cfg.q_lora_rank else ["q"]
    assert {f"layers.0.{name}.out" for name in attention + ["kv_a", "o"]} <= fp8
    assert w["layers.0.attn.w_uk"].dtype == w["layers.0.attn.w_uv"].dtype == model.dtype
    if overrides:   # the fp8 GEMMs' input quantization for every projection input width, MLA's among them
        import json
        manifest = json.loads((tmp_path / "b/manifest.json").read_text())
        quant = {r["variant"] for r in manifest["kernels"] if r["op"] == "fp8_quant"}
        assert f"k{cfg.num_heads * cfg.v_head_dim}" in quant and (not cfg.q_lora_rank or f"k{cfg.q_lora_rank}" in quant)


def test_fp8_gpu_bundle_refuses_widths_scaled_mm_cannot_take(tiny_dir, tmp_path):
    from engc.compiler.build import BuildOptions, build
    from engc.errors import UserError
    # the tiny model's kv_a is 32 + 8 = 40 rows
    with pytest.raises(UserError, match=r"multiples of 16; kv_lora_rank \+ qk_rope_head_dim 40"):
        build(str(tiny_dir("deepseek_v2")), tmp_path / "b", BuildOptions(archs=("sm90",), quant="fp8"))
    assert not (tmp_path / "b").exists()


def test_prefix_cache_reuses_latent_blocks(tiny_dir, tiny_bundle):
    """A second request that shares a prompt's first blocks reads their latents from the prefix cache (an
    extend over cached context, the absorbed form's causal rows) and still decodes as HF."""
    from test_hf_parity import hf_greedy
    from engc.runtime.engine import Engine
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    model = load(tiny_bundle("deepseek_v3"))
    engine = Engine(model)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    first = model.tokenizer.encode(PROMPTS[1] + " " + PROMPTS[1])
    engine.add_request(first, greedy)
    engine.run_to_completion()
    second = first[:40] + model.tokenizer.encode(" 0123 fox")
    seq = engine.add_request(second, greedy)
    engine.run_to_completion()
    assert engine.kv.allocator.hit_tokens >= 32
    expected, hf_logits = hf_greedy(tiny_dir("deepseek_v3"), second, 6)
    assert seq.output_ids == expected
    theirs = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([s.logprob for s in seq.logprobs]), theirs, atol=1e-4, rtol=1e-4)
