"""Grammars read as an engine reads them, on vocabularies made in the tests (constrained.vocab_of_tokens): a text
is fed through a Constraint token by token, and where asked each token is checked against the mask first."""
from __future__ import annotations

from engc.runtime import constrained

EOS = 256


def vocab(extra: tuple[str, ...] = ()):
    """Every single byte (ids 0-255), an end-of-sequence token (256), then the extra texts as tokens."""
    return constrained.vocab_of_tokens([bytes([i]) for i in range(256)] + [b"<eos>"] + [t.encode() for t in extra],
                                       EOS)


BYTES = vocab()


def feed(grammar, text: str, masks: bool = False, voc=BYTES) -> str | None:
    """Feeds text byte by byte: "refused" where a byte does not continue the grammar (its mask bit must agree
    when masks), else the last take()'s answer: "done" (complete, nothing more fits) or None."""
    c, result = constrained.Constraint(voc, grammar), None
    for b in text.encode():
        allowed = bool(c.allowed()[b]) if masks else None
        result = c.take(b)
        if result == "broken":
            assert not allowed, (text, b)
            return "refused"
        assert allowed is None or allowed, (text, b)
    return result


def completes(grammar, text: str, masks: bool = False) -> bool:
    return feed(grammar, text, masks) == "done"


def is_prefix(grammar, text: str) -> bool:
    """Whether the text is where an answer of the grammar may be after its last token (or its end)."""
    return feed(grammar, text) != "refused"


def takes_tokens(grammar, voc, ids: list[int]) -> bool:
    """Whether an engine's output ids all continue the grammar (over the engine's own vocabulary)."""
    c = constrained.Constraint(voc, grammar)
    return all(c.take(t) != "broken" for t in ids)
