"""--kv-cache int8|fp8: the program's KV cache holds 1-byte codes plus float32 scales (kernels/kv_quant.py).

Adds a graph input kv_scale.{i} ([2, num_blocks, block_size, num_kv_heads] float32) per layer and hands
it to that layer's RotaryKVWrite (which quantizes as it writes) and PagedAttention (which dequantizes as
it reads) as their 6th input (RotaryPagedAttention, both fused: its 9th); kv_cache.{i} becomes int8 or float8_e4m3fn. The runtime allocates both
from the manifest's kv_cache setting.
"""
from __future__ import annotations

from engc.compiler.ir import Graph

# op -> its input count without kv_scale (which goes last); RotaryPagedAttention: passes/fuse_rotary_attention
# MLAAttention (kernels/mla_attention): its latent cache, one scale a token's row
KV_OPS = {"RotaryKVWrite": 5, "PagedAttention": 5, "RotaryPagedAttention": 8, "MLAAttention": 12}


def quantize_kv_cache(graph: Graph, kv_cache: str) -> Graph:
    for node in graph.nodes:
        if node.op in KV_OPS:
            cache = next(v for v in node.inputs if v.startswith("kv_cache."))
            assert len(node.inputs) == KV_OPS[node.op], f"{node.op} already has kv_scale"
            node.inputs.append("kv_scale." + cache.split(".", 1)[1])
    graph.kv_cache = kv_cache
    return graph


def _named(kv_cache: str):
    def run(graph: Graph) -> Graph:
        return quantize_kv_cache(graph, kv_cache)
    run.__name__ = f"quantize_kv_cache_{kv_cache}"   # the manifest lists passes by name
    return run


KV_CACHE_PASSES = {name: _named(name) for name in ("int8", "fp8")}
