"""Structured outputs (constrained.json_schema, on llguidance): every text the grammar completes is a valid
instance (the jsonschema validator), random valid instances written in declared key order complete exactly at
their end, what llguidance enforces beyond structure, the refusals, and the engine."""
import json
import random

import jsonschema
import pytest

from engc.runtime import constrained
from engc.runtime.constrained import GrammarError
from grammar_check import completes, is_prefix, takes_tokens, vocab
from test_gpu import gpu_bundle, gpu_ready  # noqa: F401 - a fixture, used by the engine test below

# pydantic's shape for nested models and Optional fields ($defs + $ref, anyOf with null), and the rest of
# what the automaton enforces
PERSON = {
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "zip": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
                          "required": ["city"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "name": {"type": "string", "title": "Name"},
        "age": {"type": "integer", "description": "years"},
        "height": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "address": {"$ref": "#/$defs/Address"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": ["integer", "null"]}},
        "extra": {"type": "object"},
        "anything": {},
        "version": {"const": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
TREE = {"$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                            "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                           "required": ["v", "kids"]}},
        "type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}
# pydantic's tagged union (oneOf + discriminator), and tags where one is a prefix of another (1, 12)
PETS = {"$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                          "required": ["kind", "lives"]},
                  "Dog": {"type": "object", "properties": {"kind": {"enum": ["dog"]}, "good": {"type": "boolean"}},
                          "required": ["kind"]}},
        "type": "object",
        "properties": {"pets": {"type": "array", "items": {
                           "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}, {"type": "null"}],
                           "discriminator": {"propertyName": "kind"}}},
                       "code": {"anyOf": [{"type": "object", "properties": {"v": {"const": 1}, "a": {"type": "string"}},
                                           "required": ["v"]},
                                          {"type": "object", "properties": {"v": {"const": 12}}, "required": ["v"]}]}},
        "required": ["pets"]}
# keys, enum values and tags outside ASCII (written as they are: llguidance matches constants byte for byte)
UNICODE = {"type": "object", "properties": {
    "名前": {"type": "string"}, "ville": {"enum": ["東京", "Zürich", "Paris", "é", 7]},
    "pet": {"oneOf": [{"type": "object", "properties": {"種": {"const": "猫"}, "n": {"type": "integer"}},
                       "required": ["種"]},
                      {"type": "object", "properties": {"種": {"const": "犬"}}, "required": ["種"]}]}},
    "required": ["名前", "ville"]}
SCHEMAS = [PERSON, TREE, PETS, {"type": "object", "properties": {}}, {"type": "array", "items": {"enum": [1, 12, 123, "x"]}},
           UNICODE]


def instance(schema, rng, root, depth=0):
    """A random valid instance, properties in declared order."""
    if "$ref" in schema:
        node = root
        for part in schema["$ref"][2:].split("/"):
            node = node[part]
        return instance(node, rng, root, depth)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    if "anyOf" in schema or "oneOf" in schema:
        return instance(rng.choice(schema.get("anyOf", schema.get("oneOf"))), rng, root, depth)
    t = schema.get("type")
    if isinstance(t, list):
        t = rng.choice(t)
    if t is None:
        return rng.choice([1, -2.5e-3, "s", None, True, {"k": [1, {}]}, [], {"a\"b": "c\\d"}])
    if t == "object":
        if "properties" not in schema:
            return rng.choice([{}, {"x": 1}, {"y": {"z": [None, "\u00e9"]}}])
        req = set(schema.get("required", []))
        return {k: instance(s, rng, root, depth + 1) for k, s in schema["properties"].items()
                if k in req or rng.random() < 0.5}
    if t == "array":
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems", lo + (3 if depth < 3 else 0))
        return [instance(schema.get("items", {}), rng, root, depth + 1) for _ in range(rng.randint(lo, hi))]
    return {"string": lambda: rng.choice(["", "Paris", "a\"b\\c\n\t\u00e9\U0001f600", "123"]),
            "integer": lambda: rng.choice([0, -7, 42, 10 ** 12]),
            "number": lambda: rng.choice([0, -1.5, 3.25e-7, 1e21, 7]),
            "boolean": lambda: rng.random() < 0.5, "null": lambda: None}[t]()


def write(value, rng) -> str:
    """value as JSON in a random style; constants outside ASCII as they are, other strings escaped or not."""
    text = json.dumps(value, ensure_ascii=False, indent=rng.choice([None, 2, "\t"]),
                      separators=rng.choice([None, (",", ":"), (", ", ": ")]))
    return text.replace("\u00e9\U0001f600", "\\u00e9\\ud83d\\ude00") if rng.random() < 0.5 else text


def valid(schema, text) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("n", range(len(SCHEMAS)))
def test_valid_instances_complete_exactly_at_their_end(n):
    schema, rng = SCHEMAS[n], random.Random(n)
    grammar = constrained.json_schema(schema)
    for _ in range(150):
        text = write(instance(schema, rng, schema), rng)
        assert valid(schema, text), text
        assert completes(grammar, text), text
        assert is_prefix(grammar, text[:-1]) and not completes(grammar, text[:-1]), text


@pytest.mark.parametrize("n", range(len(SCHEMAS)))
def test_every_completed_text_is_a_valid_instance(n):
    """Random edits of valid instances: whatever the grammar completes, jsonschema accepts (and some edits
    are completed, some refused, so both answers are exercised)."""
    schema, rng = SCHEMAS[n], random.Random(100 + n)
    grammar = constrained.json_schema(schema)
    alphabet = '{}[]":,0123456789.-eEtrufalsnx\\ \nadminuserguest'
    counts = [0, 0]
    for _ in range(1500):
        text = write(instance(schema, rng, schema), rng)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(["", rng.choice(alphabet)]) + text[i + rng.randint(0, 1):]
        ours = completes(grammar, text)
        if ours:
            assert valid(schema, text), text
        counts[ours] += 1
    assert min(counts) > 40, counts


def test_objects_follow_the_schema_not_just_json():
    g = constrained.json_schema(PERSON)
    ok = '{"name":"a","age":3,"role":"user","tags":["x"]}'
    assert completes(g, ok, masks=True)
    for bad in ['{"name":"a","age":3.5,"role":"user","tags":["x"]}',      # integer
                '{"name":"a","age":3,"role":"root","tags":["x"]}',        # enum
                '{"name":"a","age":3,"role":"user","tags":[]}',           # minItems
                '{"name":"a","age":3,"role":"user","tags":["1","2","3","4"]}',   # maxItems
                '{"name":"a","role":"user","age":3,"tags":["x"]}',        # declared order
                '{"name":"a","age":3,"role":"user"}',                     # required
                '{"name":"a","age":3,"role":"user","tags":["x"],"other":1}',     # undeclared
                '{"name":"a","age":3,"role":"user","tags":["x"],"version":3}',   # const
                '{"name":"a","age":3,"role":"user","tags":["x"],"address":{"zip":1}}']:   # nested required
        assert not completes(g, bad), bad
    assert completes(g, '{"name":"a","age":3,"role":"user","address":{"city":"P","zip":null},"tags":["x"],'
                        '"anything":[1,{"a":-0.5}],"version":2}')


def test_a_tagged_union_follows_the_branch_its_tag_picks():
    g = constrained.json_schema(PETS)
    assert completes(g, '{"pets": [{"kind": "cat", "lives": 9}, {"kind": "dog"}, null], "code": {"v": 12}}')
    assert completes(g, '{"pets": [], "code": {"v": 1, "a": "x"}}')
    for bad in ['{"pets": [{"kind": "cat"}]}',                  # the cat's required lives
                '{"pets": [{"kind": "dog", "lives": 9}]}',      # a cat's property on a dog
                '{"pets": [{"lives": 9, "kind": "cat"}]}',      # declared order: the tag first
                '{"pets": [{"kind": "cow"}]}', '{"pets": [], "code": {"v": 12, "a": "x"}}', '{"pets": [], "code": {"v": 123}}']:
        assert not completes(g, bad), bad


def test_keywords_beyond_structure_are_enforced():
    """What llguidance enforces that a structure-only automaton could not: patterns, formats, lengths, bounds,
    additional properties by schema, a root that is a string."""
    g = constrained.json_schema({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"}, "day": {"type": "string", "format": "date"},
        "name": {"type": "string", "minLength": 2, "maxLength": 4}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 10},
        "tags": {"type": "object", "additionalProperties": {"type": "boolean"}}}, "required": ["id"]})
    assert completes(g, '{"id": "AB12", "day": "2024-02-29", "name": "abc", "n": 10, "tags": {"x": true}}')
    for bad in ('{"id": "A12"}', '{"id": "AB12", "day": "2024-13-01"}', '{"id": "AB1", "name": "a"}',
                '{"id": "AB1", "name": "abcde"}', '{"id": "AB1", "n": -1}', '{"id": "AB1", "n": 11}',
                '{"id": "AB1", "tags": {"x": 1}}'):
        assert not completes(g, bad), bad
    assert completes(constrained.json_schema({"type": "string", "enum": ["a b"]}), '"a b"')


def test_properties_not_declared_stay_out_unless_the_schema_takes_them():
    """Declared properties only (engc closes such objects); a schema that requires an undeclared key, or
    says additionalProperties itself, keeps JSON Schema's meaning."""
    assert not completes(constrained.json_schema({"type": "object", "properties": {"a": {}}}), '{"a": 1, "b": 2}')
    assert completes(constrained.json_schema({"type": "object", "properties": {"a": {}}, "required": ["b"]}),
                     '{"b": 2}')
    assert completes(constrained.json_schema({"type": "object", "properties": {"a": {}},
                                              "additionalProperties": True}), '{"a": 1, "b": 2}')


def test_constraint_takes_tokens_to_the_end():
    texts = ("{", "}", '"v"', ":", "1", "2", ",", '"kids"', "[", "]", " ", "]}")
    ids = {t: 257 + i for i, t in enumerate(texts)}
    schema = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
    c = constrained.Constraint(vocab(texts), constrained.json_schema(schema))
    m = c.allowed()
    assert not m[ids["}"]] and not m[ids[" "]] and m[ids["{"]]   # it opens first, no blanks before
    assert c.take(ids["{"]) is None and not c.allowed()[ids["}"]]        # '}' before the required v
    assert c.take(ids['"v"']) is None and c.take(ids[":"]) is None and c.take(ids["1"]) is None
    assert c.allowed()[ids["2"]] and not c.allowed()[ids[","]]           # more digits or the close; no second key
    assert c.take(ids["}"]) == "done"
    empty = constrained.json_schema({"type": "array", "maxItems": 0, "items": {"type": "integer"}})
    assert completes(empty, "[]") and completes(empty, "[ ]") and not completes(empty, "[1]")


@pytest.mark.parametrize("schema,message", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, 'Unimplemented keys: ["not"]'),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "Unimplemented keys"),
    ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "x"}}}, "Unknown format: x"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "other.json"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "does not exist"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, "Invalid type: text"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems (3) is greater than maxItems (2)"),
    ([1], "must be a JSON object"),
    ("{x", "the schema is not JSON"),
    (json.loads('{"type": "object", "properties": {"a": ' * 300 + '{}' + '}}' * 300), "nested too deeply"),
])
def test_unenforceable_schemas_are_refused_in_one_line(schema, message):
    with pytest.raises(GrammarError) as e:
        constrained.json_schema(schema)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_schema_that_is_not_strict_is_enforced_as_far_as_it_can_be():
    """OpenAI's strict: false: keywords llguidance cannot enforce are ignored, the rest still holds."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}, "required": ["a"]}
    g = constrained.json_schema(schema, strict=False)
    assert completes(g, '{"a": 4}') and not completes(g, '{"a": "x"}')


def test_a_byte_level_vocabulary_writes_keys_and_values_outside_ascii():
    """A tokenizer without a whole token for a character writes it byte by byte: the mask allows the bytes
    of the constant's UTF-8, one at a time."""
    g = constrained.json_schema({"type": "object", "properties": {"名前": {"enum": ["東京"]}}, "required": ["名前"]})
    assert completes(g, '{"名前":"東京"}', masks=True)


def test_the_same_schema_compiles_once_and_each_sequence_gets_its_own_matcher():
    a = constrained.json_schema(json.loads(json.dumps(PERSON)))
    assert a is constrained.json_schema(PERSON) and a is not constrained.json_schema(TREE)
    matchers = constrained.Matchers(vocab())
    first, second = matchers.constraint(a), matchers.constraint(constrained.json_schema(PERSON))
    assert matchers.built.cache_info().misses == 1
    assert first.take(ord("{")) is None and not first.allowed()[ord("{")] and second.allowed()[ord("{")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not gpu_ready(), reason="needs a CUDA device and engc._native"))])
def test_engine_outputs_follow_the_schema(device, request):
    """A random tiny model under a schema: every output continues the grammar, and those that stop are valid
    instances. On the GPU (tests/test_gpu.py's bundle) beside unconstrained greedy rows, so steps mix the
    masked rows with rows the CUDA graphs sample."""
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    bundle = request.getfixturevalue("tiny_bundle")("llama") if device == "cpu" else request.getfixturevalue("gpu_bundle")
    model = load(bundle, device=device)
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=16))
    prompt = model.tokenizer.encode("Hello, world!")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"]}
    g = constrained.json_schema(schema)
    seqs = [engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=s, grammar=g))
            for s in range(12)]
    seqs.append(engine.add_request(prompt, SamplingParams(max_tokens=64, grammar=g)))
    free = [engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            for _ in range(2)]
    with pytest.raises(ValueError, match="unknown special token"):   # a grammar naming a token the vocabulary lacks
        engine.check_request(prompt, SamplingParams(grammar=constrained.grammar("start: <|no_such_token|>")))
    engine.run_to_completion()
    assert all(len(s.output_ids) == 40 for s in free) and free[0].output_ids == free[1].output_ids
    for s in seqs:
        assert takes_tokens(g, engine.grammar_vocab, s.output_ids), s.output_text
    stopped = [s for s in seqs if s.finish_reason == "stop"]
    assert stopped and all(valid(schema, s.output_text) for s in stopped)
