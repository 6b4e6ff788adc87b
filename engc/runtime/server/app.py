"""The FastAPI app: routes of both APIs over one engine (an EngineFront: async_engine.py, engine_process.py),
error shapes, API key, health, metrics.

Every error a client can cause leaves as a 4xx in the shape of the API it called (OpenAI's
{"error": {...}} or Anthropic's {"type": "error", ...}); anything else is a 500 in the same shape,
and the server keeps serving (edge.py: request ids, the API key, the body limit, the catch-all, the
request counts). Tokenizing and chat templating run in worker threads (ServerState.off_loop), so a huge
prompt does not hold up other requests or /health. openapi.py writes the document of all of it.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engc.errors import UserError
from engc.runtime.async_engine import AsyncEngine, EngineDown, EngineFront, QueueFull
from engc.runtime.engine import EngineConfig
from engc.runtime.engine_spawn import Spawned, load_engine, runs_apart, spawn_engine
from engc.runtime.heap import settle_heap
from engc.runtime.sampling import SamplingParams
from engc.runtime.server.metrics import Metrics

# json.dumps(obj, ensure_ascii=False) with one encoder for the process, not a new one a call: both APIs' streamed
# events are written with it
dumps = json.JSONEncoder(ensure_ascii=False).encode

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class Last(str):
    """An event stream's final event: EventStream writes it with the end of the body, in one write."""


class EventStream(StreamingResponse):
    """A text/event-stream response from an async iterator of str events: the same bytes as StreamingResponse's,
    and the same end when the client goes (the iterator is cancelled where it waits, so its `async with stream`
    aborts the request). It streams in the request's own task beside one watcher task that waits for the
    disconnect, where StreamingResponse (under uvicorn's ASGI spec 2.3) starts an anyio task group of two tasks and
    a cancel scope a response; and a Last event goes out with the end of the body in one write, not two."""

    def __init__(self, events):
        super().__init__(events, media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        ended, gone, failed = False, False, None

        async def watch():
            nonlocal gone, failed
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except Exception as e:  # noqa: BLE001 - the stream ends and the response raises it, as StreamingResponse's
                failed = e
            if not ended:
                gone = True
                task.cancel()
        watcher = asyncio.ensure_future(watch())
        try:
            await self._send_events(send)
        except asyncio.CancelledError:
            if not gone:   # cancelled from outside (the server shutting down): not this response's to swallow
                raise
            if hasattr(task, "uncancel"):   # Python 3.11+: the task is not being cancelled any more
                task.uncancel()
        finally:
            ended = True
            watcher.cancel()
            await self.body_iterator.aclose()   # left at a yield (the client went during a write): its cleanup now
        if failed is not None:
            raise failed

    async def _send_events(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.body_iterator:
            last = event.__class__ is Last
            await send({"type": "http.response.body", "body": event.encode(), "more_body": not last})
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass
class ServerState:
    engine: EngineFront
    model_name: str
    api_key: str | None
    metrics: Metrics
    created: int
    max_body_bytes: int
    workers: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "engc-prompt"))

    async def off_loop(self, fn, *args):
        """fn(*args) in a worker thread (tokenizing, chat templates): the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found")

    def params(self, prompt_len: int, max_tokens: int | None, **kw) -> SamplingParams:
        """SamplingParams for a prompt of prompt_len tokens, refusing what cannot fit the context."""
        room = self.max_context - prompt_len
        if room <= 0:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                                f"{self.max_context} tokens", "messages", "context_length_exceeded")
        if max_tokens is None:
            max_tokens = room
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens > room:
            raise APIError(400, f"max_tokens is {max_tokens}, but the prompt has {prompt_len} tokens and this "
                                f"model's context is {self.max_context}: at most {room} can be generated",
                           "max_tokens", "context_length_exceeded")
        kw = {k: v for k, v in kw.items() if v is not None}
        if kw.get("top_k", 0) < 0:
            kw["top_k"] = 0
        try:
            p = SamplingParams(max_tokens=max_tokens, **kw)
            p.validate()
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        return p

    async def stream(self, prompts, priority: int = 0, session_id: str | None = None):
        try:
            if any(params.grammar is not None for _, params in prompts):
                # a grammar compiles over the vocabulary where the request is checked (the first one also
                # builds llguidance's vocabulary, ~0.3 s; a pathological regex takes longer): in a worker
                # thread, so the loop keeps serving; generate's own check then finds it compiled
                await self.off_loop(lambda: [self.engine.check_request(ids, p) for ids, p in prompts])
            return self.engine.generate(prompts, priority, session_id)
        except ValueError as e:
            raise APIError(400, str(e)) from None


def from_anthropic_client(request: Request) -> bool:
    """Anthropic's routes, or a shared one (/v1/models) asked by an Anthropic client (its SDK always sends
    anthropic-version): answered, errors included, in Anthropic's shapes."""
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


def error_response(request: Request, status: int, message: str, param=None, code=None) -> JSONResponse:
    if from_anthropic_client(request):
        kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)
    kind = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def default_max_body_bytes(max_context: int) -> int:
    """1 MiB plus 64 bytes a context token: a prompt filling the context fits even written as JSON
    escapes (12 bytes for a character outside the BMP), with room for tools and the other fields."""
    return (1 << 20) + 64 * max_context


def create_app(engine: EngineFront, model_name: str, api_key: str | None = None,
               max_body_bytes: int | None = None) -> FastAPI:
    from engc.runtime.server import anthropic, openai
    from engc.runtime.server.edge import Edge
    from engc.runtime.server.openapi import document
    import time

    app = FastAPI(title="engc", description="OpenAI- and Anthropic-compatible LLM server", version="1")
    metrics = engine.metrics or Metrics()
    engine.metrics = metrics
    metrics.bind(lambda: engine.stats)
    metrics.bind_gateway(lambda: engine.stats, model_name, engine.block_size, engine.config.prefix_cache)
    limit = max_body_bytes or default_max_body_bytes(engine.max_context)
    app.state.engc = ServerState(engine, model_name, api_key, metrics, int(time.time()), limit)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(request, e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            message, where = "the request body is not valid JSON", ""
        else:
            msg = err.get("msg", "invalid value").removeprefix("Value error, ")   # pydantic's prefix for our own checks
            message = f"{where}: {msg}" if where else msg
        return error_response(request, 400, message, where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        detail = e.detail if isinstance(e.detail, str) else "bad request"
        if e.status_code == 400 and "parsing the body" in detail:
            detail = "the request body is not valid JSON (or not UTF-8)"
        response = error_response(request, e.status_code, detail)
        response.headers.update(e.headers or {})   # a 405's Allow
        return response

    @app.exception_handler(UserError)
    async def _user(request: Request, e: UserError):
        return error_response(request, 400, str(e))

    @app.exception_handler(QueueFull)
    async def _full(request: Request, e: QueueFull):
        return error_response(request, 429, str(e), None, "queue_full")

    @app.exception_handler(EngineDown)
    async def _down(request: Request, e: EngineDown):
        return error_response(request, 503, str(e))

    app.add_middleware(Edge, paths=lambda: app.openapi()["paths"], respond=error_response, metrics=metrics,
                       api_key=api_key, max_body_bytes=limit, authorized=_authorized)

    @app.get("/health")
    async def health():
        if engine.down is not None:   # the engine's process or a tensor-parallel rank died: the server is leaving
            return JSONResponse({"status": "down", "reason": engine.down}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(anthropic_shape: bool) -> dict:
        s = app.state.engc
        if anthropic_shape:
            created = datetime.fromtimestamp(s.created, timezone.utc).isoformat().replace("+00:00", "Z")
            return {"type": "model", "id": s.model_name, "display_name": s.model_name, "created_at": created}
        return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "engc",
                "max_model_len": s.max_context}

    @app.get("/v1/models")
    async def models(request: Request):
        anthropic_shape = from_anthropic_client(request)
        card = model_card(anthropic_shape)
        if anthropic_shape:
            return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        app.state.engc.check_model(model_id)
        return model_card(from_anthropic_client(request))

    app.include_router(openai.router)
    app.include_router(anthropic.router)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, model_name, engine.vocab_size, api_key,
                                          engine.config.max_waiting is not None)
        return app.openapi_schema
    app.openapi = openapi
    return app


def _authorized(request: Request, key: str) -> bool:
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


def build_server(bundle: str, config: EngineConfig, model_name: str | None = None,
                 api_key: str | None = None, device: str = "cpu",
                 max_body_bytes: int | None = None, tp: int | None = None,
                 child: Spawned | None = None) -> tuple[FastAPI, EngineFront]:
    """The app over an engine in a process of its own (config.engine_process; child: that process as
    engine_spawn.spawn_engine started it, else it is spawned here) or in a thread of this one. tp: the ranks the
    command line asked for (checked against the bundle's; runtime/tp.py). On a rank other than 0 of a
    tensor-parallel launch this serves as a worker and exits."""
    import time
    if runs_apart(config):
        from engc.runtime.engine_process import EngineClient
        engine = EngineClient.start(bundle, config, child or spawn_engine(bundle, config, device, tp), Metrics())
    else:
        started = time.perf_counter()
        engine = AsyncEngine(load_engine(bundle, config, device, tp), Metrics()).start()
        engine.startup.total_s = time.perf_counter() - started
    name = model_name or engine.manifest.get("source", {}).get("name") or "engc"
    return create_app(engine, name, api_key, max_body_bytes), engine


def serve(bundle: str, config: EngineConfig, sock: socket.socket, host: str = "127.0.0.1",
          model_name: str | None = None, api_key: str | None = None, device: str = "auto",
          max_body_bytes: int | None = None, tp: int | None = None, child: Spawned | None = None) -> None:
    """Serves on sock, listen.listening_socket's for host, until interrupted (engc run binds it first, so a port
    in use is one line at once; with port 0 the port it took is said here). child: the engine's process as
    engc run spawned it before importing this module (build_server). If the engine goes down (its process or
    a tensor-parallel rank died), it answers 503 for ENGC_DOWN_DRAIN_S seconds (default 3: a load balancer
    sees /health fail) and exits with one line and status 1."""
    import os
    import signal
    import sys
    import threading
    import uvicorn
    port = sock.getsockname()[1]
    app, engine = build_server(bundle, config, model_name, api_key, device, max_body_bytes, tp, child)
    shown = f"[{host}]" if ":" in host else host
    print(f"engc: {engine.startup.line()}", flush=True)
    print(f"engc: serving {app.state.engc.model_name} on http://{shown}:{port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=5))
    drain = float(os.environ.get("ENGC_DOWN_DRAIN_S", "3"))

    def exit_after_drain(_reason):
        timer = threading.Timer(drain, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()
    engine.on_down.append(exit_after_drain)
    settle_heap()
    # uvicorn raises a SIGTERM it handled again once it has shut down: an exit here, so the finally below stops
    # the engine's process (and the ranks) rather than leaving them to find their pipes closed
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    if engine.down is not None:
        raise UserError(f"the server stopped: {engine.down}")
