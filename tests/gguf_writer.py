"""Tiny GGUF files as llama.cpp's converter writes them, for the tests: the hyperparameters every family has,
its tensor names, and llama's q/k row order. Each test's writer adds what its family has beyond these."""
from __future__ import annotations

# HF module under model.layers.N -> llama.cpp's tensor stem (the llama-like families)
STEMS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GLOBALS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def add_hparams(w, cfg: dict, rope_dims: int | None = None) -> None:
    """The hyperparameters of every family, from HF config keys (head_dim given); rope_dims: the rotated width
    (default the whole head)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"] if rope_dims is None else rope_dims)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def tensor_name(name: str, stems: dict = STEMS) -> str:
    """An HF tensor's GGUF name: token_embd / output_norm / output, or blk.N.<stem>.<weight|bias>."""
    module, suffix = name.rsplit(".", 1)
    if module in GLOBALS:
        return f"{GLOBALS[module]}.{suffix}"
    _, _, layer, sub = module.split(".", 3)
    return f"blk.{layer}.{stems[sub]}.{suffix}"


def permute_qk(array, heads: int):
    """A llama q or k projection's rows in llama.cpp's order (each head's rotary halves interleaved)."""
    return array.reshape(heads, 2, array.shape[0] // heads // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
