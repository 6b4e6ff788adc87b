"""Calibration text -> token samples [N, L].

A user file (plain text, or JSONL with a "text" field per line), else the default corpus: the Python
language reference that CPython ships in every installation (pydoc_data.topics, ~460 KB of English
prose with code). Topics alternate between a calibration half and a held-out half, so perplexity is
measured on text the quantizer never saw (`engc.compiler.quantize.calibration.default_corpus`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engc.errors import UserError

SPLITS = ("calibration", "heldout")


def default_corpus(split: str = "calibration") -> str:
    from pydoc_data.topics import topics
    names = sorted(topics)
    half = names[0::2] if split == "calibration" else names[1::2]
    return "\n\n".join(topics[n] for n in half)


def read_text(path: str | None) -> str:
    if path is None:
        return default_corpus("calibration")
    p = Path(path)
    if not p.is_file():
        raise UserError(f"calibration file {path}: no such file")
    text = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix.lower() in (".jsonl", ".json"):
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"calibration file {path}: line {n} is not JSON") from None
            docs.append(row if isinstance(row, str) else row.get("text", "") if isinstance(row, dict) else "")
        text = "\n\n".join(d for d in docs if d)
    return text


def calibration_samples(tokenizer_json: bytes, path: str | None, samples: int, seqlen: int) -> torch.Tensor:
    """samples evenly spaced, non-overlapping windows of seqlen tokens."""
    text = read_text(path)
    ids = Tokenizer.from_str(tokenizer_json.decode()).encode(text, add_special_tokens=False).ids
    need = samples * seqlen
    source = path or "the default corpus"
    if len(ids) < need:
        raise UserError(f"calibration text {source} has {len(ids)} tokens; {samples} samples of "
                        f"{seqlen} tokens need {need}: give more text or lower --calib-samples/--calib-seqlen")
    windows = len(ids) // seqlen
    starts = [(i * windows // samples) * seqlen for i in range(samples)]
    return torch.tensor([ids[s:s + seqlen] for s in starts], dtype=torch.int64)
