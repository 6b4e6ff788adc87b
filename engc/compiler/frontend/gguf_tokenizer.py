"""A GGUF file's embedded tokenizer as the files a bundle carries: tokenizer.json (transformers' own GGUF
conversion, so the runtime encodes exactly as it does) and tokenizer_config.json (special tokens, BOS/EOS
flags, the chat template). meta: gguf.py's metadata reader."""
from __future__ import annotations

import json
from pathlib import Path

from engc.errors import UserError


def tokenizer_files(path: Path, meta, hf_config: dict) -> dict[str, bytes]:
    return {
        "tokenizer.json": _tokenizer_json(path, meta),
        "tokenizer_config.json": _tokenizer_config_json(meta, hf_config),
    }


def _tokenizer_json(path: Path, meta) -> bytes:
    """transformers' own GGUF tokenizer conversion, serialized: the runtime then encodes exactly as it does.

    Its per-vocabulary pre-tokenizer rules (tokenizer.ggml.pre) and added-token handling are too
    intricate to copy; this is build-time only, so depending on transformers here costs nothing at run time.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its GGUF path logs every metadata key it skips
    try:
        # Same conversion AutoTokenizer runs, without AutoTokenizer's extra full parse of the file
        # just to pick a class.
        tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:
        model = meta.get("tokenizer.ggml.model")
        reason = " ".join(str(e).split())
        raise UserError(f"{path.name}: cannot build a tokenizer from GGUF tokenizer '{model}' ({reason})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    # tokenizers writes vocab and added tokens in id order and has no clock or randomness in its output
    return tok.backend_tokenizer.to_str().encode("utf-8")


def _tokenizer_config_json(meta, hf_config: dict) -> bytes:
    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return None if token_id is None else meta.token(token_id)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        # llama.cpp's defaults when the flags are absent: sentencepiece vocabularies add BOS, BPE ones do not
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"),
        "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", False),
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_config["max_position_embeddings"],
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return (json.dumps(config, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
