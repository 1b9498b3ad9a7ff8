"""Anthropic's Messages request bodies and their translation into the chat endpoint's conversation and tools.

A request becomes the chat endpoint's conversation: `system` a system message in front, each turn's text blocks its
content, an assistant turn's `tool_use` blocks its tool calls, a user turn's `tool_result` blocks tool messages (the
chat template renders them as it renders OpenAI's), and a last assistant turn a prefill the answer continues
(`continue_final_message`). `tools` become OpenAI function tools and `tool_choice` auto / any / tool / none the chat
endpoint's auto / required / named / none (`disable_parallel_tool_use`: one call at most), checked by the same
`tool_request`. Every request field is implemented, harmless, or a 400 naming it (docs/serving-api.md lists the
three groups).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...engine.sampling_params import INT32_MAX, MAX_STOP_STRINGS, SamplingParams
from ...engine.structured import Structured
from .api_error import APIError
from .openai_messages import FUNCTION_NAME
from .openai_protocol import Refused, StopString, TopP, given, unless
from .openapi import Documented, Int, bounded, plain
from .tool_calls import ToolRequest, answer_stops, tool_request

CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice type -> OpenAI's
HARMLESS_TOOL_KEYS = {"type", "cache_control", "eager_input_streaming", "strict"}  # strict: the grammar always is
DROPPED_BLOCKS = ("thinking", "redacted_thinking")  # Anthropic strips past turns' thinking from the context too
REFUSED = {"mcp_servers": "the MCP connector is not supported", "context_management": "context editing is not "
           "supported", "container": "code-execution containers are not supported",
           "diagnostics": "prompt-cache diagnostics are not supported"}  # Anthropic's features this server lacks


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # harmless: prefix caching is automatic
    citations: Annotated[list[Any], Documented(maxItems=0)] | None = None  # none to render: a citation is refused


class ToolUseBlock(Strict):
    """A past call of the assistant's (its input is the arguments object)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Strict):
    """A call's result, in a user turn; `is_error` is accepted (the result's text says what went wrong)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Strict):
    """A past turn's thinking: dropped from the context, as Anthropic drops it."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


UserBlock = Annotated[TextBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
                           Field(discriminator="type")]


class UserTurn(Strict):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantTurn(Strict):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


Turn = plain(Annotated[UserTurn | AssistantTurn, Field(discriminator="role")])


class InputSchema(BaseModel):
    """A tool's input: a JSON schema of type object (compiled when the request comes: `tool_calls.tool_request`)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["object"]


class ClientTool(Strict):
    """A tool the client runs (Anthropic's server tools, web search and the like, are refused by their type)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str = ""
    input_schema: InputSchema
    cache_control: dict[str, Any] | None = None  # harmless, as the next two
    eager_input_streaming: bool | None = None
    strict: bool | None = None  # the grammar always enforces the schema


class ChoiceOf(Strict):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: bool = False


class NamedTool(Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class JsonOutput(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: JsonOutput | None = None
    effort: Refused = None  # refused: one effort here


class ThinkingOff(Strict):
    type: Literal["disabled"]


# Anthropic's features this server lacks: refused unless null or empty (REFUSED says why)
RefusedUnlessEmpty = Annotated[Any, Documented(replace=True, anyOf=[
    {"type": "null"}, {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}],
    description="Not supported: refused unless null or empty.")]


class CountTokensRequest(BaseModel):
    """What a prompt is made of (all count_tokens reads); an unknown field is a 400 naming it."""

    # a tool_choice other than none needs tools (`tool_request`)
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"dependentSchemas": {
        "tool_choice": unless("tool_choice", {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "none"}}}]},
                              given("tools"))}})
    model: str
    messages: list[Turn] = Field(min_length=1)
    system: str | list[plain(TextBlock)] | None = None
    tools: Annotated[list[plain(ClientTool)], Documented(minItems=1)] | None = None
    tool_choice: plain(Annotated[ChoiceOf | NamedTool, Field(discriminator="type")]) | None = None
    output_config: plain(OutputConfig) | None = None  # format (json_schema) is implemented; effort is refused
    thinking: plain(ThinkingOff) | None = None  # {"type": "disabled"} only
    cache_control: dict[str, Any] | None = None  # harmless: prefix caching is automatic here
    speed: str | None = None  # harmless: this server has one speed
    mcp_servers: RefusedUnlessEmpty = None  # refused: no MCP connector
    context_management: RefusedUnlessEmpty = None  # refused: nothing is edited out of the context

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

    max_tokens: bounded(ge=1)
    stop_sequences: Annotated[list[StopString], Documented(maxItems=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: TopP | None = None
    top_k: Annotated[Int, Documented(minimum=0, maximum=INT32_MAX)] | None = None  # 0: off
    metadata: dict[str, Any] | None = None  # harmless: a user id for abuse tracking
    service_tier: str | None = None  # harmless: one tier
    inference_geo: str | None = None  # harmless: one place
    container: RefusedUnlessEmpty = None  # refused: no code-execution containers
    diagnostics: RefusedUnlessEmpty = None  # refused: no prompt-cache diagnostics

    def sampling(self, max_tokens: int, structured: Structured | None, tools: ToolRequest | None) -> SamplingParams:
        """How to sample the answer; stop_sequences end text, never a call that tool_choice forces (`answer_stops`)."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return SamplingParams(max_tokens=max_tokens, stop=answer_stops(tools, self.stop_sequences),
                              structured=structured, **{name: value for name, value in given.items()
                                                        if value is not None})


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
    uses: set[str] = set()  # the ids of the tool_use blocks so far
    for i, message in enumerate(messages):
        out += turn(message, i, uses)
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


def turn(message: dict[str, Any], i: int, uses: set[str]) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results (tool messages) then its text; an assistant
    turn's text and tool calls in one message. `uses`: the ids of the earlier turns' tool_use blocks, which a
    tool_result must name (as Anthropic checks: a result of no call is a 400); this turn's calls join them."""
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
            if results[-1]["tool_call_id"] not in uses:
                raise APIError(400, f"{at}: tool_result names tool_use_id {block['tool_use_id']!r:.80}, which no "
                                    f"earlier tool_use block has: each tool_result answers a tool_use of an "
                                    f"assistant turn before it", param="messages")
        elif kind in DROPPED_BLOCKS and role == "assistant":
            continue
        else:
            raise APIError(400, f"{at}: blocks of type {kind!r:.40} are not supported in a {role} turn (text, "
                                f"tool_use in assistant turns, tool_result in user turns)", param="messages")
    uses.update(call["id"] for call in calls)
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
