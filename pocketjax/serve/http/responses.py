"""POST /v1/responses: OpenAI's Responses API, stateless, over the same scheduler as the chat endpoint.

Stateless means what `store: false` means at OpenAI: nothing is kept after the answer, so `previous_response_id`
(a stored conversation) is a 400 and a client sends the whole conversation in `input` each time; `store: true` is
accepted and stores nothing (as vLLM does without a response store). `input` is a string or a list of items:
messages (role + text or text content parts), `function_call` items (a past call: call_id, name, arguments) and
`function_call_output` items (its result), which become the chat conversation an agent loop sends back;
`instructions` becomes a system message in front. The prompt is the chat template's, as /v1/chat/completions builds
it (the same --max-prompt-chars bound, rendered on the server's host pool).

Function tools (`{"type": "function", "name", "parameters"}`) with `tool_choice` and `parallel_tool_calls` work as on
the chat endpoint (the same ToolRequest: grammar, closed schemas, parser): the answer's text before its first call
is a `message` output item, each call a `function_call` item (call_id, name, arguments as JSON text). `text.format`
json_schema or json_object constrains the output as the chat endpoint's response_format does. Streaming sends the
Responses event types in OpenAI's order: created, in_progress, then per output item its added event, its deltas
(output_text.delta in a content part, or function_call_arguments.delta) and done events, then completed or
incomplete. Anything else a request asks for (built-in tools, reasoning, background, include, auto truncation,
images, the other endpoints' max_tokens, a field this body does not declare) is a 400 that names it.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ...errors import PocketJaxError
from .api_error import APIError
from .constraints import TextFormat
from .context import finish_all, merged
from .openai_messages import FUNCTION_NAME
from .openai_protocol import HarmlessFields, Refused, SamplingFields, given, unless, with_seed
from .openapi import GENERATION, Documented, Int, answers, bounded, plain
from .replies import event_stream
from .response_models import Response
from .tool_call_parser import Arguments, ToolCall, ToolCallParser
from .tool_calls import ToolRequest, answer_format, template_messages, tool_request

if TYPE_CHECKING:
    from ..handle import RequestHandle
    from .context import ServeContext

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


Status = Literal["in_progress", "completed", "incomplete"]


class TextPart(Strict):
    """A message's text (input_text; output_text when a client replays an answer, with its annotations)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: Status | None = None


class FunctionCallItem(Strict):
    """A past call (an agent loop sends its calls back with their outputs)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: Status | None = None


def item_kind(item: Any) -> str | None:
    """An input item's type: a message when it names none (OpenAI's EasyInputMessage)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = plain(Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                            | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Discriminator(item_kind)])


class FunctionTool(Strict):
    """A Responses function tool (flat; the chat endpoint's nests the function)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextOptions(Strict):
    format: TextFormat | None = None


NOTHING = {"maxProperties": 0}  # an option refused unless empty (`check_supported` names it)


class ResponsesRequest(HarmlessFields, SamplingFields):
    """OpenAI's response-create body (the fields a stateless text server can honour), plus the sampling extras
    both other endpoints take (top_k, min_p, penalties, seed, stop...) and the fields that never change an answer
    (`HarmlessFields`, `user`); a field not declared here is a 400 naming it, as on the chat endpoint."""

    # a tool_choice that asks for a call needs tools (`tool_request`)
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"dependentSchemas": {
        "tool_choice": unless("tool_choice", [None, "none", "auto"], {**given("tools"), "properties": {
            "tools": {"type": "array", "minItems": 1}}})}})
    input: str | Annotated[list[InputItem], Documented(minItems=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[Int, Documented(minimum=1)] | None = None
    store: bool | None = None  # accepted; nothing is ever stored
    metadata: dict[str, str] | None = None  # echoed back
    tools: list[plain(FunctionTool)] | None = None
    tool_choice: Literal["none", "auto", "required"] | plain(NamedFunction) | None = None
    parallel_tool_calls: bool | None = None
    text: plain(TextOptions) | None = None
    n: bounded(ge=1, le=1) | None = None
    prompt_cache_retention: str | None = None  # a caching hint (as prompt_cache_key): accepted and ignored
    # refused (`check_supported` says why, naming them): declared so that the document says so
    previous_response_id: Refused = None
    conversation: Refused = None
    prompt: Refused = None
    reasoning: Annotated[dict[str, Any], Documented(**NOTHING)] | None = None
    include: Annotated[list[str], Documented(maxItems=0)] | None = None
    truncation: Annotated[str, Documented(enum=["disabled"])] | None = None
    background: Annotated[bool, Documented(enum=[False])] | None = None
    top_logprobs: Annotated[Int, Documented(enum=[0])] | None = None
    max_tokens: Refused = None  # spelled max_output_tokens here
    return_tokens_as_token_ids: Annotated[bool, Documented(enum=[False])] | None = None
    stream_options: Refused = None
    # the other endpoints' constraint fields: they would change the output, so they are refused here by name
    response_format: Refused = None
    structured_outputs: Refused = None

    def check_supported(self) -> None:
        super().check_supported()
        unsupported = [("max_tokens", self.max_tokens is not None, "is spelled max_output_tokens on /v1/responses"),
                       ("return_tokens_as_token_ids", bool(self.return_tokens_as_token_ids),
                        "logprobs are not supported on /v1/responses"),
                       ("previous_response_id", self.previous_response_id is not None,
                        "needs stored responses; this server is stateless: send the whole conversation in input"),
                       ("conversation", self.conversation is not None, "needs stored conversations"),
                       ("prompt", self.prompt is not None, "stored prompt templates are not supported"),
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

    def chat(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: instructions first (a system message), then the input items, past
        calls in the form chat templates read (`template_messages`)."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        if not self.input:
            raise APIError(400, "input must not be empty", param="input")
        for i, item in enumerate(self.input):
            add_item(messages, item, i)
        return template_messages(messages)

    def tool_request(self) -> ToolRequest | None:
        """The request's function tools as the chat endpoint's (None without tools); 400 naming tools or
        tool_choice."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        tools = [function_tool(tool, i) for i, tool in enumerate(self.tools)]
        return tool_request(tools, chat_tool_choice(self.tool_choice), self.parallel_tool_calls)


def add_item(messages: list[dict[str, Any]], item: Any, i: int) -> None:
    """Append input item `i` to the chat messages: a message, a past function call (joined to the assistant
    message before it, as one turn with its calls), or a call's output (a tool message)."""
    if not isinstance(item, dict):
        raise APIError(400, f"input[{i}] must be an object", param="input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise APIError(400, f"input[{i}].role must be one of {sorted(ROLES)}, got {role!r:.40}", param="input")
        messages.append({"role": ROLES[role], "content": item_text(item.get("content"), i)})
    elif kind == "function_call":
        call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
        if not all(isinstance(v, str) for v in (call_id, name, arguments)):
            raise APIError(400, f"input[{i}]: a function_call item needs string call_id, name and arguments",
                           param="input")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        if messages and messages[-1]["role"] == "assistant":  # the answer's text and calls: one turn
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise APIError(400, f"input[{i}]: a function_call_output item needs a string call_id", param="input")
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": output if isinstance(output, str) else item_text(output, i)})
    else:
        raise APIError(400, f"input[{i}]: items of type {kind!r:.40} are not supported (only message, "
                            f"function_call and function_call_output)", param="input")


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


def function_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (flat: type, name, description, parameters, strict) as the chat endpoint's
    (nested under "function"); a built-in tool (web search, file search, computer use...) is a 400."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise APIError(400, f"tools[{i}]: only function tools are supported, got type {kind!r:.60}", param="tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def chat_tool_choice(choice: Any) -> Any:
    """A Responses tool_choice as the chat endpoint's: the same three words, or {"type": "function", "name"}."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                           param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def responses_router(ctx: ServeContext) -> APIRouter:
    """POST /responses (mounted under /v1) over the server's context (model check, context budget, the bounded
    host pool, submit with its limits and metrics)."""
    router = APIRouter()

    @router.post("/responses", responses=answers(Response, *GENERATION, stream=True))
    async def create(body: ResponsesRequest, request: Request):
        ctx.check_model(body.model)
        body.check_supported()
        ctx.check_size("input", input=body.input, instructions=body.instructions, tools=body.tools)
        structured, text_format = TextFormat.of(body.text)
        tools = await ctx.checked_tools(body.tools, body.tool_request)  # compiles each tool's parameters schema
        structured, constrained_by = ctx.answer_constraint(tools, answer_format(tools, structured, "text"), "text")
        llm = ctx.llm

        def render() -> list[int]:
            text = llm.tokenizer.apply_chat_template(body.chat(), tools=tools.tools if tools else None,
                                                     add_generation_prompt=True)
            return ctx.encode(text, param="input")

        prompt = await ctx.off_loop(render)
        max_tokens = ctx.budget(prompt, body.max_output_tokens, None, param="max_output_tokens")
        sampling = body.sampling(max_tokens, structured=structured, tools=tools)
        handle = (await ctx.submit([(prompt, with_seed(sampling, 0))], "input", constrained_by))[0]
        draft = Draft(body, ctx.name, len(prompt), text_format)
        output = Output(tools.parser() if tools is not None and tools.parsed else None)
        if body.stream:
            return event_stream(events(draft, output, handle))
        out = (await finish_all(request, [handle]))[0]
        output.feed(out.text)
        output.finish(out.finish_reason == "length")
        return draft.response(output.whole(), out.finish_reason, len(out.token_ids), handle.cached_prefix_len)

    return router


class Draft:
    """One response's fixed fields (ids, echoed settings) and the Response object at any stage."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int,
                 text_format: dict[str, Any] | None = None):
        self.body, self.model, self.prompt_tokens = body, model, prompt_tokens
        self.text_format = text_format or {"type": "text"}
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, output: list[dict[str, Any]] | None, reason: str | None, tokens: int = 0,
                 cached: int = 0) -> dict[str, Any]:
        """The Response object: in progress (output None), completed, or incomplete (`reason` "length")."""
        body = self.body
        status = "in_progress" if output is None else "incomplete" if reason == "length" else "completed"
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if output is not None else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output or [],
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "text": {"format": self.text_format}, "truncation": "disabled",
            "metadata": body.metadata or {}, "user": body.user, "usage": None}
        if output is not None:
            out["usage"] = {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                            "output_tokens": tokens, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": self.prompt_tokens + tokens}
        return out


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "in_progress") -> dict[str, Any]:
    """An assistant message output item holding `text`."""
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [output_text(text)]}


class Output:
    """A response's output items as its text arrives, and the stream events (type, fields) that build them: the
    text goes into a message item, each call the parser starts into a function_call item whose arguments grow
    piece by piece. One builder makes both the streamed events and the non-streamed output, so they agree."""

    def __init__(self, parser: ToolCallParser | None):
        self.parser = parser  # None: no tools to parse (tool_choice none, or no tools)
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still receiving text or arguments

    def begin(self) -> list[tuple[str, dict[str, Any]]]:
        """The first events: without tools the message item opens at once (as OpenAI's does); with tools the first
        piece of the answer decides which item comes first."""
        return self._start_message() if self.parser is None else []

    def feed(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        pieces = [text] if self.parser is None else self.parser.feed(text)
        return [event for piece in pieces for event in self._add(piece)]

    def finish(self, cut: bool) -> list[tuple[str, dict[str, Any]]]:
        """The last events: the open item closed ("incomplete" when the answer was `cut` by max_output_tokens), and
        an empty message when the answer has no item at all (OpenAI always answers with one)."""
        pieces = [] if self.parser is None else self.parser.finish()
        events = [event for piece in pieces for event in self._add(piece)]
        if not self.items and self._open is None:
            events += self._start_message()
        return events + self._close("incomplete" if cut else "completed")

    def _add(self, piece: str | ToolCall | Arguments) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if isinstance(piece, str):
            if not piece:
                return events
            if self._open is None or self._open["type"] != "message":
                events += self._close("completed") + self._start_message()
            self._open["content"][0]["text"] += piece
            return events + [("response.output_text.delta", {**self._where(), "delta": piece, "logprobs": []})]
        if isinstance(piece, ToolCall):
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": piece.id, "name": piece.name,
                    "arguments": "", "status": "in_progress"}
            return self._close("completed") + self._start(item)
        self._open["arguments"] += piece.text
        return [("response.function_call_arguments.delta", {"item_id": self._open["id"],
                                                            "output_index": len(self.items), "delta": piece.text})]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items), "content_index": 0}

    def whole(self) -> list[dict[str, Any]]:
        """The non-streamed output (after `finish`): the items, a call whose JSON never closed as a message item of
        the text it was written as (as `parse_tool_calls` makes the chat answer: a client never gets, nor replays,
        arguments that are not JSON)."""
        cut = {call.id: call.written for call in self.parser.calls if not call.complete} if self.parser else {}
        return [message_item(cut[item["call_id"]], item["status"]) if item.get("call_id") in cut else item
                for item in self.items]

    def _start_message(self) -> list[tuple[str, dict[str, Any]]]:
        events = self._start({**message_item(""), "content": []})
        self._open["content"].append(output_text(""))
        return events + [("response.content_part.added", {**self._where(), "part": output_text("")})]

    def _start(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self._open = item
        return [("response.output_item.added", {"output_index": len(self.items), "item": json.loads(json.dumps(item))})]

    def _close(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items)
        item["status"] = status
        self.items.append(item)
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events = [("response.output_text.done", {**where, "text": part["text"], "logprobs": []}),
                      ("response.content_part.done", {**where, "part": part})]
        else:
            events = [("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                 "name": item["name"], "arguments": item["arguments"]})]
        return events + [("response.output_item.done", {"output_index": index, "item": item})]


async def events(draft: Draft, output: Output, handle: RequestHandle) -> AsyncIterator[str]:
    """The SSE stream: `event: <type>` + `data: <json>` per event, sequence numbers from 0, no [DONE] (OpenAI's
    Responses stream ends with its last event). An error after the headers went out is one `error` event."""
    sequence = 0

    def event(kind: str, fields: dict[str, Any]) -> str:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    yield event("response.created", {"response": draft.response(None, None)})
    yield event("response.in_progress", {"response": draft.response(None, None)})
    for kind, fields in output.begin():
        yield event(kind, fields)
    try:
        async for _, _, text, done in merged([handle]):
            for kind, fields in output.feed(text) if text else []:
                yield event(kind, fields)
            if done is not None:
                for kind, fields in output.finish(done.finish_reason == "length"):
                    yield event(kind, fields)
                final = draft.response(output.items, done.finish_reason, len(done.token_ids),
                                       handle.cached_prefix_len)
                yield event(f"response.{final['status']}", {"response": final})
    except PocketJaxError as error:
        yield event("error", {"code": None, "message": str(error), "param": None})
