"""Tool calling on /v1/chat/completions (and the other endpoints that take tools): the request's tools checked, the
grammar that enforces calls, and the messages the chat template reads.

Qwen2.5 and Qwen3 answer a call as a `<tool_call>` block (`tool_call_parser.py` reads them back). `tool_choice`
"required" or a named function is enforced by a Lark grammar of such blocks whose arguments follow each tool's
parameters schema (llguidance's `%json`), so the answer always parses; "auto" leaves the model free and parses what
it writes; "none" parses nothing (the tools are still rendered, as vLLM renders them by default).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...engine.sampling_params import SamplingParams
from ...engine.structured import Structured, llguidance_module
from ...errors import StructuredOutputError
from .api_error import APIError
from .tool_call_parser import END, START, Event, ToolCall, ToolCallParser, parse_tool_calls

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (they go into the grammar as literals)
CHOICES = ("none", "auto", "required")
OUTPUT_FORMATS = ("response_format", "text")  # the fields that say what a text answer looks like (`answer_format`)
# Calls one answer may make under "required" with parallel_tool_calls (OpenAI and vLLM state none): a weak model
# repeats a call until max_tokens otherwise; after the 8th the grammar allows only the end of the answer.
MAX_PARALLEL_CALLS = 8
# Arguments laid out as the chat template writes past calls (tojson: ", " and ": ", no other whitespace), the layout
# the model was trained on; llguidance's default would let a weak model spend its tokens on whitespace.
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Keywords whose values are schemas (one, a list, or a map of them) that close_schema walks into. allOf is left
# alone: closing each branch would forbid the properties the other branches add.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_VALUES = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "not", "if", "then", "else",
                 "contains", "propertyNames", "additionalItems")


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools: `tools` as the chat template gets them, each function's parameters schema as the
    grammar embeds it (closed: `close_schema`), `choice` ("none", "auto", "required" or a function's name), whether
    several calls may come at once, and whether the request used the legacy `functions` fields."""

    tools: list[dict[str, Any]]
    parameters: dict[str, dict[str, Any]]
    choice: str
    parallel: bool = True
    legacy: bool = False

    @property
    def enforced(self) -> bool:
        """True when a grammar makes the answer one or more calls ("required" or a named function)."""
        return self.choice not in ("none", "auto")

    @property
    def parsed(self) -> bool:
        """True when the answer's <tool_call> blocks become tool calls (every choice but "none")."""
        return self.choice != "none"

    @property
    def max_calls(self) -> int | None:
        """The most calls an answer may make: one for a named function or without parallel calls, else
        MAX_PARALLEL_CALLS when enforced, else unbounded ("auto": the parser keeps what the model writes)."""
        if self.choice in self.parameters or not self.parallel:
            return 1
        return MAX_PARALLEL_CALLS if self.enforced else None

    def parser(self) -> ToolCallParser:
        """A parser for one answer to this request (it keeps `max_calls` calls at most)."""
        return ToolCallParser(self.max_calls, calls_only=self.enforced)

    def answer(self, text: str) -> tuple[dict[str, Any], int]:
        """An answer's assistant message and how many calls it made: content before the first call (None when there
        is none) and `tool_calls`, or with `legacy` the one call as `function_call`, as OpenAI's legacy answer."""
        content, calls = parse_tool_calls(self.parser(), text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls and self.legacy:
            message["function_call"] = calls[0].message()["function"]
        elif calls:
            message["tool_calls"] = [call.message() for call in calls]
        return message, len(calls)

    def delta(self, event: Event) -> dict[str, Any]:
        """A parser event as a stream chunk's delta: content, a call's head (id, type, name) or a piece of its
        arguments (OpenAI's incremental tool_calls shape; with `legacy`, function_call's)."""
        if isinstance(event, str):
            return {"content": event}
        piece = event.head() if isinstance(event, ToolCall) else event.delta()
        if self.legacy:
            return {"function_call": {k: v for k, v in piece["function"].items() if k == "arguments" or v}}
        return {"tool_calls": [piece]}

    def finish_reason(self, reason: str, calls: int) -> str:
        """"tool_calls" ("function_call" with `legacy`) for an answer that ended on its own after making calls;
        else the completion's own reason ("length" for a call cut short)."""
        if calls and reason == "stop":
            return "function_call" if self.legacy else "tool_calls"
        return reason

    def grammar(self, special_tags: bool) -> str:
        """The Lark grammar (llguidance's dialect) of the answers this choice allows: `max_calls` blocks at most,
        one per line as the template writes them, each naming a function and giving arguments that follow its
        parameters schema; nothing before the first block, nothing after the last (the answer ends there).

        `special_tags`: the tokenizer has <tool_call> and </tool_call> as tokens of their own (Qwen's do): the grammar
        names those tokens, the ones the model was trained to emit (llguidance treats added tokens as special, so a
        quoted "<tool_call>" would only match it spelled out in pieces)."""
        names = [self.choice] if self.choice in self.parameters else list(self.parameters)
        start, end = (START, END) if special_tags else (json.dumps(START), json.dumps(END))
        more = (self.max_calls or MAX_PARALLEL_CALLS) - 1
        lines = ["start: call" + (f' ("\\n" call){{0,{more}}}' if more else ""),
                 "call: " + " | ".join(f"call_{i}" for i in range(len(names)))]
        for i, name in enumerate(names):
            head = json.dumps('\n{"name": ' + json.dumps(name) + ', "arguments": ')
            lines.append(f'call_{i}: {start} {head} args_{i} "}}\\n" {end}')
            lines.append(f"args_{i}: %json {json.dumps(grammar_schema(self.parameters[name]), ensure_ascii=False)}")
        return "\n".join(lines) + "\n"


def grammar_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameters schema as the grammar embeds it: the template's JSON layout (a schema's own x-guidance wins)."""
    return {"x-guidance": TEMPLATE_JSON, **schema}


def close_schema(schema: Any) -> Any:
    """`schema` with every object that lists "properties" and says nothing of others closed
    (additionalProperties: false), at any depth: unlisted properties are refused, as vLLM's default backend
    (xgrammar, strict mode) refuses them. Without it a weak model adds keys until max_tokens. A schema that allows
    other properties (additionalProperties or unevaluatedProperties given) keeps its word."""
    if isinstance(schema, list):
        return [close_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: close_schema(item) for name, item in value.items()}
        else:
            out[key] = close_schema(value) if key in SCHEMA_VALUES else value
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def tool_request(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
                 ) -> ToolRequest | None:
    """The checked tools of a request, or None without tools; 400 naming the field for a malformed tool, a
    parameters schema that does not compile, or a tool_choice that names no tool."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "tools must be a non-empty list (leave it out for no tools)", param="tools")
    rendered, parameters = [], {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise APIError(400, f"{where}: unknown field {sorted(unknown)[0]!r}", param="tools")
        name, schema = checked_function(tool.get("function"), f"{where}.function", "tools", parameters)
        parameters[name] = schema
        rendered.append({"type": "function", "function": tool["function"]})
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or set(choice) - {"type", "function"}:
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                                '{"name": ...}}', param="tool_choice")
        choice = function.get("name")
        if choice not in parameters:
            raise APIError(400, f"tool_choice names {choice!r:.80}, which is not one of the tools "
                                f"{sorted(parameters)}", param="tool_choice")
    elif choice not in CHOICES:
        raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r:.80}',
                       param="tool_choice")
    return ToolRequest(rendered, parameters, choice, True if parallel_tool_calls is None else parallel_tool_calls)


def answer_stops(tools: ToolRequest | None, stops: str | Sequence[Any] | None) -> tuple[Any, ...]:
    """The stop strings (or stop token ids) that may end an answer to a request with `tools`: none when a grammar
    forces the answer to be calls. A forced answer has no text for a stop to end, and one matched inside a call
    (`stop: ["\\n"]` before its JSON, a "}" inside it) left no call or broken JSON; the grammar ends the answer after
    its last call. Every route with tools takes its stops through here (OpenAI's stop and stop_token_ids,
    Anthropic's stop_sequences). Stops left out are still refused where they are malformed, as they would be without
    tools (the document's ranges hold whatever tool_choice says)."""
    if stops is None:
        return ()
    stops = (stops,) if isinstance(stops, str) else tuple(stops)
    if tools is not None and tools.enforced:
        field = "stop" if all(isinstance(s, str) for s in stops) else "stop_token_ids"
        SamplingParams(max_tokens=1, **{field: stops}).validate()
        return ()
    return stops


def answer_format(tools: ToolRequest | None, structured: Structured | None, field: str | None) -> Structured | None:
    """The request's own output constraint (from `field`) for this answer: none from an output format
    (response_format, text.format) when tool_choice forces calls. The forced turn is calls (the tool grammar); the
    format is for the text turns after it, and clients send it on every turn (openai-agents sends an Agent's
    output_type with its forced tool). A constraint for this very answer (vLLM's structured_outputs) stays, and with
    a forced tool_choice it is a 400 naming it (`ServeContext.answer_constraint`)."""
    forced = tools is not None and tools.enforced
    return None if forced and field in OUTPUT_FORMATS else structured


def banned_words(tools: ToolRequest | None, constrained: bool) -> tuple[str, ...]:
    """What an answer to a request with `tools` may not write (vLLM's bad_words): the <tool_call> tag under
    tool_choice "none". The tools are still rendered, so the model may begin a call that nothing parses and its
    markup would reach the content; with the tag's own token (Qwen's tokenizers) that token is never sampled. A
    request that constrains its own answer (`constrained`: its grammar may write the tag) keeps its word."""
    return (START,) if tools is not None and tools.choice == "none" and not constrained else ()


def checked_function(function: Any, where: str, param: str, seen: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A function definition's name and its closed parameters schema; 400 naming `param` when it is malformed, its
    name is in `seen`, or its schema does not compile."""
    if not isinstance(function, dict):
        raise APIError(400, f"{where} must be an object", param=param)
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise APIError(400, f"{where}: unknown field {sorted(unknown)[0]!r}", param=param)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise APIError(400, f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}", param=param)
    if name in seen:
        raise APIError(400, f"{where}.name {name!r} is given twice", param=param)
    if not isinstance(function.get("description", ""), str):
        raise APIError(400, f"{where}.description must be a string", param=param)
    if not isinstance(function.get("strict", False), bool):
        raise APIError(400, f"{where}.strict must be a boolean", param=param)
    schema = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(schema, dict):
        raise APIError(400, f"{where}.parameters must be a JSON schema (an object)", param=param)
    schema = close_schema(schema)
    error = schema_error(grammar_schema(schema))
    if error:
        raise APIError(400, f"{where}.parameters is not a JSON schema this server compiles: {error}", param=param)
    return name, schema


def legacy_tool_request(functions: Any, function_call: Any) -> ToolRequest:
    """OpenAI's deprecated `functions` / `function_call` as the tools they stand for: each function a tool,
    "none" / "auto" / {"name": ...} as tool_choice, one call at most (the legacy answer has one function_call);
    400 naming functions or function_call."""
    if not isinstance(functions, list) or not functions:
        raise APIError(400, "functions must be a non-empty list of function definitions", param="functions")
    parameters: dict[str, Any] = {}
    for i, function in enumerate(functions):
        name, parameters[name] = checked_function(function, f"functions[{i}]", "functions", parameters)
    choice = "auto" if function_call is None else function_call
    if isinstance(choice, dict):
        if set(choice) != {"name"} or choice["name"] not in parameters:
            raise APIError(400, f'function_call must be "none", "auto" or {{"name": <one of {sorted(parameters)}>}}, '
                                f'got {choice!r:.80}', param="function_call")
        choice = choice["name"]
    elif choice not in ("none", "auto"):
        raise APIError(400, f'function_call must be "none", "auto" or {{"name": ...}}, got {choice!r:.80}',
                       param="function_call")
    return ToolRequest([{"type": "function", "function": f} for f in functions], parameters, choice, parallel=False,
                       legacy=True)


def schema_error(schema: dict[str, Any]) -> str:
    """Why llguidance cannot compile `schema` (what the grammar of a call embeds), or "" when it can; on a machine
    without llguidance, what to install (the 400 a constrained request gets there too), never an ImportError."""
    try:
        matcher = llguidance_module().LLMatcher
        return matcher.validate_grammar(matcher.grammar_from_json_schema(schema))
    except (ValueError, TypeError, StructuredOutputError) as error:
        return str(error)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages in the form Qwen-style templates read (as vLLM hands them over): an assistant message's
    tool-call arguments as an object, not OpenAI's JSON string (the template writes them with `tojson`), and its
    missing content as "" (Qwen3's template searches it for </think>); the legacy forms (an assistant's
    `function_call`, a `role: "function"` result) as tool calls and tool results. Arguments that are not a JSON
    object stay the string they are (`json_object`)."""
    out = []
    for i, message in enumerate(messages):
        message = legacy_message(message)
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if message.get("role") == "assistant" and message.get("content") is None:  # OpenAI's: optional there
            message = {**message, "content": ""}
        if calls:
            if not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls must be a list", param="messages")
            message = {**message, "content": message.get("content") or "", "tool_calls": [
                template_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]}
        out.append(message)
    return out


def legacy_message(message: Any) -> Any:
    """A legacy function-calling message in the tool form (an assistant's function_call as its one tool call, a
    "function" role's result as a tool result); any other message as it is."""
    if not isinstance(message, dict):
        return message
    if message.get("role") == "assistant" and message.get("function_call") is not None and not message.get(
            "tool_calls"):
        rest = {k: v for k, v in message.items() if k != "function_call"}
        call = message["function_call"]
        name = call.get("name") if isinstance(call, dict) else None
        return {**rest, "tool_calls": [{"id": f"call_{name}", "type": "function", "function": call}]}
    if message.get("role") == "function":  # the result of the last call of that name
        return {"role": "tool", "tool_call_id": f"call_{message.get('name')}", "name": message.get("name"),
                "content": message.get("content") or ""}  # null: a function that returned nothing
    return message


def template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"arguments\": ...}}}}", param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json_object(arguments) if arguments.strip() else {}
    elif not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a string (or a JSON object)", param="messages")
    return {**call, "function": {**function, "arguments": arguments}}


def json_object(text: str) -> dict[str, Any] | str:
    """The object a past call's arguments spell, or the text itself when it is not a JSON object: a call a client
    replays may be one cut short (its own or another server's), and refusing it would end an agent's loop; Qwen3's
    template writes a string as it is, Qwen2.5's as a JSON string."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
