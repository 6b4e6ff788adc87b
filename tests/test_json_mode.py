"""JSON mode (runtime/constrained/json_mode.py): the automaton against Python's json module, the masks (the sorted token texts
walked as a trie) against a brute-force walk of every token, and the engine and server ending outputs at the
object's close."""
import json
import random

import pytest
import torch

from engc.runtime.constrained.json_mode import DONE, OBJECT, START, JsonConstraint, JsonVocab, blank_limit, walk
from engc.runtime.constrained.json_schema import compile_schema

VALID = ['{}', '{ }', '{"a":1}', '{"a": [1, -2.5e-3, 0, 0.0, 1E+9, true, false, null]}',
         '{"k": {"x": [], "y": {}, "z": [[{}]]}}', '{"s": "a\\"b\\\\c\\/d\\b\\f\\n\\r\\t\\u00e9\\uFFFF"}',
         '{\n\t"a" : "caf\u00e9 \ufffd \U0001f600" ,\r\n "b":[ ] }', '{"": ""}', '{"-0": -0, "e": 1e5}']
INVALID = [' {}', '\n{"a": 1}', '[1]', '"a"', '1', '{a:1}', '{"a":01}', '{"a":tru}', '{"a":1,}', '{"a" 1}',
           '{"a":1}}', '{"a":-}',
           '{"a":1.}', '{"a":1e}', '{"a":"\\x"}', '{"a":"\x01"}', '{"a":[1,]}', '{"a":[1}', '{"a":.5}',
           "{'a':1}", '{"a":1}x', '{"a":"\\u12"}', '{"a":+1}', '{"a":NaN}', '{,}', '{"a":1 2}']


def parses_as_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text, parse_constant=lambda c: 1 / 0), dict)
    except (ValueError, ZeroDivisionError):
        return False


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_end_exactly_at_their_close(text):
    assert parses_as_object(text)
    for i in range(len(text)):
        state = walk(START, text[:i])
        assert state is not None and state[0] != DONE, text[:i]
    assert walk(START, text)[0] == DONE


@pytest.mark.parametrize("text", INVALID)
def test_invalid_texts_are_refused(text):
    assert not parses_as_object(text) or not text.startswith("{")   # the answer starts with its brace
    state = walk(START, text)
    assert state is None or state[0] != DONE


def test_agrees_with_json_module_on_random_texts():
    """Complete for the automaton exactly when json.loads reads an object that starts with its brace, on
    random short strings and on the valid objects above with one to three random edits (json allows
    trailing blanks, which end nothing here: stripped first)."""
    rng = random.Random(0)
    alphabet = '{}[]":,0123456789.-+eEtrufalsn\\ \nx'
    counts = [0, 0]
    for n in range(30000):
        if n % 2:
            text = "{" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))
        else:
            text = rng.choice(VALID)
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(text) + 1)
                text = text[:i] + rng.choice(["", rng.choice(alphabet)]) + text[i + rng.randint(0, 1):]
        text = text.rstrip()
        state = walk(START, text)
        ours = state is not None and state[0] == DONE
        assert ours == (parses_as_object(text) and text.startswith("{")), text
        counts[ours] += 1
    assert min(counts) > 3000, counts   # both answers were exercised


def test_masks_equal_a_brute_force_walk():
    texts = ["{", "}", '"', "a", '":', " ", "\n", "  ", "1", ".5", "e-3", "true", " true", "tr", "ue", ",", '"}',
             'x"', "", "[", "]", '"]', "\\", "\\n", "\\u", "00", "e9", "}}", "], ", '{"', "-", "0", " {", "\t\n",
             "null", "n", ": ", '", "', "\x01", "caf\u00e9", "\ufffd", " ,", " }", "  ]", " 5", "\n}"]
    vocab = JsonVocab(texts)
    doc = '{"a": [1.5e-3, true, "x\\n\\u00e9"], "b": {"c": null}, "d": -0}'
    state, states = START, [START]
    for ch in doc:
        state = walk(state, ch)
        states.append(state)
    assert state[0] == DONE
    for s in states[:-1]:
        brute = torch.tensor([bool(t) and walk(s, t) is not None for t in texts])
        assert torch.equal(vocab.mask(s), brute), s


def test_masks_of_a_large_vocabulary_with_shared_prefixes_equal_a_brute_force_walk():
    """The trie walk at scale: thousands of texts built from JSON's pieces (many sharing a prefix, blank-led,
    quote-led or a prefix of a constant), one text under two ids, empty texts, characters outside ASCII (the
    last code point too), over every state of a document in JSON mode and in a schema's grammar (its
    constant-choice states walk only their first characters' runs, its strings judge the text after the quote)."""
    rng = random.Random(0)
    pieces = ["{", "}", "[", "]", '"', ":", ",", " ", "\n", "\\", "u", "true", "tr", "false", "null", "nu", "1", "0",
              ".", "e", "-", "a", "r", "ue", "alse", "l", "s", "name", "role", "user", "admin", "\u00e9", "\U0010ffff",
              "\ufffd", "x"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 5))) for _ in range(3000)]
    texts += ["", "true", "true", '", "', "\U0010ffff"]
    vocab = JsonVocab(texts)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "role": {"enum": ["admin", "user", 1]},
                                                "ok": {"type": "boolean"},
                                                "n": {"type": "array", "items": {"type": "number"}}},
              "required": ["name", "role"], "additionalProperties": False}
    for grammar, doc in ((OBJECT, '{"a": [1.5e-3, true, null, "x\\n\\u00e9"], "b": {}, "c": -0}'),
                         (compile_schema(schema), '{"name": "x\\"y", "role": "user", "ok": false, "n": [1, -2.5e3]}')):
        state, states = grammar.start, [grammar.start]
        for ch in doc:
            state = grammar.step(state, ch)
            states.append(state)
        assert state[0] == DONE
        nonempty = 0
        for s in states[:-1]:
            brute = torch.tensor([bool(t) and walk(s, t, grammar) is not None for t in texts])
            assert torch.equal(vocab.mask(s, grammar), brute), s
            nonempty += bool(brute.any())
        assert nonempty > 0.6 * len(states), (nonempty, len(states))   # most states had tokens to allow


def test_constraint_ends_at_the_close_and_stops_blank_loops():
    texts = ["{", "}", " ", "\n", '"a"', ":", "1", " }"]
    c = JsonConstraint(JsonVocab(texts))
    assert c.take(0) is None                   # {
    for _ in range(blank_limit(1)):
        assert c.take(3) is None               # blanks between values, up to the limit
    assert not c.allowed()[2] and not c.allowed()[3] and c.allowed()[7]
    assert c.take(4) is c.take(5) is c.take(6) is None        # "a" : 1
    assert c.allowed()[2] and c.take(7) == "done" and c.done   # " }" closes it
    assert JsonConstraint(JsonVocab(texts)).take(6) == "broken"   # a token that cannot start it


def test_token_texts_keep_leading_spaces(tiny_bundle):
    from engc.runtime.loader import load
    tok = load(tiny_bundle("llama"), device="cpu").tokenizer
    texts = tok.token_texts()
    assert len(texts) == tok.vocab_size
    ids = tok.encode(' {"a": true}', add_special_tokens=False)
    assert "".join(texts[i] for i in ids) == ' {"a": true}'


def json_mode_runs(model, sampled: int, max_tokens: int, max_num_seqs: int):
    """(engine, seqs): `sampled` seeded JSON-mode requests and a greedy one, run to completion."""
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.sampling import SamplingParams
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=max_num_seqs))
    prompt = model.tokenizer.encode("Hello, world!")
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, json_object=True) for s in range(sampled)]
    params.append(SamplingParams(max_tokens=max_tokens, temperature=0, json_object=True))
    seqs = [engine.add_request(prompt, p) for p in params]
    engine.run_to_completion()
    return engine, seqs


def test_json_mode_with_a_head_wider_than_the_tokenizer(tiny_bundle):
    """Qwen2.5's head has 151,936 logits for 151,665 tokens: masks are as wide as the logits (ids past the
    tokenizer never allowed), where a mask of the tokenizer's width failed the step, and with it every
    request in flight."""
    model_vocab = 400
    from engc.runtime.loader import load
    model = load(tiny_bundle("qwen2", vocab_size=model_vocab), device="cpu")
    assert model.tokenizer.vocab_size == 320
    engine, seqs = json_mode_runs(model, sampled=6, max_tokens=32, max_num_seqs=8)
    assert engine.json_vocab.size == model_vocab
    for s in seqs:
        assert s.finish_reason in ("stop", "length") and walk(START, s.output_text) is not None, s.output_text
        assert all(t < 320 for t in s.output_ids)


def test_engine_outputs_are_json_objects(tiny_bundle):
    """A random tiny model in JSON mode: every output is a prefix of an object, and those that stop are whole
    objects that json.loads reads (the stop is the object's close, whose text is kept)."""
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    model = load(tiny_bundle("llama"), device="cpu")
    engine, seqs = json_mode_runs(model, sampled=16, max_tokens=48, max_num_seqs=16)
    prompt = model.tokenizer.encode("Hello, world!")
    stopped = [s for s in seqs if s.finish_reason == "stop"]
    for s in seqs:
        assert walk(START, s.output_text) is not None, s.output_text
    for s in stopped:
        assert parses_as_object(s.output_text), s.output_text
    assert len(stopped) >= 4 and all(s.finish_reason in ("stop", "length") for s in seqs)
    # a token that cannot continue the object (a mask left empty) ends the output without its text
    from engc.runtime.sampling import Sampled
    seq = engine.add_request(prompt, SamplingParams(max_tokens=8, json_object=True))
    engine.output.process(seq, Sampled(model.tokenizer.encode("x", add_special_tokens=False)[0]))
    assert seq.finish_reason == "stop" and seq.output_text == "" and not engine.has_work
