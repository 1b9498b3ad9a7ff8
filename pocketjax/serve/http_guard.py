"""The HTTP edge: the API key before the body, a body-size limit and read deadline, and uvicorn's connection bounds.

FastAPI reads and parses a body before any dependency runs, so a key checked in a dependency lets a client without
one make the server hold and parse any body (a 39 MB body took the server from 354 to 1,325 MB, and malformed
JSON got 400 rather than 401). `HTTPGuard` is plain ASGI middleware in front of the app: it answers 401 from the
headers, 413 from Content-Length or as soon as the streamed bytes pass the limit, and 408 when a body is not in
within its deadline, and only then hands the app the body it read.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`), header size (`h11_max_incomplete_event_size`)
and concurrency (`limit_concurrency`: 503 past it), but it never times out a connection whose request headers
never complete: ~1,000 such clients held every file descriptor. `HeaderTimeoutH11` closes a connection whose next
request's headers are not in within `header_timeout_s`. What no single process can do (rate limits per client,
TLS) is a reverse proxy's job: docs/security.md.
"""
from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import ConfigError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
OPEN_PATHS = ("/health", "/metrics")  # served without the key (load balancers, Prometheus), as vLLM does


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-connection bounds of `pocketjax serve` (flags of the same names; docs/security.md).

    max_body_bytes: request body size (413 past it). body_timeout_s: seconds to receive a whole body (408).
    header_timeout_s: seconds for a request's headers once a connection is open or idle (then it is closed).
    keep_alive_s: idle keep-alive seconds. max_connections: uvicorn's limit_concurrency (503 past it; keep it under
    the process's file-descriptor limit). max_header_bytes: the request line and headers.
    max_prompt_chars: a text prompt (or a conversation's text) longer than this is refused before it is tokenized
    or rendered; None: 32 characters per token of the context (no real text averages more per token).
    max_choices: completions one request may ask for (prompts x n).
    """

    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    keep_alive_s: int = 5
    max_connections: int = 512
    max_header_bytes: int = 64 << 10
    max_prompt_chars: int | None = None
    max_choices: int = 128

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "keep_alive_s", "max_connections", "max_header_bytes", "max_choices"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("body_timeout_s", "header_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        chars = self.max_prompt_chars
        if chars is not None and (not isinstance(chars, int) or isinstance(chars, bool) or chars < 1):
            raise ConfigError(f"max_prompt_chars must be None or a positive integer, got {chars!r}")

    def prompt_chars(self, max_seq_len: int) -> int:
        return self.max_prompt_chars if self.max_prompt_chars is not None else 32 * max_seq_len

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config keywords for these limits (with `HeaderTimeoutH11` as the HTTP protocol)."""
        protocol = type("PocketJaxH11", (HeaderTimeoutH11,), {"header_timeout_s": float(self.header_timeout_s)})
        return dict(http=protocol, timeout_keep_alive=self.keep_alive_s, limit_concurrency=self.max_connections,
                    h11_max_incomplete_event_size=self.max_header_bytes)


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request headers are not complete in time."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # before the next pipelined request (if any) starts its cycle
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire, self.cycle)

    def _expire(self, armed: Any) -> None:
        if self.cycle is armed and not self.transport.is_closing():  # no new request's headers since it was armed
            self.transport.close()


async def _answer(send: Send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class HTTPGuard:
    """ASGI middleware: 401 before any body is read, 413 past `max_body_bytes`, 408 past `body_timeout_s`."""

    def __init__(self, app: Callable, *, api_key: str | None, limits: ServerLimits,
                 open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app, self.limits, self.open_paths = app, limits, open_paths
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.expected is not None and scope.get("path") not in self.open_paths:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _answer(send, 401, "invalid or missing API key (Authorization: Bearer KEY)",
                                     "invalid_api_key")
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _answer(send, 400, "malformed Content-Length")
            if int(declared) > limit:
                return await _answer(send, 413, f"request body of {int(declared)} bytes is over the limit of "
                                                f"{limit} bytes", "body_too_large")
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE") and declared is None:
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                return await _answer(send, 408, f"the request body did not arrive within "
                                                f"{self.limits.body_timeout_s:g} s", "request_timeout")
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _answer(send, 413, f"request body is over the limit of {limit} bytes", "body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect the handlers watch for

        return await self.app(scope, replay, send)
