"""OpenAI's chat messages, tools and tool_choice as typed models: the contract /openapi.json publishes for
/v1/chat/completions and /tokenize, checked at the edge (a message of an unknown role, a content part this text
server cannot read, a field OpenAI's messages do not have: a 400 naming `messages`, `tools` or `tool_choice`).

Every field of OpenAI's message types is accepted; content parts are text only (images, audio and files are refused
by their type), as the chat templates of text models read them. Validated, each value stays the plain JSON it came
as (`openapi.plain`): the rules across fields (a tool_choice naming one of the tools, each tool's parameters schema
compiling) are `tool_calls.tool_request`'s, and the templates read the messages as sent.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .openapi import plain

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # tool_calls.NAME: OpenAI's rule for function names


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


TextContent = str | list[TextPart]


class SystemMessage(Strict):
    role: Literal["system"]
    content: TextContent
    name: str | None = None


class DeveloperMessage(Strict):
    """OpenAI's newer name for a system message (rendered as one)."""

    role: Literal["developer"]
    content: TextContent
    name: str | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: TextContent
    name: str | None = None


class CalledFunction(Strict):
    name: str
    arguments: str | dict[str, Any]  # OpenAI's JSON text; an object is read as the arguments too


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AudioReference(Strict):
    id: str


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: TextContent | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: CalledFunction | None = None  # the deprecated form of one call
    audio: AudioReference | None = None  # a past audio answer's id: nothing to render, accepted
    reasoning_content: str | None = None  # vLLM's: the thinking a Qwen3 template renders back


class ToolMessage(Strict):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str


class FunctionMessage(Strict):
    """The deprecated result of a `function_call` (rendered as a tool result)."""

    role: Literal["function"]
    content: str | None
    name: str


ChatMessage = plain(Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage
                              | FunctionMessage, Field(discriminator="role")])


class FunctionDefinition(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})  # a JSON schema
    strict: bool = False  # accepted: the grammar always enforces the schema


class FunctionTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


Tool = plain(FunctionTool)
ToolChoice = Literal["none", "auto", "required"] | plain(NamedToolChoice)
Function = plain(FunctionDefinition)
FunctionCallChoice = Literal["none", "auto"] | plain(NamedFunction)
