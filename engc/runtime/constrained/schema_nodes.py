"""A JSON Schema compiled into nodes for the structured-output automaton (runtime/constrained/json_schema.py): one node
per subschema, referenced by index, so $ref recursion is a cycle of indices.

What a node can be: literals (enum, const, boolean, null: their JSON texts), a free string, an integer or
number, an object with declared properties, an array of one item schema (minItems, maxItems), any JSON value
or any object (where the schema says no more), or a union of those whose texts start with different
characters (type lists, anyOf/oneOf: the first character picks the branch, so the automaton never
backtracks); object alternatives must be a tagged union (each starts with the same required property, a
constant that differs: its text picks the branch). Keywords that would constrain what the automaton cannot
enforce (pattern, format, minimum, minLength, ...) are refused with SchemaError, not ignored: an output
that breaks the user's schema silently would be worse than a 400.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engc.runtime.constrained import json_mode as jm

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "discriminator"}   # (OpenAPI's, pydantic writes it)
KEYWORDS = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
            "maxItems", "anyOf", "oneOf", "$ref"}
TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}
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


def compile_nodes(schema) -> list[Node]:
    """The nodes of a schema (a parsed JSON value), the root first; SchemaError names what cannot be enforced."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    nodes = _Compiler(schema).nodes
    if set(nodes[0].starts) - {"{", "["}:
        raise SchemaError("the root schema must be an object or an array")
    return nodes


class _Compiler:
    """One schema's compilation: subschemas seen by identity (a $ref to one compiles it once: recursion)."""

    def __init__(self, schema: dict):
        self.root_schema, self.nodes, self._ids, self._seen = schema, [], {}, []
        self._compile(schema, "#")

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
