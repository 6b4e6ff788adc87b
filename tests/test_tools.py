"""Function calling (runtime/server/tools.py): the request's tools checked, calls read from answers in the
formats models write, the prompt for templates with and without tool support, and the server: a required or
named call is a valid call (constrained), streamed or not, through the openai SDK."""
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from engc.runtime import constrained
from engc.runtime.server.app import APIError
from engc.runtime.server.tools import CallWatch, ToolSpec
from grammar_check import completes, is_prefix

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}


@pytest.mark.parametrize("tools,choice,fragment", [
    ([{"type": "function"}], None, "tools[0] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "1-64 letters"),
    ([WEATHER, WEATHER], None, "declared twice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope'"),
    (None, "required", "needs tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "parameters must be"),
])
def test_bad_tools_are_400s(tools, choice, fragment):
    with pytest.raises(APIError, match=fragment.replace("[", r"\[")) as e:
        ToolSpec(tools, choice)
    assert e.value.status == 400


def test_a_function_whose_parameters_cannot_be_enforced_is_a_400_when_required():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "not": {"const": ""}}}}}}]
    assert ToolSpec(tools, "auto").grammar() is None        # auto: not constrained, so not refused
    with pytest.raises(APIError, match=r'parameters cannot be enforced: Unimplemented keys: \["not"\]') as e:
        ToolSpec(tools, "required").grammar()
    assert e.value.status == 400 and e.value.param == "tools"


def test_a_required_call_names_a_declared_function_with_its_arguments():
    g = ToolSpec([WEATHER, TIME, NOARGS], "required").grammar()
    assert completes(g, '{"name": "get_time", "arguments": {"zone": 2}}')
    assert completes(g, '{"name": "ping", "arguments": {}}')
    for bad in ('{"name": "get_time", "arguments": {"zone": "2"}}', '{"name": "nope", "arguments": {}}',
                '{"name": "ping", "arguments": {}, "extra": 1}', '{"arguments": {}, "name": "ping"}'):
        assert not completes(g, bad), bad


def test_one_constraint_rule_for_both_apis():
    """ToolSpec.constraint: a required call's grammar, strict calls under auto, else the request's format; a
    constrained call meeting a format or a continued answer is a 400 in the API's words."""
    class Tok:
        chat_template, reads_tools = None, False
    strict = {"type": "function", "function": dict(WEATHER["function"], strict=True)}
    fmt = constrained.json_object()
    plain = ToolSpec([WEATHER], "auto").constraint(Tok(), fmt, "response_format", None)
    assert plain == {"grammar": fmt}                                              # not constrained: the format
    assert ToolSpec(None, None).constraint(Tok(), None, "f", "c") == {"grammar": None}
    required = ToolSpec([WEATHER], "required").constraint(Tok(), None, "response_format", None)
    assert required["grammar"].kind == "json_schema"
    auto = ToolSpec([strict], "auto").constraint(Tok(), None, "output_config.format", None)
    assert auto["grammar"].kind == "tool_calls"
    for tools, choice, what, param in (([WEATHER], "required", "a required tool call", "tool_choice"),
                                       ([strict], "auto", "strict tools under tool_choice auto", "tools")):
        for answer, continued, clash in ((fmt, None, "response_format"),
                                         (None, "continue_final_message", "continue_final_message")):
            with pytest.raises(APIError, match=f"^{clash} cannot be combined with {what}$") as e:
                ToolSpec(tools, choice).constraint(Tok(), answer, "response_format", continued)
            assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    ('Let me check.\n<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>\n'
     '<tool_call>{"name": "ping", "arguments": {}}</tool_call>', "Let me check.",
     [("get_time", {"zone": 1}), ("ping", {})]),
    ('<tool_call>{"name": "ping", "arguments": "{}"}', None, [("ping", {})]),      # unclosed, string arguments
    ('{"name": "get_time", "parameters": {"zone": 2}}', None, [("get_time", {"zone": 2})]),   # Llama 3
    ('```json\n[{"name": "ping", "arguments": {}}, {"name": "get_time", "arguments": {"zone": 3}}]\n```', None,
     [("ping", {}), ("get_time", {"zone": 3})]),
    ('{"name": "unknown", "arguments": {}}', '{"name": "unknown", "arguments": {}}', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('It is sunny.', 'It is sunny.', []),
    ('<tool_call>{"name": broken}</tool_call>', '<tool_call>{"name": broken}</tool_call>', []),
    # Llama 3.1: after <|python_tag|> (kept where a tokenizer does not mark it special), ';' between calls
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": 4}}; {"name": "ping", "parameters": {}}', None,
     [("get_time", {"zone": 4}), ("ping", {})]),
    ('Sure. <|python_tag|>{"name": "ping", "parameters": {}}', "Sure.", [("ping", {})]),
    ('<function=get_time>{"zone": 5}</function>', None, [("get_time", {"zone": 5})]),   # Llama 3.1 custom
    # Mistral: a JSON list after [TOOL_CALLS], or name[ARGS]{...} (v11 tokenizers)
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": 6}}]', None, [("get_time", {"zone": 6})]),
    ('[TOOL_CALLS]get_time[ARGS]{"zone": 7}[TOOL_CALLS]ping[ARGS]{}', None, [("get_time", {"zone": 7}), ("ping", {})]),
    ('[TOOL_CALLS]get_time[ARGS]{"zone": 8} ping[ARGS]{}', None, [("get_time", {"zone": 8}), ("ping", {})]),
    # pythonic (Llama 3.2 / 4): literal keyword arguments only, nothing evaluated
    ('[get_weather(city="Paris", unit="c"), ping()]', None, [("get_weather", {"city": "Paris", "unit": "c"}), ("ping", {})]),
    ('get_time(zone=-2)', None, [("get_time", {"zone": -2})]),
    ('[get_time(zone=__import__("os").getpid())]', '[get_time(zone=__import__("os").getpid())]', []),
    ('[get_time(3)]', '[get_time(3)]', []),                                   # positional: not a call
    ('[get_time(zone={1, 2})]', '[get_time(zone={1, 2})]', []),               # a set is no JSON value
    ('[ping(), unknown()]', '[ping(), unknown()]', []),                       # a whole answer: all or none
    ('<tool_call>{"name": "ping", "arguments": {}}</tool_call><tool_call>{"name": "nope", "arguments": {}}'
     '</tool_call>', None, [("ping", {})]),                                   # tagged: the declared ones
    ('print("hi")', 'print("hi")', []),
    ("[" * 5000, "[" * 5000, []),                                           # too deep to parse: content, no 500
    ('<tool_call>' + '[' * 5000, '<tool_call>' + '[' * 5000, []),
    ("[f(a=" + "[" * 3000 + "]" * 3000 + ")]", "[f(a=" + "[" * 3000 + "]" * 3000 + ")]", []),
])
def test_calls_are_read_from_the_formats_models_write(text, content, calls):
    got_content, got = ToolSpec([WEATHER, TIME, NOARGS], "auto").calls(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)
    assert ToolSpec([WEATHER], "none").calls(text) == (text, [])


@pytest.mark.parametrize("text,sent,content,names", [
    ("It is sunny in Paris.", "It is sunny in Paris.", "", []),
    ('Checking <tool_call>{"name": "ping", "arguments": {}}</tool_call>', "Checking ", "", ["ping"]),
    ('  {"name": "ping", "arguments": {}}', "", "", ["ping"]),                   # held whole: a call object
    ('{"weather": "sunny"}', "", '{"weather": "sunny"}', []),                     # held, then it is content
    ("a < b <tool_ca", "a < b ", "<tool_ca", []),          # a tail that could begin a call waits to the end
    ("x <tool_call>{broken</tool_call> y", "x ", "<tool_call>{broken</tool_call> y", []),
    ('Sure. <|python_tag|>{"name": "ping", "parameters": {}}', "Sure. ", "", ["ping"]),
    ('[TOOL_CALLS]ping[ARGS]{}', "", "", ["ping"]),                             # held whole: it opens with '['
    ('Use <function=ping>{}</function>', "Use ", "", ["ping"]),
    ("a <|pyth", "a ", "<|pyth", []),
])
def test_streamed_text_is_held_only_where_it_could_be_a_call(text, sent, content, names):
    """Whatever the chunking, CallWatch sends the same text early and reads the same calls at the end."""
    spec = ToolSpec([WEATHER, NOARGS], "auto")
    for size in (1, 2, 3, 7, len(text)):
        watch = CallWatch(spec)
        early = "".join(watch.feed(text[i:i + size]) for i in range(0, len(text), size))
        rest, calls, whole = watch.finish()
        assert early == sent and rest == content and whole and [c["function"]["name"] for c in calls] == names, size
        assert early + rest == text or calls
    required = CallWatch(ToolSpec([NOARGS], "required"))
    assert required.feed("It is") == "" and required.finish() == ("It is", [], True)


@pytest.mark.parametrize("text, name, arguments, members", [
    ('{"name": "get_weather", "arguments": {"city": "Par', "get_weather", '{"city": "Par', {}),
    ('{ "name" : "get_weather",\n "arguments":{"city": "Paris", "unit": "c', "get_weather",
     '{"city": "Paris", "unit": "c', {"city": "Paris"}),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}', "get_weather", '{"city": "Paris"}', {"city": "Paris"}),
    ('{"name": "get_wea', None, None, None),              # two functions, the name unfinished: text
    ('{"name": "ping", "argu', "ping", "", {}),
])
def test_a_required_call_cut_by_max_tokens(text, name, arguments, members):
    """Where max_tokens cuts a required call short, the call comes back with its arguments as written
    (unterminated JSON, OpenAI's finish_reason length), Anthropic's input with the members written whole;
    uncut, or under auto, the same text is content."""
    from engc.runtime.server.tools import call_input
    spec = ToolSpec([WEATHER, NOARGS], "required")
    content, calls, whole = spec.calls_or_cut(text, cut=True)
    if name is None:
        assert (content, calls, whole) == (text, [], True)
    else:
        (call,) = calls
        assert content is None and not whole and call["function"] == {"name": name, "arguments": arguments}
        assert call["id"].startswith("call_") and call_input(arguments) == members
    assert spec.calls_or_cut(text, cut=False) == (text, [], True)
    assert ToolSpec([WEATHER, NOARGS], "auto").calls_or_cut(text, cut=True) == (text, [], True)
    named = ToolSpec([WEATHER, NOARGS], {"type": "function", "function": {"name": "get_weather"}})
    assert named.calls_or_cut('{"name": "get_wea', cut=True)[1][0]["function"]["name"] == "get_weather"


def test_prompt_for_templates_with_and_without_tools(tiny_bundle):
    from engc.runtime.loader import load
    tok = load(tiny_bundle("llama"), device="cpu").tokenizer
    convo = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    spec = ToolSpec([WEATHER], "auto")
    assert not tok.reads_tools
    messages, tools = spec.prompt_messages(convo, tok.reads_tools)
    text = tok.apply_chat_template(messages, tools=tools)
    assert tools is None and messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text
    assert "Function result (call call_1): 21 C" in text
    # a template that reads tools gets them, and the calls with their arguments as objects (HF's shapes)
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                         "<call>{{ c.function.name }}({{ c.function.arguments.city }})</call>{% endfor %}|"
                         "{% endfor %}")
    tok._template = None
    assert tok.reads_tools
    messages, tools = spec.prompt_messages(convo, tok.reads_tools)
    assert tok.apply_chat_template(messages, tools=tools) == (
        "[get_weather]user:Weather in Paris?|assistant:<call>get_weather(Paris)</call>|tool:21 C|")
    messages, tools = ToolSpec([WEATHER], "none").prompt_messages(convo, True)
    assert tools is None   # tool_choice none: the template is not told of them


@pytest.fixture(scope="module")
def client(tiny_bundle):
    from live_server import LiveServer
    # engc's tool instructions take ~600 of the tiny tokenizer's tokens: a longer context than the default 256
    with LiveServer(tiny_bundle("llama", max_position_embeddings=2048)) as s:
        yield s, openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def test_required_and_named_calls_are_valid_calls(client):
    """A random tiny model cannot know tools; with tool_choice required or named its answer is still a call
    of a declared function whose arguments follow its schema (streamed or not)."""
    srv, c = client
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in (WEATHER, TIME, NOARGS)}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        spec = ToolSpec([WEATHER, TIME, NOARGS], choice)
        r = c.chat.completions.create(model=srv.model, messages=msgs, tools=[WEATHER, TIME, NOARGS],
                                      tool_choice=choice, max_tokens=120, temperature=1.0, seed=1, n=6)
        for ch in r.choices:
            if ch.finish_reason == "length":   # a random model's string or number ran past max_tokens: the
                (call,) = ch.message.tool_calls   # call as far as it was written
                g = constrained.json_schema(schemas[call.function.name] or {"type": "object"})
                assert ch.message.content is None and is_prefix(g, call.function.arguments)
                continue
            assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
            (call,) = ch.message.tool_calls
            assert choice == "required" or call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert sum(ch.finish_reason == "tool_calls" for ch in r.choices) >= 2
    stream = c.chat.completions.create(model=srv.model, messages=msgs, tools=[NOARGS], tool_choice="required",
                                       max_tokens=200, temperature=0, stream=True)
    deltas = [ch.choices[0] for ch in stream if ch.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "ping" and calls[0].index == 0
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    assert deltas[-1].finish_reason == "tool_calls"


def test_a_forced_call_cut_by_max_tokens_is_still_a_call(client):
    """max_tokens 6 ends a required / forced call early: OpenAI gets it in tool_calls with its arguments as
    far as written and finish_reason length (streamed too); Anthropic a tool_use block with the members
    written whole and stop_reason max_tokens."""
    srv, c = client
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = c.chat.completions.create(model=srv.model, messages=msgs, tools=[WEATHER], tool_choice="required",
                                  max_tokens=6, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    chunks = [x.choices[0] for x in c.chat.completions.create(
        model=srv.model, messages=msgs, tools=[WEATHER], tool_choice="required", max_tokens=6, temperature=0,
        stream=True) if x.choices]
    streamed = [tc for x in chunks for tc in x.delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [("get_weather", call.function.arguments)]
    assert chunks[-1].finish_reason == "length"
    a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    m = a.messages.create(model=srv.model, max_tokens=6, messages=msgs, tools=[tool],
                          tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    (block,) = m.content
    assert m.stop_reason == "max_tokens" and block.type == "tool_use" and block.name == "get_weather"
    assert isinstance(block.input, dict)
    with a.messages.stream(model=srv.model, max_tokens=6, messages=msgs, tools=[tool],
                           tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == block.input


def test_auto_and_none_answer_text_and_conversations_with_results_render(client):
    srv, c = client
    convo = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    for choice in ("auto", "none"):
        r = c.chat.completions.create(model=srv.model, messages=convo, tools=[WEATHER], tool_choice=choice,
                                      max_tokens=8, temperature=0)
        ch = r.choices[0]
        # a random model writes no call: its text is the content
        assert ch.finish_reason in ("stop", "length") and ch.message.tool_calls is None and ch.message.content
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(model=srv.model, messages=convo, tools=[WEATHER], tool_choice="required",
                                  response_format={"type": "json_object"}, max_tokens=8)
    # strict functions under "auto" (tests/test_triggered.py has the constraint): answered, streamed too,
    # and refused beside response_format
    strict = dict(WEATHER, function=dict(WEATHER["function"], strict=True))
    r = c.chat.completions.create(model=srv.model, messages=convo, tools=[strict, TIME], max_tokens=12,
                                  temperature=1.0, seed=3)
    for call in r.choices[0].message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = list(c.chat.completions.create(model=srv.model, messages=convo, tools=[strict], max_tokens=12,
                                              temperature=1.0, seed=3, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="cannot be combined with strict tools"):
        c.chat.completions.create(model=srv.model, messages=convo, tools=[strict], max_tokens=8,
                                  response_format={"type": "json_object"})


def test_anthropic_tools_any_named_and_streamed(client):
    """/v1/messages with tools through the anthropic SDK: tool_choice any / tool is a tool_use block whose input
    follows its input_schema (stop_reason tool_use), streamed as input_json_delta too."""
    srv, _ = client
    a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": "d",
              "input_schema": t["function"].get("parameters", {"type": "object", "properties": {}})}
             for t in (WEATHER, TIME, NOARGS)]
    schemas = {t["name"]: t["input_schema"] for t in tools}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    ok = 0
    for seed_choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}, {"type": "tool", "name": "ping"}):
        for t in (0.0, 1.0):
            m = a.messages.create(model=srv.model, max_tokens=120, messages=msgs, tools=tools,
                                  tool_choice=seed_choice, extra_body={"temperature": t})
            if m.stop_reason == "max_tokens":   # a random model's string or number ran long
                continue
            (block,) = m.content
            assert m.stop_reason == "tool_use" and block.type == "tool_use" and block.id.startswith("toolu_")
            assert seed_choice["type"] == "any" or block.name == seed_choice["name"]
            jsonschema.validate(block.input, schemas[block.name])
            ok += 1
    assert ok >= 3
    with a.messages.stream(model=srv.model, max_tokens=200, messages=msgs, tools=tools,
                           tool_choice={"type": "tool", "name": "ping"}, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].name == "ping" and final.content[-1].input == {}
    # a strict tool under "auto": answered (any tool_use block valid), refused beside output_config.format
    strict = [dict(tools[0], strict=True)]
    m = a.messages.create(model=srv.model, max_tokens=16, messages=msgs, tools=strict, extra_body={"temperature": 1.0})
    for block in m.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, schemas[block.name])
    with pytest.raises(anthropic.BadRequestError, match="strict tools"):
        a.messages.create(model=srv.model, max_tokens=8, messages=msgs, tools=strict,
                          extra_body={"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})


def test_anthropic_conversations_with_tool_blocks(client):
    srv, _ = client
    a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    convo = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris", "unit": "c"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                                          {"type": "text", "text": "Thanks"}]}]
    m = a.messages.create(model=srv.model, max_tokens=8, messages=convo, tools=tools,
                          tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert m.content[0].type == "text" and m.content[0].text and m.stop_reason in ("end_turn", "max_tokens")
    with_tools = a.messages.count_tokens(model=srv.model, messages=convo, tools=tools).input_tokens
    assert with_tools > a.messages.count_tokens(model=srv.model, messages=convo[:1]).input_tokens
    url = srv.url + "/v1/messages"
    for body, fragment in (
            (dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]),
             "tool_use blocks belong to assistant"),
            (dict(messages=convo[:2]), "tool_use (send its tool_result)"),
            (dict(messages=convo[:1], tools=[{"name": "f"}]), "input_schema"),
            (dict(messages=convo[:1], tools=tools, tool_choice={"type": "sometimes"}), "tool_choice.type")):
        r = httpx.post(url, json={"model": srv.model, "max_tokens": 8, **body})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_anthropic_structured_output(client):
    """output_config.format (Anthropic's structured outputs) constrains the text as response_format does."""
    srv, _ = client
    a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = a.messages.create(model=srv.model, max_tokens=200, messages=[{"role": "user", "content": "JSON"}],
                          output_config={"format": {"type": "json_schema", "schema": schema}},
                          extra_body={"temperature": 0})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)
    for cfg, fragment in (({"format": {"type": "json_schema", "schema": {"type": "object", "properties": {
                               "d": {"type": "string", "format": "x"}}}}}, "Unknown format: x"),
                          ({"format": {"type": "xml"}}, "output_config.format must be"),
                          ({"format": {"type": "json_schema", "schema": schema}, "tools": [
                              {"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}},
                           "cannot be combined with a required tool call")):
        extra = {k: cfg.pop(k) for k in ("tools", "tool_choice") if k in cfg}
        r = httpx.post(srv.url + "/v1/messages", json={"model": srv.model, "max_tokens": 8, "output_config": cfg,
                                                       "messages": [{"role": "user", "content": "x"}], **extra})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_auto_answers_stream_as_they_come(client):
    """With tools under "auto" a text answer is streamed in pieces, not held to its end (both APIs)."""
    srv, c = client
    msgs = [{"role": "user", "content": "Hello"}]
    chunks = [ch.choices[0].delta.content for ch in c.chat.completions.create(
        model=srv.model, messages=msgs, tools=[WEATHER], max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].delta.content]
    whole = c.chat.completions.create(model=srv.model, messages=msgs, tools=[WEATHER], max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].message
    if whole.tool_calls is None and not whole.content.lstrip().startswith(("{", "[", "`")):
        assert len(chunks) > 3 and "".join(chunks) == whole.content
    a = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    with a.messages.stream(model=srv.model, max_tokens=24, messages=msgs, extra_body={"temperature": 0},
                           tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]) as st:
        pieces = list(st.text_stream)
        final = st.get_final_message()
    assert "".join(pieces) == "".join(b.text for b in final.content if b.type == "text")
    if final.stop_reason != "tool_use" and not pieces[0].lstrip().startswith(("{", "[", "`")):
        assert len(pieces) > 3
