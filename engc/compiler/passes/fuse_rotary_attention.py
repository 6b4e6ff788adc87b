"""Fuses RotaryKVWrite -> PagedAttention (a layer's rotary and its attention) into one
ai.engc::RotaryPagedAttention node (kernels/paged_attention: the op's contract).

The rotated q is read by the attention only, so it need not exist as a value: on the GPU a decode-only
step then runs one kernel that rotates q and k itself, writes the new k/v and attends, in place of
the rotary kernel and then the decode kernel (two launches of pure latency a layer); prefill and mixed steps
launch the two. The CPU reference is
the two references in sequence. Inputs: the rotary's five, then the attention's block_tables,
context_lens, query_start_loc, then kv_scale when the cache is quantized; attributes and output name are
the attention's, so nothing downstream changes.
"""
from __future__ import annotations

from engc.compiler.ir import Graph, Node

HEAD_ATTRS = ("num_heads", "num_kv_heads", "head_dim")


def fuse_rotary_attention(g: Graph) -> Graph:
    for rot in [n for n in g.nodes if n.op == "RotaryKVWrite" and n.domain != ""]:
        users = g.consumers(rot.outputs[0])
        if len(users) != 1 or not _attention_of(users[0], rot) or rot.outputs[0] in g.outputs:
            continue
        attn = users[0]
        inputs = rot.inputs[:5] + attn.inputs[2:5] + rot.inputs[5:]   # kv_scale last, when there is one
        fused = Node("RotaryPagedAttention", inputs, list(attn.outputs), dict(attn.attrs))
        g.nodes[g.nodes.index(attn)] = fused
        g.nodes.remove(rot)
    return g


def _attention_of(n: Node, rot: Node) -> bool:
    """n is a PagedAttention on rot's q over the same cache (and scales), with the same heads."""
    return (n.op == "PagedAttention" and n.domain == rot.domain and n.inputs[0] == rot.outputs[0]
            and n.inputs[1] == rot.inputs[3] and n.inputs[5:] == rot.inputs[5:]
            and all(n.attrs.get(a) == rot.attrs.get(a) for a in HEAD_ATTRS))
