"""The HTTP edge: the API key before the body, a body-size limit and read deadline, and uvicorn's connection bounds.

FastAPI reads and parses a body before any dependency runs, so a key checked in a dependency lets a client without
one make the server hold and parse any body (a 39 MB body took the server from 354 to 1,325 MB, and malformed
JSON got 400 rather than 401). `HTTPGuard` is plain ASGI middleware in front of the app: it answers 401 from the
headers, 413 from Content-Length or as soon as the streamed bytes pass the limit, and 408 when a body is not in
within its deadline, and only then hands the app the body it read.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`), header size (`h11_max_incomplete_event_size`)
and concurrency (`limit_concurrency`: 503 past it), but it never times out a connection whose request headers
never complete, counts such connections against nothing, and closes a connection whose client half-closed it
(shutdown(SHUT_WR) after a whole request: legal HTTP, curl and some proxies do it) before answering.
`ConnectionRules` fixes the three on uvicorn's own protocol classes (httptools' C parser when installed, else h11):
a connection whose next request's headers are not in within `header_timeout_s` is closed; past `max_connections`
open connections the one that has waited longest for its headers is closed, so ~1,000 slow clients can never hold
every file descriptor (with a process limit of 1,024 they did, and /health was refused); a half-closed request is
answered, then its connection closed. What no single process can do (rate limits per client, TLS) is a reverse
proxy's job: docs/security.md.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import resource
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ...errors import ConfigError

try:  # uvicorn[standard]'s C parser: what uvicorn itself picks when it is installed
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools missing: h11 serves
    HttpToolsProtocol = None
HTTP_PROTOCOL: type = HttpToolsProtocol or H11Protocol  # the uvicorn protocol ConnectionRules extends

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
OPEN_PATHS = ("/health", "/metrics")  # served without the key (load balancers, Prometheus), as vLLM does
# File descriptors kept free of connections: the process's own (weights, compile cache, JAX's pipes, logs, about 40
# on CPU) and connections accepted only to be turned away; a quarter of the limit when that is more.
FD_HEADROOM = 128
MAX_DEFAULT_CONNECTIONS = 16384  # the default's ceiling, whatever the limit (an unlimited one included)


def default_max_connections(fd_limit: int | None = None) -> int:
    """Connections a server may hold by default: the process's soft file-descriptor limit (RLIMIT_NOFILE, or
    `fd_limit`) less a headroom of max(FD_HEADROOM, a quarter of it), at least 1 and at most
    MAX_DEFAULT_CONNECTIONS. 1,024 (a common `ulimit -n`) gives 768."""
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if fd_limit == resource.RLIM_INFINITY or fd_limit < 0:
        return MAX_DEFAULT_CONNECTIONS
    return max(1, min(fd_limit - max(FD_HEADROOM, fd_limit // 4), MAX_DEFAULT_CONNECTIONS))


@dataclass(frozen=True)
class ServerLimits:
    """Per-request and per-connection bounds of `pocketjax serve` (flags of the same names; docs/security.md).

    max_body_bytes: request body size (413 past it). body_timeout_s: seconds to receive a whole body (408).
    header_timeout_s: seconds for a request's headers once a connection is open or idle (then it is closed).
    keep_alive_s: idle keep-alive seconds. max_connections: open connections (past it the one waiting longest for its
    headers is closed) and uvicorn's limit_concurrency (503 past it); None: `default_max_connections()`, from the
    process's file-descriptor limit. max_header_bytes: the request line and headers.
    max_prompt_chars: a text prompt (or a conversation's text) longer than this is refused before it is tokenized
    or rendered; None: 32 characters per token of the context (no real text averages more per token).
    max_choices: completions one request may ask for (prompts x n).
    """

    max_body_bytes: int = 8 << 20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    keep_alive_s: int = 5
    max_connections: int | None = None
    max_header_bytes: int = 64 << 10
    max_prompt_chars: int | None = None
    max_choices: int = 128

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "keep_alive_s", "max_connections", "max_header_bytes", "max_choices"):
            value = getattr(self, name)
            if name == "max_connections" and value is None:
                continue
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

    def connections(self) -> int:
        """max_connections, or the default derived from the file-descriptor limit now."""
        return self.max_connections if self.max_connections is not None else default_max_connections()

    def uvicorn_options(self, base: type = HTTP_PROTOCOL) -> dict[str, Any]:
        """uvicorn.Config keywords for these limits: `ConnectionRules` on httptools' protocol (h11's without it, or
        `base`); the event loop stays uvicorn's "auto" (uvloop when installed)."""
        connections = self.connections()
        protocol = type("PocketJaxHTTP", (ConnectionRules, base),
                        {"header_timeout_s": float(self.header_timeout_s), "max_connections": connections,
                         "max_header_bytes": self.max_header_bytes})
        # uvicorn counts the connection asking too: limit + 1 lets `max_connections` open ones be served
        return dict(http=protocol, timeout_keep_alive=self.keep_alive_s, limit_concurrency=connections + 1,
                    h11_max_incomplete_event_size=self.max_header_bytes)


TCP_CLOSE = 7  # Linux's tcpi_state of a socket that got a reset (include/net/tcp_states.h)
RESET_POLL_S = 0.1


def tcp_state(sock: Any) -> int | None:
    """The kernel's TCP state of a socket (Linux TCP_INFO's first byte); None where the platform has no TCP_INFO."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return None
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, option, 1)[0]
    except OSError:
        return None


class ConnectionRules:
    """Mixed in before uvicorn's H11Protocol or HttpToolsProtocol (both keep `cycle`, `connections`, `transport`,
    `loop`): a deadline for each request's headers, at most `max_header_bytes` of them (h11 bounds its own;
    httptools does not), at most `max_connections` open connections (the one waiting longest for its headers gives
    way to a new one), and a half-closed client's request still answered."""

    header_timeout_s = 10.0
    max_connections = 512
    max_header_bytes = 64 << 10

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self._serving() or self.transport.is_closing():  # the headers are in (the bytes may be body)
            self._header_bytes = 0
            return
        self._header_bytes += len(data)
        if self._header_bytes > self.max_header_bytes:
            self.send_400_response(f"request headers over the limit of {self.max_header_bytes} bytes")

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._eof = False
        self._arm()
        if len(self.connections) > self.max_connections:
            self._shed()

    def on_response_complete(self) -> None:
        self._arm()  # before the next pipelined request (if any) starts its cycle
        super().on_response_complete()  # type: ignore[misc]
        if self._eof and not self.transport.is_closing():  # the client sends nothing more: the answer was all
            self.transport.close()

    def eof_received(self) -> bool:
        """The client half-closed: keep writing while its complete request is being answered (True keeps the
        transport open), else close as uvicorn does.

        An EOF is also what a client that hung up altogether sends, and its request must then be cancelled (its
        slot freed). Only data tells the two apart: a closed socket answers data with a reset, a half-closed one
        takes it. So before the answer starts, the client gets an interim `102 Processing` (RFC 9110: a client
        parses 1xx responses before the final one), and a reset seen afterwards ends the connection, which
        disconnects the request. A stream that already started probes with its own next chunk."""
        self._eof = True
        keep = self._serving() and not self.cycle.more_body
        if keep and not self.cycle.response_started:
            self.transport.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            self._watch_reset()
        return keep

    def _watch_reset(self) -> None:
        """Poll the socket's TCP state until the answer is complete: a reset (state CLOSE) aborts the transport."""
        if self.transport.is_closing() or not self._serving():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and tcp_state(sock) == TCP_CLOSE:
            self.transport.abort()  # uvicorn's connection_lost: the app's receive() gets http.disconnect
            return
        self.loop.call_later(RESET_POLL_S, self._watch_reset)

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def waiting_since(self) -> float | None:
        """loop time since which this connection has waited for a request's headers; None while serving one."""
        return None if self._serving() else self._armed_at

    def _serving(self) -> bool:
        """A request whose headers are in is being answered (httptools makes a pipelined one's cycle early)."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _shed(self) -> None:
        """Close the connection that has waited longest for its headers (this one if none waits): open connections
        stay within max_connections, and a new client (a /health probe) is served rather than the slowest."""
        waiting = [(since, id(c), c) for c in self.connections if (since := c.waiting_since()) is not None
                   and not c.transport.is_closing()]
        if waiting:
            victim = min(waiting)[2]
            victim.transport.close()
            # counted out now, not when its connection_lost runs: uvicorn's 503 rule counts open connections, and
            # the new client's request may be parsed first
            self.connections.discard(victim)

    def _arm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._armed_at, self._header_bytes = self.loop.time(), 0
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire, self.cycle)

    def _expire(self, armed: Any) -> None:
        # no new request's headers since it was armed (nor one already waiting its turn)
        if self.cycle is armed and not self._serving() and not self.transport.is_closing():
            self.transport.close()


ErrorShape = Callable[[int, dict[str, Any]], dict[str, Any]]


async def _answer(send: Send, status: int, message: str, code: str | None = None,
                  shape: ErrorShape | None = None) -> None:
    error = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    body = json.dumps(error if shape is None else shape(status, error)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


MISSING_KEY = "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)"
KEY_HEADERS = (b"authorization", b"x-api-key")


def repeated(headers: Any, names: tuple[bytes, ...]) -> str | None:
    """The first of `names` (lower-case) that `headers` (ASGI's (name, value) pairs) hold more than once, or None.
    Authorization is a singleton field (RFC 9110): two of them are a malformed request, not two keys to try, and a
    proxy that adds its own must not make the client's count (or the other way round)."""
    seen: set[bytes] = set()
    for name, _ in headers:
        name = name.lower()
        if name in names:
            if name in seen:
                return name.decode()
            seen.add(name)
    return None


def key_given(key: bytes, authorization: bytes, x_api_key: bytes) -> bool:
    """True when a request carries the key as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
    (Anthropic's); both are compared in constant time."""
    bearer = hmac.compare_digest(authorization, b"Bearer " + key)
    return hmac.compare_digest(x_api_key, key) or bearer


class HTTPGuard:
    """ASGI middleware: 401 before any body is read, 413 past `max_body_bytes`, 408 past `body_timeout_s`.

    `error_shapes` maps a path prefix to the function that turns the OpenAI error body into that API's own shape
    (Anthropic's /v1/messages), so a client reads the guard's errors as it reads the route's."""

    def __init__(self, app: Callable, *, api_key: str | None, limits: ServerLimits,
                 open_paths: tuple[str, ...] = OPEN_PATHS, error_shapes: dict[str, ErrorShape] | None = None):
        self.app, self.limits, self.open_paths = app, limits, open_paths
        self.error_shapes = error_shapes or {}
        self.expected = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        path = scope.get("path") or ""
        shape = next((f for prefix, f in self.error_shapes.items() if path.startswith(prefix)), None)

        async def answer(status: int, message: str, code: str | None = None) -> None:
            await _answer(send, status, message, code, shape)

        if self.expected is not None and path not in self.open_paths:
            twice = repeated(scope.get("headers") or (), KEY_HEADERS)
            if twice is not None:
                return await answer(400, f"the {twice} header is given more than once (it holds one key)")
            if not key_given(self.expected, headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")):
                return await answer(401, MISSING_KEY, "invalid_api_key")
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await answer(400, "malformed Content-Length")
            if int(declared) > limit:
                return await answer(413, f"request body of {int(declared)} bytes is over the limit of "
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
                return await answer(408, f"the request body did not arrive within "
                                         f"{self.limits.body_timeout_s:g} s", "request_timeout")
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await answer(413, f"request body is over the limit of {limit} bytes", "body_too_large")
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
