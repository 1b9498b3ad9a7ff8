"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the scheduler, chat template and
tool-call grammar that /v1/chat/completions uses, so a Claude-style client or agent framework talks to the same model.

A request is read into the chat endpoint's conversation and tools by `anthropic_requests.py`. The answer's text and
calls become `text` and `tool_use` blocks, in the order the model wrote them, read back by the chat endpoint's
`ToolCallParser`; one `Blocks` builds both the message and the stream events, so a stream accumulates to exactly the
non-streamed message. Every error on these routes answers in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with the status the rest of the server gives the same error (`AnthropicRoute`).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from ...engine.request import Completion
from .anthropic_requests import CountTokensRequest, MessagesRequest, conversation, tools_of
from .context import finish_all, merged
from .openapi import ANSWERED, GENERATION, answers
from .replies import event_stream, retry_after
from .response_models import Message, TokenCount
from .tool_call_parser import Arguments, Event, ToolCall, ToolCallParser
from .tool_calls import ToolRequest

if TYPE_CHECKING:
    from ..handle import RequestHandle
    from .context import ServeContext

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); other 5xx are api_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
               529: "overloaded_error"}


@dataclass
class Blocks:
    """An answer's content blocks as its text arrives, and the stream events that build them: text before the first
    call goes into a text block, each call the parser reads into a tool_use block.

    With tool_choice any / tool (`streamed`), a grammar makes every call's input valid JSON as it is written, so its
    pieces go out as they arrive (input_json_delta). With auto the model is free and may write a call whose input is
    not a JSON object; Anthropic's client parses every input_json_delta as it comes and raises on one that is not
    JSON, so such a call is held until it closes: a JSON object becomes a tool_use block with its input in one delta,
    anything else a text block holding the call as the model wrote it (`ToolCall.written`, markup included), never a
    500 or an error event."""

    parser: ToolCallParser | None  # None: no tools to parse (tool_choice none or no tools)
    streamed: bool = False  # the tools are enforced: a call's input is valid JSON at every piece
    content: list[dict[str, Any]] = field(default_factory=list)
    _open: ToolCall | str | None = None  # the block still receiving: a call, "text", or None
    _held: ToolCall | None = None  # an unenforced call held until its arguments close

    def feed(self, text: str) -> list[dict[str, Any]]:
        pieces = [text] if self.parser is None else self.parser.feed(text)
        return [event for piece in pieces for event in self._add(piece)]

    def finish(self) -> list[dict[str, Any]]:
        pieces = [] if self.parser is None else self.parser.finish()
        return [event for piece in pieces for event in self._add(piece)] + self._settle() + self._close()

    @property
    def calls(self) -> int:
        """How many tool_use blocks the answer holds."""
        return sum(block["type"] == "tool_use" for block in self.content)

    def _add(self, piece: Event) -> list[dict[str, Any]]:
        if isinstance(piece, ToolCall):
            if not self.streamed:
                events, self._held = self._settle(), piece
                return events
            return self._close() + self._start(tool_use(piece), piece)
        if isinstance(piece, Arguments):
            if not self.streamed:
                return []  # the held call grows its own arguments
            return [{"type": "content_block_delta", "index": len(self.content) - 1,
                     "delta": {"type": "input_json_delta", "partial_json": piece.text}}]
        return self._settle() + self._text(piece)

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = [] if self._open == "text" else self._close() + self._start({"type": "text", "text": ""}, "text")
        self.content[-1]["text"] += text
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": {"type": "text_delta", "text": text}}]

    def _settle(self) -> list[dict[str, Any]]:
        """The held call as blocks: a tool_use block with its whole input, the start of one cut short by max_tokens
        (input {}, as a message gives it), or text when its closed arguments are not a JSON object."""
        call, self._held = self._held, None
        if call is None:
            return []
        if call.complete and call_input(call) is None:
            return self._text(call.written)
        events = self._close() + self._start(tool_use(call), call)
        if call.complete:
            events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                           "delta": {"type": "input_json_delta", "partial_json": call.arguments}})
        return events

    def _start(self, block: dict[str, Any], opened: ToolCall | str) -> list[dict[str, Any]]:
        self.content.append(dict(block))
        self._open = opened
        return [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        """End the open block; a call's input is its arguments parsed ({} for a call cut short by max_tokens, whose
        JSON never closed: Anthropic's advice is to retry with a larger max_tokens)."""
        if self._open is None:
            return []
        if isinstance(self._open, ToolCall):
            self.content[-1]["input"] = (call_input(self._open) if self._open.complete else None) or {}
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A call's tool_use block as it starts (its input arrives by input_json_delta)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": {}}


def call_input(call: ToolCall) -> dict[str, Any] | None:
    """A closed call's arguments as its input object; None when the model wrote something else."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def stop_reason(completion: Completion, stop_string: str | None, calls: int) -> str:
    """Anthropic's stop_reason: max_tokens, stop_sequence, tool_use (the answer made calls), else end_turn."""
    if completion.finish_reason == "length":
        return "max_tokens"
    if stop_string is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


def message(message_id: str, model: str, content: list[dict[str, Any]], reason: str | None,
            stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Anthropic's Message object (reason None: the stream's first snapshot)."""
    return {"id": message_id, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage(input_tokens, output_tokens)}


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage, whole in every message_delta too (its counts are cumulative: a client such as
    langchain-anthropic takes input_tokens from the last one). Prefix reuse here is automatic and costs nothing
    extra, so every prompt token counts as input and the prompt-cache counts are 0."""
    return {"input_tokens": input_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
            "output_tokens": output_tokens}


async def stream(request: Request, handle: RequestHandle, blocks: Blocks, message_id: str, model: str,
                 input_tokens: int) -> AsyncIterator[str]:
    """The SSE stream in Anthropic's event types: message_start, ping, the content blocks' start / delta / stop,
    message_delta with the stop reason and usage, message_stop; an error after the headers is one `error` event."""
    yield sse({"type": "message_start", "message": message(message_id, model, [], None, None, input_tokens, 0)})
    yield sse({"type": "ping"})
    try:
        async for _, _, text, done in merged([handle]):
            for event in blocks.feed(text) if text else []:
                yield sse(event)
            if done is not None:
                for event in blocks.finish():
                    yield sse(event)
                stop = handle.stop_string
                yield sse({"type": "message_delta", "delta": {"stop_reason": stop_reason(done, stop, blocks.calls),
                                                              "stop_sequence": stop},
                           "usage": usage(input_tokens, len(done.token_ids))})
        yield sse({"type": "message_stop"})
    except Exception as error:  # noqa: BLE001 - a failure after the headers still ends the stream in Anthropic's shape
        status, body = await app_error(request, error)
        yield sse(anthropic_error(status, body))


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def app_error(request: Request, error: Exception) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI error body the app's own exception handlers give `error` (one mapping of errors to
    statuses for every route); re-raised when no handler takes it."""
    handlers = request.app.exception_handlers
    for kind in type(error).__mro__:
        if kind in handlers:
            response = await handlers[kind](request, error)
            return response.status_code, json.loads(response.body)
    raise error


def anthropic_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error body in Anthropic's shape; the field it names leads the message (Anthropic's has no param)."""
    error = body.get("error") or {}
    text, param = str(error.get("message", "")), error.get("param")
    if param and not text.startswith(param):
        text = f"{param}: {text}"
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": text}}


class AnthropicRoute(APIRoute):
    """A route whose errors, validation failures included, answer in Anthropic's error shape with the
    status the app's handlers give them (and their Retry-After); the 401 / 413 / 408 that `HTTPGuard` answers before
    a route runs take the same shape through its `error_shapes`."""

    def get_route_handler(self):  # noqa: ANN201 - Starlette's handler type
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            request_id = {"request-id": f"req_{uuid.uuid4().hex}"}  # as Anthropic names each answer, errors too
            try:
                response = await handler(request)
            except Exception as error:  # noqa: BLE001 - every error gets an answer in this API's shape
                status, body = await app_error(request, error)
                return Response(json.dumps(anthropic_error(status, body), ensure_ascii=True),
                                status_code=status, media_type="application/json",
                                headers={**(retry_after(status) or {}), **request_id})
            response.headers.update(request_id)
            return response

        return route


def messages_router(ctx: ServeContext) -> APIRouter:
    """POST /messages and /messages/count_tokens (mounted under /v1) over the server's context."""
    router = APIRouter(route_class=AnthropicRoute)
    llm = ctx.llm

    async def prepare(body: CountTokensRequest) -> tuple[list[int], ToolRequest | None]:
        """The prompt ids (rendered off the loop, tools included) and the checked tools of a request."""
        ctx.check_model(body.model)
        body.check_supported()
        ctx.check_size("messages", messages=body.messages, system=body.system, tools=body.tools)
        tools = await ctx.checked_tools(body.tools, tools_of, body)  # compiles each tool's input_schema
        chat = conversation(body.system, body.messages)

        def render() -> list[int]:
            # thinking is off unless asked for (Anthropic's default; this server produces no thinking blocks): Qwen3's
            # templates think unless enable_thinking is false, and their <think> text would land in text blocks
            text = llm.tokenizer.apply_chat_template(chat.messages, tools=tools.tools if tools else None,
                                                     add_generation_prompt=not chat.prefill,
                                                     continue_final_message=chat.prefill, enable_thinking=False)
            return ctx.encode(text, param="messages")

        return await ctx.off_loop(render), tools

    @router.post("/messages", responses=answers(Message, *GENERATION, stream=True, anthropic=True))
    async def create(body: MessagesRequest, request: Request):
        prompt, tools = await prepare(body)
        structured, _ = ctx.answer_constraint(tools, body.constraint(), "output_config")
        enforced = tools is not None and tools.enforced
        sampling = body.sampling(ctx.budget(prompt, body.max_tokens, None), structured, tools)
        constrained_by = "tools" if enforced else "output_config"
        handle = (await ctx.submit([(prompt, sampling)], "messages", constrained_by))[0]
        blocks = Blocks(tools.parser() if tools is not None and tools.parsed else None, streamed=enforced)
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return event_stream(stream(request, handle, blocks, message_id, ctx.name, len(prompt)))
        out = (await finish_all(request, [handle]))[0]
        blocks.feed(out.text)
        blocks.finish()
        stop = handle.stop_string
        return message(message_id, ctx.name, blocks.content, stop_reason(out, stop, blocks.calls), stop,
                       len(prompt), len(out.token_ids))

    @router.post("/messages/count_tokens", responses=answers(TokenCount, *ANSWERED, anthropic=True))
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        prompt, _ = await prepare(body)
        return {"input_tokens": len(prompt)}

    return router
