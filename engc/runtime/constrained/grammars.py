r"""What a request may ask its answer to follow, as llguidance grammars: JSON mode, a JSON Schema, a regex, one
of a list of choices, a Lark or GBNF grammar, and function calls (the whole answer, or only where a call
starts). Each constructor checks its input and raises GrammarError with llguidance's reason in one line;
the grammar text it returns is what LLMatcher compiles per request (matcher.py).

Choices made on top of llguidance's JSON Schema support:
- Blanks outside strings: at each place JSON allows them, one space or tab, or a line break and an indent
  of up to 16 (WHITESPACE), so json.dumps' styles and pretty-printing fit but a model cannot spend its
  tokens on blank lines or runs of spaces; nothing before the first bracket or after the last.
- An object schema that declares `properties` and says nothing of other keys gets
  `additionalProperties: false`: the answer writes declared keys only (still a valid instance; a small
  model wandering into keys of its own is worse). Left as they are: schemas that combine (allOf, anyOf,
  $ref beside properties), since closing one part would refuse the other's keys, and those that require
  an undeclared key.
- Strings may write any character as its \uXXXX escape, as json.dumps does outside ASCII (llguidance
  allows it for control characters only unless told); `\/` is the one JSON escape llguidance refuses.
- `oneOf` is read as `anyOf` (pydantic writes discriminated unions that way; a document matching two
  branches is rare and still well-formed).
- strict: every keyword is enforced, or the schema is refused naming the one llguidance cannot enforce;
  not strict (OpenAI's `strict: false`): such keywords are ignored and the rest enforced.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from llguidance import LLMatcher, grammar_from

# one place's blanks: a space or tab, or a line break (after at most one) and an indent of up to 16
WHITESPACE = r"[\x20\x09]|[\x20\x09]?\r?\n[\x20\x09]{0,16}"
LEAD_BLANKS = r"/[\x20\x09\r\n]{1,8}/"     # between a call's trigger (or the answer's start) and its value
KEEPS_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf",
                    "oneOf", "$ref", "if")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMAS = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
              "additionalItems", "unevaluatedItems", "unevaluatedProperties")
SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")   # not allOf: its parts are merged, see the docstring


class GrammarError(ValueError):
    """A format llguidance cannot compile or enforce; the message is one line."""


@dataclass(frozen=True)
class Grammar:
    """A compiled, checked request format. kind: json_object, json_schema, regex, choice, grammar or
    tool_calls (for messages); text: llguidance's grammar."""
    kind: str
    text: str


def json_object() -> Grammar:
    """Any JSON object (`response_format: {"type": "json_object"}`)."""
    return _checked("json_object", _schema_text(json.dumps({"type": "object"}), True))


def json_schema(schema, strict: bool = True) -> Grammar:
    """One instance of a JSON Schema (a parsed JSON value, or its text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the schema is not JSON: {e}") from None
        except RecursionError:
            raise GrammarError("the schema is nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("the schema must be a JSON object")
    return _checked("json_schema", _schema_text(_json_text(_closed(schema)), strict))


def regex(pattern) -> Grammar:
    """Text that the whole pattern matches (Rust regex syntax: `.` stops at a line break)."""
    if not isinstance(pattern, str):
        raise GrammarError("a regex must be a string")
    return _checked("regex", LLMatcher.grammar_from_regex(pattern))


def choice(options) -> Grammar:
    """Exactly one of the strings."""
    if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
        raise GrammarError("choice must be a non-empty list of strings")
    return _checked("choice", grammar_from("choice", list(options)))


def grammar(text) -> Grammar:
    """A Lark grammar (llguidance's dialect, `start` its root) or a GBNF/EBNF one (llama.cpp's, `root`)."""
    if not isinstance(text, str):
        raise GrammarError("a grammar must be a string")
    try:
        compiled = grammar_from("grammar", text)
    except ValueError as e:
        raise GrammarError(_one_line(str(e))) from None
    return _checked("grammar", compiled)


def tool_calls(call_schema: dict, triggers: tuple[str, ...] = ()) -> Grammar:
    """Free text in which function calls are constrained from where they start. With triggers (a chat template
    that writes `<tool_call>`): the text may reach a trigger anywhere, the call's value follows (after a few
    blanks) and the text goes on after it. Without: the answer is either text that does not open with `{`
    or `[`, or a call value (one call, or a list of them) that is the whole answer."""
    if triggers:
        marks = " | ".join(json.dumps(t) for t in triggers)
        lark = (f"start: call* TEXT\nTEXT: /(.|\\n)*/\nhead[lazy]: TEXT ({marks})\n"
                f"call: head LEAD? {_embedded(call_schema)}\nLEAD: {LEAD_BLANKS}\n")
    else:
        listed = {"anyOf": [call_schema, {"type": "array", "items": call_schema, "minItems": 1}]}
        lark = ("start: TEXT | LEAD? call\nTEXT: /[\\x20\\x09\\r\\n]*([^\\x20\\x09\\r\\n{\\[](.|\\n)*)?/\n"
                f"LEAD: {LEAD_BLANKS}\ncall: {_embedded(listed)}\n")
    return _checked("tool_calls", LLMatcher.grammar_from_lark(lark))


# --- helpers --------------------------------------------------------------------------------------

def _json_options(strict: bool) -> dict:
    return {"whitespace_pattern": WHITESPACE, "coerce_one_of": True, "lenient": not strict,
            "json_allow_general_unicode_escapes": True}


def _embedded(schema: dict) -> str:
    """A schema inside a Lark grammar, with JSON mode's options (strict)."""
    return "%json " + _json_text(_closed({**schema, "x-guidance": _json_options(True)}))


def _schema_text(schema_text: str, strict: bool) -> str:
    try:
        return LLMatcher.grammar_from_json_schema(schema_text, overrides=_json_options(strict))
    except ValueError as e:
        raise GrammarError(_one_line(str(e))) from None


def _json_text(schema) -> str:
    try:
        return json.dumps(schema, ensure_ascii=False)   # not sorted: properties keep their declared order
    except (TypeError, ValueError) as e:
        raise GrammarError(f"the schema is not JSON: {e}") from None
    except RecursionError:
        raise GrammarError("the schema is nested too deeply") from None


def _closed(schema, depth: int = 0):
    """A copy of the schema whose objects with declared properties take no other keys (module docstring)."""
    if depth > 200:
        raise GrammarError("the schema is nested too deeply")
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v, depth + 1) for k, v in out[key].items()}
    for key in SUBSCHEMAS:
        if key in out:
            out[key] = _closed(out[key], depth + 1)
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(v, depth + 1) for v in out[key]]
    if isinstance(out.get("items"), list):   # draft 4-7's tuple form
        out["items"] = [_closed(v, depth + 1) for v in out["items"]]
    props, required = out.get("properties"), out.get("required", [])
    if (isinstance(props, dict) and not any(k in out for k in KEEPS_OTHER_KEYS)
            and isinstance(required, list) and all(k in props for k in required if isinstance(k, str))):
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=256)
def _checked(kind: str, text: str) -> Grammar:
    """The grammar once llguidance has compiled it (without a tokenizer: the engine checks the tokens it
    names against its own); cached, as a request's format often repeats."""
    problem = LLMatcher.validate_grammar(text)
    if problem:
        raise GrammarError(_one_line(problem, keep_position=kind == "grammar"))
    return Grammar(kind, text)


MESSAGE_CHARS = 500   # an unknown special token's message lists the vocabulary's: 100s of them
CODE_FRAME = re.compile(r"^(\d+ \|.*|\^+)$")


def _one_line(message: str, keep_position: bool = False) -> str:
    """llguidance's message in one line: without the code frames under it, and (but for a user's grammar,
    where they point into it) without positions in the grammar engc wrote for the format."""
    lines = [s for line in message.splitlines() if (s := line.strip()) and not CODE_FRAME.match(s)]
    text = " ".join(lines)
    text = text if keep_position else re.sub(r"^at \d+\(\d+\): ", "", text)
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 3] + "..."
