"""JSON mode (constrained.json_object, on llguidance): what it completes against Python's json module, its
bounded blanks, its masks against taking each token, and the engine ending outputs at the object's close."""
import json
import random
import re

import pytest
import torch

from engc.runtime import constrained
from engc.runtime.constrained.grammars import WHITESPACE
from grammar_check import completes, is_prefix, takes_tokens, vocab

OBJECT = constrained.json_object()
VALID = ['{}', '{ }', '{"a":1}', '{"a": [1, -2.5e-3, 0, 0.0, 1E+9, true, false, null]}',
         '{"k": {"x": [], "y": {}, "z": [[{}]]}}', '{"s": "a\\"b\\\\c/d\\b\\f\\n\\r\\t\\u00e9\\uFFFF"}',
         '{\n\t"a" : "caf\u00e9 \ufffd \U0001f600" ,\r\n "b":[ ] }', '{"": ""}', '{"-0": -0, "e": 1e5}',
         json.dumps({"a": {"b": [1, {"c": None}]}, "d": "x"}, indent=4)]
INVALID = [' {}', '\n{"a": 1}', '[1]', '"a"', '1', '{a:1}', '{"a":01}', '{"a":tru}', '{"a":1,}', '{"a" 1}',
           '{"a":1}}', '{"a":-}', '{"a":1} ',
           '{"a":1.}', '{"a":1e}', '{"a":"\\x"}', '{"a":"\x01"}', '{"a":[1,]}', '{"a":[1}', '{"a":.5}',
           "{'a':1}", '{"a":1}x', '{"a":"\\u12"}', '{"a":+1}', '{"a":NaN}', '{,}', '{"a":1 2}']


def parses_as_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text, parse_constant=lambda c: 1 / 0), dict)
    except (ValueError, ZeroDivisionError):
        return False


def blanks_fit(text: str) -> bool:
    """Whether every run of blanks is one JSON mode allows in one place (at most a line break and an indent)."""
    return all(re.fullmatch(WHITESPACE, m.group()) for m in re.finditer(r"[ \t\r\n]+", text))


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_end_exactly_at_their_close(text):
    assert parses_as_object(text) and blanks_fit(text)
    assert completes(OBJECT, text, masks=True)
    assert not completes(OBJECT, text[:-1]) and is_prefix(OBJECT, text[:-1])


@pytest.mark.parametrize("text", INVALID)
def test_invalid_texts_are_refused(text):
    assert not parses_as_object(text) or not text.startswith("{") or text != text.strip()
    assert not completes(OBJECT, text)


def test_agrees_with_json_module_on_random_texts():
    """Complete exactly when json.loads reads an object that starts with its brace and ends with its close,
    its blanks within JSON mode's bounds, on random short strings and on the valid objects above with one
    to three random edits."""
    rng = random.Random(0)
    alphabet = '{}[]":,0123456789.-+eEtrufalsn\\ \nx'
    counts = [0, 0]
    for n in range(3000):
        if n % 2:
            text = "{" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))
        else:
            text = rng.choice(VALID)
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(text) + 1)
                text = text[:i] + rng.choice(["", rng.choice(alphabet)]) + text[i + rng.randint(0, 1):]
        ours = completes(OBJECT, text)
        assert ours == (parses_as_object(text) and text.startswith("{") and text.endswith("}")
                        and blanks_fit(text)), text
        counts[ours] += 1
    assert min(counts) > 300, counts   # both answers were exercised


def test_blank_runs_are_bounded():
    """The gaps json.dumps writes fit (a space; a line break and an indent of up to 16, after a space or
    not); more is refused, so a model cannot fill its answer with blank lines or runs of spaces."""
    for gap in (' ', '\t', '\n', ' \n' + ' ' * 16, '\r\n\t\t'):
        assert completes(OBJECT, '{' + gap + '"a":' + gap + '1' + gap + '}'), repr(gap)
    for gap in ('  ', '\n\n', '\n' + ' ' * 17, ' \n \n', '\t '):
        assert not is_prefix(OBJECT, '{' + gap + '"'), repr(gap)


def test_masks_allow_only_tokens_the_grammar_takes():
    """Along a document, every token the mask allows (multi-byte ones, the end token) is one the matcher
    takes, and most it takes are allowed: the bitmask's unpacking, masks wider than one word. (Where the
    grammar forces its next bytes, llguidance allows only their canonical tokens: after "tr" of true, "ue"
    but not "u".)"""
    texts = ("{", "}", '"', "a", '":', " ", "\n", "  ", "1", ".5", "e-3", "true", " true", "tr", "ue", ",", '"}',
             'x"', "[", "]", '"]', "\\", "\\n", "\\u", "00", "e9", "}}", "], ", '{"', "-", "0", " {", "\t\n",
             "null", "n", ": ", '", "', "caf\u00e9", "\ufffd", " ,", " }", "  ]", " 5", "\n}")
    voc = vocab(texts)
    c, same = constrained.Constraint(voc, OBJECT), 0
    for b in '{"a": [1.5e-3, true, "x\\n\\u00e9"], "b": {"c": null}, "d": -0}'.encode():
        mask = c.allowed()
        assert len(mask) == voc.vocab_size and mask.dtype == torch.bool
        takes = torch.tensor([c.matcher.validate_tokens([t]) == 1 for t in range(voc.vocab_size)])
        assert mask.any() and not (mask & ~takes).any(), bytes([b])
        same += torch.equal(mask, takes)
        assert c.take(b) in (None, "done")
    assert c.matcher.is_stopped() and same > 40


def json_mode_runs(model, sampled: int, max_tokens: int, max_num_seqs: int):
    """(engine, seqs): `sampled` seeded JSON-mode requests and a greedy one, run to completion."""
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.sampling import SamplingParams
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=max_num_seqs))
    prompt = model.tokenizer.encode("Hello, world!")
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, grammar=OBJECT) for s in range(sampled)]
    params.append(SamplingParams(max_tokens=max_tokens, temperature=0, grammar=OBJECT))
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
    assert engine.grammar_vocab.vocab_size == model_vocab
    for s in seqs:
        assert s.finish_reason in ("stop", "length") and is_prefix(OBJECT, s.output_text), s.output_text
        assert all(t < 320 for t in s.output_ids)


def test_engine_outputs_are_json_objects(tiny_bundle):
    """A random tiny model in JSON mode: every output is a prefix of an object, and those that stop are whole
    objects that json.loads reads (the stop is the object's close, whose text is kept)."""
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    model = load(tiny_bundle("llama"), device="cpu")
    engine, seqs = json_mode_runs(model, sampled=16, max_tokens=48, max_num_seqs=16)
    stopped = [s for s in seqs if s.finish_reason == "stop"]
    for s in seqs:
        assert takes_tokens(OBJECT, engine.grammar_vocab, s.output_ids), s.output_text
    for s in stopped:
        assert parses_as_object(s.output_text), s.output_text
    assert len(stopped) >= 4 and all(s.finish_reason in ("stop", "length") for s in seqs)
    # a token that cannot continue the object (sampled where a mask was ignored) ends the output without its text
    prompt = model.tokenizer.encode("Hello, world!")
    seq = engine.add_request(prompt, SamplingParams(max_tokens=8, grammar=OBJECT))
    engine.output.process(seq, model.tokenizer.encode("x", add_special_tokens=False)[0])
    assert seq.finish_reason == "stop" and seq.output_text == "" and not engine.has_work
