"""Structured outputs (`response_format: {"type": "json_schema", ...}`): the output is one JSON value that
follows a schema. The schema compiles to nodes (runtime/constrained/schema_nodes.py: what a schema may say, what is
refused) and this character automaton walks them with json_mode's interface (start, step, kind), so the same
cached masks, blank limit and end rule apply: a token is allowed if every character of it keeps the output
a prefix of a valid document. Objects write their properties in declared order, optional ones skippable,
and no others (additionalProperties never has to be used: a document without extra keys is valid either
way).

In keys and constants, each character outside ASCII may be written as it is or as its JSON escape (\\uXXXX,
as json.dumps writes it; a surrogate pair past U+FFFF), character by character: a tokenizer without a whole
token for some character (its bytes split over tokens, which read as U+FFFD here) can still write it.
"""
from __future__ import annotations

import json
from functools import lru_cache

from engc.runtime.constrained import json_mode as jm
from engc.runtime.constrained.schema_nodes import SchemaError, compile_nodes

__all__ = ["SchemaError", "SchemaGrammar", "compile_schema", "grammar_of"]

BETWEEN = {"value", "key_or_close", "key", "colon", "comma_or_close", "item_or_close"}


class SchemaGrammar:
    """A compiled schema: the automaton json_mode.JsonVocab and JsonConstraint drive. Hashed by identity, so
    its masks are cached apart from other schemas'; compile_schema keeps one per schema text."""

    def __init__(self, schema):
        self.nodes = compile_nodes(schema)
        self.start = ("start", 0, ())   # "value" without blanks: the answer starts with its bracket

    # the automaton -----------------------------------------------------------------------------------------

    def kind(self, state: tuple) -> str:
        """'string' (plain characters keep the state), 'between' (blanks keep it) or 'other'."""
        mode = state[0]
        if mode == "any":
            return jm.OBJECT.kind(state[1])
        return "string" if mode == "string" else "between" if mode in BETWEEN else "other"

    def choices(self, state: tuple) -> tuple[str, ...] | None:
        """Where the next characters must be one of a few constant texts — the keys that may come, the
        literals or tags left — the part of each that can only be written one way (up to its first character
        outside ASCII; a whole key with its closing quote). JsonVocab's masks of such states look tokens up
        by these texts instead of walking the vocabulary. None where one of them has no such part (it may
        end here, or starts with a character outside ASCII)."""
        mode, aux, stack = state
        if mode == "key_text":
            rests = [r for _, (k, _) in self._candidates(stack[-1]) if (r := key_rest(k, aux)) is not None]
            texts = [fixed + '"' if (fixed := forced_prefix(r)) == r else fixed for r in rests]
        elif mode == "literal":
            texts = [forced_prefix(t) for t in aux]
        elif mode == "tag":
            texts = [forced_prefix(t) for t, _ in aux]
        else:
            return None
        return tuple(texts) if texts and all(texts) else None

    def depth(self, state: tuple) -> int:
        return len(state[2]) + (len(state[1][2]) if state[0] == "any" else 0)

    def step(self, state: tuple, ch: str) -> tuple | None:
        mode, aux, stack = state
        if mode in BETWEEN and ch in jm.BLANKS:
            return state
        if mode in ("value", "start"):
            return self._start_value(aux, ch, stack)
        if mode in ("string", "escape", "unicode"):
            inner = jm.step((mode, aux, ("[",)), ch)
            if inner is None:
                return None
            return (inner[0], inner[1], stack) if inner[0] != "comma_or_close" else self._after_value(stack)
        if mode == "any":
            inner = jm.step(aux, ch)
            if inner is None:   # a number at the top of the inner value ends at a character it cannot take
                ended = aux[0] == "number" and aux[1] in jm.NUMBER_ENDS and not aux[2]
                return self.step(self._after_value(stack), ch) if ended else None
            return self._after_value(stack) if inner[0] == jm.DONE else ("any", inner, stack)
        if mode == "number":
            sub, integer = aux
            nxt = jm.number_next(sub, ch, integer)
            if nxt is not None:
                return ("number", (nxt, integer), stack)
            return self.step(self._after_value(stack), ch) if sub in jm.NUMBER_ENDS else None
        if mode == "tag":   # a discriminator's value: once it is known, its branch replaces the union
            rest = tuple(sorted((r, b) for t, b in aux if (r := advance(t, ch)) is not None))
            if rest and any(t for t, _ in rest):
                return ("tag", rest, stack)
            chosen = rest[0][1] if rest else next((b for t, b in aux if not t), None)
            if chosen is None:
                return None
            after = ("comma_or_close", None, stack[:-1] + (("o", chosen, 1),))
            return after if rest else self.step(after, ch)
        if mode == "literal":
            rest = tuple(sorted({r for t in aux if (r := advance(t, ch)) is not None}))
            if rest:
                return ("literal", rest, stack) if rest != ("",) else self._after_value(stack)
            return self.step(self._after_value(stack), ch) if "" in aux else None
        if mode in ("key_or_close", "key"):
            frame = stack[-1]
            if ch == '"' and self._candidates(frame):
                return ("key_text", "", stack)
            return self._after_value(stack[:-1]) if ch == "}" and mode == "key_or_close" and self._closable(frame) else None
        if mode == "key_text":
            frame = stack[-1]
            cands = self._candidates(frame)
            if ch == '"':
                hit = next((j for j, (k, _) in cands if key_rest(k, aux) == ""), None)
                if hit is None:
                    return None
                return ("colon", self.nodes[frame[1]].props[hit][1], stack[:-1] + (("o", frame[1], hit + 1),))
            text = aux + ch
            return ("key_text", text, stack) if any(key_rest(k, text) is not None for _, (k, _) in cands) else None
        if mode == "colon":
            return ("value", aux, stack) if ch == ":" else None
        if mode == "comma_or_close":
            frame = stack[-1]
            node = self.nodes[frame[1]]
            if frame[0] == "o":
                if ch == ",":
                    return ("key", None, stack) if self._candidates(frame) else None
                return self._after_value(stack[:-1]) if ch == "}" and self._closable(frame) else None
            if ch == ",":
                more = node.max_items is None or frame[2] < node.max_items
                return ("value", node.items, stack[:-1] + (("a", frame[1], frame[2] + 1),)) if more else None
            return self._after_value(stack[:-1]) if ch == "]" and frame[2] >= node.min_items else None
        if mode == "item_or_close":
            frame = stack[-1]
            node = self.nodes[frame[1]]
            if ch == "]":
                return self._after_value(stack[:-1]) if node.min_items == 0 else None
            if node.max_items == 0:
                return None
            return self._start_value(node.items, ch, stack[:-1] + (("a", frame[1], 1),))
        return None   # done

    def _start_value(self, index: int, ch: str, stack: tuple) -> tuple | None:
        node = self.nodes[index]
        kind = node.starts.get(ch)
        if kind == "literal":
            return self.step(("literal", tuple(sorted(set(node.literals))), stack), ch)
        if kind == "tag":
            return self.step(("tag", tuple(sorted(node.tags)), stack), ch)
        if kind == "string":
            return ("string", False, stack)
        if kind == "number":
            return ("number", (jm.number_start(ch), node.number == "integer"), stack)
        if kind == "object":
            if node.props is None:   # any object
                return ("any", jm._start_value(ch, ()), stack)
            return ("key_or_close", None, stack + (("o", index, 0),))
        if kind == "array":
            return ("item_or_close", None, stack + (("a", index, 0),))
        if kind == "any":
            return ("any", jm._start_value(ch, ()), stack)
        return None

    def _candidates(self, frame: tuple) -> list[tuple[int, tuple[str, int]]]:
        """The properties that may come next: from the frame's position up to the first required one."""
        node = self.nodes[frame[1]]
        out = []
        for j in range(frame[2], len(node.props)):
            out.append((j, node.props[j]))
            if node.props[j][0] in node.required:
                break
        return out

    def _closable(self, frame: tuple) -> bool:
        node = self.nodes[frame[1]]
        return not any(k in node.required for k, _ in node.props[frame[2]:])

    @staticmethod
    def _after_value(stack: tuple) -> tuple:
        return (jm.DONE, None, ()) if not stack else ("comma_or_close", None, stack)


def advance(rest: str, ch: str) -> str | None:
    """What is left of a constant text (a key, a literal) after the character ch, or None where ch does not
    continue it: a character outside ASCII may also come as its JSON escape, whose backslash expands it."""
    if not rest:
        return None
    if rest[0] == ch:
        return rest[1:]
    if ch == "\\" and ord(rest[0]) > 127:
        return json.dumps(rest[0])[2:-1] + rest[1:]   # '"\\u5927"' -> 'u5927' (a surrogate pair past U+FFFF)
    return None


@lru_cache(maxsize=4096)
def key_rest(key: str, typed: str) -> str | None:
    """What is left of a property name after the text typed so far inside its quotes (advance, character by
    character), or None where the text is not a start of it."""
    rest = key
    for ch in typed:
        rest = advance(rest, ch)
        if rest is None:
            return None
    return rest


def forced_prefix(rest: str) -> str:
    """The part of a constant's rest that can only be written one way: up to its first character outside ASCII."""
    return next((rest[:i] for i, c in enumerate(rest) if ord(c) > 127), rest)


@lru_cache(maxsize=64)
def _compiled(text: str) -> SchemaGrammar:
    return SchemaGrammar(json.loads(text))


def grammar_of(spec) -> "SchemaGrammar | jm.ObjectGrammar":
    """SamplingParams.json_schema as a grammar: None -> any JSON object (json_object mode), a compiled
    SchemaGrammar as is, a schema (a dict, e.g. from engc.LLM callers) compiled."""
    if spec is None:
        return jm.OBJECT
    return spec if isinstance(spec, SchemaGrammar) else compile_schema(spec)


def compile_schema(schema) -> SchemaGrammar:
    """The grammar of a schema (a parsed JSON value); the same schema again gets the same grammar, so its
    masks are reused across requests. SchemaError names what cannot be enforced."""
    try:
        text = json.dumps(schema)   # not sorted: properties are written in their declared order
        return _compiled(text)
    except (TypeError, ValueError) as e:
        if isinstance(e, SchemaError):
            raise
        raise SchemaError(f"the schema is not JSON: {e}") from None
    except RecursionError:
        raise SchemaError("the schema is nested too deeply") from None
