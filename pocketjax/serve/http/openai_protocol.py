"""OpenAI's request bodies: the pydantic models of /v1/completions and /v1/chat/completions and their SamplingParams
(the replies are `replies.py`'s, their logprobs `logprobs.py`'s).

Types are checked strictly (a string where a number belongs is a 400, never coerced); ranges are left to
`SamplingParams.validate`, the one place that knows them, so the server and the Python API reject the same values.
Fields set to null take their default, as OpenAI's API does.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ...engine.sampling_params import (FLOAT32_MAX, INT32_MAX, LOGIT_BIAS_RANGE, MAX_BAD_WORDS, MAX_LOGIT_BIAS,
                                       MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, PENALTY_RANGE,
                                       SamplingParams)
from ...engine.structured import Structured
from .api_error import APIError
from .constraints import ConstraintFields
from .openai_messages import ChatMessage, Function, FunctionCallChoice, Tool, ToolChoice
from .openapi import TOKEN_ID, Documented, Int, bounded
from .tool_calls import (ToolRequest, answer_stops, banned_words, legacy_tool_request, template_messages,
                         tool_request)

MAX_N = 64  # choices per request: each is a request of its own in the scheduler


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's extension: usage so far in every chunk


# reasoning_effort -> Qwen3's enable_thinking: the low efforts answer without thinking, the others think
REASONING_EFFORTS = {"none": False, "minimal": False, "low": False, "medium": True, "high": True, "xhigh": True}
# The ranges SamplingParams.validate enforces (and names), declared in the document (`Documented`)
Temperature = Annotated[float, Documented(minimum=0, maximum=FLOAT32_MAX)]
Probability = Annotated[float, Documented(minimum=0, maximum=1)]
TopP = Annotated[float, Documented(exclusiveMinimum=0, maximum=1)]
Penalty = Annotated[float, Documented(minimum=-PENALTY_RANGE, maximum=PENALTY_RANGE)]
RepetitionPenalty = Annotated[float, Documented(exclusiveMinimum=0, maximum=FLOAT32_MAX)]
TopK = Annotated[Int, Documented(minimum=-1, maximum=INT32_MAX)]  # -1 and 0: off
Seed = Annotated[Int, Documented(minimum=0, maximum=2**32 - 1)]
TopLogprobs = Annotated[Int, Documented(minimum=0, maximum=MAX_LOGPROBS)]
TokenId = Annotated[Int, Documented(minimum=0, **{TOKEN_ID: True})]  # below the vocabulary size (install_openapi)
StopString = Annotated[str, Documented(minLength=1)]
Stop = StopString | Annotated[list[StopString], Documented(maxItems=MAX_STOP_STRINGS)]  # in all MAX_STOP_CHARS
Bias = Annotated[float, Documented(minimum=-LOGIT_BIAS_RANGE, maximum=LOGIT_BIAS_RANGE)]
LogitBias = Annotated[dict[str, Bias], Documented(maxProperties=MAX_LOGIT_BIAS, propertyNames={"pattern": "^[0-9]+$"})]
Text = Annotated[str, Documented(minLength=1)]
TokenIds = Annotated[list[TokenId], Documented(minItems=1)]
Prompt = Text | Annotated[list[Text], Documented(minItems=1)] | TokenIds | Annotated[list[TokenIds], Documented(
    minItems=1)]
# a field this server refuses unless null (its `check_supported` says why, naming it)
Refused = Annotated[Any, Documented(replace=True, type="null", description="Not supported: refused unless null.")]


def unless(field: str, values: list[Any] | dict[str, Any], rule: dict[str, Any]) -> dict[str, Any]:
    """A dependentSchemas rule: `field` is one of `values` (or meets that schema), or the body meets `rule`."""
    return {"anyOf": [{"properties": {field: {"enum": values} if isinstance(values, list) else values}}, rule]}


def given(field: str) -> dict[str, Any]:
    """A rule: `field` is there, a list."""
    return {"required": [field], "properties": {field: {"type": "array"}}}


def no_tools(rule: dict[str, Any] | None = None) -> dict[str, Any]:
    """`rule` (if any), and none of the tool fields set (the deprecated functions stand alone)."""
    rule = rule or {}
    return {**rule, "properties": {**rule.get("properties", {}), **{
        name: {"type": "null"} for name in ("tools", "tool_choice", "parallel_tool_calls")}}}


class SamplingFields(BaseModel):
    """The fields every OpenAI endpoint shares (OpenAI's, plus vLLM's top_k, min_p, repetition_penalty, ignore_eos,
    stop_token_ids); each endpoint's body (CompletionRequest, ChatCompletionRequest, ResponsesRequest) refuses the
    fields it does not declare by name (extra="forbid")."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: Annotated[Int, Documented(minimum=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Documented(maxItems=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    n: bounded(ge=1, le=MAX_N) | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None  # accepted and ignored
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:N" (never ambiguous)

    def check_supported(self) -> None:
        """400 naming a field whose value this server cannot honour (subclasses add theirs)."""

    def token_bias(self) -> dict[int, Any]:
        """logit_bias with its keys as token ids (OpenAI sends them as strings); 400 for a key that is not one."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit():  # as the document's pattern: "5", never " 5" nor "\u0665"
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r:.40}", param="logit_bias")
            out[int(key)] = bias
        return out

    def sampling_extras(self) -> dict[str, Any]:
        """SamplingParams fields beyond the shared ones (the vLLM extras of `VllmFields`)."""
        return {}

    def sampling(self, max_tokens: int, logprobs: int = 0, prompt_logprobs: int | None = None,
                 structured: Structured | None = None, tools: ToolRequest | None = None) -> SamplingParams:
        """The SamplingParams these fields ask for (validated later by the engine, which names a bad field), with
        `structured` constraining the output and the request's `tools` deciding which stops apply (`answer_stops`)
        and what may not be written (`banned_words`)."""
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                                        "frequency_penalty", "repetition_penalty", "seed",
                                                        "ignore_eos")}
        given = {name: value for name, value in given.items() if value is not None}
        if self.top_k is not None:
            given["top_k"] = 0 if self.top_k == -1 else self.top_k  # vLLM's -1 means off, as our 0
        if structured is not None:
            given["structured"] = structured
        if self.logit_bias:
            given["logit_bias"] = self.token_bias()
        extras = self.sampling_extras()
        if banned := banned_words(tools, structured is not None):
            extras["bad_words"] = (*extras.get("bad_words", ()), *banned)
        return SamplingParams(max_tokens=max_tokens, stop=answer_stops(tools, self.stop),
                              stop_token_ids=answer_stops(tools, self.stop_token_ids), logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, **{**given, **extras})


class HarmlessFields(BaseModel):
    """OpenAI fields accepted and ignored because they never change the output: bookkeeping for OpenAI's own
    platform (metadata, store: this server stores nothing; service_tier; safety_identifier), caching and latency
    hints (prompt_cache_key, prediction: a predicted output speeds OpenAI up, the answer is the same), and vLLM's
    scheduling extras (priority: the order requests run in, never their tokens; request_id)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prediction: dict[str, Any] | None = None
    priority: Int | None = None
    request_id: str | None = None


class VllmFields(BaseModel):
    """vLLM's extras that change the output, implemented with vLLM's names and meaning (`SamplingParams`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    min_tokens: Annotated[Int, Documented(minimum=0)] | None = None  # at most max_tokens
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: Annotated[list[TokenId], Documented(minItems=1)] | None = None
    bad_words: Annotated[list[Annotated[str, Documented(pattern=r"\S")]], Documented(maxItems=MAX_BAD_WORDS)
                         ] | None = None
    prompt_logprobs: TopLogprobs | None = None  # each prompt token's logprob and top-k, in prompt_logprobs
    # keep the last k (-1: as many as fit); 0 is refused (check_supported)
    truncate_prompt_tokens: Annotated[bounded(ge=-1), Documented(**{"not": {"const": 0}})] | None = None
    use_beam_search: Annotated[bool, Documented(enum=[False])] | None = None  # not implemented: true is a 400
    # pocketjax's own: steering vectors {"layer": [hidden_size floats]} added to the residual stream after that
    # layer (`SamplingParams.steer`: data, no new program)
    steer: Annotated[dict[str, list[float]], Documented(propertyNames={"pattern": "^[0-9]+$"})] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.use_beam_search:
            raise APIError(400, "use_beam_search is not supported (sampling and greedy only)", param="use_beam_search")
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 or >= 1", param="truncate_prompt_tokens")
        if self.prompt_logprobs is not None and getattr(self, "stream", None):
            raise APIError(400, "prompt_logprobs are not available when stream is true (as vLLM)",
                           param="prompt_logprobs")

    def prompt_top(self, echoed: int | None = None) -> int | None:
        """Top logprobs the engine records per prompt token: what prompt_logprobs and `echoed` (completions' echo
        with logprobs) ask for, the larger (None: neither)."""
        asked = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(asked) if asked else None

    def sampling_extras(self) -> dict[str, Any]:
        given = {name: getattr(self, name) for name in ("min_tokens", "include_stop_str_in_output",
                                                        "skip_special_tokens", "allowed_token_ids", "bad_words")}
        extras = {name: value for name, value in given.items() if value is not None}
        if self.steer is not None:
            if not all(k.isascii() and k.isdigit() for k in self.steer):
                raise APIError(400, "steer maps layer numbers (\"0\", \"1\", ...) to vectors", param="steer")
            extras["steer"] = {int(k): v for k, v in self.steer.items()}
        return extras

    def truncated(self, prompt: list[int], max_seq_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: the most the context holds with one to generate)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt
        k = max_seq_len - 1 if k == -1 else k
        return prompt[-k:]


class CompletionRequest(VllmFields, HarmlessFields, SamplingFields, ConstraintFields):
    """POST /v1/completions' body: a field not declared here (or in its bases) is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    prompt: Prompt
    max_tokens: Annotated[Int, Documented(minimum=0)] | None = None  # 0: score the prompt (needs echo)
    echo: bool | None = None
    logprobs: TopLogprobs | None = None
    suffix: Annotated[str, Documented(maxLength=0)] | None = None  # not supported
    best_of: Annotated[Int, Documented(minimum=1, maximum=MAX_N)] | None = None  # only best_of == n

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of other than n is not supported", param="best_of")


class ChatCompletionRequest(VllmFields, HarmlessFields, SamplingFields, ConstraintFields):
    """POST /v1/chat/completions' body: a field not declared here (or in its bases) is a 400 naming it."""

    # `tool_request`'s rules across fields: a tool_choice needs tools, and the deprecated form stands alone
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"dependentSchemas": {
        "tool_choice": unless("tool_choice", [None, "none"], given("tools")),  # given: a list of one or more
        "functions": unless("functions", [None], no_tools()),
        "function_call": unless("function_call", [None], no_tools(given("functions")))}})
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    max_completion_tokens: Annotated[Int, Documented(minimum=1)] | None = None  # max_tokens' newer name; wins
    chat_template_kwargs: dict[str, Any] | None = None  # template variables, e.g. {"enable_thinking": false}
    tools: Annotated[list[Tool], Documented(minItems=1)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated tools: mapped to tools (tool_calls.legacy_tool_request) and tool_choice; the answer says
    # function_call
    functions: Annotated[list[Function], Documented(minItems=1)] | None = None
    function_call: FunctionCallChoice | None = None
    echo: bool | None = None  # vLLM: the last message's content starts the reply when it has the reply's role
    add_generation_prompt: bool | None = None  # default true
    continue_final_message: bool | None = None  # the reply continues the last (assistant) message
    chat_template: str | None = None  # a name of the checkpoint's templates, or (trusted servers) a template
    # Qwen3's enable_thinking: none/minimal/low -> off, medium/high -> on
    reasoning_effort: Annotated[str, Documented(enum=list(REASONING_EFFORTS))] | None = None
    modalities: Annotated[list[Annotated[str, Documented(enum=["text"])]], Documented(minItems=1, maxItems=1)
                          ] | None = None  # ["text"] only

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "Cannot set both continue_final_message and add_generation_prompt to true",
                           param="continue_final_message")
        if self.modalities is not None and self.modalities != ["text"]:
            raise APIError(400, f"modalities: this server answers with text only, got {self.modalities!r:.60}",
                           param="modalities")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {sorted(REASONING_EFFORTS)}",
                           param="reasoning_effort")

    def reply_role(self) -> str:
        """The role of the message being written (vLLM): the assistant's after a generation prompt, else the last
        message's (it is continued)."""
        if self.add_generation_prompt is False or self.continue_final_message:
            return str(self.messages[-1].get("role", "assistant"))
        return "assistant"

    def echoed(self) -> str:
        """What `echo` puts before each reply (vLLM): the last message's content when its role is the reply's."""
        last = self.chat_messages()[-1] if self.echo else {}
        return (last.get("content") or "") if last.get("role") == self.reply_role() else ""

    def template_options(self, trusted: bool, templates: dict[str, str]) -> dict[str, Any]:
        """apply_chat_template's keywords: `template_options` of chat_template_kwargs, then the generation prompt,
        continue_final_message, the top-level chat_template (a checkpoint template's name, or a template where
        `trusted`) and reasoning_effort as enable_thinking where the template reads it; 400 naming the field."""
        options = template_options(self.chat_template_kwargs, trusted)
        if self.continue_final_message:
            options.update(add_generation_prompt=False, continue_final_message=True)
        elif self.add_generation_prompt is not None:
            options["add_generation_prompt"] = self.add_generation_prompt
        if self.chat_template is not None:
            if self.chat_template not in templates and not trusted:
                raise APIError(400, f"chat_template must name one of this model's templates {sorted(templates)}: "
                                    f"request-supplied chat templates are off on this server (pocketjax serve "
                                    f"--trust-request-chat-template turns them on)", param="chat_template",
                               code="chat_template_not_allowed")
            options["chat_template"] = self.chat_template
        if self.reasoning_effort is not None:
            chosen = options.get("chat_template")
            default = templates.get("default") or (next(iter(templates.values())) if len(templates) == 1 else "")
            source = default if chosen is None else templates.get(chosen, chosen)
            if "enable_thinking" not in source:
                raise APIError(400, "reasoning_effort: this model's chat template has no enable_thinking switch",
                               param="reasoning_effort")
            options.setdefault("enable_thinking", REASONING_EFFORTS[self.reasoning_effort])
        return options

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_messages(self.messages)

    def tool_request(self) -> ToolRequest | None:
        """The request's checked tools (None without tools), from `tools` or the legacy `functions`; 400 naming the
        field when malformed or when both forms are given."""
        if self.functions is None and self.function_call is None:
            return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)
        mixed = [name for name in ("tools", "tool_choice", "parallel_tool_calls") if getattr(self, name) is not None]
        if mixed:
            raise APIError(400, f"functions / function_call (deprecated) cannot be combined with {mixed[0]}",
                           param=mixed[0])
        if self.functions is None:
            raise APIError(400, "function_call needs functions", param="function_call")
        return legacy_tool_request(self.functions, self.function_call)


def chat_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with text-only content parts joined into one string (what text-only templates expect) and past
    tool calls in the form templates read (`template_messages`); 400 for a part that is not text (images, audio:
    this server serves text models)."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text", ""), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, got {kind!r:.40}",
                                   param="messages")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            message = {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
        if isinstance(message, dict) and message.get("role") == "developer":  # OpenAI's newer name for system
            message = {**message, "role": "system"}
        out.append(message)
    return template_messages(out)


def with_seed(sampling: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n choices: seed + i (mod 2**32), so choices differ yet each is reproducible; None stays None
    (the engine draws a fresh seed per request)."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**32)


# chat_template_kwargs set template variables only: these would replace the template or the conversation
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "messages", "conversation", "tools", "documents",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
                                      "return_tensors", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def template_options(kwargs: dict[str, Any] | None, trusted: bool) -> dict[str, Any]:
    """apply_chat_template's keywords for a request: its chat_template_kwargs as template variables, after checking
    that none replaces the conversation or the generation prompt, nor (unless trusted) the template; 400 naming it."""
    kwargs = dict(kwargs or {})
    for key in kwargs:
        if key == "chat_template" and trusted:
            if not isinstance(kwargs[key], str):
                raise APIError(400, "chat_template_kwargs.chat_template must be a string", param="chat_template_kwargs")
            continue
        if key == "chat_template":
            raise APIError(400, "chat_template_kwargs.chat_template: request-supplied chat templates are off on this "
                                "server (pocketjax serve --trust-request-chat-template turns them on)",
                           param="chat_template_kwargs", code="chat_template_not_allowed")
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier() or key.startswith("_"):
            raise APIError(400, f"chat_template_kwargs.{key!r} cannot be set: chat_template_kwargs only sets template "
                                f"variables (the messages, tools and generation prompt come from the request)",
                           param="chat_template_kwargs")
    return {"add_generation_prompt": True, **kwargs}
