"""The 200 bodies as the document declares them (`openapi.answers`): typed where a client reads a field, open to
fields added later (no `additionalProperties: false`). The routes build their answers as dicts; these models only
describe them, and tests/test_openapi.py's fuzzer checks every answer against them."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's extra, per choice


class Completion(BaseModel):
    """POST /v1/completions' answer (OpenAI's Completion)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: str  # "assistant", or the continued message's role (continue_final_message, add_generation_prompt false)
    content: str | None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # the deprecated `functions` answer


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls", "function_call"] | None


class ChatCompletion(BaseModel):
    """POST /v1/chat/completions' answer (OpenAI's ChatCompletion)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's extra


class ResponsesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class Response(BaseModel):
    """POST /v1/responses' answer (OpenAI's Response): `output` holds message and function_call items."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponsesUsage | None


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class Message(BaseModel):
    """POST /v1/messages' answer (Anthropic's Message): `content` holds text and tool_use blocks."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(BaseModel):
    """POST /v1/messages/count_tokens' answer."""

    input_tokens: int


class Tokens(BaseModel):
    """POST /tokenize's answer (vLLM's)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class Text(BaseModel):
    """POST /detokenize's answer (vLLM's)."""

    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    """GET /health when ready: the scheduler's queue."""

    status: Literal["ok"]
    running: int
    waiting: int
    free_slots: int


class Progress(BaseModel):
    done: int
    total: int


class Warming(BaseModel):
    """GET /health before the engine is warm (503): the warm-up's progress, or why it failed."""

    status: Literal["warming", "failed"]
    progress: Progress
    seconds: float
    error: str | None = None
