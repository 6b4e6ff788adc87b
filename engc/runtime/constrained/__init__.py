"""Constrained decoding: the output follows a JSON grammar (json_mode, json_schema, schema_nodes), from its
start or from where it reaches a trigger (triggered). A constraint gives each step a mask of the tokens it
allows (its `allowed`) and takes each token the sequence appends (its `take`)."""
from __future__ import annotations

from typing import Callable

from engc.runtime.constrained.json_mode import JsonConstraint, JsonVocab
from engc.runtime.constrained.json_schema import grammar_of
from engc.runtime.constrained.triggered import TriggeredConstraint
from engc.runtime.sampling import SamplingParams


def vocab_of(tokenizer, width: int) -> JsonVocab:
    """The token texts masks read, one per logit: ids past the tokenizer's (Qwen2.5's and Phi-3's heads are
    wider than their tokenizers) have no text, so, like special tokens, no mask allows them. Making it takes
    0.3-0.5 s for SmolLM2's 49,152 tokens on the CPU, so an engine makes it at its first constrained request."""
    texts = tokenizer.token_texts()
    return JsonVocab((texts + [""] * (width - len(texts)))[:width])


def constraint_for(params: SamplingParams, vocab: Callable[[], JsonVocab]
                   ) -> JsonConstraint | TriggeredConstraint | None:
    """The constraint a request's sampling parameters ask for, or None; vocab is called only when one does."""
    if params.json_triggers or params.json_at_start:
        return TriggeredConstraint(vocab(), grammar_of(params.json_schema), params.json_triggers,
                                   params.json_at_start)
    if params.json_object or params.json_schema is not None:
        return JsonConstraint(vocab(), grammar_of(params.json_schema))
    return None
