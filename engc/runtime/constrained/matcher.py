"""A sequence's grammar state: an llguidance LLMatcher over the engine's vocabulary.

Masks are bitmasks, one bit per token id (32 ids an int32 word), as llguidance fills them: a batch's rows are
filled at once by an LLExecutor, its threads working without the GIL (fill_masks), and the bits go to the
logits' device as they are (a 128k vocabulary is 16 KB a row, not 128 KB of bools) to be unpacked there
(unpack). The host sampler's rows read a bool mask (Constraint.allowed).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer, TokenizerWrapper

from engc.runtime.constrained.grammars import Grammar, GrammarError, _one_line


def vocab_of(tokenizer, width: int) -> LLTokenizer:
    """llguidance's view of a bundle's tokenizer (its tokenizer.json) over `width` ids, the model's logits: ids
    past the tokenizer's (Qwen2.5's and Phi-3's heads are wider than their tokenizers) have no bytes, so no
    mask allows them. Special tokens are no text a grammar can match; the end-of-sequence ones end an answer
    where the grammar may end. Made at an engine's first constrained request (about 0.2 s for SmolLM2's
    49,152 tokens, 0.4 s for 128k)."""
    eos = sorted(tokenizer.eos_token_ids) or None
    return LLTokenizer(tokenizer.tok.to_str(), n_vocab=max(width, tokenizer.vocab_size), eos_token=eos)


def vocab_of_tokens(tokens: list[bytes], eos: int, special: tuple[int, ...] = (),
                    encode: Callable[[bytes], list[int]] | None = None) -> LLTokenizer:
    """A vocabulary from each id's bytes (benches and tests that have no tokenizer.json): eos and special are
    ids whose bytes are no text. encode tokenizes text as the model would; where the grammar forces bytes,
    their tokens are encode's (default: greedily, longest token first)."""
    ids = {t: i for i, t in enumerate(tokens) if i != eos and i not in special and t}
    longest = max(map(len, ids))

    def greedy(data: bytes) -> list[int]:
        out, at = [], 0
        while at < len(data):
            size = next(n for n in range(min(longest, len(data) - at), 0, -1) if data[at:at + n] in ids)
            out.append(ids[data[at:at + size]])
            at += size
        return out

    class Source:   # what llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id, special_token_ids = eos, None, sorted({eos, *special})

        @staticmethod
        def __call__(text) -> list[int]:
            return (encode or greedy)(text.encode() if isinstance(text, str) else text)
    Source.tokens = tokens
    return LLTokenizer(TokenizerWrapper(Source()))


class Matchers:
    """The grammars' compiled matchers over an engine's vocabulary, kept per grammar (the last CACHED): built
    where a request is checked, in its caller's thread, since a build can take long (1.6 s for the regex
    (a{1000}){1000} over SmolLM2's vocabulary; 0.6 ms for a tool call); each sequence takes a copy (µs)."""
    CACHED = 64

    def __init__(self, vocab: LLTokenizer):
        self.vocab = vocab
        self.built = lru_cache(maxsize=self.CACHED)(lambda grammar: matcher_of(vocab, grammar))

    def constraint(self, grammar: Grammar) -> Constraint:
        return Constraint(self.vocab, grammar, self.built(grammar).deep_copy())


def matcher_of(vocab: LLTokenizer, grammar: Grammar) -> LLMatcher:
    """The grammar compiled over the vocabulary; GrammarError where it cannot run there (a special token it
    names is not in the vocabulary)."""
    matcher = LLMatcher(vocab, grammar.text, log_level=0)
    if matcher.is_error():
        raise GrammarError(_one_line(matcher.get_error(), keep_position=grammar.kind == "grammar"))
    return matcher


class Constraint:
    """One sequence's grammar: the mask of its next token, advanced by each token it takes."""

    def __init__(self, vocab: LLTokenizer, grammar: Grammar, matcher: LLMatcher | None = None):
        """matcher: the grammar's own, fresh (Matchers gives copies of a compiled one), else compiled here."""
        self.matcher = matcher if matcher is not None else matcher_of(vocab, grammar)
        self.size = vocab.vocab_size

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next, one bool per id (the host sampler's rows)."""
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        return unpack(bits[None], self.size)[0]

    def take(self, token: int) -> str | None:
        """Advance by the token the sequence took. "done": the grammar is complete and can take no more (the
        output ends with this token's text); "broken": the token does not continue it (sampled where a mask
        was ignored), so the output ends before it; None: go on."""
        if not self.matcher.consume_token(token):
            return "broken"
        return "done" if self.matcher.is_stopped() else None


def mask_words(size: int) -> int:
    return (size + 31) // 32


@lru_cache(maxsize=1)
def _executor() -> LLExecutor:
    return LLExecutor()   # threads: llguidance's default, most of the machine's cores


def fill_masks(constraints: list[Constraint], out: torch.Tensor) -> None:
    """Each constraint's next-token bitmask into its row of out ([len(constraints), words] int32, contiguous,
    on the host), computed in parallel without the GIL."""
    assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
    _executor().unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)], out.data_ptr(),
                                        out.shape[1] * 4, out.shape[0])


def unpack(bits: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks -> [rows, width] bool, on their device (bit j of word w: id 32 w + j)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :width]
