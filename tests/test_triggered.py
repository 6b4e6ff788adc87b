"""Strict function calls under tool_choice "auto" (constrained.tool_calls): free text until a call starts, then
the call's grammar until its value closes; the engine path with ToolSpec's parameters on a random tiny model,
every call it writes valid (jsonschema as the oracle)."""
import json
import random

import jsonschema
import pytest

from engc.runtime import constrained
from engc.runtime.server.app import APIError
from engc.runtime.server.tools import ToolSpec
from grammar_check import EOS, feed, vocab
from test_gpu import gpu_bundle, gpu_ready  # noqa: F401 - a fixture, used by the engine test below

CALL = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}, "required": ["name", "arguments"]}
# every byte is a token, so any text can be written, and a few longer tokens models have
LONG = ("<tool_call>", "<tool_", "call>", "<tool_call>\n{", "<tool_call>x", '{"', "{}", "  {", "Hello", "</tool_call>")
VOCAB = vocab(LONG)
ID = {t: 257 + i for i, t in enumerate(LONG)}
HERMES = constrained.tool_calls(CALL, ("<tool_call>",))
AT_START = constrained.tool_calls(CALL)


def token(text: str) -> int:
    return ID[text] if text in ID else text.encode()[0]


def write(c, text: str) -> list:
    """Feed `text` one byte a token, asserting the mask allows each; the take() results."""
    results = []
    for b in text.encode():
        assert c.allowed()[b], (text, chr(b))
        results.append(c.take(b))
    return results


def test_free_until_the_trigger_then_the_call_then_free_again():
    c = constrained.Constraint(VOCAB, HERMES)
    assert c.allowed()[token("Hello")] and c.allowed()[EOS]           # free text, which may end here
    write(c, "Hi ")
    assert c.take(token("<tool_call>")) is None
    m = c.allowed()
    assert m[token("\n")] and m[token("{")] and not m[token("x")] and not m[token("{}")] and not m[EOS]
    results = write(c, '\n{"name": "f", "arguments": {"n": 12}}')
    assert results[-1] is None and c.allowed()[EOS]                    # the value closed: free again, not the end
    write(c, "\n</tool_call> and more")
    assert c.allowed()[token("Hello")]


def test_a_trigger_split_over_tokens_and_one_that_runs_on_into_the_value():
    c = constrained.Constraint(VOCAB, HERMES)
    assert c.take(token("<tool_")) is None and c.allowed()[token("x")]   # not a call yet
    assert c.take(token("call>")) is None and not c.allowed()[token("x")]   # now it is
    c = constrained.Constraint(VOCAB, HERMES)
    assert c.allowed()[token("<tool_call>\n{")]
    c.take(token("<tool_call>\n{"))
    assert not c.allowed()[token("}")]                                 # the call's required keys come first
    # a token that runs on past the trigger into something no call starts with is masked out
    assert not constrained.Constraint(VOCAB, HERMES).allowed()[token("<tool_call>x")]


def test_blanks_after_a_trigger_are_capped():
    c = constrained.Constraint(VOCAB, HERMES)
    c.take(token("<tool_call>"))
    write(c, " " * 8)
    assert not c.allowed()[token(" ")] and c.allowed()[token("{")]


def test_at_start_a_call_is_the_whole_answer_and_prose_stays_free():
    c = constrained.Constraint(VOCAB, AT_START)
    m = c.allowed()
    assert m[token("Hello")] and m[token("{")] and m[token("[")] and m[token("  {")] and m[token(" ")]
    assert not m[token("{}")] and m[EOS]
    results = write(c, ' [{"name":"f","arguments":{"n":1}}]')
    assert results[-1] == "done"                                       # the call was the answer: it ends there
    c = constrained.Constraint(VOCAB, AT_START)
    write(c, "Hello {")                                                # prose first: free for good
    assert c.allowed()[token("}")] and c.allowed()[EOS]
    assert feed(AT_START, '{"name":"f","arguments":{"n":1}} more') == "refused"


STRUCTURAL = set(b'"}],:0123456789nfa')


def _random_answer(c, rng, n=60):
    """Random allowed tokens; inside a call (where prose is masked), mostly the structural ones, so that calls
    get to close."""
    out = ""
    for _ in range(n):
        m = c.allowed()
        choices = [i for i in m.nonzero().flatten().tolist() if i != EOS and (i >= 32 or i == 10)]
        if not choices:
            break
        in_call = not m[token("Hello")]
        closing = [i for i in choices if i in STRUCTURAL]
        t = rng.choice(closing if in_call and closing and rng.random() < 0.8 else choices)
        out += VOCAB.decode_str([t])
        if c.take(t) == "done":
            break
        if in_call and c.allowed()[token("Hello")]:   # a Hermes call closed: its end tag, as models write it
            out += "</tool_call>"
            write(c, "</tool_call>")
    return out


@pytest.mark.parametrize("at_start", [False, True])
def test_random_answers_hold_only_valid_calls(at_start):
    """Random allowed tokens (prose and calls mixed): every call that ToolSpec reads back follows the schema,
    and calls that closed do get read."""
    spec = ToolSpec([{"type": "function", "function": {"name": "f", "strict": True,
                                                       "parameters": CALL["properties"]["arguments"]}}], "auto")
    grammar = AT_START if at_start else HERMES
    rng, read = random.Random(at_start), 0
    for k in range(200):
        c = constrained.Constraint(VOCAB, grammar)
        opening = "" if k % 2 else rng.choice("{[") if at_start else "<tool_call>"   # half open a call
        if opening:
            c.take(token(opening))
        text = opening + _random_answer(c, rng, 150)
        _, calls = spec.calls(text)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), CALL["properties"]["arguments"])
        read += bool(calls)
    assert read > 5


def test_toolspec_picks_the_trigger_from_the_template_and_refuses_bad_strict():
    class Tok:
        def __init__(self, template):
            self.chat_template, self.reads_tools = template, template is not None and "tools" in template
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": CALL["properties"]["arguments"]}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "string", "format": "x"}}}]
    spec = ToolSpec(tools, "auto")
    hermes = spec.auto_constraint(Tok("{{ tools }} <tool_call>"))["grammar"]
    call = '{"name": "f", "arguments": {"n": 1}}'
    assert feed(hermes, f"Sure. <tool_call>\n{call}\n</tool_call>") is None
    assert feed(hermes, "Sure. <tool_call>\nnot json") == "refused"
    whole = spec.auto_constraint(Tok(None))["grammar"]                  # engc's instructions: the call is the answer
    assert feed(whole, call) == "done" and feed(whole, f"[{call}]") == "done"
    assert feed(whole, '{"name": "g", "arguments": {"x": [1]}}') == "done"   # g is not strict: any object
    assert ToolSpec(tools[1:], "auto").auto_constraint(Tok(None)) == {}        # nothing strict
    assert ToolSpec(tools, "none").auto_constraint(Tok(None)) == {}
    bad = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "x"}}}}}]
    with pytest.raises(APIError, match="Unknown format: x"):
        ToolSpec(bad, "auto").auto_constraint(Tok(None))
    with pytest.raises(APIError, match="strict must be true or false"):
        ToolSpec([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "auto")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not gpu_ready(), reason="needs a CUDA device and engc._native"))])
def test_engine_rows_with_strict_auto_tools(device, request):
    """The engine path (SamplingParams from ToolSpec) on a random tiny model: answers are prose or calls, and
    every call read back follows its function's schema. On the GPU beside unconstrained greedy rows, so
    steps mix the masked rows with rows the CUDA graphs sample."""
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    bundle = request.getfixturevalue("tiny_bundle")("llama") if device == "cpu" else request.getfixturevalue("gpu_bundle")
    model = load(bundle, device=device)
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=16))
    args = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = ToolSpec([{"type": "function", "function": {"name": "f", "strict": True, "parameters": args}}], "auto")
    strict = spec.auto_constraint(model.tokenizer)
    assert strict["grammar"].kind == "tool_calls"
    prompt = model.tokenizer.encode("Hello, world!")
    seqs = [engine.add_request(prompt, SamplingParams(max_tokens=48, temperature=1.0, seed=s, **strict))
            for s in range(16)]
    free = [engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            for _ in range(2)]
    with pytest.raises(ValueError, match="grammar must be"):
        engine.check_request(prompt, SamplingParams(grammar={"type": "object"}))
    engine.run_to_completion()
    assert all(len(s.output_ids) == 40 for s in free) and free[0].output_ids == free[1].output_ids
    for s in seqs:
        _, calls = spec.calls(s.output_text)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), args)
        if s.output_text.lstrip()[:1] in ("{", "[") and s.finish_reason == "stop":
            assert calls, s.output_text                       # a closed call at the start is a call
