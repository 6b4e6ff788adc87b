"""Structured outputs (runtime/constrained/json_schema.py): the schema automaton against the jsonschema validator (every
text it completes is a valid instance; random valid instances, written in declared key order, complete
exactly at their end), its masks against a brute-force walk, the refusals, and the engine and server."""
import json
import random

import jsonschema
import pytest
import torch

from engc.runtime.constrained.json_mode import DONE, JsonConstraint, JsonVocab, walk
from engc.runtime.constrained.json_schema import SchemaError, compile_schema
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
# keys, enum values and tags outside ASCII: written as they are or escaped (write() picks at random)
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
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2, "\t"]),
                      separators=rng.choice([None, (",", ":"), (", ", ": ")]))


def completes(grammar, text) -> bool:
    state = walk(grammar.start, text, grammar)
    return state is not None and state[0] == DONE


def valid(schema, text) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("n", range(len(SCHEMAS)))
def test_valid_instances_complete_exactly_at_their_end(n):
    schema, rng = SCHEMAS[n], random.Random(n)
    grammar = compile_schema(schema)
    for _ in range(300):
        text = write(instance(schema, rng, schema), rng)
        assert valid(schema, text), text
        state = grammar.start
        for i, ch in enumerate(text):
            assert state is not None and state[0] != DONE, (text[:i], ch)
            state = grammar.step(state, ch)
        assert state is not None and state[0] == DONE, text


@pytest.mark.parametrize("n", range(len(SCHEMAS)))
def test_every_completed_text_is_a_valid_instance(n):
    """Random edits of valid instances: whatever the automaton completes, jsonschema accepts (and some
    edits are completed, some refused, so both answers are exercised)."""
    schema, rng = SCHEMAS[n], random.Random(100 + n)
    grammar = compile_schema(schema)
    alphabet = '{}[]":,0123456789.-eEtrufalsnx\\ \nadminuserguest'
    counts = [0, 0]
    for _ in range(4000):
        text = write(instance(schema, rng, schema), rng)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(["", rng.choice(alphabet)]) + text[i + rng.randint(0, 1):]
        ours = completes(grammar, text)
        if ours:
            assert valid(schema, text), text
        counts[ours] += 1
    assert min(counts) > 100, counts


def test_objects_follow_the_schema_not_just_json():
    g = compile_schema(PERSON)
    ok = '{"name":"a","age":3,"role":"user","tags":["x"]}'
    assert completes(g, ok)
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
    g = compile_schema(PETS)
    assert completes(g, '{"pets": [{"kind": "cat", "lives": 9}, {"kind": "dog"}, null], "code": {"v": 12}}')
    assert completes(g, '{"pets": [], "code": {"v": 1, "a": "x"}}')
    for bad in ['{"pets": [{"kind": "cat"}]}',                  # the cat's required lives
                '{"pets": [{"kind": "dog", "lives": 9}]}',      # a cat's property on a dog
                '{"pets": [{"lives": 9, "kind": "cat"}]}',      # the tag comes first
                '{"pets": [{"kind": "cow"}]}', '{"pets": [], "code": {"v": 12, "a": "x"}}', '{"pets": [], "code": {"v": 123}}']:
        assert not completes(g, bad), bad


def test_masks_equal_a_brute_force_walk():
    texts = ["{", "}", '"', "name", '":', " ", "\n", "1", "12", "2", ".5", "e3", "true", " true", ",", '"}', "[",
             "]", '"]', "\\", "\\n", "admin", "user", '"user"', "nu", "ll", "x", '{"', '"name', '": "', ', "', "-",
             "null", ": ", "caf\u00e9", " ,", " }", "tags", '":["', "age", "role", "3", '"]}', "\x01", "", "\t",
             "kind", '"cat"', "cat", '"', "dog", "lives", "9", "pets", "v", "12", '"}]', "}}", '{"kind": "']
    vocab = JsonVocab(texts)
    for schema, doc in ((PERSON, '{"name": "a\\n", "age": 12, "role": "user", "tags": ["x", "y"], "scores": [1, null], '
                                 '"anything": -1.5}'),
                        (PETS, '{"pets": [{"kind": "cat", "lives": 9}, {"kind": "dog"}], "code": {"v": 12}}')):
        g = compile_schema(schema)
        state, states = g.start, [g.start]
        for ch in doc:
            state = g.step(state, ch)
            states.append(state)
        assert state[0] == DONE
        for s in states[:-1]:
            brute = torch.tensor([bool(t) and walk(s, t, g) is not None for t in texts])
            assert torch.equal(vocab.mask(s, g), brute), s


def test_masks_of_several_constant_texts_equal_a_brute_force_walk():
    """States where one of several constants must come next (optional keys sharing prefixes, enum values one
    a prefix of another, keys and values outside ASCII) take the choices path (JsonVocab._compute_choices);
    their masks must still be exactly the brute-force walk's."""
    schema = {"type": "object", "properties": {
        "a": {"enum": [1, 12, "x", "xy"]}, "ab": {"type": "boolean"}, "abc": {"enum": ["大阪", "大x"]},
        "都": {"const": "b"}, "b": {"type": "integer"}}, "required": ["b"]}
    texts = ["{", "}", '"', "a", "ab", "abc", '"a', '"ab', '":', ":", " ", "1", "12", "2", ",", '"x', 'x"', "xy",
             '"xy"', "\\", "u", "\\u", "5927", "\\u5927", "大", "阪", "x", '"大', "都", '"都', "\\u90fd", '"b"',
             "b", '": ', "true", "tr", '", "', "}}", "\\u962a", '962a"', "", "\\u90"]
    vocab = JsonVocab(texts)
    g = compile_schema(schema)
    for doc in ('{"a": 12, "ab": true, "abc": "\\u5927\\u962a", "\\u90fd": "b", "b": 1}',
                '{"abc": "大x", "都": "b", "b": 2}', '{"a": "xy", "b": 1}', '{"a": 1, "b": 1}'):
        state, states = g.start, [g.start]
        for ch in doc:
            state = g.step(state, ch)
            states.append(state)
        assert state[0] == DONE, doc
        assert any(g.choices(s) and len(g.choices(s)) > 1 for s in states[:-1]), doc
        for s in states[:-1]:
            brute = torch.tensor([bool(t) and walk(s, t, g) is not None for t in texts])
            assert torch.equal(vocab.mask(s, g), brute), (doc, s)


def test_constraint_takes_tokens_to_the_end():
    texts = ["{", "}", '"v"', ":", "1", "2", ",", '"kids"', "[", "]", " ", "]}"]
    schema = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
    c = JsonConstraint(JsonVocab(texts), compile_schema(schema))
    assert not c.allowed()[1] and not c.allowed()[10] and c.allowed()[0]   # it opens first, no blanks before
    assert c.take(0) is None and not c.allowed()[1]        # '}' before the required v
    assert c.take(2) is None and c.take(3) is None and c.take(4) is None
    assert c.allowed()[5] and not c.allowed()[6]           # more digits or the close; no second property
    assert c.take(1) == "done"
    empty = compile_schema({"type": "array", "maxItems": 0, "items": {"type": "integer"}})
    assert completes(empty, "[]") and completes(empty, "[ ]") and not completes(empty, "[1]")


@pytest.mark.parametrize("schema,message", [
    ({"type": "string"}, "root schema must be an object or an array"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}, "'pattern' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "date"}}}, "'format' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, "'minimum' is not supported"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "only local $ref"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "does not resolve"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "object"}, {"type": "object", "properties": {}}]}}},
     "both start with '{'"),
    ({"type": "object", "properties": {"a": {"type": ["integer", "number"]}}}, "integer and number"),
    ({"type": "object", "properties": {"a": {"anyOf": [
        {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}]}}}, "must share a first"),
    ({"type": "object", "properties": {"a": {"anyOf": [
        {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
        {"type": "object", "properties": {"j": {"const": 2}}, "required": ["j"]}]}}}, "must share a first"),
    ({"type": "object", "properties": {"a": {"anyOf": [
        {"type": "object", "properties": {"k": {"const": 1}}},
        {"type": "object", "properties": {"k": {"const": 2}}, "required": ["k"]}]}}}, "must share a first"),
    ({"type": "object", "properties": {"a": {"anyOf": [
        {"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
        {"type": "object", "properties": {"k": {"enum": [1]}, "x": {}}, "required": ["k"]}]}}}, "the same 'k'"),
    ({"type": "object", "additionalProperties": {"type": "string"}}, "additionalProperties as a schema"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "required must list declared"),
    ({"type": "object", "properties": {'a"b': {}}}, "needs escaping"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, "unknown type 'text'"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems/maxItems"),
    ([1], "must be a JSON object"),
    (json.loads('{"type": "object", "properties": {"a": ' * 300 + '{}' + '}}' * 300), "nested too deeply"),
])
def test_unenforceable_schemas_are_refused(schema, message):
    with pytest.raises(SchemaError, match=message.replace("$", r"\$").replace("(", r"\(")):
        compile_schema(schema)


def test_a_vocabulary_without_whole_characters_can_still_write_keys_and_values_outside_ascii():
    """Byte-split characters read as U+FFFD, which no key or constant matches: the escaped spelling is the
    way through, token by token (a greedy walk over an ASCII vocabulary completes a valid instance)."""
    schema = {"type": "object", "properties": {"名前": {"enum": ["東京"]}}, "required": ["名前"]}
    g = compile_schema(schema)
    texts = [chr(c) for c in range(32, 127)] + ["\ufffd", '{"', '":']
    vocab = JsonVocab(texts)
    c = JsonConstraint(vocab, g)
    out = ""
    for _ in range(40):
        allowed = c.allowed()
        assert not allowed[texts.index("\ufffd")]
        token = int(torch.nonzero(allowed)[-1])          # the last allowed: never the one a test expects
        out += texts[token]
        if c.take(token) == "done":
            break
    assert c.done and json.loads(out) == {"名前": "東京"} and "\\u540d" in out, out


def test_each_character_outside_ascii_may_be_written_either_way():
    """A tokenizer with a whole token for one character of a value but not the next (SmolLM2 wrote '"大' and
    then had no token for 阪): the rest is escaped character by character, and the two may mix."""
    schema = {"type": "object", "properties": {"都市": {"enum": ["大阪", "東京"]}}, "required": ["都市"]}
    g = compile_schema(schema)
    for text in ('{"都市":"大\\u962a"}', '{"\\u90fd市":"\\u6771京"}', '{"都\\u5e02":"大阪"}'):
        assert completes(g, text) and json.loads(text) == {"都市": json.loads(text)["都市"]}, text
    for text in ('{"都市":"大"}', '{"都市":"\\u5927\\u962b"}', '{"都市":"\\u5927\\U962A"}', '{"\\u90fd":"大阪"}'):
        assert not completes(g, text), text
    texts = [chr(c) for c in range(32, 127)] + ["大"]      # 大 whole, 阪 only escaped
    vocab = JsonVocab(texts)
    c = JsonConstraint(vocab, g)
    for ch in '{"\\u90fd\\u5e02":"大':
        assert c.allowed()[texts.index(ch)], ch
        c.take(texts.index(ch))
    allowed = [texts[i] for i in torch.nonzero(c.allowed()).flatten().tolist()]
    assert allowed == ["\\"]                              # the only way on: 阪 escaped


def test_the_same_schema_compiles_once():
    a = compile_schema(json.loads(json.dumps(PERSON)))
    assert a is compile_schema(PERSON) and a is not compile_schema(TREE)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not gpu_ready(), reason="needs a CUDA device and engc._native"))])
def test_engine_outputs_follow_the_schema(device, request):
    """A random tiny model under a schema: every output is a prefix the automaton accepts, and those that
    stop are valid instances. On the GPU (tests/test_gpu.py's bundle) beside unconstrained greedy rows, so
    steps mix the host-sampled constrained rows with rows the CUDA graphs sample."""
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    bundle = request.getfixturevalue("tiny_bundle")("llama") if device == "cpu" else request.getfixturevalue("gpu_bundle")
    model = load(bundle, device=device)
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=16))
    prompt = model.tokenizer.encode("Hello, world!")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"]}
    g = compile_schema(schema)
    seqs = [engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=s, json_object=True,
                                                      json_schema=g)) for s in range(12)]
    seqs.append(engine.add_request(prompt, SamplingParams(max_tokens=64, json_schema=schema)))   # a dict will do
    free = [engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            for _ in range(2)]
    with pytest.raises(ValueError, match="'pattern' is not supported"):
        engine.check_request(prompt, SamplingParams(json_schema={"type": "object", "properties": {
            "a": {"type": "string", "pattern": "x"}}}))
    engine.run_to_completion()
    assert all(len(s.output_ids) == 40 for s in free) and free[0].output_ids == free[1].output_ids
    for s in seqs:
        assert walk(g.start, s.output_text, g) is not None, s.output_text
    stopped = [s for s in seqs if s.finish_reason == "stop"]
    assert stopped and all(valid(schema, s.output_text) for s in stopped)
