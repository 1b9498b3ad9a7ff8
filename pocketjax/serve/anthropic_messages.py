"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the scheduler, chat template and
tool-call grammar that /v1/chat/completions uses, so a Claude-style client or agent framework talks to the same model.

A request becomes the chat endpoint's conversation: `system` a system message in front, each turn's text blocks its
content, an assistant turn's `tool_use` blocks its tool calls, a user turn's `tool_result` blocks tool messages (the
chat template renders them as it renders OpenAI's), and a last assistant turn a prefill the answer continues
(`continue_final_message`). `tools` become OpenAI function tools and `tool_choice` auto / any / tool / none the chat
endpoint's auto / required / named / none (`disable_parallel_tool_use`: one call at most), enforced by the same
grammar and read back by the same `ToolCallParser`. The answer's text and calls become `text` and `tool_use` blocks,
in the order the model wrote them; one `Blocks` builds both the message and the stream events, so a stream
accumulates to exactly the non-streamed message.

Every request field is implemented, harmless, or a 400 naming it (docs/serving-api.md lists the three groups), and
every error on these routes answers in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, with the
status the rest of the server gives the same error (`AnthropicRoute`).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from ..engine.request import Completion
from ..engine.sampling import SamplingParams
from ..engine.structured import Structured
from .api_error import APIError
from .context import finish_all, merged
from .tool_calls import Arguments, Event, ToolCall, ToolCallParser, ToolRequest, tool_request

if TYPE_CHECKING:
    from .context import ServeContext
    from .handle import RequestHandle

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); other 5xx are api_error
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
               529: "overloaded_error"}
CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice type -> OpenAI's
HARMLESS_TOOL_KEYS = {"type", "cache_control", "eager_input_streaming", "strict"}  # strict: the grammar always is
DROPPED_BLOCKS = ("thinking", "redacted_thinking")  # Anthropic strips past turns' thinking from the context too
REFUSED = {"mcp_servers": "the MCP connector is not supported", "context_management": "context editing is not "
           "supported", "container": "code-execution containers are not supported",
           "diagnostics": "prompt-cache diagnostics are not supported"}  # Anthropic's features this server lacks


class CountTokensRequest(BaseModel):
    """What a prompt is made of (all count_tokens reads); an unknown field is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format (json_schema) is implemented; effort is refused
    thinking: dict[str, Any] | None = None  # {"type": "disabled"} only
    cache_control: dict[str, Any] | None = None  # harmless: prefix caching is automatic here
    speed: str | None = None  # harmless: this server has one speed
    mcp_servers: Any = None  # refused: no MCP connector
    context_management: Any = None  # refused: nothing is edited out of the context

    def check_supported(self) -> None:
        """400 naming the first field asking for what this server does not do (REFUSED, thinking, effort)."""
        for param, why in REFUSED.items():
            if getattr(self, param, None) not in (None, [], {}):
                raise APIError(400, f"{param}: {why}", param=param)
        if self.thinking is not None and self.thinking != {"type": "disabled"}:
            raise APIError(400, 'thinking: only {"type": "disabled"} is supported (no thinking blocks are produced)',
                           param="thinking")
        config = self.output_config or {}
        if set(config) - {"format", "effort"}:
            raise APIError(400, f"output_config.{sorted(set(config) - {'format', 'effort'})[0]} is not supported",
                           param="output_config")
        if config.get("effort") is not None:
            raise APIError(400, "output_config.effort is not supported", param="output_config")

    def constraint(self) -> Structured | None:
        """output_config.format's JSON schema as the engine's constraint (None without one)."""
        given = (self.output_config or {}).get("format")
        if given is None:
            return None
        if (not isinstance(given, dict) or given.get("type") != "json_schema" or set(given) != {"type", "schema"}
                or not isinstance(given["schema"], dict)):
            raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                           param="output_config")
        return Structured(json_schema=given["schema"])


class MessagesRequest(CountTokensRequest):
    """A message to create: the prompt fields and how to sample the answer."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # harmless: a user id for abuse tracking
    service_tier: str | None = None  # harmless: one tier
    inference_geo: str | None = None  # harmless: one place
    container: Any = None  # refused: no code-execution containers
    diagnostics: Any = None  # refused: no prompt-cache diagnostics

    def sampling(self, max_tokens: int, structured: Structured | None) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return SamplingParams(max_tokens=max_tokens, stop=tuple(self.stop_sequences or ()), structured=structured,
                              **{name: value for name, value in given.items() if value is not None})


@dataclass
class Conversation:
    """The request as chat-template messages; `prefill`: the last is the assistant's, and the answer continues it."""

    messages: list[dict[str, Any]]
    prefill: bool = False


def conversation(system: str | list[dict[str, Any]] | None, messages: Sequence[dict[str, Any]]) -> Conversation:
    """The chat endpoint's messages for Anthropic's `system` and `messages`; 400 naming the field for a turn or block
    this server cannot render (images, documents, server tools' blocks)."""
    out = []
    if system:
        text = system if isinstance(system, str) else "\n".join(text_of(b, f"system[{j}]", "system")
                                                                for j, b in enumerate(system))
        out.append({"role": "system", "content": text})
    for i, message in enumerate(messages):
        out += turn(message, i)
    prefill = messages[-1].get("role") == "assistant"
    if prefill and out[-1].get("tool_calls"):
        raise APIError(400, "the last message is an assistant turn with tool_use blocks: send their tool_result "
                            "blocks in a user turn (only text can be continued)", param="messages")
    return Conversation(merged_turns(out), prefill)


def merged_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user (or assistant) messages as one, as Anthropic combines consecutive turns of one role: texts
    joined by a newline, tool calls in order (tool messages stay apart: the template groups them itself)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        last = out[-1] if out else None
        if last is None or message["role"] != last["role"] or message["role"] not in ("user", "assistant"):
            out.append(message)
            continue
        text = "\n".join(t for t in (last["content"], message["content"]) if t)
        calls = last.get("tool_calls", []) + message.get("tool_calls", [])
        out[-1] = {"role": last["role"], "content": text, **({"tool_calls": calls} if calls else {})}
    return out


def turn(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results (tool messages) then its text; an assistant
    turn's text and tool calls in one message."""
    where, role, content = f"messages[{i}]", message.get("role"), message.get("content")
    if role not in ("user", "assistant") or set(message) - {"role", "content"}:
        raise APIError(400, f"{where} must be {{\"role\": \"user\" | \"assistant\", \"content\": ...}}",
                       param="messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content blocks", param="messages")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text":
            texts.append(text_of(block, at, "messages"))
        elif kind == "tool_use" and role == "assistant":
            calls.append(tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(tool_result(block, at))
        elif kind in DROPPED_BLOCKS and role == "assistant":
            continue
        else:
            raise APIError(400, f"{at}: blocks of type {kind!r:.40} are not supported in a {role} turn (text, "
                                f"tool_use in assistant turns, tool_result in user turns)", param="messages")
    if role == "assistant":
        message = {"role": "assistant", "content": "\n".join(texts)}
        return [{**message, "tool_calls": calls} if calls else message]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def text_of(block: Any, where: str, param: str) -> str:
    """A text block's text; cache_control is harmless (prefix caching is automatic), citations are refused."""
    if (not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str)
            or set(block) - {"type", "text", "cache_control", "citations"} or block.get("citations")):
        raise APIError(400, f"{where} must be a text block {{\"type\": \"text\", \"text\": ...}}", param=param)
    return block["text"]


def tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A past tool_use block as the call the chat template renders (its input is the arguments object)."""
    if (not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str)
            or not isinstance(block.get("input"), dict) or set(block) - {"type", "id", "name", "input",
                                                                           "cache_control"}):
        raise APIError(400, f"{where} must be {{\"type\": \"tool_use\", \"id\": ..., \"name\": ..., \"input\": "
                            f"{{...}}}}", param="messages")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block["input"]}}


def tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A tool_result block as the tool message the chat template renders; `is_error` is accepted (the template has
    no place for it: the result's text says what went wrong)."""
    content = block.get("content", "")
    if (not isinstance(block.get("tool_use_id"), str) or set(block) - {"type", "tool_use_id", "content", "is_error",
                                                                       "cache_control"}
            or not isinstance(block.get("is_error", False), bool)):
        raise APIError(400, f"{where} must be {{\"type\": \"tool_result\", \"tool_use_id\": ..., \"content\": ...}}",
                       param="messages")
    if not isinstance(content, str):
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content must be a string or text blocks", param="messages")
        content = "\n".join(text_of(b, f"{where}.content[{k}]", "messages") for k, b in enumerate(content))
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def tools_of(body: CountTokensRequest) -> ToolRequest | None:
    """The request's tools and tool_choice checked as the chat endpoint checks OpenAI's (the same ToolRequest and
    grammar); 400 naming tools or tool_choice, spelled as Anthropic's fields."""
    functions = None
    if body.tools is not None:
        functions = [function_tool(tool, i) for i, tool in enumerate(body.tools)]
    choice, parallel = openai_choice(body.tool_choice)
    try:
        return tool_request(functions, choice, parallel)
    except APIError as error:  # the chat endpoint's words for the same fields
        error.message = error.message.replace(".function.parameters", ".input_schema").replace(".function.", ".")
        raise


def function_tool(tool: Any, i: int) -> dict[str, Any]:
    """An Anthropic client tool as an OpenAI function tool; a server tool (web search, bash...) is a 400."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise APIError(400, f"{where}: only client tools ({{\"name\", \"description\", \"input_schema\"}}) are "
                            f"supported, got type {kind!r:.60}", param="tools")
    unknown = set(tool) - HARMLESS_TOOL_KEYS - {"name", "description", "input_schema"}
    if unknown:
        raise APIError(400, f"{where}.{sorted(unknown)[0]} is not supported", param="tools")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise APIError(400, f"{where}.input_schema must be a JSON schema of type \"object\"", param="tools")
    described = {"description": tool["description"]} if "description" in tool else {}
    # in OpenAI's order: Qwen's templates render each tool with tojson, so the order of keys is part of the prompt
    return {"type": "function", "function": {"name": tool.get("name"), **described, "parameters": schema}}


def openai_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as the chat endpoint's (tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    disable = choice.get("disable_parallel_tool_use", False)
    if (kind not in (*CHOICES, "tool") or set(choice) - keys or not isinstance(disable, bool)
            or (kind == "tool" and not isinstance(choice.get("name"), str))):
        raise APIError(400, 'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}, '
                            'with an optional boolean disable_parallel_tool_use', param="tool_choice")
    openai = {"type": "function", "function": {"name": choice["name"]}} if kind == "tool" else CHOICES[kind]
    return openai, (not disable) if "disable_parallel_tool_use" in choice else None


@dataclass
class Blocks:
    """An answer's content blocks as its text arrives, and the stream events that build them: text before the first
    call goes into a text block, each call the parser starts into a tool_use block whose input arrives in pieces
    (input_json_delta), as the model writes it."""

    parser: ToolCallParser | None  # None: no tools to parse (tool_choice none or no tools)
    content: list[dict[str, Any]] = field(default_factory=list)
    _open: ToolCall | str | None = None  # the block still receiving: a call, "text", or None

    def feed(self, text: str) -> list[dict[str, Any]]:
        pieces = [text] if self.parser is None else self.parser.feed(text)
        return [event for piece in pieces for event in self._add(piece)]

    def finish(self) -> list[dict[str, Any]]:
        pieces = [] if self.parser is None else self.parser.finish()
        return [event for piece in pieces for event in self._add(piece)] + self._close()

    @property
    def calls(self) -> int:
        return 0 if self.parser is None else len(self.parser.calls)

    def _add(self, piece: Event) -> list[dict[str, Any]]:
        index = len(self.content) - 1
        if isinstance(piece, Arguments):
            return [{"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": piece.text}}]
        if isinstance(piece, ToolCall):
            block = {"type": "tool_use", "id": "toolu_" + piece.id.removeprefix("call_"), "name": piece.name,
                     "input": {}}
            return self._close() + self._start(block, piece)
        if not piece:
            return []
        events = [] if self._open == "text" else self._close() + self._start({"type": "text", "text": ""}, "text")
        self.content[-1]["text"] += piece
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": {"type": "text_delta", "text": piece}}]

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
            self.content[-1]["input"] = json.loads(self._open.arguments) if self._open.complete else {}
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


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
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


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
                           "usage": {"output_tokens": len(done.token_ids)}})
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
    """A route whose errors, validation failures and 401s included, answer in Anthropic's error shape with the
    status the app's handlers give them (and their Retry-After)."""

    def get_route_handler(self):  # noqa: ANN201 - Starlette's handler type
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as error:  # noqa: BLE001 - every error gets an answer in this API's shape
                status, body = await app_error(request, error)
                headers = {"Retry-After": "1"} if status == 429 else None
                return Response(json.dumps(anthropic_error(status, body), ensure_ascii=True),
                                status_code=status, media_type="application/json", headers=headers)

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
        tools = await ctx.off_loop(tools_of, body)  # compiles each tool's input_schema
        chat = conversation(body.system, body.messages)

        def render() -> list[int]:
            text = llm.tokenizer.apply_chat_template(chat.messages, tools=tools.tools if tools else None,
                                                     add_generation_prompt=not chat.prefill,
                                                     continue_final_message=chat.prefill)
            return ctx.encode(text, param="messages")

        return await ctx.off_loop(render), tools

    @router.post("/messages")
    async def create(body: MessagesRequest, request: Request):
        prompt, tools = await prepare(body)
        structured, _ = ctx.answer_constraint(tools, body.constraint(), "output_config")
        sampling = body.sampling(ctx.budget(prompt, body.max_tokens, None), structured)
        constrained_by = "tools" if tools is not None and tools.enforced else "output_config"
        handle = (await ctx.submit([(prompt, sampling)], "messages", constrained_by))[0]
        blocks = Blocks(tools.parser() if tools is not None and tools.parsed else None)
        message_id = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(stream(request, handle, blocks, message_id, ctx.name, len(prompt)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = (await finish_all(request, [handle]))[0]
        blocks.feed(out.text)
        blocks.finish()
        stop = handle.stop_string
        return message(message_id, ctx.name, blocks.content, stop_reason(out, stop, blocks.calls), stop,
                       len(prompt), len(out.token_ids))

    @router.post("/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        prompt, _ = await prepare(body)
        return {"input_tokens": len(prompt)}

    return router
