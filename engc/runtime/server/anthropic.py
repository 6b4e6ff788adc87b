"""Anthropic routes: /v1/messages (streamed in Anthropic's event order, or whole) and count_tokens.

Usage follows Anthropic's convention: input_tokens are the prompt tokens that were *not* read from
the prefix cache, cache_read_input_tokens the ones that were; their sum is the prompt length.
"""
from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engc.runtime.async_engine import Delta, EngineError
from engc.runtime.server.app import APIError, ServerState
from engc.runtime.server.protocol import CountTokensRequest, MessagesRequest

router = APIRouter()


@router.post("/v1/messages")
async def messages(req: MessagesRequest, request: Request):
    s: ServerState = request.app.state.engc
    s.check_model(req.model)
    if req.tools:
        raise APIError(400, "tools are not supported by engc")
    prompt_ids = _encode(s, req)
    params = s.params(len(prompt_ids), req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stop=tuple(req.stop_sequences or ()))
    stream = s.stream([(prompt_ids, params)], 0, req.session_id)
    msg_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return StreamingResponse(_events(stream, msg_id, s.model_name, len(prompt_ids)),
                                 media_type="text/event-stream")
    text, last = "", None
    async with stream:
        try:
            async for d in stream:
                text += d.text
                last = d
        except EngineError as e:
            raise APIError(500, str(e)) from None
    stop_reason, stop_sequence = _stop(last)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": s.model_name,
            "content": [{"type": "text", "text": text}], "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(len(prompt_ids), last.cached_tokens, last.completion_tokens)}


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request):
    s: ServerState = request.app.state.engc
    s.check_model(req.model)
    return {"input_tokens": len(_encode(s, req))}


def _encode(s: ServerState, req) -> list[int]:
    """The prompt as Anthropic's API reads a conversation: it starts with a user turn; consecutive messages
    of one role are one turn; a final assistant message is the start of the reply, which the model continues
    (the response holds only the new text)."""
    if not req.messages:
        raise APIError(400, "messages: at least one message is required")
    if req.messages[0].role != "user":
        raise APIError(400, "messages.0.role: the first message must use the user role")
    turns: list[dict] = []
    for i, m in enumerate(req.messages):
        content = m.content if isinstance(m.content, str) else "".join(b.text for b in m.content)
        final_reply = i == len(req.messages) - 1 and m.role == "assistant"
        if not content and not final_reply:
            raise APIError(400, f"messages.{i}.content: must not be empty (only a final assistant message may be)")
        if final_reply and content != content.rstrip():
            raise APIError(400, f"messages.{i}.content: a final assistant message cannot end with whitespace")
        if turns and turns[-1]["role"] == m.role:
            if content:
                turns[-1]["content"] += "\n\n" + content
        elif content:
            turns.append({"role": m.role, "content": content})
    system = req.system if isinstance(req.system, str) or req.system is None else \
        "".join(b.text for b in req.system)
    messages = ([{"role": "system", "content": system}] if system else []) + turns
    return s.tokenizer.encode_chat(messages, continue_final=turns[-1]["role"] == "assistant")


def _usage(prompt: int, cached: int, output: int) -> dict:
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(d: Delta | None) -> tuple[str, str | None]:
    if d is None or d.finish_reason == "length":
        return "max_tokens", None
    if d.stop_string is not None:
        return "stop_sequence", d.stop_string
    return "end_turn", None


async def _events(stream, msg_id: str, model: str, prompt_len: int):
    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **data), ensure_ascii=False)}\n\n"
    async with stream:
        try:
            first = await stream.__anext__()
            yield event("message_start", {"message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_len, first.cached_tokens, 1)}})
            yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            yield event("ping", {})
            last = first
            while True:
                if last.text:
                    yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                              "text": last.text}})
                if last.finished:
                    break
                last = await stream.__anext__()
            yield event("content_block_stop", {"index": 0})
            stop_reason, stop_sequence = _stop(last)
            yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                          "usage": {"output_tokens": last.completion_tokens}})
            yield event("message_stop", {})
        except EngineError as e:
            yield event("error", {"error": {"type": "api_error", "message": str(e)}})

