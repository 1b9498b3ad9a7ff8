"""POST /v1/responses: OpenAI's Responses API, stateless, over the same scheduler as the chat endpoint.

Stateless means what `store: false` means at OpenAI: nothing is kept after the answer, so `previous_response_id`
(a stored conversation) is a 400 and a client sends the whole conversation in `input` each time; `store: true` is
accepted and stores nothing (as vLLM does without a response store). `input` is a string or a list of messages
(EasyInputMessage: role + text or text content parts); `instructions` becomes a system message in front. The
prompt is the chat template's, as /v1/chat/completions builds it. Streaming sends the Responses event types in
OpenAI's order (created, in_progress, output_item.added, content_part.added, output_text.delta..., their done
events, then completed or incomplete). `text.format` json_schema or json_object constrains the output as the chat
endpoint's response_format does. Anything else a request asks for (tools, reasoning, background, include, auto
truncation, images, function-call items) is a 400 that names it.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ..errors import PocketJaxError
from .constraints import TextFormat
from .openai_protocol import APIError, SamplingFields, with_seed

if TYPE_CHECKING:
    from .handle import RequestHandle
    from .llm import LLM

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesRequest(SamplingFields):
    """OpenAI's response-create body (the fields a stateless text server can honour), plus the sampling extras
    both other endpoints take (top_k, min_p, penalties, seed, stop...)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    store: bool | None = None  # accepted; nothing is ever stored
    metadata: dict[str, str] | None = None  # echoed back
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    # the other endpoints' constraint fields: they would change the output, so they are refused here by name
    response_format: Any = None
    structured_outputs: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        unsupported = [("previous_response_id", self.previous_response_id is not None,
                        "needs stored responses; this server is stateless: send the whole conversation in input"),
                       ("conversation", self.conversation is not None, "needs stored conversations"),
                       ("prompt", self.prompt is not None, "stored prompt templates are not supported"),
                       ("tools", bool(self.tools), "tools are not supported yet"),
                       ("tool_choice", self.tool_choice not in (None, "none", "auto"), "tools are not supported yet"),
                       ("reasoning", bool(self.reasoning), "reasoning options are not supported"),
                       ("include", bool(self.include), "include is not supported"),
                       ("truncation", self.truncation not in (None, "disabled"), "only truncation 'disabled'"),
                       ("background", bool(self.background), "background responses need storage"),
                       ("top_logprobs", bool(self.top_logprobs), "logprobs are not supported on /v1/responses; "
                                                                 "use /v1/chat/completions"),
                       ("stream_options", self.stream_options is not None, "stream_options is not supported"),
                       ("response_format", self.response_format is not None,
                        "is spelled text.format on /v1/responses"),
                       ("structured_outputs", self.structured_outputs is not None,
                        "is not supported on /v1/responses: use text.format, or /v1/chat/completions")]
        for param, refused, why in unsupported:
            if refused:
                raise APIError(400, f"{param}: {why}", param=param)

    def chat(self) -> list[dict[str, str]]:
        """The conversation as chat messages: instructions first (a system message), then the input items."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        if not self.input:
            raise APIError(400, "input must not be empty", param="input")
        for i, item in enumerate(self.input):
            kind, role = item.get("type", "message"), item.get("role")
            if kind != "message":
                raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported (only messages)",
                               param="input")
            if role not in ROLES:
                raise APIError(400, f"input[{i}].role must be one of {sorted(ROLES)}, got {role!r}", param="input")
            messages.append({"role": ROLES[role], "content": item_text(item.get("content"), i)})
        return messages


def item_text(content: Any, i: int) -> str:
    """A message's text: a string, or its text parts joined (an image or file part is a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].content must be a string or a list of content parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"input[{i}]: content parts of type {kind!r} are not supported (only text)",
                           param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def responses_router(llm: LLM, model_name: str, check: Callable[[SamplingFields], None],
                     budget: Callable[[list[int], int | None, int | None], int],
                     submit: Callable[[list[tuple[list[int], Any]], str | None, str | None], list[RequestHandle]],
                     finish_all: Callable, merged: Callable) -> APIRouter:
    """POST /responses (mounted under /v1) over `llm`; `check`, `budget`, `submit` (jobs, the field a refusal names,
    the field a constraint came from), `finish_all` and `merged` are the server's own (model name, context budget,
    queueing with its limits and metrics, waiting with disconnect cancellation, streaming deltas), passed in so
    this module needs nothing of server.py's."""
    router = APIRouter()

    @router.post("/responses")
    async def create(body: ResponsesRequest, request: Request):
        check(body)
        structured, text_format = TextFormat.of(body.text)
        prompt = await asyncio.to_thread(  # off the event loop, as the chat endpoint renders
            lambda: llm.encode(llm.tokenizer.apply_chat_template(body.chat(), add_generation_prompt=True)))
        try:
            max_tokens = budget(prompt, body.max_output_tokens, None)
        except APIError as error:  # the budget speaks of the chat endpoints' field
            if error.param == "max_tokens":
                error.param = "max_output_tokens"
            raise
        sampling = body.sampling(max_tokens, structured=structured)
        handle = submit([(prompt, with_seed(sampling, 0))], "input", "text")[0]
        draft = Draft(body, model_name, len(prompt), text_format)
        if body.stream:
            return StreamingResponse(events(draft, handle, merged), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = (await finish_all(request, [handle]))[0]
        return draft.response(out.text, out.finish_reason, len(out.token_ids), handle.cached_prefix_len)

    return router


class Draft:
    """One response's fixed fields (ids, echoed settings) and the Response object at any stage."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int,
                 text_format: dict[str, Any] | None = None):
        self.body, self.model, self.prompt_tokens = body, model, prompt_tokens
        self.text_format = text_format or {"type": "text"}
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [output_text(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def response(self, text: str | None, reason: str | None, tokens: int = 0, cached: int = 0) -> dict[str, Any]:
        """The Response object: in progress (text None), completed, or incomplete (`reason` "length")."""
        body = self.body
        status = "in_progress" if text is None else "incomplete" if reason == "length" else "completed"
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if text is not None else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": [] if text is None else [self.item(text, status)],
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
            "tools": [], "text": {"format": self.text_format}, "truncation": "disabled",
            "metadata": body.metadata or {}, "user": body.user, "usage": None}
        if text is not None:
            out["usage"] = {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                            "output_tokens": tokens, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": self.prompt_tokens + tokens}
        return out


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def events(draft: Draft, handle: RequestHandle, merged: Callable) -> AsyncIterator[str]:
    """The SSE stream: `event: <type>` + `data: <json>` per event, sequence numbers from 0, no [DONE] (OpenAI's
    Responses stream ends with its last event). An error after the headers went out is one `error` event."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    where = {"item_id": draft.item_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=draft.response(None, None))
    yield event("response.in_progress", response=draft.response(None, None))
    yield event("response.output_item.added", output_index=0, item=draft.item(None, "in_progress"))
    yield event("response.content_part.added", part=output_text(""), **where)
    pieces: list[str] = []
    try:
        async for _, _, text, done in merged([handle]):
            if text:
                pieces.append(text)
                yield event("response.output_text.delta", delta=text, logprobs=[], **where)
            if done is not None:
                text, final = "".join(pieces), draft.response("".join(pieces), done.finish_reason,
                                                              len(done.token_ids), handle.cached_prefix_len)
                yield event("response.output_text.done", text=text, logprobs=[], **where)
                yield event("response.content_part.done", part=output_text(text), **where)
                yield event("response.output_item.done", output_index=0, item=final["output"][0])
                yield event(f"response.{final['status']}", response=final)
    except PocketJaxError as error:
        yield event("error", code=None, message=str(error), param=None)
