"""What the OpenAI routes answer with: one request's reply (`Reply`: its id, choices and usage), server-sent events,
and the one mapping of errors to HTTP statuses and OpenAI's error object.

Errors map in one place (`install_error_handlers`, `error_response`): validation failures and malformed JSON are a
400 naming the field (FastAPI would say 422), typed pocketjax errors answer by kind (a full queue is a 429 with
Retry-After), unknown routes a 404, anything else a 500. A stream whose headers already went out ends with one
error event instead (`sse_response`, as vLLM's does); the Anthropic routes reshape these same answers.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import CapacityError, PocketJaxError, RequestError, StoppedError
from ..handle import RequestHandle
from .api_error import APIError, error_body
from .metrics import prompt_groups
from .openai_protocol import StreamOptions

log = logging.getLogger("pocketjax.server")
# A 429 (queue full) says when to retry: the queue drains as requests finish, seconds at most for a typical load;
# the openai client waits Retry-After (when <= 60 s) instead of its own 0.5-8 s backoff.
RETRY_AFTER_S = 1
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # nothing between may cache or buffer a stream


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the prefix cache already held (not prefilled again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Reply:
    """One response being built: its id, object type, model name, the handles of its choices (in order) and the
    counts its usage reports."""

    id: str
    object: str
    model: str
    handles: list[RequestHandle]
    prompt_tokens: int
    stream_options: StreamOptions | None = None

    def completion_tokens(self) -> int:
        return sum(h.num_delivered for h in self.handles)

    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, each prompt counted once (as `prompt_tokens` counts it): what its
        first choice reused."""
        return sum(group[0].cached_prefix_len for group in prompt_groups(self.handles))

    def body(self, choices: list[dict], completion_tokens: int | None = None, chunk: bool = False) -> dict[str, Any]:
        """The response (or, with `chunk`, one stream chunk); with `completion_tokens` it carries usage."""
        out = {"id": self.id, "object": self.object + (".chunk" if chunk and self.object != "text_completion" else ""),
               "created": int(time.time()), "model": self.model, "choices": choices}
        if completion_tokens is not None:
            out["usage"] = usage(self.prompt_tokens, completion_tokens, self.cached_tokens())
        return out

    def chunk(self, choices: list[dict], completion_tokens: int) -> dict[str, Any]:
        """A stream chunk; usage so far only with stream_options.continuous_usage_stats (vLLM's extension)."""
        continuous = self.stream_options is not None and self.stream_options.continuous_usage_stats
        return self.body(choices, completion_tokens if continuous else None, chunk=True)

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any] | None:
        """The last chunk, choices empty, with the usage: only with stream_options.include_usage."""
        if self.stream_options is None or not self.stream_options.include_usage:
            return None
        return self.body([], completion_tokens, chunk=True)


def event_stream(body: AsyncIterator[str]) -> StreamingResponse:
    """A text/event-stream response of `body`'s already formatted events (every API's streams go out so)."""
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


def sse_response(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events in OpenAI's format, ending with `data: [DONE]`; an error after the headers went out is
    one `data: {"error": ...}` event (as vLLM sends). Starlette cancels the stream when the client disconnects,
    and `merged` then cancels the handles."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        except PocketJaxError as error:
            _, payload = error_response(error)
            yield f"data: {json.dumps(payload)}\n\n"
        except Exception as error:  # noqa: BLE001 - a failure after the headers still ends the stream properly
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(f'internal error: {type(error).__name__}', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return event_stream(body())


def error_response(error: PocketJaxError) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error body of a typed pocketjax error."""
    if isinstance(error, RequestError):  # SamplingError included
        return 400, error_body(str(error))
    if isinstance(error, CapacityError):  # a full queue: clients back off and retry (openai's client does)
        return 429, error_body(str(error), "rate_limit_error", code="queue_full")
    if isinstance(error, StoppedError):
        return 503, error_body(str(error), "server_error", code="stopped")
    return 500, error_body(str(error), "server_error")


def retry_after(status: int) -> dict[str, str] | None:
    """The headers of an error answer: when to retry a 429 (queue full), nothing for the others."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message that quotes the request (a lone surrogate in `model`) always encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def field_path(body: Any, problem: dict[str, Any]) -> str:
    """Where in the body a validation problem is, as the API spells it (`messages[0].content[1].text`): pydantic's
    location walked through the body itself, so the names of union members and tags it adds are left out."""
    path, value = "", body
    parts = [part for part in problem.get("loc", ()) if part != "body"]
    for i, part in enumerate(parts):
        if isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value):
            path, value = f"{path}[{part}]", value[part]
        elif isinstance(value, dict) and part in value:
            path, value = f"{path}.{part}" if path else str(part), value[part]
        elif i == len(parts) - 1 and problem.get("type") in ("missing", "extra_forbidden"):
            path += f".{part}" if path else str(part)
    return path or "body"


def install_error_handlers(app: FastAPI) -> None:
    """Every error answers with OpenAI's error object: validation failures and malformed JSON as 400 (FastAPI
    would say 422), typed pocketjax errors by kind, unknown routes as 404, anything else as 500."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return ErrorResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
        else:
            said = dict.fromkeys(f"{field_path(error.body, e)}: {e['msg']}" for e in problems)
            message = "; ".join(list(said)[:3])
            param = loc[0] if loc else None
        return ErrorResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(PocketJaxError)
    async def pocketjax_error(request: Request, error: PocketJaxError) -> JSONResponse:
        status, body = error_response(error)
        return ErrorResponse(body, status_code=status, headers=retry_after(status))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        # its headers too: a 405 says which methods the route allows (Allow, RFC 9110)
        return ErrorResponse(error_body(str(error.detail), kind), status_code=error.status_code,
                             headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return ErrorResponse(error_body(f"internal error: {type(error).__name__}", "server_error"), status_code=500)
