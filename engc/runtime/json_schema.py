"""Structured outputs (`response_format: {"type": "json_schema", ...}`): the output is one JSON value that
follows a schema. The schema compiles to nodes (one per subschema, referenced by index, so $ref recursion is
a cycle of indices) and a character automaton over them with json_mode's interface (start, step, kind), so
the same cached masks, blank limit and end rule apply: a token is allowed if every character of it keeps the
output a prefix of a valid document.

What a node can be: literals (enum, const, boolean, null: their JSON texts), a free string, an integer or
number, an object with declared properties, an array of one item schema (minItems, maxItems), any JSON value
or any object (where the schema says no more), or a union of those whose texts start with different
characters (type lists, anyOf/oneOf: the first character picks the branch, so no backtracking); object
alternatives must be a tagged union (each starts with the same required property, a constant that differs:
its text picks the branch). Objects write
their properties in declared order, optional ones skippable, and no others (additionalProperties never has
to be used: a document without extra keys is valid either way). Keywords that would constrain what this
automaton cannot enforce (pattern, format, minimum, minLength, ...) are refused with SchemaError, not
ignored: an output that breaks the user's schema silently would be worse than a 400.

In keys and constants, each character outside ASCII may be written as it is or as its JSON escape (\\uXXXX,
as json.dumps writes it; a surrogate pair past U+FFFF), character by character: a tokenizer without a whole
token for some character (its bytes split over tokens, which read as U+FFFD here) can still write it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

from engc.runtime import json_mode as jm

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "discriminator"}   # (OpenAPI's, pydantic writes it)
KEYWORDS = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
            "maxItems", "anyOf", "oneOf", "$ref"}
TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}
BETWEEN = {"value", "key_or_close", "key", "colon", "comma_or_close", "item_or_close"}
NUMBER_START = "-0123456789"
ANY_START = '{["tfn' + NUMBER_START


class SchemaError(ValueError):
    """A schema engc cannot enforce (one line, names the keyword and where)."""


@dataclass
class Node:
    literals: tuple[str, ...] = ()              # exact JSON texts
    string: bool = False                         # any string
    number: str | None = None                    # "integer" or "number"
    props: tuple[tuple[str, int], ...] | None = None   # declared properties (key, node), in order
    required: frozenset = frozenset()
    items: int | None = None                     # an array of this node
    min_items: int = 0
    max_items: int | None = None
    any: str | None = None                       # "value" or "object": json_mode's grammar, unconstrained
    tags: tuple[tuple[str, int], ...] = ()       # a discriminator's value texts and the object node each picks
    starts: dict = field(default_factory=dict)   # first character -> branch ("literal", "string", ...)


class SchemaGrammar:
    """A compiled schema: the automaton json_mode.JsonVocab and JsonConstraint drive. Hashed by identity, so
    its masks are cached apart from other schemas'; compile_schema keeps one per schema text."""

    def __init__(self, schema):
        if not isinstance(schema, dict):
            raise SchemaError("the schema must be a JSON object")
        self.root_schema, self.nodes, self._ids, self._seen = schema, [], {}, []
        root = self.nodes[self._compile(schema, "#")]
        if set(root.starts) - {"{", "["}:
            raise SchemaError("the root schema must be an object or an array")
        self.start = ("start", 0, ())   # "value" without blanks: the answer starts with its bracket

    # compilation -------------------------------------------------------------------------------------------

    def _compile(self, schema, where: str) -> int:
        if not isinstance(schema, dict):
            if schema is True:
                schema = {}
            else:
                raise SchemaError(f"{where}: a subschema must be a JSON object")
        if "$ref" in schema:
            extra = set(schema) - ANNOTATIONS - {"$ref"}
            if extra:
                raise SchemaError(f"{where}: $ref beside {sorted(extra)[0]} is not supported")
            schema, where = self._resolve(schema["$ref"], where), schema["$ref"]
        if id(schema) in self._ids:
            return self._ids[id(schema)]
        unknown = sorted(set(schema) - KEYWORDS - ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{where}: the keyword '{unknown[0]}' is not supported in json_schema outputs")
        index = self._ids[id(schema)] = len(self.nodes)
        self._seen.append(schema)   # alive while compiling, so no other subschema takes its id
        node = Node()
        self.nodes.append(node)
        self._fill(node, schema, where)
        return index

    def _resolve(self, ref, where: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{where}: only local $ref ('#/...') is supported, not {ref!r}")
        target = self.root_schema
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{where}: $ref {ref!r} does not resolve")
            target = target[part]
        return target

    def _fill(self, node: Node, schema: dict, where: str) -> None:
        branches = schema.get("anyOf", schema.get("oneOf"))
        if branches is not None:
            if not isinstance(branches, list) or not branches:
                raise SchemaError(f"{where}: anyOf/oneOf must be a non-empty list")
            if set(schema) & {"type", "enum", "const", "properties", "items"}:
                raise SchemaError(f"{where}: anyOf/oneOf beside type, enum or properties is not supported")
            ids = [self._compile(branch, f"{where}/anyOf/{i}") for i, branch in enumerate(branches)]
            objects = [i for i in ids if self.nodes[i].props is not None]
            if len(objects) > 1:
                ids = [i for i in ids if i not in objects] + [self._union(objects, where)]
            for i in ids:
                self._merge(node, self.nodes[i], where)
            return
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{where}: enum must be a non-empty list")
            self._merge(node, Node(literals=tuple(dict.fromkeys(
                json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in values))), where)
            return
        types = schema.get("type")
        if types is None:
            types = ["object"] if "properties" in schema else ["array"] if "items" in schema else None
        if types is None:
            self._merge(node, Node(any="value"), where)
            return
        for t in [types] if isinstance(types, str) else types:
            if t not in TYPES:
                raise SchemaError(f"{where}: unknown type {t!r}")
            self._merge(node, self._typed(t, schema, where), where)

    def _typed(self, t: str, schema: dict, where: str) -> Node:
        if t in ("string", "integer", "number"):
            return Node(string=True) if t == "string" else Node(number=t)
        if t in ("boolean", "null"):
            return Node(literals=("true", "false") if t == "boolean" else ("null",))
        if t == "array":
            items = schema.get("items", {})
            lo, hi = schema.get("minItems", 0), schema.get("maxItems")
            if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
                raise SchemaError(f"{where}: minItems/maxItems must be integers with 0 <= minItems <= maxItems")
            return Node(items=self._compile(items, f"{where}/items"), min_items=lo, max_items=hi)
        props = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        if not isinstance(extra, bool) and extra != {}:
            raise SchemaError(f"{where}: additionalProperties as a schema is not supported (true or false only)")
        if props is None:
            if schema.get("required"):
                raise SchemaError(f"{where}: required names properties the schema does not declare")
            return Node(any="object")
        if not isinstance(props, dict):
            raise SchemaError(f"{where}: properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or set(required) - set(props):
            raise SchemaError(f"{where}: required must list declared properties")
        for key in props:
            if not jm.plain(key):
                raise SchemaError(f"{where}: property name {key!r} needs escaping, which is not supported")
        return Node(props=tuple((k, self._compile(s, f"{where}/properties/{k}")) for k, s in props.items()),
                    required=frozenset(required))

    def _union(self, objects: list[int], where: str) -> int:
        """Object alternatives told apart by their first property, required in each and a constant (a
        discriminator, as pydantic's tagged unions write it): a node whose only property is that key, with
        a 'tag' value node; the tag's text picks the branch, whose properties go on from its second."""
        keys = {self.nodes[i].props[0][0] if self.nodes[i].props else None for i in objects}
        problem = f"{where}: object alternatives must share a first property, required, with a constant value"
        if len(keys) != 1 or None in keys:
            raise SchemaError(problem)
        key, tags = keys.pop(), []
        for i in objects:
            value = self.nodes[self.nodes[i].props[0][1]]
            if key not in self.nodes[i].required or len(value.literals) != 1 or set(value.starts.values()) != {"literal"}:
                raise SchemaError(problem)
            tags.append((value.literals[0], i))
        if len({t for t, _ in tags}) < len(tags):
            raise SchemaError(f"{where}: two object alternatives have the same '{key}'")
        self.nodes.append(Node(tags=tuple(tags), starts={t[0]: "tag" for t, _ in tags}))
        self.nodes.append(Node(props=((key, len(self.nodes) - 1),), required=frozenset({key})))
        return len(self.nodes) - 1

    def _merge(self, node: Node, other: Node, where: str) -> None:
        """Add other's texts to node's as a union: each first character must lead to one branch."""
        kinds = [("literal", c) for c in {t[0] for t in other.literals}]
        if other.string:
            kinds.append(("string", '"'))
        if other.number:
            kinds += [("number", c) for c in NUMBER_START]
        if other.props is not None or other.any == "object":
            kinds.append(("object", "{"))
        if other.items is not None:
            kinds.append(("array", "["))
        if other.any == "value":
            kinds += [("any", c) for c in ANY_START]
        for kind, c in kinds:   # literals and scalars merge; two objects or arrays would need backtracking
            if c in node.starts and (node.starts[c] != kind or kind in ("object", "array", "any")):
                raise SchemaError(f"{where}: alternatives that both start with {c!r} ({node.starts[c]}, {kind}) "
                                  "are not supported")
            node.starts[c] = kind
        if other.number and node.number and other.number != node.number:
            raise SchemaError(f"{where}: integer and number alternatives together are not supported; use number")
        node.literals += other.literals
        node.string |= other.string
        node.number = node.number or other.number
        for name in ("props", "items", "any"):   # at most one alternative has each (checked above)
            if getattr(other, name) is not None:
                setattr(node, name, getattr(other, name))
        node.required |= other.required
        if other.items is not None:
            node.min_items, node.max_items = other.min_items, other.max_items

    # the automaton -----------------------------------------------------------------------------------------

    def kind(self, state: tuple) -> str:
        """'string' (plain characters keep the state), 'between' (blanks keep it) or 'other'."""
        mode = state[0]
        if mode == "any":
            return jm.OBJECT.kind(state[1])
        return "string" if mode == "string" else "between" if mode in BETWEEN else "other"

    def forced(self, state: tuple) -> str | None:
        """The characters that must come next where only one text can: the rest of the one key that may come
        (with its closing quote), of the one literal or tag left. JsonVocab's masks of such states look
        tokens up instead of walking the vocabulary."""
        mode, aux, stack = state
        if mode == "key_text":
            rests = [r for _, (k, _) in self._candidates(stack[-1]) if (r := key_rest(k, aux)) is not None]
            if len(rests) != 1:
                return None
            fixed = forced_prefix(rests[0])
            return (fixed + '"' if fixed == rests[0] else fixed) or None
        if mode == "literal" and len(aux) == 1:
            return forced_prefix(aux[0]) or None
        if mode == "tag" and len(aux) == 1:
            return forced_prefix(aux[0][0]) or None
        return None

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
