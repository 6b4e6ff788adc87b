"""The fuse_rotary_attention pass: every layer's RotaryKVWrite -> PagedAttention becomes one
RotaryPagedAttention node (with kv_scale last in a --kv-cache int8 build), and the CPU path computes the
same tokens and logprobs as a bundle built without the pass, which the runtime still runs."""
from __future__ import annotations

import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.runtime.engine import Engine
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams

FUSED = (ENGC_DOMAIN, "RotaryPagedAttention")


def _greedy(bundle, prompts):
    model = load(bundle)
    nodes = model.executor.program.nodes
    engine = Engine(model)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(model.tokenizer.encode(p), params) for p in prompts]
    engine.run_to_completion()
    return nodes, [s.output_ids for s in seqs], torch.tensor([s.logprob for q in seqs for s in q.logprobs])


def _build_without_pass(tiny_dir, path, monkeypatch, **options):
    from engc.compiler import build as build_mod
    from engc.compiler.passes import PASSES
    monkeypatch.setattr(build_mod, "PASSES", [p for p in PASSES if p.__name__ != "fuse_rotary_attention"])
    build_mod.build(str(tiny_dir("mistral", sliding_window=8)), path, build_mod.BuildOptions(**options))


def test_pass_fuses_every_layer_and_keeps_outputs(tiny_dir, tiny_bundle, tmp_path, monkeypatch):
    prompts = ["The quick brown fox jumps", "Paris"]       # one prompt past the sliding window
    fused_nodes, fused_ids, fused_lp = _greedy(tiny_bundle("mistral", sliding_window=8), prompts)
    _build_without_pass(tiny_dir, tmp_path / "plain", monkeypatch)
    plain_nodes, plain_ids, plain_lp = _greedy(tmp_path / "plain", prompts)

    ops = [(n.domain, n.op) for n in fused_nodes]
    layers = [(n.domain, n.op) for n in plain_nodes].count((ENGC_DOMAIN, "PagedAttention"))
    assert layers >= 1 and ops.count(FUSED) == layers
    assert (ENGC_DOMAIN, "RotaryKVWrite") not in ops and (ENGC_DOMAIN, "PagedAttention") not in ops
    attn = next(n for n in plain_nodes if n.op == "PagedAttention")
    fused = next(n for n in fused_nodes if n.op == "RotaryPagedAttention")
    assert fused.attrs == attn.attrs and fused.outputs == attn.outputs and len(fused.inputs) == 8
    assert fused_ids == plain_ids
    assert torch.allclose(fused_lp, plain_lp, atol=1e-5)


def test_quantized_cache_passes_its_scales_last(tiny_dir, tmp_path):
    from engc.compiler.build import BuildOptions, build
    build(str(tiny_dir("llama")), tmp_path / "b", BuildOptions(kv_cache="int8"))
    nodes = load(tmp_path / "b").executor.program.nodes
    fused = [n for n in nodes if n.op == "RotaryPagedAttention"]
    assert fused and all(len(n.inputs) == 9 and n.inputs[8] == "kv_scale." + n.inputs[3].split(".")[1]
                         for n in fused)
    assert not any(n.op in ("RotaryKVWrite", "PagedAttention") for n in nodes)


def test_pass_leaves_a_shared_q_alone():
    from engc.compiler.ir import Graph
    from engc.compiler.passes.fuse_rotary_attention import fuse_rotary_attention
    heads = dict(num_heads=4, num_kv_heads=2, head_dim=8)
    g = Graph()
    g.add("RotaryKVWrite", ["qkv", "positions", "inv_freq", "kv_cache.0", "slot_mapping"], "q", **heads)
    g.add("PagedAttention", ["q", "kv_cache.0", "block_tables", "context_lens", "query_start_loc"], "attn",
          scale=0.3, sliding_window=0, **heads)
    g.add("RMSNorm", ["q", "w"], "other", eps=1e-6)
    fuse_rotary_attention(g)
    assert [n.op for n in g.nodes] == ["RotaryKVWrite", "PagedAttention", "RMSNorm"]


def test_fused_kernel_only_up_to_its_row_limit():
    import torch
    from engc.kernels.paged_attention import fuses_rotary
    consts = {"decode_rotary": {"rotary_max_rows": 32}}
    p32, p33 = torch.zeros(32, dtype=torch.int64), torch.zeros(33, dtype=torch.int64)
    assert fuses_rotary(consts, p32, p32) and not fuses_rotary(consts, p33, p33)
    assert fuses_rotary({"decode_rotary": {}}, p33, p33)        # records from before the limit: any batch
    assert not fuses_rotary({}, p32, p32)                       # bundles without the fused kernel
    assert not fuses_rotary(consts, p32.int(), p32.int())       # compiled for int64 positions and slots
