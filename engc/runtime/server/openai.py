"""OpenAI routes: /v1/chat/completions and /v1/completions, streamed (SSE) and not.

A stream writes each step's delta as one chunk as soon as it arrives; a stream that fell behind the engine
(its deltas already waiting) writes all it has in one write, the chunks unchanged. A chunk of plain text, the
bulk of a stream, is filled into the request's chunk as serialized once (_Output.text_chunk): the same bytes
json.dumps would write, for a fraction of the host time a token.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import replace

from fastapi import APIRouter, Request

from engc.runtime.async_engine import Delta, EngineError
from engc.runtime.server.app import APIError, EventStream, Last, ServerState, dumps
from engc.runtime.server.echo import Echo, read_prompts
from engc.runtime.server.edge import uuid4_hex
from engc.runtime.server.formats import openai_format
from engc.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from engc.runtime.server.tools import CallWatch, ToolSpec

router = APIRouter()
quote = json.encoder.encode_basestring   # a str as its JSON string (ensure_ascii=False): what dumps writes


def json_logprob(lp: float | None) -> float | None:
    """A logprob as JSON can carry it: -inf (a token of probability 0) and NaN (logits a model overflowed)
    have no JSON form and would fail the response, so they go out as -9999.0, OpenAI's "very unlikely".
    None (an echoed prompt's first token, which nothing predicts) stays null."""
    return lp if lp is None or math.isfinite(lp) else -9999.0


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    s: ServerState = request.app.state.engc
    s.check_model(req.model)
    if not req.messages:
        raise APIError(400, "messages must not be empty", "messages")
    tools = ToolSpec(req.tools, req.tool_choice)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": _text(m.content),
                 **({"tool_calls": m.tool_calls} if m.tool_calls else {}),
                 **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in req.messages]
    if req.continue_final_message and messages[-1]["role"] != "assistant":
        raise APIError(400, "continue_final_message needs a final assistant message to continue",
                       "continue_final_message")
    answer = openai_format(req)
    if answer is not None and req.continue_final_message:   # the format would have to start inside the given text
        raise APIError(400, f"an answer format ({answer.kind}) cannot be combined with continue_final_message",
                       "response_format")
    constraint = tools.constraint(s.tokenizer, answer, "response_format",
                                  "continue_final_message" if req.continue_final_message else None)
    messages, tool_list = tools.prompt_messages(messages, s.tokenizer.reads_tools)
    prompt_ids = await s.off_loop(s.tokenizer.encode_chat, messages, req.continue_final_message, tool_list)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prompts = _prompts(s, [prompt_ids], req, max_tokens, logprobs, constraint)
    out = _Output(s, req, f"chatcmpl-{uuid4_hex()}", "chat.completion", [len(prompt_ids)], tools)
    stream = await s.stream(prompts, req.priority, req.session_id)
    if req.stream:
        return EventStream(_events(stream, out))
    return await _collect(stream, out)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    s: ServerState = request.app.state.engc
    s.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported by engc", "suffix")
    id_lists, texts = await s.off_loop(read_prompts, s.tokenizer, req.prompt, req.echo)
    echo = Echo.of(req, id_lists, texts)   # echo and prompt logprobs (echo.py)
    max_tokens = 1 if echo is not None and echo.scoring_only else req.max_tokens
    prompts = _prompts(s, id_lists, req, max_tokens, req.logprobs,
                       {"grammar": openai_format(req), "prompt_logprobs": echo.k if echo else None})
    out = _Output(s, req, f"cmpl-{uuid4_hex()}", "text_completion", [len(x) for x in id_lists], echo=echo)
    stream = await s.stream(prompts, req.priority, req.session_id)
    if req.stream:
        return EventStream(_events(stream, out))
    return await _collect(stream, out)


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def _prompts(s: ServerState, id_lists, req, max_tokens, logprobs, constraint=None):
    if (req.model_extra or {}).get("logit_bias"):   # an OpenAI field that changes the answer: refused, not ignored
        raise APIError(400, "logit_bias is not supported by engc", "logit_bias")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    prompts = []
    for ids in id_lists:
        base = s.params(len(ids), max_tokens, temperature=req.temperature if req.temperature is not None else 1.0,
                        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=stop,
                        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                        repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos, logprobs=logprobs,
                        **(constraint or {}))
        for j in range(req.n):
            prompts.append((ids, base if req.seed is None or j == 0 else replace(base, seed=req.seed + j)))
    return prompts


class _Output:
    """Builds the response objects (whole or chunks) of one chat or text completion."""

    def __init__(self, s: ServerState, req, rid: str, kind: str, prompt_lens: list[int], tools=None,
                 echo: Echo | None = None):
        self.s, self.req, self.id, self.kind, self.echo = s, req, rid, kind, echo
        self.tools = tools if tools is not None and tools.active else None   # choices' texts read for calls
        self.chat = kind == "chat.completion"
        self.prompt_lens = prompt_lens
        self.created = int(time.time())
        self.num_choices = len(prompt_lens) * req.n
        self.completion_tokens = [0] * self.num_choices
        self.cached = 0
        self._text_chunk: tuple[str, str, str] | None = None

    def track(self, d: Delta) -> None:
        self.completion_tokens[d.index] = d.completion_tokens
        if d.index % self.req.n == 0:
            self.cached += d.cached_tokens if d.finished else 0

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt_lens), sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def obj(self, choices: list[dict], chunk: bool, usage=None) -> dict:
        o = {"id": self.id, "object": self.kind + (".chunk" if chunk and self.chat else ""),
             "created": self.created, "model": self.s.model_name, "system_fingerprint": None, "choices": choices}
        if not chunk or self.include_usage:
            o["usage"] = usage
        return o

    def text_chunk(self, index: int, text: str) -> str:
        """The SSE event of a chunk of text without logprobs: sse(obj([choice(index, text, None, None, delta)]))
        from the chunk's JSON split where the index and the text go, made at the first call."""
        if self._text_chunk is None:
            mark_index, mark_text = "\ue000index", "\ue000text"
            choice = self.choice(0, mark_text, None, None, delta=True)
            choice["index"] = mark_index
            whole = "data: " + dumps(self.obj([choice], chunk=True)) + "\n\n"
            head, rest = whole.split(quote(mark_index))
            middle, tail = rest.split(quote(mark_text))
            self._text_chunk = head, middle, tail
        head, middle, tail = self._text_chunk
        return f"{head}{index}{middle}{quote(text)}{tail}"

    @property
    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def logprobs(self, sampled: list, offset: int = 0):
        if not sampled:
            return None
        tok = self.s.tokenizer
        text = [tok.decode([x.token], skip_special_tokens=False) for x in sampled]
        if self.chat:
            def entry(t, lp):
                return {"token": t, "logprob": json_logprob(lp), "bytes": list(t.encode("utf-8", "replace"))}
            return {"content": [dict(entry(t, x.logprob), top_logprobs=[
                entry(tok.decode([i], skip_special_tokens=False), lp) for i, lp in x.top or []])
                for t, x in zip(text, sampled)]}
        offsets = [offset + sum(len(t) for t in text[:k]) for k in range(len(text))]
        return {"tokens": text, "token_logprobs": [json_logprob(x.logprob) for x in sampled],
                "top_logprobs": [None if x.top is None and x.logprob is None else
                                 {tok.decode([i], skip_special_tokens=False): json_logprob(lp) for i, lp in x.top or []}
                                 for x in sampled], "text_offset": offsets}

    def choice(self, index: int, text: str | None, finish_reason, logprobs, delta: bool, role: bool = False,
               calls: list | None = None):
        c = {"index": index}
        if self.chat and delta:
            c["delta"] = ({"role": "assistant", "content": ""} if role else
                          {"tool_calls": [dict(call, index=k) for k, call in enumerate(calls)]} if calls else
                          {"content": text} if text is not None else {})
        elif self.chat:
            c["message"] = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        else:
            c["text"] = text or ""
        c["logprobs"] = logprobs
        c["finish_reason"] = finish_reason
        return c


async def _collect(stream, out: _Output) -> dict:
    texts = [""] * out.num_choices
    sampled: list[list] = [[] for _ in range(out.num_choices)]
    reasons = [None] * out.num_choices
    async with stream:
        try:
            async for d in stream:
                if out.echo is not None:
                    d, _ = out.echo.track(d)
                texts[d.index] += d.text
                sampled[d.index] += d.logprobs
                out.track(d)
                if d.finished:
                    reasons[d.index] = _reason(d)
        except EngineError as e:
            raise APIError(e.status, str(e)) from None
    want_logprobs = bool(out.req.logprobs) if out.chat else out.req.logprobs is not None
    choices = []
    for i in range(out.num_choices):
        text, calls, whole = out.tools.calls_or_cut(texts[i], reasons[i] == "length") if out.tools \
            else (texts[i], [], True)
        choices.append(out.choice(i, text, "tool_calls" if calls and whole else reasons[i],
                                  out.logprobs(sampled[i]) if want_logprobs else None, delta=False, calls=calls))
        if out.echo is not None:   # the prompt before the answer, and vLLM's prompt_logprobs
            if out.echo.echo:
                head, entries = out.echo.head(i)
                choices[i]["text"] = head + choices[i]["text"]
                choices[i]["logprobs"] = out.logprobs(entries + sampled[i]) if want_logprobs else None
            if out.echo.vllm is not None:
                choices[i]["prompt_logprobs"] = out.echo.vllm_list(
                    i, lambda t: out.s.tokenizer.decode([t], skip_special_tokens=False), json_logprob)
    return out.obj(choices, chunk=False, usage=out.usage())


def sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


async def _events(stream, out: _Output):
    offsets = [0] * out.num_choices
    watches = [CallWatch(out.tools) for _ in range(out.num_choices)] if out.tools else None
    parts: list[str] = []   # events not written yet: written when the stream has no delta waiting
    async with stream:
        try:
            if out.chat:
                yield "".join(sse(out.obj([out.choice(i, None, None, None, delta=True, role=True)], chunk=True))
                              for i in range(out.num_choices))
            async for d in stream:
                if out.echo is not None:   # an echo's prompt goes first
                    d, head = out.echo.track(d)
                    if head is not None:
                        text, entries = head
                        lp = out.logprobs(entries) if out.req.logprobs is not None else None
                        offsets[d.index] += len(text)
                        parts.append(sse(out.obj([out.choice(d.index, text, None, lp, delta=True)], chunk=True)))
                out.track(d)
                if watches:   # with tools: text that could be a call waits for the choice's end
                    text = watches[d.index].feed(d.text)
                    if text or d.logprobs:
                        lp = out.logprobs(d.logprobs) if out.req.logprobs else None
                        parts.append(sse(out.obj([out.choice(d.index, text, None, lp, delta=True)], chunk=True)))
                    if d.finished:
                        parts += map(sse, _tool_chunks(out, d, watches[d.index]))
                elif d.logprobs:
                    lp = out.logprobs(d.logprobs, offsets[d.index])
                    offsets[d.index] += len(d.text)
                    parts.append(sse(out.obj([out.choice(d.index, d.text, None, lp, delta=True)], chunk=True)))
                elif d.text:
                    offsets[d.index] += len(d.text)
                    parts.append(out.text_chunk(d.index, d.text))
                if d.finished and not watches:
                    parts.append(sse(out.obj([out.choice(d.index, None, _reason(d), None, delta=True)], chunk=True)))
                if parts and stream.remaining and not stream.pending():   # the last ones go with [DONE]
                    yield "".join(parts)
                    parts.clear()
            if out.include_usage:
                parts.append(sse(out.obj([], chunk=True, usage=out.usage())))
        except EngineError as e:
            parts.append(sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}))
    parts.append("data: [DONE]\n\n")
    yield Last("".join(parts))


def _tool_chunks(out: _Output, d: Delta, watch: CallWatch):
    """The end of a streamed choice of a request with tools: the text it held, its calls, its finish."""
    content, calls, whole = watch.finish(_reason(d) == "length")
    if content:
        yield out.obj([out.choice(d.index, content, None, None, delta=True)], chunk=True)
    if calls:
        yield out.obj([out.choice(d.index, None, None, None, delta=True, calls=calls)], chunk=True)
    yield out.obj([out.choice(d.index, None, "tool_calls" if calls and whole else _reason(d), None, delta=True)],
                  chunk=True)


def _reason(d: Delta) -> str:
    return "length" if d.finish_reason == "length" else "stop"
