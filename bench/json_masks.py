"""Host time of structured-output masks (runtime/constrained/json_mode.py): what a tool call's grammar states cost the engine
thread, which computes a state's mask (a bool over the vocabulary) the first time a sequence reaches it.

A two-function tool call (the grammar the server's ToolSpec builds for tool_choice "required") is written in six styles and
tokenized by a real tokenizer; the distinct states the token-by-token walk reaches are each timed computing
their mask (the best of --repeat, so a busy machine's stalls do not count), then summed per document (its
cost on a cold cache) and per kind of state. --vocab 128k pads the real vocabulary to Llama 3's 128,256
tokens with concatenations of two of its tokens (what BPE merges are), seeded, so the cost at a large
vocabulary can be read with SmolLM2's tokenizer. --threads sets torch's intra-op threads (default: torch's).

    python bench/json_masks.py [--tokenizer bundles/smollm2/tokenizer] [--vocab real|128k] [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from engc.runtime.constrained.json_mode import JsonConstraint, JsonVocab
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


def call_grammar():
    """The grammar of one call of FUNCTIONS, as a request with tool_choice "required" gets it."""
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in FUNCTIONS.items()]
    return ToolSpec(tools, "required").grammar()


def documents() -> list[str]:
    return [json.dumps(c, indent=indent, separators=sep) for c in CALLS
            for indent, sep in ((None, None), (2, None), (None, (",", ":")))]


def padded(texts: list[str], size: int, seed: int = 0) -> list[str]:
    """texts plus concatenations of two non-empty ones up to `size` entries, all distinct."""
    rng, seen = random.Random(seed), set(texts)
    pool = [t for t in texts if t]
    out = list(texts)
    while len(out) < size:
        t = rng.choice(pool) + rng.choice(pool)
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def states_of(vocab: JsonVocab, tokenizer: Tokenizer, grammar, doc: str) -> list[tuple]:
    """The states a sequence writing `doc` token by token asks a mask in, in order, without repeats."""
    constraint, seen = JsonConstraint(vocab, grammar), {}
    for token in tokenizer.encode(doc, add_special_tokens=False):
        seen.setdefault(constraint.state, None)
        assert constraint.allowed()[token], (doc, token)
        constraint.take(token)
    assert constraint.done, doc
    return list(seen)


def best_ms(vocab: JsonVocab, grammar, state: tuple, repeat: int) -> float:
    """The best of `repeat` computations of the state's mask, uncached, in milliseconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        vocab._compute(state, grammar)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="bundles/smollm2/tokenizer", help="a folder with tokenizer.json")
    ap.add_argument("--vocab", choices=("real", "128k"), default="real")
    ap.add_argument("--repeat", type=int, default=5, help="computations of each state's mask (the best counts)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer(Path(args.tokenizer))
    texts = tokenizer.token_texts()
    if args.vocab == "128k":
        texts = padded(texts, LLAMA3_VOCAB)
    grammar, vocab = call_grammar(), JsonVocab(texts)
    docs = {doc: states_of(vocab, tokenizer, grammar, doc) for doc in documents()}
    cost = {s: best_ms(vocab, grammar, s, args.repeat) for states in docs.values() for s in states}
    print(f"vocabulary {len(texts)} tokens, torch threads {torch.get_num_threads()}, {len(cost)} distinct states")
    print(f"{'document (a cold mask cache)':60s} {'states':>6s} {'total ms':>9s} {'worst ms':>9s}")
    for doc, states in docs.items():
        ms = [cost[s] for s in states]
        print(f"{doc.replace(chr(10), '/')[:58]:60s} {len(ms):6d} {sum(ms):9.1f} {max(ms):9.2f}")
    kinds = defaultdict(list)
    for s, ms in cost.items():
        kinds["choices" if grammar.choices(s) else grammar.kind(s)].append(ms)
    print("by kind of state: " + ", ".join(f"{k} {len(v)} states {sum(v):.1f} ms (worst {max(v):.2f})"
                                           for k, v in sorted(kinds.items())))
    print(f"all distinct states: {sum(cost.values()):.1f} ms; the slowest:")
    for s, ms in sorted(cost.items(), key=lambda kv: -kv[1])[:4]:
        print(f"  {ms:7.2f} ms  {str(s)[:100]}")


if __name__ == "__main__":
    main()
