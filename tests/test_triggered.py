"""Strict function calls under tool_choice "auto" (runtime/constrained/triggered.py): free text until a call starts, then
the call's grammar until its value closes; the engine path with ToolSpec's parameters on a random tiny model,
every call it writes valid (jsonschema as the oracle)."""
import json
import random

import jsonschema
import pytest
import torch

from engc.runtime.constrained.json_mode import JsonVocab
from engc.runtime.constrained.json_schema import compile_schema
from engc.runtime.server.app import APIError
from engc.runtime.server.tools import ToolSpec
from engc.runtime.constrained.triggered import LEAD_BLANKS, TriggeredConstraint
from test_gpu import gpu_bundle, gpu_ready  # noqa: F401 - a fixture, used by the engine test below

CALL = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}, "required": ["name", "arguments"]}
# single characters, so any text can be written, and a few longer tokens models have
TEXTS = [chr(c) for c in range(32, 127)] + ["\n", "<tool_call>", "<tool_", "call>", "<tool_call>\n{", "<tool_call>x",
                                             '{"', "{}", "  {", "Hello", "</tool_call>", ""]


def vocab():
    return JsonVocab(TEXTS)


def write(c, text: str) -> list:
    """Feed `text` one character token at a time, asserting the mask allows each; the take() results."""
    results = []
    for ch in text:
        t = TEXTS.index(ch)
        m = c.allowed()
        assert m is None or m[t], (ch, c.phase)
        results.append(c.take(t))
    return results


def test_free_until_the_trigger_then_the_call_then_free_again():
    g = compile_schema(CALL)
    c = TriggeredConstraint(vocab(), g, ("<tool_call>",))
    assert c.allowed() is None
    write(c, "Hi ")
    assert c.take(TEXTS.index("<tool_call>")) is None and c.phase == "lead"
    m = c.allowed()
    assert m[TEXTS.index("\n")] and m[TEXTS.index("{")] and not m[TEXTS.index("x")] and not m[TEXTS.index("{}")]
    results = write(c, '\n{"name": "f", "arguments": {"n": 12}}')
    assert results[-1] is None and c.phase == "free"          # the value closed: free again, not the end
    assert c.allowed() is None
    write(c, "\n</tool_call> and more")
    assert c.phase == "free"


def test_a_trigger_split_over_tokens_and_one_that_runs_on_into_the_value():
    g = compile_schema(CALL)
    c = TriggeredConstraint(vocab(), g, ("<tool_call>",))
    c.take(TEXTS.index("<tool_"))
    assert c.phase == "free"
    c.take(TEXTS.index("call>"))
    assert c.phase == "lead"
    c = TriggeredConstraint(vocab(), g, ("<tool_call>",))
    c.take(TEXTS.index("<tool_call>\n{"))                     # sampled free: its rest is walked
    assert c.phase == "value" and not c.allowed()[TEXTS.index("}")]
    c = TriggeredConstraint(vocab(), g, ("<tool_call>",))
    c.take(TEXTS.index("<tool_call>x"))                       # a rest the grammar refuses: the call stays free
    assert c.phase == "free" and c.allowed() is None


def test_blanks_after_a_trigger_are_capped():
    c = TriggeredConstraint(vocab(), compile_schema(CALL), ("<tool_call>",))
    c.take(TEXTS.index("<tool_call>"))
    write(c, " " * LEAD_BLANKS)
    assert not c.allowed()[TEXTS.index(" ")] and c.allowed()[TEXTS.index("{")]


def test_at_start_a_call_is_the_whole_answer_and_prose_stays_free():
    g = compile_schema({"anyOf": [CALL, {"type": "array", "items": CALL, "minItems": 1}]})
    c = TriggeredConstraint(vocab(), g, at_start=True)
    m = c.allowed()
    assert m[TEXTS.index("Hello")] and m[TEXTS.index("{")] and m[TEXTS.index("[")] and m[TEXTS.index("  {")]
    assert not m[TEXTS.index("{}")] and m[TEXTS.index("")] and m[TEXTS.index(" ")]
    results = write(c, ' [{"name":"f","arguments":{"n":1}}]')
    assert results[-1] == "done"                               # the call was the answer: it ends there
    c = TriggeredConstraint(vocab(), g, at_start=True)
    write(c, "Hello {")                                        # prose first: free for good
    assert c.phase == "free" and c.allowed() is None


def _random_answer(c, rng, n=60):
    """Random allowed tokens; inside a call, mostly the structural ones, so that calls get to close."""
    out = ""
    for _ in range(n):
        m = c.allowed()
        choices = [i for i in range(len(TEXTS)) if TEXTS[i] and (m is None or m[i])]
        closing = [i for i in choices if TEXTS[i] in '"}],:0123456789nfa'] if m is not None else []
        t = rng.choice(closing if closing and rng.random() < 0.8 else choices)
        was = c.phase
        out += TEXTS[t]
        if c.take(t) == "done":
            break
        if was == "value" and c.phase == "free":   # a Hermes call closed: its tag, as models write it
            out += "</tool_call>"
            c.take(TEXTS.index("</tool_call>"))
    return out


@pytest.mark.parametrize("at_start", [False, True])
def test_random_answers_hold_only_valid_calls(at_start):
    """Random tokens (prose and calls mixed): every call that ToolSpec reads back follows the schema, and calls
    that closed do get read."""
    spec = ToolSpec([{"type": "function", "function": {"name": "f", "strict": True, "parameters": CALL["properties"]["arguments"]}}],
                    "auto")
    g = compile_schema({"anyOf": [CALL, {"type": "array", "items": CALL, "minItems": 1}]} if at_start else CALL)
    rng, read = random.Random(at_start), 0
    for k in range(300):
        c = TriggeredConstraint(vocab(), g, () if at_start else ("<tool_call>",), at_start)
        opening = "" if k % 2 else rng.choice("{[") if at_start else "<tool_call>"   # half open a call
        if opening:
            c.take(TEXTS.index(opening))
        text = opening + _random_answer(c, rng, 200)
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
    hermes = spec.auto_constraint(Tok("{{ tools }} <tool_call>"))
    assert hermes["json_triggers"] == ("<tool_call>",) and "json_at_start" not in hermes
    whole = spec.auto_constraint(Tok(None))                   # engc's instructions: the call is the answer
    assert whole["json_at_start"] and whole["json_schema"] is not hermes["json_schema"]
    assert ToolSpec(tools[1:], "auto").auto_constraint(Tok(None)) == {}        # nothing strict
    assert ToolSpec(tools, "none").auto_constraint(Tok(None)) == {}
    bad = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "date"}}}}}]
    with pytest.raises(APIError, match="'format' is not supported"):
        ToolSpec(bad, "auto").auto_constraint(Tok(None))
    with pytest.raises(APIError, match="strict must be true or false"):
        ToolSpec([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "auto")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not gpu_ready(), reason="needs a CUDA device and engc._native"))])
def test_engine_rows_with_strict_auto_tools(device, request):
    """The engine path (SamplingParams from ToolSpec) on a random tiny model: answers are prose or calls, and
    every call read back follows its function's schema. On the GPU beside unconstrained greedy rows, so
    steps mix the host-sampled triggered rows with rows the CUDA graphs sample."""
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    bundle = request.getfixturevalue("tiny_bundle")("llama") if device == "cpu" else request.getfixturevalue("gpu_bundle")
    model = load(bundle, device=device)
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=16))
    args = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = ToolSpec([{"type": "function", "function": {"name": "f", "strict": True, "parameters": args}}], "auto")
    strict = spec.auto_constraint(model.tokenizer)
    assert strict["json_at_start"]
    prompt = model.tokenizer.encode("Hello, world!")
    seqs = [engine.add_request(prompt, SamplingParams(max_tokens=48, temperature=1.0, seed=s, **strict))
            for s in range(16)]
    free = [engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            for _ in range(2)]
    with pytest.raises(ValueError, match="need json_schema"):
        engine.check_request(prompt, SamplingParams(json_at_start=True))
    engine.run_to_completion()
    assert all(len(s.output_ids) == 40 for s in free) and free[0].output_ids == free[1].output_ids
    for s in seqs:
        _, calls = spec.calls(s.output_text)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), args)
        if s.output_text.lstrip()[:1] in ("{", "[") and s.finish_reason == "stop":
            assert calls, s.output_text                       # a closed call at the start is a call
    assert torch.is_tensor(engine.json_vocab.plain)
