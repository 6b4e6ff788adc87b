"""The node the rotary kernel serves: RotaryKVWrite (a quantized KV cache passes its scales as a 6th input)."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.paged_attention import hf_half
from engc.kernels.rotary import launch, rotary_kv_write

CPU_OPS = {(ENGC_DOMAIN, "RotaryKVWrite"): lambda qkv, pos, inv_freq, kv, slots, kv_scale=None, **a: (
    rotary_kv_write(qkv, pos, inv_freq, kv, slots, kv_scale=kv_scale, **a),)}
# a bfloat16 / float16 bundle on the CPU: HF transformers' roundings
HALF_OPS = {(ENGC_DOMAIN, "RotaryKVWrite"): lambda qkv, pos, inv_freq, kv, slots, kv_scale=None, **a: (
    hf_half.rotary_kv_write(qkv, pos, inv_freq, kv, slots, kv_scale=kv_scale, **a),)}


def gpu_ops(ctx) -> dict:
    if not ctx.has("rotary"):
        return {}
    def rope(qkv, positions, inv_freq, kv, slots, kv_scale=None, *, num_heads, num_kv_heads, head_dim):
        q = torch.empty(qkv.shape[0], num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
        ctx.run("rotary", launch(qkv, positions, inv_freq, kv, slots, q, kv_scale=kv_scale))
        return (q,)

    return {(ENGC_DOMAIN, "RotaryKVWrite"): rope}
