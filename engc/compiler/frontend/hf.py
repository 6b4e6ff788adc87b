"""Reads a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from engc.compiler.frontend.checkpoint import Checkpoint
from engc.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def read_hf_folder(path: Path) -> Checkpoint:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{config_path} is not valid JSON: {e}") from None
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise UserError(f"{path} has no *.safetensors weights (.bin/pickle checkpoints are not read: "
                        "they can execute code)")
    loaders = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                names = list(f.keys())
        except Exception as e:  # safetensors raises several types for a damaged file
            raise UserError(f"cannot read {shard.name}: {e}") from None
        for name in names:
            loaders[name] = _loader(shard, name)
    tokenizer_files = {n: (path / n).read_bytes() for n in TOKENIZER_FILES if (path / n).is_file()}
    if "tokenizer.json" not in tokenizer_files:
        raise UserError(f"{path} has no tokenizer.json (engc needs a fast tokenizer file)")
    return Checkpoint(name=path.resolve().name, hf_config=hf_config, loaders=loaders,
                      tokenizer_files=tokenizer_files,
                      source_files=[config_path, *shards])


def _loader(shard: Path, name: str):
    def load():
        with safe_open(str(shard), framework="pt") as f:
            return f.get_tensor(name)
    return load
