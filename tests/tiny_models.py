"""Tiny random-weight checkpoints of each supported family, made from a config (seeded, no download)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
          "Hello, world! How are you today?", "engc compiles models ahead of time.",
          "Numbers 0123456789 and symbols +-*/=<>()[]{}", "ünïcödé tëxt, 日本語, emoji 🙂"]

FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"],
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None,
                    tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
                  tie_word_embeddings=True),
    # mixture of experts: top-2 of 4 renormalized; a shared expert and a dense layer (mlp_only_layers);
    # norm_topk_prob with q/k norm; top-8 of 64 with q/k norm over the whole projection
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
                      tie_word_embeddings=False),
    "olmoe": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], num_experts=64,
                  num_experts_per_tok=8, intermediate_size=16, tie_word_embeddings=False),
    # Gemma 2: local/global layers, a query_pre_attn_scalar other than head_dim, soft-caps small enough to
    # bend this tiny model's scores (|score| < 0.4) and logits (|logit| < 1.3)
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], head_dim=16, num_hidden_layers=3,
                   query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=0.5,
                   final_logit_softcapping=1.0, tie_word_embeddings=True),
    # Gemma 3: one global layer in two, the global rope linearly scaled and of another base than the local
    "gemma3_text": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=32,
                        num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                        tie_word_embeddings=True),
    # DeepSeek (multi-head latent attention, kernels/mla_attention): V2 without q_lora, group-limited greedy
    # routing, YaRN whose attention factor is 1 (mscale == mscale_all_dim) but whose softmax scale is not; V3 with
    # q_lora, noaux_tc (sigmoid scores, correction bias, best-two group scores), a YaRN attention factor != 1.
    # Each has a dense first layer and ungated shared experts
    "deepseek_v2": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], num_key_value_heads=4,
                        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5, tie_word_embeddings=False,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 0.707, "mscale_all_dim": 0.707}),
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=4,
                        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5, tie_word_embeddings=False,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 1.0, "mscale_all_dim": 0.8}),
    # SmolLM3: the second layer of every two without rotary embedding (NoPE), YaRN with an attention factor
    # (which the NoPE layers do without), tied embeddings
    "smollm3": dict(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], num_hidden_layers=4,
                    no_rope_layer_interval=2, pad_token_id=None, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "rope_theta": 10000.0}),
    # OLMo 2: no pre-norms, q/k normed over the whole projection, each block's output normed before the add
    "olmo2": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], tie_word_embeddings=False),
    # GLM-4: half of each 16-wide head rotated in interleaved pairs, q/k/v biases, Gemma's four norms
    "glm4": dict(model_type="glm4", architectures=["Glm4ForCausalLM"], partial_rotary_factor=0.5,
                 attention_bias=True, pad_token_id=None, eos_token_id=1, tie_word_embeddings=False),
    # Ministral 3: YaRN and Llama 4's query temperature past the original 128 positions (the bundle stops there)
    "ministral3": dict(model_type="ministral3", architectures=["Ministral3ForCausalLM"], head_dim=16,
                       pad_token_id=None, tie_word_embeddings=False, max_position_embeddings=512,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 128, "max_position_embeddings": 512,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "llama_4_scaling_beta": 0.1}),
    # Cohere: LayerNorm, the parallel block, interleaved rotary pairs, a logit scale, tied embeddings
    "cohere": dict(model_type="cohere", architectures=["CohereForCausalLM"], logit_scale=0.3, layer_norm_eps=1e-5,
                   pad_token_id=None, tie_word_embeddings=True),
    # Cohere 2: Cohere's block, three local layers in four, the global one NoPE
    "cohere2": dict(model_type="cohere2", architectures=["Cohere2ForCausalLM"], num_hidden_layers=4, sliding_window=8,
                    logit_scale=0.3, pad_token_id=None, tie_word_embeddings=True),
    # ERNIE 4.5: interleaved rotary pairs over the whole head, tied embeddings
    "ernie4_5": dict(model_type="ernie4_5", architectures=["Ernie4_5ForCausalLM"], head_dim=16, pad_token_id=None,
                     tie_word_embeddings=True),
    # EXAONE 4: post-norms only, per-head q/k norms, three local layers in four and a global NoPE one
    "exaone4": dict(model_type="exaone4", architectures=["Exaone4ForCausalLM"], num_hidden_layers=4,
                    sliding_window=8, sliding_window_pattern=4, tie_word_embeddings=False),
    # OLMo 3: three local layers in four and a global one whose rope alone is YaRN-scaled (attention factor 1.2)
    "olmo3": dict(model_type="olmo3", architectures=["Olmo3ForCausalLM"], num_hidden_layers=4, sliding_window=8,
                  pad_token_id=None, tie_word_embeddings=False,
                  rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 64,
                                                      "attention_factor": 1.2},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Seed-OSS: q/k/v biases
    "seed_oss": dict(model_type="seed_oss", architectures=["SeedOssForCausalLM"], head_dim=16, pad_token_id=None,
                     attention_dropout=0.0, residual_dropout=0.0, tie_word_embeddings=False),
    # Granite: its four multipliers, none of them a power of two (the bf16 test sets ones that are)
    "granite": dict(model_type="granite", architectures=["GraniteForCausalLM"], embedding_multiplier=3.0,
                    attention_multiplier=0.3, residual_multiplier=0.7, logits_scaling=2.5, tie_word_embeddings=True),
    # GLM-4.5: DeepSeek-V3's routing (two groups, one chosen) and shared expert after a dense first layer, q/k/v
    # biases, half of each head rotated (rotate-half)
    "glm4_moe": dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], n_routed_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                     partial_rotary_factor=0.5, head_dim=32, tie_word_embeddings=False),
    # ERNIE 4.5 MoE: experts chosen by softmax scores plus a correction bias, a shared expert, the MoE layers a
    # range (layer 1 of 3), interleaved rotary
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", architectures=["Ernie4_5_MoeForCausalLM"], num_hidden_layers=3,
                         moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
                         moe_layer_start_index=1, moe_layer_end_index=1, head_dim=16, pad_token_id=None,
                         tie_word_embeddings=False),
    # Granite MoE: the multipliers over stacked experts routed by the softmax of their top-k logits
    "granitemoe": dict(model_type="granitemoe", architectures=["GraniteMoeForCausalLM"], num_local_experts=8,
                       num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=3.0,
                       attention_multiplier=0.3, residual_multiplier=0.7, logits_scaling=2.5,
                       tie_word_embeddings=False),
    # Phi-3: fused qkv/gate_up, half the head rotated, LongRoPE short factors and its attention factor
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], pad_token_id=1, max_position_embeddings=512,
                 original_max_position_embeddings=128, partial_rotary_factor=0.5,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.1, 4.0],
                               "long_factor": [1.5, 3.0, 6.0, 9.0]}, tie_word_embeddings=False),
}


def make_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    return tok.get_vocab_size()


def make_tiny(family: str, folder: Path, seed: int = 0, dtype=torch.float32, router_ties: bool = False,
              **overrides) -> Path:
    """router_ties (MoE): routers where ties decide the top-k, so the choice among equal scores must be
    torch.topk's as in HF: layer 0's first three router rows equal (top-2 picks two of three whenever they
    lead), every other layer's router zero (all experts tie on every token)."""
    import transformers
    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(folder)
    cfg_kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0, eos_token_id=1)
    cfg_kwargs.update({k: v for k, v in FAMILIES[family].items() if k not in ("model_type", "architectures")})
    # a list override comes as a tuple (the tiny_dir fixture's cache keys are hashable); configs want lists
    cfg_kwargs.update({k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()})
    config = transformers.AutoConfig.for_model(FAMILIES[family]["model_type"], **cfg_kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # HF initializes norms to ones; random norms test the weight mapping too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            if router_ties and name.endswith(("mlp.gate.weight", "block_sparse_moe.router.weight")):
                if name.startswith("model.layers.0."):
                    p[1:3] = p[0]
                else:
                    p.zero_()
        for name, b in model.named_buffers():   # DeepSeek-V3's router bias is zero at init: random, so it counts
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def write_random_llama(folder: Path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                       head_dim: int, vocab: int, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """A random Llama checkpoint of any size, written one shard per layer (plus one for the tied
    embedding and final norm), so making it never holds more than a layer or the embedding.
    Returns the bytes of the largest layer, of the embedding and of the whole model."""
    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)  # config.vocab_size may exceed the tokenizer's: calibration ids stay in range
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab,
                  hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, torch_dtype=str(dtype)[6:])
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    shards = layers + 1
    embed = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    save_file(embed, str(folder / f"model-{shards:05d}-of-{shards:05d}.safetensors"))
    sizes = {"embedding_bytes": embed["model.embed_tokens.weight"].nbytes, "layer_bytes": 0}
    total = sum(t.nbytes for t in embed.values())
    del embed
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (intermediate, hidden),
              "mlp.up_proj": (intermediate, hidden), "mlp.down_proj": (hidden, intermediate)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {p + name + ".weight": rand(*shape) for name, shape in shapes.items()}
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        nbytes = sum(t.nbytes for t in tensors.values())
        sizes["layer_bytes"] = max(sizes["layer_bytes"], nbytes)
        total += nbytes
        save_file(tensors, str(folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    sizes["model_bytes"] = total
    return sizes
