"""The fuse_qlinear_add_norm pass: an int4 bundle's o and down QLinear -> AddRMSNorm become QLinearAddRMSNorm
nodes, and the CPU path computes the same tokens and logprobs as a bundle built without the pass (the GPU
path, the GEMV's partials summed by the norm: tests/test_gpu.py)."""
from __future__ import annotations

from engc.compiler.ir import Graph
from engc.compiler.passes.fuse_qlinear_add_norm import fuse_qlinear_add_norm
from test_fuse_qlinear_silu_mul import check_int4_pass_replaces


def test_pass_fuses_the_projection_into_the_norm_after_it():
    g = Graph()
    g.add("QLinear", ["a", "o.qweight", "o.scales", "o.zeros"], "o", group_size=32, has_bias=0, act_order=0)
    g.add("AddRMSNorm", ["o", "res", "ln.weight"], ["h", "h.residual"], eps=1e-5)
    g.add("QLinear", ["h", "q.qweight", "q.scales", "q.zeros"], "y", group_size=32, has_bias=0, act_order=0)
    fuse_qlinear_add_norm(g)
    assert [n.op for n in g.nodes] == ["QLinearAddRMSNorm", "QLinear"]
    fused = g.nodes[0]
    assert fused.inputs == ["a", "o.qweight", "o.scales", "o.zeros", "res", "ln.weight"]
    assert fused.outputs == ["h", "h.residual"] and fused.attrs == {"group_size": 32, "eps": 1e-5}


def test_pass_leaves_bias_act_order_shared_and_residual_side_alone():
    g = Graph()
    g.add("QLinear", ["a", "q", "s", "z", "b"], "biased", group_size=32, has_bias=1, act_order=0)
    g.add("AddRMSNorm", ["biased", "r0", "w"], ["h0", "r1"], eps=1e-5)
    g.add("QLinear", ["a", "q", "s", "z", "perm"], "sorted", group_size=32, has_bias=0, act_order=1)
    g.add("AddRMSNorm", ["sorted", "r1", "w"], ["h1", "r2"], eps=1e-5)
    g.add("QLinear", ["a", "q", "s", "z"], "shared", group_size=32, has_bias=0, act_order=0)
    g.add("AddRMSNorm", ["shared", "r2", "w"], ["h2", "r3"], eps=1e-5)
    g.add("Identity", ["shared"], "kept")           # the projection's output is read elsewhere too
    g.add("QLinear", ["a", "q", "s", "z"], "side", group_size=32, has_bias=0, act_order=0)
    g.add("AddRMSNorm", ["r3", "side", "w"], ["h3", "r4"], eps=1e-5)   # the projection is the residual input
    before = [n.op for n in g.nodes]
    fuse_qlinear_add_norm(g)
    assert [n.op for n in g.nodes] == before


def test_bundle_with_the_pass_decodes_as_without(tiny_dir, tmp_path, monkeypatch):
    # o and down in each of the two layers
    check_int4_pass_replaces(tiny_dir, tmp_path, monkeypatch, fuse_qlinear_add_norm, "AddRMSNorm", "QLinearAddRMSNorm", 4)
