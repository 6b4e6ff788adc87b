"""Function calling: OpenAI's `tools` / `tool_choice` on /v1/chat/completions, and Anthropic's on /v1/messages
(anthropic.py turns its tools, tool_use and tool_result blocks into these shapes first).

The prompt: a chat template that reads `tools` (Qwen's, Llama 3's, Hermes-style ones) gets them and the
conversation's calls and results in Hugging Face's message shapes. A template that does not (SmolLM2's) gets
engc's own instructions in the system message: the functions' JSON specs and "reply with only a JSON object
{"name": ..., "arguments": {...}}"; earlier calls are written in that form and results as user messages.

The answer: with tool_choice "required" or a named function the output is constrained to a call (a JSON
Schema grammar, runtime/constrained: {"name": <a function>, "arguments": <its parameters>}, one alternative
per function), so it always parses and its arguments follow the schema. With "auto" the model decides, and
its text is read for calls afterwards in the formats models write (call_formats.py: Hermes/Qwen
`<tool_call>` blocks, Llama 3.x's JSON, `<|python_tag|>`, `<function=...>` and pythonic lists, Mistral's
`[TOOL_CALLS]`, an answer that is only a call object or list as engc's instructions ask), naming a declared
function.
"""
from __future__ import annotations

import json
import re
import uuid

from engc.runtime import constrained
from engc.runtime.server import call_formats
from engc.runtime.server.app import APIError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
LONGEST_MARK = max(map(len, call_formats.MARKS))
NO_PARAMETERS = {"type": "object", "properties": {}}
# a required call as its grammar writes it, {"name": ..., "arguments": ...}: the name, and where the arguments start
CALL_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
CALL_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


class ToolSpec:
    """A request's functions and tool_choice, checked (400s name the field)."""

    def __init__(self, tools: list | None, choice):
        self.functions: dict[str, dict] = {}
        for i, t in enumerate(tools or []):
            f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
                raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                               "with a name of 1-64 letters, digits, '_' or '-'", "tools")
            if f["name"] in self.functions:
                raise APIError(400, f"tools[{i}]: the function name '{f['name']}' is declared twice", "tools")
            params = f.get("parameters", NO_PARAMETERS)
            if not isinstance(params, dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
            problem = schema_problem(params)
            if problem:   # under every tool_choice: a schema the model reads in its prompt must mean something
                raise APIError(400, f"tools[{i}].function.parameters is not a valid JSON Schema: {problem}", "tools")
            if "strict" in f and not isinstance(f["strict"], bool):
                raise APIError(400, f"tools[{i}].function.strict must be true or false", "tools")
            self.functions[f["name"]] = dict(f, parameters=params)
        # strict (OpenAI's function.strict, Anthropic's tool strict): its calls' arguments follow the schema,
        # under "auto" too (constrained.tool_calls)
        self.strict = any(f.get("strict") is True for f in self.functions.values())
        if choice is None:
            choice = "auto" if self.functions else "none"
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in self.functions:
                raise APIError(400, f"tool_choice names the function {name!r}, which tools does not declare",
                               "tool_choice")
            self.mode, self.forced = "required", [name]
        elif choice in ("none", "auto", "required"):
            if choice != "none" and not self.functions:
                raise APIError(400, f"tool_choice '{choice}' needs tools", "tool_choice")
            self.mode, self.forced = choice, list(self.functions)
        else:
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def grammar(self) -> constrained.Grammar | None:
        """The call's grammar where a call is required, else None."""
        if self.mode != "required":
            return None
        return _compile(constrained.json_schema, self._calls(self.forced, enforce_all=True))

    def constraint(self, tokenizer, answer: constrained.Grammar | None, fmt: str, continued: str | None) -> dict:
        """The SamplingParams fields that constrain the answer, one rule for both APIs: a required call's
        grammar, else strict functions' calls under "auto" (auto_constraint), else the request's own format
        (answer: its grammar or None). A constrained call can neither meet a format nor start inside a
        continued answer: a 400 in the API's words (fmt: its format field; continued: its continued-answer
        field, None when the answer is not continued)."""
        if self.mode == "required":
            fields, what, param = {"grammar": self.grammar()}, "a required tool call", "tool_choice"
        else:
            fields, what, param = self.auto_constraint(tokenizer), "strict tools under tool_choice auto", "tools"
        if not fields:
            return {"grammar": answer}
        clash = fmt if answer is not None else continued
        if clash:
            raise APIError(400, f"{clash} cannot be combined with {what}", param)
        return fields

    def auto_constraint(self, tokenizer) -> dict:
        """SamplingParams fields for strict functions under "auto" ({} otherwise): the calls constrained
        where they start (constrained.tool_calls), at a `<tool_call>` where the chat template writes calls
        that way, else at the start of the answer (Llama 3.x's and engc's own instructions: the call is the
        answer, an object or a list of them). A non-strict function's arguments may be any object."""
        if self.mode != "auto" or not self.strict:
            return {}
        call = self._calls(list(self.functions), enforce_all=False)
        template = tokenizer.chat_template or ""
        triggers = ("<tool_call>",) if tokenizer.reads_tools and "<tool_call>" in template else ()
        return {"grammar": _compile(constrained.tool_calls, call, triggers)}

    def _calls(self, names: list[str], enforce_all: bool) -> dict:
        """The schema of one call of the named functions: {"name": <const>, "arguments": <parameters>}."""
        alternatives = [{"type": "object", "properties": {"name": {"const": n}, "arguments": (
                            self.functions[n]["parameters"] if enforce_all or self.functions[n].get("strict") is True
                            else {"type": "object"})},
                         "required": ["name", "arguments"]} for n in names]
        return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}

    def prompt_messages(self, messages: list[dict], template_reads_tools: bool) -> tuple[list[dict], list | None]:
        """(messages, tools) for the chat template: HF shapes where it reads tools, engc's text otherwise."""
        tools = [{"type": "function", "function": f} for f in self.functions.values()]
        if template_reads_tools:
            return [_hf_message(m) for m in messages], (tools if self.active else None)
        out = [_text_message(m) for m in messages]
        if self.active:
            text = ("You can call these functions (JSON Schema of their arguments):\n"
                    + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
                    + '\nTo call one, reply with only a JSON object: {"name": <function name>, "arguments": '
                      "<an object of its arguments>}. Otherwise reply normally.")
            if out and out[0]["role"] == "system":
                out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + text)
            else:
                out.insert(0, {"role": "system", "content": text})
        return out, None

    def calls_or_cut(self, text: str, cut: bool) -> tuple[str | None, list[dict], bool]:
        """(content, calls, complete): calls(text); or, where max_tokens cut a required call short (cut
        and no whole call read), that call with its arguments as written so far, unterminated JSON, as
        OpenAI returns one (finish_reason stays "length"). A cut call that names no declared function (its
        name unfinished, among several) stays text."""
        content, calls = self.calls(text)
        if calls or not cut or self.mode != "required":
            return content, calls, True
        named = CALL_NAME.search(text)
        name = json.loads(f'"{named.group(1)}"') if named else (self.forced[0] if len(self.forced) == 1 else None)
        if name not in self.forced:
            return content, calls, True
        arguments = CALL_ARGUMENTS.search(text, named.end() if named else 0)
        return None, [_tool_call(name, text[arguments.end():] if arguments else "")], False

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of an answer (call_formats.py reads the formats models write): the tagged
        calls that name declared functions, or the whole answer's calls if every one does; else no calls."""
        read = call_formats.read_calls(text) if self.active else None
        if read is None:
            return text, []
        content, found, whole = read
        known = [c for c in found if c[0] in self.functions]
        if not known or (whole and len(known) < len(found)):
            return text, []
        return content, [_tool_call(name, json.dumps(args, ensure_ascii=False)) for name, args in known]


class CallWatch:
    """One streamed answer of a request with tools: the text that can be sent now, and the rest held to be
    read for calls at the end. A required call is held whole; under "auto" an answer whose first character
    opens a call object, list or code fence is held whole, and any other streams until a call marker
    (call_formats.MARKS: `<tool_call>`, `<|python_tag|>`, ...; a tail that could begin one waits)."""

    def __init__(self, spec: ToolSpec):
        self.spec, self.held, self.sent = spec, "", False
        self.mode = "whole" if spec.mode == "required" else "open"   # or "marked": held from a marker on

    def feed(self, text: str) -> str:
        self.held += text
        if self.mode != "open":
            return ""
        head = self.held.lstrip()
        if not head:   # leading blanks wait: the first visible character decides
            return ""
        if not self.sent and head[0] in "{[`":
            self.mode = "whole"
            return ""
        at = min((i for i in (self.held.find(m) for m in call_formats.MARKS) if i >= 0), default=-1)
        if at >= 0:
            out, self.held, self.mode = self.held[:at], self.held[at:], "marked"
        else:
            keep = next((k for k in range(min(len(self.held), LONGEST_MARK - 1), 0, -1)
                         if any(m.startswith(self.held[-k:]) for m in call_formats.MARKS)), 0)
            out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent = self.sent or bool(out)
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[dict], bool]:
        """The text still to send, the calls (no calls: the held text is content) and whether they are
        whole (ToolSpec.calls_or_cut; cut: max_tokens ended the answer)."""
        if self.mode != "open":
            content, calls, whole = self.spec.calls_or_cut(self.held, cut)
            return content or "", calls, whole
        return self.held, [], True


def _compile(make, *args) -> constrained.Grammar:
    try:
        return make(*args)
    except constrained.GrammarError as e:
        raise APIError(400, f"tools: a function's parameters cannot be enforced: {e}", "tools") from None


def schema_problem(schema: dict) -> str | None:
    """Why a schema is not a JSON Schema, by the meta-schema of its $schema (2020-12, OpenAI's, by default), in
    one line; None if it is one. What the answer's grammar can enforce is the grammar's to say, where it runs."""
    from jsonschema import exceptions, validators
    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as e:
        where = ".".join(map(str, e.absolute_path))
        message = " ".join(e.message.split())
        return (f"at {where}: " if where else "") + (message if len(message) <= 200 else message[:197] + "...")
    return None


def call_input(arguments: str) -> dict:
    """A call's arguments as an object (Anthropic's tool_use input): all of them, or of a call max_tokens
    cut short, the top-level members written whole ({} if none)."""
    try:
        value = json.loads(arguments)
        return value if isinstance(value, dict) else {}
    except ValueError:
        pass
    depth, in_string, escaped, cuts = 0, False, False, []
    for i, ch in enumerate(arguments):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 1:
            cuts.append(i)
    for cut in reversed(cuts):
        try:
            value = json.loads(arguments[:cut] + "}")
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _tool_call(name: str, arguments: str) -> dict:
    """An OpenAI tool call; arguments: JSON text (of a call max_tokens cut short, as far as written)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments(call: dict):
    args = (call.get("function") or {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _hf_message(m: dict) -> dict:
    """OpenAI's message -> the shape HF chat templates read (arguments as objects, not JSON text)."""
    if m["role"] == "assistant" and m.get("tool_calls"):
        return dict(m, tool_calls=[{"id": c.get("id"), "type": "function",
                                    "function": {"name": (c.get("function") or {}).get("name"),
                                                 "arguments": _arguments(c)}} for c in m["tool_calls"]])
    return m


def _text_message(m: dict) -> dict:
    """OpenAI's message -> plain text turns, for templates that know nothing of tools."""
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = "\n".join(json.dumps({"name": (c.get("function") or {}).get("name"), "arguments": _arguments(c)},
                                     ensure_ascii=False) for c in m["tool_calls"])
        return {"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()}
    if m["role"] == "tool":
        return {"role": "user", "content": f"Function result (call {m.get('tool_call_id') or '?'}): {m['content']}"}
    return {"role": m["role"], "content": m["content"]}
