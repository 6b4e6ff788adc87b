"""Function calls in the text models write, read without running anything (tools.py decides which count).

Tagged calls, anywhere in the answer (the text around them is content):
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>      Hermes, Qwen 2/2.5/3 (unclosed at the end too)
    <function=NAME>{...arguments...}</function>                    Llama 3.1's custom-tool format
A marker after which the rest of the answer is calls (the text before it is content):
    <|python_tag|>   Llama 3.1/3.2 (JSON objects, ';'-separated)  [TOOL_CALLS]   Mistral (a JSON list, or
    NAME[ARGS]{...} repeated, the v11 tokenizers' form)
Or the whole answer (after such a marker too): a call object or a list of them ({"name", "arguments"} or
Llama 3's "parameters"; arguments as an object or a JSON string), optionally in a ```json fence, or a
Python-style list of calls, [get_weather(city="Paris"), ping()] (Llama 3.2 / 4's pythonic form), read with
the ast module: literal arguments only, nothing evaluated.
The markers are special tokens in those tokenizers, which decoding usually drops: then the plain forms
match what is left.
"""
from __future__ import annotations

import ast
import json
import re

TAGGED = [re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL),
          re.compile(r"<function=([A-Za-z0-9_-]+)>\s*(.*?)\s*(?:</function>|$)", re.DOTALL)]
LEADS = ("<|python_tag|>", "[TOOL_CALLS]")
MARKS = ("<tool_call>", "<function=") + LEADS    # where a streamed answer starts to hold text back
FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
MISTRAL = re.compile(r"\s*(?:\[TOOL_CALLS\]\s*)?([A-Za-z0-9_-]+)\[ARGS\]")

Call = tuple[str, dict]
# what parsing a model's text may raise: deep nesting ("[[[[...") is a RecursionError in json and ast, not a
# ValueError, and must not turn an answer into a 500
BAD = (ValueError, RecursionError, MemoryError)


def read_calls(text: str) -> tuple[str | None, list[Call], bool] | None:
    """(content, calls, whole) where the text holds calls in a format above, else None. content is the text
    outside the calls (None when empty); a tagged call whose JSON does not parse is not read; whole: the
    calls came as one unit (after a marker, or the whole answer), to be taken all or none."""
    for i, pattern in enumerate(TAGGED):
        blocks = pattern.findall(text)
        if blocks:
            calls = [c for c in (_object(b) if i == 0 else _named(*b) for b in blocks) if c]
            rest = pattern.sub("", text).strip()
            return (rest or None), calls, False
    for lead in LEADS:
        at = text.find(lead)
        if at >= 0:
            return (text[:at].strip() or None), (whole_answer(text[at + len(lead):]) or []), True
    calls = whole_answer(text)
    return (None, calls, True) if calls else None


def whole_answer(body: str) -> list[Call] | None:
    """The calls of an answer that is nothing but calls, in any of the whole-answer forms; None otherwise."""
    body = body.strip()
    fenced = FENCE.match(body)
    body = fenced.group(1) if fenced else body
    try:
        value = json.loads(body)
    except BAD:
        return _joined_objects(body) or _mistral(body) or _pythonic(body)
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(v) for v in items]
    return calls if items and all(calls) else None


def _call_of(value) -> Call | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return _named(value["name"], value.get("arguments", value.get("parameters", {})))


def _named(name: str, args) -> Call | None:
    if isinstance(args, str):   # arguments as JSON text, as OpenAI's API writes them (and the tags hold)
        try:
            args = json.loads(args) if args.strip() else {}
        except BAD:
            return None
    return (name, args) if isinstance(args, dict) else None


def _object(text: str) -> Call | None:
    try:
        return _call_of(json.loads(text))
    except BAD:
        return None


def _joined_objects(body: str) -> list[Call] | None:
    """Call objects one after another, ';' or blanks between (Llama 3.1 after <|python_tag|>)."""
    decoder, at, calls = json.JSONDecoder(), 0, []
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except BAD:
            return None
        calls.append(_call_of(value))
        at = len(body) - len(body[at:].lstrip(" \t\r\n;"))
    return calls if calls and all(calls) else None


def _mistral(body: str) -> list[Call] | None:
    """NAME[ARGS]{...} repeated (Mistral's v11 tokenizers, after [TOOL_CALLS])."""
    decoder, at, calls = json.JSONDecoder(), 0, []
    while at < len(body):
        head = MISTRAL.match(body, at)
        if not head:
            return None
        try:
            args, at = decoder.raw_decode(body, head.end())
        except BAD:
            return None
        calls.append(_named(head.group(1), args))
        at = len(body) - len(body[at:].lstrip())
    return calls if calls and all(calls) else None


def _pythonic(body: str) -> list[Call] | None:
    """[f(a=1, b="x"), g()] or f(a=1): keyword arguments with literal values (ast.literal_eval), nothing run."""
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, *BAD):
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg for k in node.keywords)):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            if not _json_like(args):
                return None
        except (TypeError, SyntaxError, *BAD):
            return None
        calls.append((node.func.id, args))
    return calls or None


def _json_like(value) -> bool:
    """Literal values JSON can hold (no tuples, sets, bytes or complex numbers)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_like(v) for v in value)
    return value is None or isinstance(value, (str, bool, int, float))
