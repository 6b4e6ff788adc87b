"""Host time of structured-output masks (runtime/constrained, on llguidance): what a tool call's grammar costs
the engine thread per token, where GrammarMasks fills each constrained row's bitmask before the draw.

A two-function tool call (the grammar the server's ToolSpec builds for tool_choice "required") is written in six
styles and tokenized by a real tokenizer; at each token of each document the mask is filled as the engine fills
it (constrained.fill_masks, llguidance's threads; each token's best of --repeat runs, so a busy machine's
stalls do not count), checked to allow the token, and the token taken. Then --batch sequences at once (every document at
every position, in turn) time one fill_masks call for the batch, as a step with that many constrained rows
makes. --vocab 128k pads the real vocabulary to Llama 3's 128,256 tokens with concatenations of two of its
tokens (what BPE merges are), seeded, so the cost at a large vocabulary can be read with SmolLM2's tokenizer.

    python bench/json_masks.py [--tokenizer bundles/smollm2/tokenizer] [--vocab real|128k] [--repeat 5] [--batch 32]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import llguidance
import torch

from engc.runtime import constrained
from engc.runtime.server.tools import ToolSpec
from engc.runtime.tokenizer import Tokenizer

FUNCTIONS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["city"], "additionalProperties": False},
    "search_flights": {"type": "object", "properties": {
        "origin": {"type": "string"}, "destination": {"type": "string"}, "max_price": {"type": "number"},
        "nonstop": {"type": "boolean"}, "airlines": {"type": "array", "items": {"type": "string"}}},
        "required": ["origin", "destination"], "additionalProperties": False},
}
CALLS = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}},
         {"name": "search_flights", "arguments": {"origin": "SFO", "destination": "Tokyo Haneda",
                                                  "max_price": 1250.5, "nonstop": True, "airlines": ["ANA", "JAL"]}}]
LLAMA3_VOCAB = 128256


def call_grammar() -> constrained.Grammar:
    """The grammar of one call of FUNCTIONS, as a request with tool_choice "required" gets it."""
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in FUNCTIONS.items()]
    return ToolSpec(tools, "required").grammar()


def documents() -> list[str]:
    return [json.dumps(c, indent=indent, separators=sep) for c in CALLS
            for indent, sep in ((None, None), (2, None), (None, (",", ":")))]


def vocabulary(tokenizer: Tokenizer, size: str, seed: int = 0):
    """The engine's vocabulary of the tokenizer, or (128k) its tokens' bytes plus distinct concatenations of
    two of them up to Llama 3's size, the special tokens kept special."""
    real = constrained.vocab_of(tokenizer, tokenizer.vocab_size)
    if size == "real":
        return real
    tokens = [real.decode_bytes([i]) for i in range(real.vocab_size)]
    special = tuple(i for i in range(real.vocab_size) if real.is_special_token(i))
    rng, seen = random.Random(seed), set(tokens)
    pool = [t for i, t in enumerate(tokens) if t and i not in special]
    while len(tokens) < LLAMA3_VOCAB:
        t = rng.choice(pool) + rng.choice(pool)
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    def encode(text: bytes) -> list[int]:   # the real tokenizer's: the padding tokens are never its choice
        return tokenizer.encode(text.decode("utf-8", "replace"), add_special_tokens=False)
    return constrained.vocab_of_tokens(tokens, min(tokenizer.eos_token_ids), special, encode)


def fill_ms(rows: list[constrained.Constraint], bits: torch.Tensor) -> float:
    """One fill of the rows' masks, in milliseconds (the first at their states: a matcher keeps the mask it
    computed until it takes a token, so a second fill would only read that)."""
    t0 = time.perf_counter()
    constrained.fill_masks(rows, bits[:len(rows)])
    return (time.perf_counter() - t0) * 1e3


def walk(vocab, grammar, ids: list[int]) -> list[float]:
    """The mask time at each token of one document (the mask checked to allow it, the token then taken)."""
    c = constrained.Constraint(vocab, grammar)
    bits = torch.zeros(1, constrained.mask_words(vocab.vocab_size), dtype=torch.int32)
    times = []
    for token in ids:
        times.append(fill_ms([c], bits))
        assert constrained.unpack(bits, vocab.vocab_size)[0, token], token
        assert c.take(token) != "broken"
    assert c.matcher.is_stopped()
    return times


def batched(vocab, grammar, docs: list[list[int]], batch: int) -> list[float]:
    """ms per fill_masks call of `batch` sequences, at each position of the longest document (sequence i
    writes document i % len(docs), shorter ones starting over when done)."""
    rows = [constrained.Constraint(vocab, grammar) for _ in range(batch)]
    at = [0] * batch
    bits = torch.zeros(batch, constrained.mask_words(vocab.vocab_size), dtype=torch.int32)
    times = []
    for _ in range(max(map(len, docs))):
        times.append(fill_ms(rows, bits))
        for i in range(batch):
            doc = docs[i % len(docs)]
            if at[i] == len(doc):
                rows[i], at[i] = constrained.Constraint(vocab, grammar), 0
            rows[i].take(doc[at[i]])
            at[i] += 1
    return times


def best(runs: list[list[float]]) -> list[float]:
    """Position by position, the best of several runs (a busy machine's stalls do not count)."""
    return [min(t) for t in zip(*runs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="bundles/smollm2/tokenizer", help="a folder with tokenizer.json")
    ap.add_argument("--vocab", choices=("real", "128k"), default="real")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each document (each token's best counts)")
    ap.add_argument("--batch", type=int, default=32, help="sequences filled in one call for the batched figure")
    args = ap.parse_args()
    tokenizer = Tokenizer(Path(args.tokenizer))
    vocab, grammar = vocabulary(tokenizer, args.vocab), call_grammar()
    docs = {doc: tokenizer.encode(doc, add_special_tokens=False) for doc in documents()}
    per_doc = {doc: best([walk(vocab, grammar, ids) for _ in range(args.repeat)]) for doc, ids in docs.items()}
    every = [ms for times in per_doc.values() for ms in times]
    print(f"vocabulary {vocab.vocab_size} tokens, llguidance {llguidance.__version__}, "
          f"{len(every)} tokens in {len(docs)} documents")
    print(f"{'document':60s} {'tokens':>6s} {'total ms':>9s} {'mean ms':>8s} {'worst ms':>9s}")
    for doc, times in per_doc.items():
        print(f"{doc.replace(chr(10), '/')[:58]:60s} {len(times):6d} {sum(times):9.2f} "
              f"{statistics.mean(times):8.3f} {max(times):9.3f}")
    print(f"per token: mean {statistics.mean(every):.3f} ms, median {statistics.median(every):.3f} ms, "
          f"worst {max(every):.3f} ms")
    times = best([batched(vocab, grammar, list(docs.values()), args.batch) for _ in range(args.repeat)])
    print(f"{args.batch} sequences a fill_masks call ({torch.get_num_threads()} torch threads; llguidance's "
          f"own pool): mean {statistics.mean(times):.3f} ms, worst {max(times):.3f} ms a step, "
          f"{statistics.mean(times) / args.batch:.3f} ms a row")


if __name__ == "__main__":
    main()
