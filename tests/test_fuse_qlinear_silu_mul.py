"""The fuse_qlinear_silu_mul pass: an int4 bundle's gate_up QLinear -> SiluMul becomes one QLinearSiluMul node,
and the CPU path computes the same tokens and logprobs as a bundle built without the pass."""
from __future__ import annotations

import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.compiler.ir import Graph
from engc.compiler.passes.fuse_qlinear_silu_mul import fuse_qlinear_silu_mul
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.stream import quantize_checkpoint
from test_fuse_silu_mul_linear import _greedy


def test_pass_fuses_gate_up_and_keeps_its_attributes():
    g = Graph()
    g.add("QLinear", ["x", "gu.qweight", "gu.scales", "gu.zeros"], "gate_up", group_size=32, has_bias=0, act_order=0)
    g.add("SiluMul", ["gate_up"], "act")
    g.add("QLinear", ["act", "d.qweight", "d.scales", "d.zeros"], "y", group_size=32, has_bias=0, act_order=0)
    fuse_qlinear_silu_mul(g)
    assert [n.op for n in g.nodes] == ["QLinearSiluMul", "QLinear"]
    fused = g.nodes[0]
    assert fused.inputs == ["x", "gu.qweight", "gu.scales", "gu.zeros"] and fused.outputs == ["act"]
    assert fused.attrs == {"group_size": 32, "has_bias": 0, "act_order": 0}


def test_pass_leaves_a_shared_or_dense_projection_alone():
    g = Graph()
    g.add("QLinear", ["x", "q", "s", "z"], "gate_up", group_size=32, has_bias=0, act_order=0)
    g.add("SiluMul", ["gate_up"], "act")
    g.add("Identity", ["gate_up"], "kept")            # the projection's output is read elsewhere too
    g.onnx_op("Gemm", ["x", "w"], "dense", transB=1)
    g.add("SiluMul", ["dense"], "act2")               # a bf16 gate_up: fuse_silu_mul_linear's business
    fuse_qlinear_silu_mul(g)
    assert [n.op for n in g.nodes] == ["QLinear", "SiluMul", "Identity", "Gemm", "SiluMul"]


def check_int4_pass_replaces(tiny_dir, tmp_path, monkeypatch, graph_pass, replaced: str, by: str, at_least: int):
    """A tiny int4 (RTN g32) llama bundle built with every pass has as many `by` nodes as one built without
    graph_pass has `replaced` ones (at least at_least), none of those left, and on the CPU the same greedy
    tokens and logprobs."""
    from engc.compiler import build as build_mod
    quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(method="rtn", group_size=32))
    build_mod.build(str(tmp_path / "q"), tmp_path / "fused", build_mod.BuildOptions())
    monkeypatch.setattr(build_mod, "PASSES", [p for p in build_mod.PASSES if p is not graph_pass])
    build_mod.build(str(tmp_path / "q"), tmp_path / "plain", build_mod.BuildOptions())
    fused_ops, fused_ids, fused_lp = _greedy(tmp_path / "fused", "The quick brown fox")
    plain_ops, plain_ids, plain_lp = _greedy(tmp_path / "plain", "The quick brown fox")
    count = plain_ops.count((ENGC_DOMAIN, replaced))
    assert count >= at_least and fused_ops.count((ENGC_DOMAIN, by)) == count
    assert (ENGC_DOMAIN, replaced) not in fused_ops
    assert fused_ids == plain_ids and torch.equal(fused_lp, plain_lp)


def test_bundle_with_the_pass_decodes_as_without(tiny_dir, tmp_path, monkeypatch):
    check_int4_pass_replaces(tiny_dir, tmp_path, monkeypatch, fuse_qlinear_silu_mul, "SiluMul", "QLinearSiluMul", 1)
