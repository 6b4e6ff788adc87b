"""The nodes the paged-attention kernels serve: PagedAttention, and RotaryPagedAttention (the rotary and the
attention of a layer in one node, passes/fuse_rotary_attention). A quantized KV cache passes its scales as
the last input."""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.paged_attention import (fuses_rotary, hf_half, launch, launch_rotary_decode, paged_attention,
                                          rotary_paged_attention)


def _scale_last(fn, n: int):
    """The node's inputs as fn takes them: n tensors, then the KV scales if the cache is quantized."""
    return lambda *xs, **a: (fn(*xs[:n], kv_scale=xs[n] if len(xs) > n else None, **a),)


CPU_OPS = {(ENGC_DOMAIN, "PagedAttention"): _scale_last(paged_attention, 5),
           (ENGC_DOMAIN, "RotaryPagedAttention"): _scale_last(rotary_paged_attention, 8)}
# a bfloat16 / float16 bundle on the CPU: HF transformers' roundings
HALF_OPS = {(ENGC_DOMAIN, "PagedAttention"): _scale_last(hf_half.paged_attention, 5),
            (ENGC_DOMAIN, "RotaryPagedAttention"): _scale_last(hf_half.rotary_paged_attention, 8)}


def gpu_ops(ctx) -> dict:
    if not ctx.has("paged_attention"):
        return {}
    facts = ctx.facts

    # softcap (Gemma 2's score cap) is the kernels' SOFTCAP constexpr, compiled in from the model's config
    def attention(q, kv, tables, ctx_lens, starts, kv_scale=None, *, num_heads, num_kv_heads, head_dim, scale,
                  sliding_window=0, softcap=0.0):
        out = torch.empty_like(q)
        ctx.run("paged_attention", launch(
            q, kv, tables, ctx_lens, starts, out, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, scale=scale, sliding_window=sliding_window,
            max_query_len=facts.max_query_len, max_context_len=facts.max_context_len,
            decode_rows=facts.has_decode_rows, consts=ctx.consts("paged_attention"), kv_scale=kv_scale,
            counters=ctx.counters))
        return (out,)

    # One launch on a decode-only step where the bundle has the fused kernel; otherwise the rotary kernel,
    # then attention, as for the unfused pair.
    def rope_attention(qkv, positions, inv_freq, kv, slots, tables, ctx_lens, starts, kv_scale=None, *,
                       num_heads, num_kv_heads, head_dim, scale, sliding_window=0, softcap=0.0):
        consts = ctx.consts("paged_attention")
        if facts.max_query_len == 1 and fuses_rotary(consts, positions, slots):
            out = torch.empty(qkv.shape[0], num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
            ctx.run("paged_attention", launch_rotary_decode(
                qkv, positions, inv_freq, kv, slots, tables, ctx_lens, starts, out, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, sliding_window=sliding_window,
                max_context_len=facts.max_context_len, consts=consts, kv_scale=kv_scale, counters=ctx.counters))
            return (out,)
        heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        (q,) = ctx.op("RotaryKVWrite")(qkv, positions, inv_freq, kv, slots, kv_scale, **heads)
        return attention(q, kv, tables, ctx_lens, starts, kv_scale, **heads, scale=scale,
                         sliding_window=sliding_window)

    return {(ENGC_DOMAIN, "PagedAttention"): attention, (ENGC_DOMAIN, "RotaryPagedAttention"): rope_attention}
