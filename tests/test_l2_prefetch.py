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


def test_each_attention_node_gets_the_weights_read_after_it_in_order(model):
    program, weights = model.executor.program, model.executor.weights
    layers = _attention_nodes(program)
    assert len(layers) == 2
    tables = l2_prefetch.node_tables(program, weights, 1 << 30, torch.device("cpu"))
    assert sorted(tables) == layers
    by_address = {w.data_ptr(): name for name, w in weights.items()}
    for i in layers:
        table = tables[i]["l2_prefetch"]
        assert table.dtype == torch.int64 and table.shape[1] == 2 and len(table) <= l2_prefetch.MAX_RANGES
        names = [by_address[a] for a, _ in table.tolist()]
        # in the order the nodes after the attention read them, big ones only, whole under a large budget
        after = [n for node in program.nodes[i + 1:] for n in node.inputs
                 if n in weights and _nbytes(weights[n]) >= l2_prefetch.MIN_RANGE_BYTES]
        assert names == after[:len(names)]
        assert names[0].endswith(".o.weight") and names[1].endswith(".gate_up.weight"), names
        assert [b for _, b in table.tolist()] == [_nbytes(weights[n]) & ~15 for n in names]


def test_the_budget_cuts_the_last_range_and_stops(model):
    program, weights = model.executor.program, model.executor.weights
    i = _attention_nodes(program)[0]
    first = l2_prefetch.ranges_after(program, weights, i, 1 << 30)[0]
    ranges = l2_prefetch.ranges_after(program, weights, i, first[1] + 1000)
    assert ranges[0] == first and len(ranges) == 2 and ranges[1][1] == 1000 & ~15
    assert l2_prefetch.ranges_after(program, weights, i, 10) == []            # less than 16 bytes: nothing
    assert l2_prefetch.node_tables(program, weights, 0, torch.device("cpu")) == {}


def test_the_last_layer_reaches_the_head_and_no_range_crosses_an_attention(model):
    program, weights = model.executor.program, model.executor.weights
    first, last = _attention_nodes(program)
    between = {n for node in program.nodes[first + 1:last] for n in node.inputs if n in weights}
    tables = l2_prefetch.node_tables(program, weights, 1 << 30, torch.device("cpu"))
    by_address = {w.data_ptr(): name for name, w in weights.items()}
    assert {by_address[a] for a, _ in tables[first]["l2_prefetch"].tolist()} <= between


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
