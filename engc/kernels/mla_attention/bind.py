"""The nodes the MLA kernels serve: MLAAttention (latent write, rope, absorbed attention over the latent cache),
and LatentRMSNorm, the RMSNorm of q_lora_rank-wide rows (DeepSeek's q_a_layernorm), whose reference is here and
whose GPU binding is the rms_norm kernel's variant of that width (kernels/rms_norm/bind.py)."""
from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.mla_attention import forward, mla_attention
from engc.kernels.rms_norm import rms_norm


def _scale_last(*xs, **a):
    """The node's inputs as mla_attention takes them: 12 tensors, then the KV scales if the cache is quantized."""
    return (mla_attention(*xs[:12], kv_scale=xs[12] if len(xs) > 12 else None, **a),)


CPU_OPS = {(ENGC_DOMAIN, "MLAAttention"): _scale_last,
           (ENGC_DOMAIN, "LatentRMSNorm"): lambda x, w, eps: (rms_norm(x, w, eps),)}


def gpu_ops(ctx) -> dict:
    if not ctx.has("mla_attention"):
        return {}

    def attention(*xs, **attrs):
        return (forward(lambda launches: ctx.run("mla_attention", launches), *xs[:12],
                        kv_scale=xs[12] if len(xs) > 12 else None, max_context_len=ctx.facts.max_context_len,
                        max_query_len=ctx.facts.max_query_len,
                        consts=ctx.consts("mla_attention"), **attrs),)

    return {(ENGC_DOMAIN, "MLAAttention"): attention}
