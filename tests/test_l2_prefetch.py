"""runtime/l2_prefetch.py: the table of weights each attention node asks L2 for (the cluster decode kernel
issues it), its budget, and the executor handing it to that node alone. The kernel side is
tests/test_decode_cluster.py."""
import pytest
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.runtime import l2_prefetch
from engc.runtime.executor import Executor
from engc.runtime.loader import load
from engc.runtime.ops_reference import REFERENCE_OPS


@pytest.fixture(scope="module")
def model(tiny_bundle):
    # wide enough that each projection is past MIN_RANGE_BYTES (float32: 128 x 256 x 4 = 128 KiB)
    return load(tiny_bundle("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2))


def _attention_nodes(program):
    return [i for i, n in enumerate(program.nodes) if n.domain == ENGC_DOMAIN and n.op == "RotaryPagedAttention"]


def _nbytes(t):
    return t.numel() * t.element_size()


def _owner(weights, address, size):
    """The weight whose bytes hold [address, address + size)."""
    (name,) = [n for n, w in weights.items() if w.data_ptr() <= address and address + size <= w.data_ptr() + _nbytes(w)]
    return name


def test_each_attention_node_gets_the_weights_read_after_it_in_order(model):
    program, weights = model.executor.program, model.executor.weights
    layers = _attention_nodes(program)
    assert len(layers) == 2
    tables = l2_prefetch.node_tables(program, weights, 1 << 30, torch.device("cpu"))
    assert sorted(tables) == layers
    for i in layers:
        table = tables[i]["l2_prefetch"]
        assert table.dtype == torch.int64 and table.shape[1] == 2 and len(table) <= l2_prefetch.MAX_RANGES
        assert all(a % 16 == 0 and b % 16 == 0 for a, b in table.tolist())
        names = [_owner(weights, a, b) for a, b in table.tolist()]   # whole tensors (no SiLU-out halves here)
        # in the order the nodes after the attention read them, big ones only, whole under a large budget
        after = [n for node in program.nodes[i + 1:] for n in node.inputs
                 if n in weights and _nbytes(weights[n]) >= l2_prefetch.MIN_RANGE_BYTES]
        assert names == after[:len(names)]
        assert names[0].endswith(".o.weight") and names[1].endswith(".gate_up.weight"), names
        # whole, but for the 16-byte rounding of a CPU tensor's ends (a GPU allocation is aligned)
        assert all(_nbytes(weights[n]) - 32 < b <= _nbytes(weights[n]) for n, (_, b) in zip(names, table.tolist()))


def test_a_node_past_the_budget_gets_the_same_leading_rows_of_each_weight_then_the_table_ends(model):
    program, weights = model.executor.program, model.executor.weights
    i = _attention_nodes(program)[0]
    whole = l2_prefetch.ranges_after(program, weights, i, 1 << 30)
    o = whole[0]
    ranges = l2_prefetch.ranges_after(program, weights, i, o[1] + 1000)
    gate_up = weights["layers.0.gate_up.weight"]
    row = gate_up.shape[1] * gate_up.element_size()
    (a, b), = ranges[1:]                                              # whole rows, under the budget
    assert ranges[0] == o and _owner(weights, a, b) == "layers.0.gate_up.weight"
    assert a - gate_up.data_ptr() < 16 and b <= 1000 // row * row and b > 1000 // row * row - 32
    assert l2_prefetch.ranges_after(program, weights, i, 10) == []    # not one row: nothing
    assert l2_prefetch.node_tables(program, weights, 0, torch.device("cpu")) == {}


def test_silu_out_gate_up_is_taken_in_halves():
    """The int4 SiLU-out GEMV reads gate row a with up row I + a: a partial prefetch takes the leading rows of
    each half of qweight, scales and zeros (a synthetic program with the int4 nodes' inputs)."""
    from engc.bundle.program import Program, ProgramNode
    n, k, groups = 512, 1024, 8
    w = {"o.q": torch.zeros(n, k // 8, dtype=torch.int32), "o.s": torch.zeros(n, 64, dtype=torch.bfloat16),
         "gu.q": torch.zeros(2 * n, k // 8, dtype=torch.int32), "gu.s": torch.zeros(2 * n, groups * 4, dtype=torch.bfloat16),
         "gu.z": torch.zeros(2 * n, groups * 8, dtype=torch.uint8), "norm": torch.ones(k, dtype=torch.bfloat16)}
    node = lambda op, *ins: ProgramNode(op, ENGC_DOMAIN, ins, (op,), {})
    program = Program((node("RotaryPagedAttention", "qkv"), node("QLinear", "attn", "o.q", "o.s"),
                       node("AddRMSNorm", "x", "norm"), node("QLinearSiluMul", "h", "gu.q", "gu.s", "gu.z"),
                       node("RotaryPagedAttention", "qkv2"), node("QLinear", "y", "o.q")), ("qkv",), ("y",), tuple(w))
    o_bytes = _nbytes(w["o.q"]) + _nbytes(w["o.s"])
    gu_bytes = sum(_nbytes(w[x]) for x in ("gu.q", "gu.s", "gu.z"))
    ranges = l2_prefetch.ranges_after(program, w, 0, o_bytes + gu_bytes // 3)
    assert ranges[:2] == [(w["o.q"].data_ptr(), _nbytes(w["o.q"])), (w["o.s"].data_ptr(), _nbytes(w["o.s"]))]
    gu = ranges[2:]
    assert len(gu) == 6                                    # qweight, scales, zeros: each half's leading rows
    for j, name in enumerate(("gu.q", "gu.s", "gu.z")):
        t = w[name]
        row = _nbytes(t) // t.shape[0]
        (a0, b0), (a1, b1) = gu[2 * j:2 * j + 2]
        assert a0 == t.data_ptr() and a1 == t.data_ptr() + n * row and b0 == b1 and b0 % row == 0
        assert b0 == n * row // 3 // row * row             # a third of each half's rows
    assert gu[0][1] // (k // 2) == gu[2][1] // (groups * 8)      # the same rows of qweight and scales
    whole = l2_prefetch.ranges_after(program, w, 0, 1 << 30)   # all of it, to the next attention only
    assert [b for _, b in whole] == [_nbytes(w[x]) for x in ("o.q", "o.s")] + [_nbytes(w[x]) // 2 for x in
                                                                                ("gu.q", "gu.q", "gu.s", "gu.s", "gu.z", "gu.z")]


def test_the_last_layer_reaches_the_head_and_no_range_crosses_an_attention(model):
    program, weights = model.executor.program, model.executor.weights
    first, last = _attention_nodes(program)
    between = {n for node in program.nodes[first + 1:last] for n in node.inputs if n in weights}
    tables = l2_prefetch.node_tables(program, weights, 1 << 30, torch.device("cpu"))
    assert {_owner(weights, a, b) for a, b in tables[first]["l2_prefetch"].tolist()} <= between
    assert "embed.weight" in {_owner(weights, a, b) for a, b in tables[last]["l2_prefetch"].tolist()}   # tied head


def test_budget_from_the_launch_and_the_environment(monkeypatch):
    monkeypatch.delenv(l2_prefetch.ENV, raising=False)
    assert l2_prefetch.budget_bytes(None) == 0                          # no cluster kernel
    assert l2_prefetch.budget_bytes({"cluster": 8}) == 0               # a kernel from before the table
    assert l2_prefetch.budget_bytes({"l2_prefetch_mb": 24}) == 24 << 20
    monkeypatch.setenv(l2_prefetch.ENV, "8.5")
    assert l2_prefetch.budget_bytes({"l2_prefetch_mb": 24}) == int(8.5 * (1 << 20))
    assert l2_prefetch.budget_bytes({"cluster": 8}) == 0               # still nothing to issue it
    monkeypatch.setenv(l2_prefetch.ENV, "lots")
    with pytest.raises(ValueError, match="ENGC_L2_PREFETCH_MB='lots'"):
        l2_prefetch.budget_bytes({"l2_prefetch_mb": 0})


def test_executor_passes_node_attrs_to_that_node_only(model):
    program, weights = model.executor.program, model.executor.weights
    i = _attention_nodes(program)[0]
    marker = torch.zeros(1, 2, dtype=torch.int64)
    ex = Executor(program, weights, REFERENCE_OPS, node_attrs={i: {"l2_prefetch": marker}})
    for steps in (ex.steps, ex.decode_steps):
        assert [j for j, (_, _, _, attrs, _) in enumerate(steps) if "l2_prefetch" in attrs] == [i]
        assert steps[i][3]["l2_prefetch"] is marker and steps[i][3]["num_heads"] == 4
