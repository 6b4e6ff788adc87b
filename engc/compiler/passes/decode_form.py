"""The program's decode form: a second output, `logits.decode`, for steps whose every row is sampled.

The step graph ends Gather(h, logits_indices) -> lm_head (-> soft-cap) -> Cast(float32) -> `logits`: a
prefill samples only each sequence's last row. In a decode step every row is sampled, so the gather
selects every row and the float32 cast only costs a launch and a copy (argmax and the sampling kernels
read the head's dtype; the host sampler casts what it reads). This pass adds the head once more over all
rows, without the gather and the cast; the runtime runs the nodes each output needs (CUDA graphs replay the
decode form), so the two heads never both run.
"""
from __future__ import annotations

from engc.bundle.program import DECODE_OUTPUT, LOGITS
from engc.compiler.ir import Graph, Node


def add_decode_form(g: Graph) -> Graph:
    gather = next((n for n in g.nodes if n.domain == "" and n.op == "Gather" and n.inputs[1:] == ["logits_indices"]),
                  None)
    if gather is None or DECODE_OUTPUT in g.outputs:
        raise ValueError("the step graph has no Gather of logits_indices to make a decode form of")
    chain, value = [], gather.outputs[0]
    while value != LOGITS:   # the head: one node after another from the gathered rows to the output
        users = g.consumers(value)
        if len(users) != 1 or len(users[0].outputs) != 1:
            raise ValueError(f"the head after {value} is not a chain of one-output nodes")
        chain.append(users[0])
        value = users[0].outputs[0]
    if not chain or chain[-1].domain != "" or chain[-1].op != "Cast":
        raise ValueError("the step graph's logits are not a Cast of the head's output")
    renamed = {gather.outputs[0]: gather.inputs[0], chain[-1].inputs[0]: DECODE_OUTPUT}
    for node in chain[:-1]:
        out = renamed.setdefault(node.outputs[0], node.outputs[0] + ".decode")
        g.nodes.append(Node(node.op, [renamed.get(v, v) for v in node.inputs], [out], dict(node.attrs),
                            node.domain))
    g.outputs = [*g.outputs, DECODE_OUTPUT]
    return g
