"""The fuse_silu_mul_linear pass: every layer's SiluMul -> down Gemm becomes one SiluMulLinear node, the
bundle carries it, and the CPU path computes the same logits as a bundle built without the pass."""
from __future__ import annotations

import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.runtime.engine import Engine
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams


def _greedy(bundle, prompt: str):
    model = load(bundle)
    ops = [(n.domain, n.op) for n in model.executor.program.nodes]
    engine = Engine(model)
    seq = engine.add_request(model.tokenizer.encode(prompt),
                             SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    engine.run_to_completion()
    return ops, seq.output_ids, torch.tensor([s.logprob for s in seq.logprobs])


def test_pass_rewrites_mlp_and_keeps_outputs(tiny_dir, tiny_bundle, tmp_path, monkeypatch):
    from engc.compiler import build as build_mod
    from engc.compiler.passes import fuse_parallel_gemms
    fused_ops, fused_ids, fused_lp = _greedy(tiny_bundle("llama"), "The quick brown fox")
    monkeypatch.setattr(build_mod, "PASSES", [fuse_parallel_gemms])
    plain = tmp_path / "plain"
    build_mod.build(str(tiny_dir("llama")), plain, build_mod.BuildOptions())
    plain_ops, plain_ids, plain_lp = _greedy(plain, "The quick brown fox")

    layers = plain_ops.count((ENGC_DOMAIN, "SiluMul"))
    assert layers >= 1 and fused_ops.count((ENGC_DOMAIN, "SiluMulLinear")) == layers
    assert (ENGC_DOMAIN, "SiluMul") not in fused_ops
    assert fused_ops.count(("", "Gemm")) == plain_ops.count(("", "Gemm")) - layers
    assert fused_ids == plain_ids
    assert torch.allclose(fused_lp, plain_lp, atol=1e-5)


def test_pass_leaves_a_shared_activation_alone():
    from engc.compiler.ir import Graph
    from engc.compiler.passes.fuse_silu_mul_linear import fuse_silu_mul_linear
    g = Graph()
    g.add("SiluMul", ["gate_up"], "act")
    g.onnx_op("Gemm", ["act", "w1"], "y1", transB=1)
    g.onnx_op("Gemm", ["act", "w2"], "y2", transB=1)
    fuse_silu_mul_linear(g)
    assert [n.op for n in g.nodes] == ["SiluMul", "Gemm", "Gemm"]
