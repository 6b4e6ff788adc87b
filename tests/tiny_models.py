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


def make_tiny(family: str, folder: Path, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    import transformers
    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(folder)
    cfg_kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0, eos_token_id=1)
    cfg_kwargs.update({k: v for k, v in FAMILIES[family].items() if k not in ("model_type", "architectures")})
    cfg_kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(FAMILIES[family]["model_type"], **cfg_kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # HF initializes norms to ones; random norms test the weight mapping too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return folder
