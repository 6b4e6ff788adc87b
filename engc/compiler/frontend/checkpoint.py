"""What every checkpoint reader hands the compiler: an HF-style config, tensors by HF name, tokenizer files.

Readers (HF safetensors folders, GGUF files, AWQ/GPTQ checkpoints) differ only in how they find these;
the family mappings downstream see one shape.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from engc.bundle.hashing import sha256_file
from engc.errors import UserError


@dataclass
class Checkpoint:
    name: str                                   # display name, no machine paths
    hf_config: dict                             # contents of an HF config.json
    loaders: dict[str, Callable[[], torch.Tensor]]  # HF tensor name -> loads that tensor (lazy)
    tokenizer_files: dict[str, bytes]           # tokenizer.json, tokenizer_config.json, ...
    source_files: list[Path] = field(default_factory=list)  # hashed into the manifest's provenance
    # where tracked (tracked()): every name has() or get() was asked about, shared by the views made from it
    asked: set[str] | None = field(default=None, repr=False, compare=False)

    def names(self) -> list[str]:
        return sorted(self.loaders)

    def tracked(self) -> "Checkpoint":
        """This checkpoint, recording the names a lowering asks about (decoder.py refuses the layer tensors
        it never asked for)."""
        return replace(self, asked=set())

    def has(self, name: str) -> bool:
        if self.asked is not None:
            self.asked.add(name)
        return name in self.loaders

    def get(self, name: str) -> torch.Tensor:
        if self.asked is not None:
            self.asked.add(name)
        if name not in self.loaders:
            raise UserError(f"checkpoint {self.name} is missing tensor '{name}'")
        return self.loaders[name]()

    def source_sha256(self) -> dict[str, str]:
        return {p.name: sha256_file(p) for p in sorted(self.source_files, key=lambda p: p.name)}

