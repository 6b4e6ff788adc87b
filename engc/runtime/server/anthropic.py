"""Anthropic routes: /v1/messages (streamed in Anthropic's event order, or whole) and count_tokens.

Usage follows Anthropic's convention: input_tokens are the prompt tokens that were *not* read from
the prefix cache, cache_read_input_tokens the ones that were; their sum is the prompt length.
"""
from __future__ import annotations

import json

from fastapi import APIRouter, Request

from engc.runtime.async_engine import Delta, EngineError
from engc.runtime.server.app import APIError, EventStream, Last, ServerState, dumps
from engc.runtime.server.edge import uuid4_hex
from engc.runtime.server.formats import anthropic_format
from engc.runtime.server.protocol import CountTokensRequest, MessagesRequest
from engc.runtime.server.tools import CallWatch, ToolSpec, call_input

router = APIRouter()
# a text delta's event (event("content_block_delta", ...)) around the text's JSON string
TEXT_DELTA = ('event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
              '"delta": {"type": "text_delta", "text": ', '}}\n\n')


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request):
    s: ServerState = request.app.state.engc
    s.check_model(req.model)
    prompt_ids, tools, continued = await s.off_loop(_encode, s, req)
    answer = _output_format(req)
    constraint = tools.constraint(s.tokenizer, answer, "output_config.format",
                                  "a final assistant message (prefill)" if continued else None)
    params = s.params(len(prompt_ids), req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stop=tuple(req.stop_sequences or ()), **constraint)
    stream = await s.stream([(prompt_ids, params)], 0, req.session_id)
    msg_id = f"msg_{uuid4_hex()}"
    if req.stream:
        events = _tool_events if tools.active else _events
        return EventStream(events(stream, msg_id, s.model_name, len(prompt_ids), tools))
    text, last = await _whole(stream)
    content, stop_reason, stop_sequence = _answer(text, last, tools)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": s.model_name,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(len(prompt_ids), last.cached_tokens, last.completion_tokens)}


def _output_format(req):
    """output_config.format (Anthropic's structured outputs) as a grammar, or None."""
    answer = anthropic_format(req)
    if answer is not None and req.messages and req.messages[-1].role == "assistant":
        raise APIError(400, "output_config.format cannot be combined with a final assistant message (prefill)")
    return answer


async def _whole(stream) -> tuple[str, Delta]:
    text, last = "", None
    async with stream:
        try:
            async for d in stream:
                text += d.text
                last = d
        except EngineError as e:
            raise APIError(e.status, str(e)) from None
    return text, last


def _answer(text: str, last: Delta, tools: ToolSpec) -> tuple[list[dict], str, str | None]:
    """The reply's content blocks and stop reason: with tools, its calls as tool_use blocks."""
    stop = _stop(last)
    content, calls, whole = tools.calls_or_cut(text, stop[0] == "max_tokens")
    blocks = [{"type": "text", "text": content or ""}] if content or not calls else []
    blocks += _tool_use_blocks(calls)
    return (blocks, "tool_use", None) if calls and whole else (blocks, *stop)


def _tool_use_blocks(calls: list[dict]) -> list[dict]:
    return [{"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"), "name": c["function"]["name"],
             "input": call_input(c["function"]["arguments"])} for c in calls]


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request):
    s: ServerState = request.app.state.engc
    s.check_model(req.model)
    return {"input_tokens": len((await s.off_loop(_encode, s, req))[0])}


def _encode(s: ServerState, req) -> tuple[list[int], ToolSpec, bool]:
    """The prompt as Anthropic's API reads a conversation: it starts with a user turn; consecutive messages
    of one role are one turn; a final assistant message is the start of the reply, which the model continues
    (the response holds only the new text). tool_use blocks are the assistant turn's calls, tool_result
    blocks tool messages before the user's text."""
    if not req.messages:
        raise APIError(400, "messages: at least one message is required")
    if req.messages[0].role != "user":
        raise APIError(400, "messages.0.role: the first message must use the user role")
    tools = ToolSpec(*_openai_tools(req.tools, req.tool_choice))
    turns: list[dict] = []
    for i, m in enumerate(req.messages):
        blocks = [] if isinstance(m.content, str) else m.content
        content = m.content if isinstance(m.content, str) else "".join(b.text for b in blocks if b.type == "text")
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if b.type == "tool_use"]
        results = [b for b in blocks if b.type == "tool_result"]
        if (calls and m.role != "assistant") or (results and m.role != "user"):
            raise APIError(400, f"messages.{i}.content: tool_use blocks belong to assistant messages, "
                                "tool_result blocks to user messages")
        final_reply = i == len(req.messages) - 1 and m.role == "assistant"
        if not content and not final_reply and not calls and not results:
            raise APIError(400, f"messages.{i}.content: must not be empty (only a final assistant message may be)")
        if final_reply and (content != content.rstrip() or calls):
            raise APIError(400, f"messages.{i}.content: a final assistant message cannot end with whitespace "
                                "or a tool_use (send its tool_result)")
        turns += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": _result_text(r)} for r in results]
        if turns and turns[-1]["role"] == m.role:
            if content:
                turns[-1]["content"] += ("\n\n" if turns[-1]["content"] else "") + content
            if calls:
                turns[-1].setdefault("tool_calls", []).extend(calls)
        elif content or calls:
            turns.append({"role": m.role, "content": content, **({"tool_calls": calls} if calls else {})})
    system = req.system if isinstance(req.system, str) or req.system is None else \
        "".join(b.text for b in req.system)
    messages = ([{"role": "system", "content": system}] if system else []) + turns
    messages, tool_list = tools.prompt_messages(messages, s.tokenizer.reads_tools)
    continued = turns[-1]["role"] == "assistant"
    return s.tokenizer.encode_chat(messages, continue_final=continued, tools=tool_list), tools, continued


def _openai_tools(tools, choice) -> tuple[list | None, object]:
    """Anthropic's tools and tool_choice in OpenAI's form (ToolSpec's)."""
    converted = None
    if tools is not None:
        converted = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("input_schema"), dict):
                raise APIError(400, f"tools.{i}: a tool needs a name and an input_schema object")
            converted.append({"type": "function", "function": {
                "name": t.get("name"), "parameters": t["input_schema"],
                **({"description": t["description"]} if t.get("description") else {}),
                **({"strict": t["strict"]} if "strict" in t else {})}})
    if choice is None:
        return converted, None
    kind = choice.get("type")
    if kind == "tool":
        return converted, {"type": "function", "function": {"name": choice.get("name")}}
    if kind not in ("auto", "any", "none"):
        raise APIError(400, "tool_choice.type must be 'auto', 'any', 'tool' or 'none'")
    return converted, {"any": "required"}.get(kind, kind)


def _result_text(r) -> str:
    text = r.content if isinstance(r.content, str) or r.content is None else "".join(b.text for b in r.content)
    return ("(error) " if r.is_error else "") + (text or "")


def _usage(prompt: int, cached: int, output: int) -> dict:
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(d: Delta | None) -> tuple[str, str | None]:
    if d is None or d.finish_reason == "length":
        return "max_tokens", None
    if d.stop_string is not None:
        return "stop_sequence", d.stop_string
    return "end_turn", None


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {dumps(dict(type=kind, **data))}\n\n"


def text_event(text: str) -> str:
    """event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}), filled in."""
    return f"{TEXT_DELTA[0]}{json.encoder.encode_basestring(text)}{TEXT_DELTA[1]}"


def _start(msg_id: str, model: str, prompt_len: int, cached: int) -> str:
    return event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_len, cached, 1)}})


async def _tool_events(stream, msg_id: str, model: str, prompt_len: int, tools: ToolSpec):
    """A reply with tools, streamed: its text as it comes, except what could be a call (CallWatch), which
    is read at the end and sent as tool_use blocks (their input in one input_json_delta)."""
    watch, last, text_open = CallWatch(tools), None, False

    def text_delta(text: str):
        if not text_open:
            yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield text_event(text)
    async with stream:
        try:
            async for d in stream:
                if last is None:
                    yield _start(msg_id, model, prompt_len, d.cached_tokens)
                last, text = d, watch.feed(d.text)
                if text:
                    for e in text_delta(text):
                        yield e
                    text_open = True
        except EngineError as e:
            yield Last(event("error", {"error": {"type": "api_error", "message": str(e)}}))
            return
    content, calls, whole = watch.finish(_stop(last)[0] == "max_tokens")
    if content or not (calls or text_open):
        for e in text_delta(content):
            yield e
        text_open = True
    if text_open:
        yield event("content_block_stop", {"index": 0})
    for i, b in enumerate(_tool_use_blocks(calls), start=int(text_open)):
        yield event("content_block_start", {"index": i, "content_block": dict(b, input={})})
        yield event("content_block_delta", {"index": i, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}})
        yield event("content_block_stop", {"index": i})
    stop_reason, stop_sequence = ("tool_use", None) if calls and whole else _stop(last)
    yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                  "usage": {"output_tokens": last.completion_tokens}})
    yield Last(event("message_stop", {}))


async def _events(stream, msg_id: str, model: str, prompt_len: int, tools=None):
    """A reply without tools, streamed; a stream that fell behind the engine writes the deltas waiting in one
    write (the events unchanged)."""
    parts: list[str] = []
    async with stream:
        try:
            first = await stream.__anext__()
            parts += [_start(msg_id, model, prompt_len, first.cached_tokens),
                     event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                     event("ping", {})]
            last = first
            while True:
                if last.text:
                    parts.append(text_event(last.text))
                if last.finished:
                    break
                if not stream.pending():
                    yield "".join(parts)
                    parts.clear()
                last = await stream.__anext__()
            stop_reason, stop_sequence = _stop(last)
            parts += [event("content_block_stop", {"index": 0}),
                      event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                              "usage": {"output_tokens": last.completion_tokens}}),
                      event("message_stop", {})]
            yield Last("".join(parts))
        except EngineError as e:
            yield Last("".join(parts) + event("error", {"error": {"type": "api_error", "message": str(e)}}))
