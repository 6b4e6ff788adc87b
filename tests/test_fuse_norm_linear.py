"""The fuse_norm_linear pass: every AddRMSNorm whose output feeds only the qkv or gate_up Gemm becomes one
AddRMSNormLinear node, the bundle carries it, and the CPU path computes the same tokens and logprobs as a
bundle built without the pass. A biased qkv (Qwen2) keeps its AddRMSNorm; only gate_up fuses there."""
from __future__ import annotations

import pytest
import torch

from engc.bundle.program import ENGC_DOMAIN
from test_fuse_silu_mul_linear import _greedy

NORM, FUSED = (ENGC_DOMAIN, "AddRMSNorm"), (ENGC_DOMAIN, "AddRMSNormLinear")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pass_fuses_block_norms_and_keeps_outputs(family, tiny_dir, tiny_bundle, tmp_path, monkeypatch):
    from engc.compiler import build as build_mod
    from engc.compiler.passes import PASSES
    fused_ops, fused_ids, fused_lp = _greedy(tiny_bundle(family), "The quick brown fox")
    monkeypatch.setattr(build_mod, "PASSES", [p for p in PASSES if p.__name__ != "fuse_norm_linear"])
    plain = tmp_path / "plain"
    build_mod.build(str(tiny_dir(family)), plain, build_mod.BuildOptions())
    plain_ops, plain_ids, plain_lp = _greedy(plain, "The quick brown fox")

    layers = plain_ops.count((ENGC_DOMAIN, "RotaryPagedAttention"))
    # the AddRMSNorms: each block's post-attention one, every block's input one but the first (an RMSNorm of
    # the embedding), and the final one (its rows are gathered before the lm_head: not fused)
    assert layers >= 2 and plain_ops.count(NORM) == 2 * layers and FUSED not in plain_ops
    fused = layers if family == "qwen2" else 2 * layers - 1   # a biased qkv Gemm is no plain Gemm
    assert fused_ops.count(FUSED) == fused and fused_ops.count(NORM) == 2 * layers - fused
    assert fused_ops.count(("", "Gemm")) == plain_ops.count(("", "Gemm")) - fused
    assert fused_ids == plain_ids
    assert torch.allclose(fused_lp, plain_lp, atol=1e-6)


def test_pass_leaves_a_shared_norm_output_alone():
    from engc.compiler.ir import Graph
    from engc.compiler.passes.fuse_norm_linear import fuse_norm_linear
    g = Graph()
    g.add("AddRMSNorm", ["x", "r", "g"], ["h", "s"], eps=1e-6)
    g.onnx_op("Gemm", ["h", "w1"], "y1", transB=1)
    g.onnx_op("Gemm", ["h", "w2"], "y2", transB=1)
    fuse_norm_linear(g)
    assert [n.op for n in g.nodes] == ["AddRMSNorm", "Gemm", "Gemm"]


def test_fused_node_keeps_both_outputs_and_eps():
    from engc.compiler.ir import Graph
    from engc.compiler.passes.fuse_norm_linear import fuse_norm_linear
    g = Graph()
    g.add("AddRMSNorm", ["x", "r", "g"], ["h", "s"], eps=1e-5)
    g.onnx_op("Gemm", ["h", "w"], "y", transB=1)
    fuse_norm_linear(g)
    (node,) = g.nodes
    assert (node.op, node.inputs, node.outputs, node.attrs) == ("AddRMSNormLinear", ["x", "r", "g", "w"],
                                                                ["y", "s"], {"eps": 1e-5})
