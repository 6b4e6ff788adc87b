"""Constrained decoding on llguidance: a request's format becomes a Grammar (grammars.py: JSON mode, JSON
Schema, regex, choice, Lark/GBNF grammars, function calls), and each of its sequences a Constraint over the
engine's vocabulary (matcher.py), which gives each step a mask of the tokens it allows and takes each token
the sequence appends."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from engc.runtime.constrained.grammars import (Grammar, GrammarError, choice, grammar, json_object, json_schema,
                                               regex, tool_calls)
from engc.runtime.constrained.matcher import (Constraint, Matchers, fill_masks, mask_words, unpack, vocab_of,
                                              vocab_of_tokens)

if TYPE_CHECKING:
    from engc.runtime.sampling import SamplingParams

__all__ = ["Constraint", "Grammar", "GrammarError", "Matchers", "choice", "constraint_for", "fill_masks", "grammar",
           "json_object", "json_schema", "mask_words", "regex", "tool_calls", "unpack", "vocab_of",
           "vocab_of_tokens"]


def constraint_for(params: SamplingParams, matchers: Callable[[], Matchers]) -> Constraint | None:
    """The constraint a request's sampling parameters ask for, or None; matchers is called only when one does."""
    return matchers().constraint(params.grammar) if params.grammar is not None else None
