"""The server's edge: what every HTTP request passes on its way to a route and back, as one ASGI middleware.

In order: a request id (the client's x-request-id when it is a short printable one, else a new one; sent
back in x-request-id and written in the log of a failure); the API key; for a request with a body, the size
limit, checked before anything parses the body (Content-Length first, then the bytes as they arrive) and
refused with 413; and the body's text, refused with 400 when a JSON string escapes a lone UTF-16 surrogate
("\\ud800": valid JSON grammar, but no Unicode character, so no tokenizer can read it). Then the app runs;
an exception it lets out becomes a 500 in the API's error shape, logged with the request id, and the
connection stays usable. Every response is counted in /metrics by route and status, these included.

A refused body is still read to its end (up to DRAIN_LIMIT) before the answer goes out: a client that is
still sending when the server closes the connection may never read the answer. (Starlette's own body limit
answers in its own shape and leaves the rest unread, and older Starlette versions have none.)
"""
from __future__ import annotations

import logging
import os
import random
import re
from typing import Callable, Iterable

from starlette.requests import Request

log = logging.getLogger("engc.server")

DRAIN_LIMIT = 64 << 20   # bytes of a refused body read and dropped so its client reads the 413
REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
# the escapes that matter for surrogates, read left to right: an escaped backslash (so the 'u' after it is
# text), a high surrogate with or without the low one that must follow it, or a low surrogate alone
ESCAPES = re.compile(rb"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}(\\u[dD][c-fC-F][0-9a-fA-F]{2})?|\\u[dD][c-fC-F][0-9a-fA-F]{2}")
ANY_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


_ids = random.Random()   # its own generator, seeded from os.urandom: random.seed() elsewhere does not repeat ids
if hasattr(os, "register_at_fork"):   # nor does a forked process repeat its parent's (POSIX)
    os.register_at_fork(after_in_child=_ids.seed)


def uuid4_hex() -> str:
    """uuid.uuid4().hex, the request's and the response's ids, drawn from a seeded generator: os.urandom lets go of
    the GIL for its syscall, and the event loop then waits for the engine thread to hand it back (~0.2 ms a call
    at 256 streams). The ids are random, not secret."""
    n = _ids.getrandbits(128) & ~(0xf000 << 64 | 0xc000 << 48) | (0x4000 << 64 | 0x8000 << 48)   # version 4, RFC 4122
    return f"{n:032x}"


def lone_surrogate(body: bytes) -> bool:
    """Whether a JSON text holds a string with an unpaired surrogate escape (raw UTF-8 cannot hold one:
    a decoder refuses those bytes, and the JSON parser reports that as a decode error)."""
    if not ANY_SURROGATE.search(body):   # the common case, one scan in C
        return False
    return any(m.group(0) != b"\\\\" and m.group(1) is None for m in ESCAPES.finditer(body))


class Edge:
    def __init__(self, app, paths: Callable[[], Iterable[str]], respond: Callable, metrics, api_key: str | None,
                 max_body_bytes: int, authorized: Callable[[Request, str], bool]):
        """paths(): the app's path templates (its OpenAPI document's); respond(request, status, message,
        param=None, code=None): an error in the API's shape."""
        self.app, self.paths, self.respond, self.metrics = app, paths, respond, metrics
        self.api_key, self.max_body_bytes, self.authorized = api_key, max_body_bytes, authorized
        self._templates: list[tuple[re.Pattern, str]] | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        given = request.headers.get("x-request-id", "")
        request_id = given if REQUEST_ID.match(given) else f"req-{uuid4_hex()}"
        scope.setdefault("state", {})["request_id"] = request_id
        status = None

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message, headers=[*message.get("headers", []),
                                                 (b"x-request-id", request_id.encode())])
            await send(message)
        try:
            if self.api_key and scope["path"] != "/health" and not self.authorized(request, self.api_key):
                refusal = (401, "missing or invalid API key")
            else:
                receive, refusal = await self._read_body(scope, receive)
            if refusal is not None:
                await self.respond(request, *refusal)(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        except Exception:  # noqa: BLE001 - any failure of a route is a 500, not a dropped connection
            log.exception("request %s (%s %s) failed", request_id, scope["method"], scope["path"])
            if status is None:
                response = self.respond(request, 500, f"internal server error (request id {request_id})")
                await response(scope, receive, send_counted)
        finally:
            self.metrics.requests.labels(self._route(scope), str(status or 500)).inc()

    async def _read_body(self, scope, receive):
        """(receive, None) with the whole body replayed to the app, or (receive, (status, message)) for a
        body refused by size or text."""
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive, None
        limit = self.max_body_bytes
        too_big = (413, f"the request body is larger than this server's limit of {limit} bytes "
                        "(engc run --max-body-bytes)")
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            # a client that waits for "100 Continue" (curl does, for large bodies) sends nothing more: answer now
            if headers.get(b"expect", b"").lower() != b"100-continue" and int(length) <= DRAIN_LIMIT:
                await _drain(receive, DRAIN_LIMIT)
            return receive, too_big
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":   # the client left: the app sees that too
                return _replay([message], receive), None
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > limit:
                if more:
                    await _drain(receive, DRAIN_LIMIT)
                return receive, too_big
            chunks.append(message.get("body", b""))
        body = b"".join(chunks)
        if lone_surrogate(body):
            return receive, (400, "the request body is not valid Unicode text: a JSON string holds an unpaired "
                                  "surrogate escape (such as \\ud800)")
        return _replay([{"type": "http.request", "body": body, "more_body": False}], receive), None

    def _route(self, scope) -> str:
        """The route's path template, the metrics' label ("other" for a path no route serves): the one the
        app routed to, or for a request refused here, the first template the path fits."""
        route = getattr(scope.get("route"), "path", None)
        if route is not None:
            return route
        if self._templates is None:
            self._templates = [(re.compile("^" + re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(t)) + "$"), t)
                               for t in self.paths()]
        return next((t for pattern, t in self._templates if pattern.match(scope["path"])), "other")


async def _drain(receive, limit: int) -> None:
    """Reads and drops the rest of a request body, up to limit bytes."""
    size = 0
    while size <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _replay(messages: list[dict], receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed
