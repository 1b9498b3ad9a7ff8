"""Tool calling on /v1/chat/completions (and the other endpoints that take tools): the request's tools checked, the
grammar that enforces calls, the messages the chat template reads, and the Hermes-style `<tool_call>` blocks of the
answer parsed into OpenAI's tool calls.

Qwen2.5 and Qwen3 answer a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (their chat
templates say so and render past calls that way), the format vLLM's `hermes` parser reads. `tool_choice` "required"
or a named function is enforced by a Lark grammar of such blocks whose arguments follow each tool's parameters
schema (llguidance's `%json`), so the answer always parses; "auto" leaves the model free and parses what it writes;
"none" parses nothing (the tools are still rendered, as vLLM renders them by default).

What the answer becomes, as vLLM's hermes parser makes it: `content` is the text before the first `<tool_call>`
(None when empty or only whitespace); from that tag on the answer is calls, and text between or after blocks is
dropped (vLLM's non-streamed parser keeps only the text before the first tag too). Where vLLM's non-streamed parser
returns the whole answer, markup included, as content when any block fails to parse, here a block that is not a
call is dropped (as vLLM's streamed parser drops it): `content` never holds `<tool_call>` markup.

One parser serves both shapes of the answer: `ToolCallParser` reads text as it streams, and the whole answer is the
same parser fed once, so a streamed answer accumulates to exactly the non-streamed one. A block written in the
template's layout (`{"name": "f", "arguments": {`) starts a call as soon as its name is complete, and its arguments
are the JSON text the model writes, passed on as it arrives and ending where that object closes; a block in any
other layout becomes a call when its JSON object closes, if it is one (a string "name", an object "arguments"), its
arguments re-encoded. An answer cut inside a call's arguments (max_tokens) keeps the call with the arguments written
so far, as vLLM returns a forced call cut short (finish_reason "length" tells the client).
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .api_error import APIError

START, END = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (they go into the grammar as literals)
CHOICES = ("none", "auto", "required")
# Calls one answer may make under "required" with parallel_tool_calls (OpenAI and vLLM state none): a weak model
# repeats a call until max_tokens otherwise; after the 8th the grammar allows only the end of the answer.
MAX_PARALLEL_CALLS = 8
# Arguments laid out as the chat template writes past calls (tojson: ", " and ": ", no other whitespace), the layout
# the model was trained on; llguidance's default would let a weak model spend its tokens on whitespace.
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A call's head in the template's layout; the arguments object starts at its last character.
HEAD_START, HEAD_END = '{"name": "', '", "arguments": {'
HEAD = re.compile(re.escape(HEAD_START) + r"([A-Za-z0-9_-]{1,64})" + re.escape(HEAD_END))
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
    """Why llguidance cannot compile `schema` (what the grammar of a call embeds), or "" when it can."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
    except (ValueError, TypeError) as error:
        return str(error)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages in the form Qwen-style templates read (as vLLM hands them over): an assistant message's
    tool-call arguments as an object, not OpenAI's JSON string (the template writes them with `tojson`), and its
    missing content as "" (Qwen3's template searches it for </think>); the legacy forms (an assistant's
    `function_call`, a `role: "function"` result) as tool calls and tool results. 400 for arguments that are not a
    JSON object."""
    out = []
    for i, message in enumerate(messages):
        message = legacy_message(message)
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
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
                "content": message.get("content")}
    return message


def template_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"arguments\": ...}}}}", param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            raise APIError(400, f"{where}.function.arguments is not JSON: {error}", param="messages") from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object", param="messages")
    return {**call, "function": {**function, "arguments": arguments}}


@dataclass
class ToolCall:
    """One call of an answer: its position among the answer's calls, id, function name and arguments (the JSON
    text the model wrote, grown as it streams); `complete` once that JSON object has closed."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def message(self) -> dict[str, Any]:
        """The call as message.tool_calls lists it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def head(self) -> dict[str, Any]:
        """The call's first stream delta (OpenAI's incremental shape): index, id, type and name, no arguments yet."""
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": ""}}


@dataclass(frozen=True)
class Arguments:
    """A piece of a call's arguments as the model wrote it (the call's `index`): clients append the pieces."""

    index: int
    text: str

    def delta(self) -> dict[str, Any]:
        return {"index": self.index, "function": {"arguments": self.text}}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_block(body: str, index: int) -> ToolCall | None:
    """The call a block's JSON text (any layout) spells, its arguments re-encoded, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments")  # other keys are ignored, as vLLM's hermes parser ignores them
    if not isinstance(arguments, dict):
        return None
    return ToolCall(index, call_id(), value["name"], json.dumps(arguments, ensure_ascii=False), complete=True)


@dataclass
class JSONScan:
    """Where a JSON object that arrives piece by piece closes: brackets counted outside strings."""

    depth: int = 0
    string: bool = False
    escape: bool = False

    def feed(self, text: str) -> tuple[int, str]:
        """(how many characters of `text` belong to the object, "closed" | "open" | "stopped"): stopped before a
        `<` outside a string (no JSON has one there: the block's end tag, or the next block's start)."""
        for i, char in enumerate(text):
            if self.string:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == '"':
                    self.string = False
            elif char == '"':
                self.string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1, "closed"
            elif char == "<":
                return i, "stopped"
        return len(text), "open"


Event = str | ToolCall | Arguments


@dataclass
class ToolCallParser:
    """Reads an answer's text piece by piece: `feed(text)` and, at the end, `finish()` each return the events ready
    to send, in order: content text (str), a call's start (ToolCall, its arguments still "") and pieces of its
    arguments (Arguments). `max_calls` (None: no bound) drops every block after that many calls. `calls_only`: a grammar
    made the answer calls and nothing else, so no text of it is content (not even a tag cut short by max_tokens).

    Content is released as soon as it cannot be the start of a <tool_call> tag, and only before the first one;
    content that is only whitespace is held until something else comes (an answer that is only calls has none)."""

    max_calls: int | None = None
    calls_only: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    _pending: str = ""  # text not yet handled: a possible tag start, a block's unread text
    _blank: str = ""  # whitespace-only content held back (no visible content sent yet)
    _shown: bool = False  # visible content has been sent
    _calls_began: bool = False  # a <tool_call> tag came: the rest of the answer is calls
    _block: str | None = None  # the open block: "head" (its layout not yet known), "args", "object"; None: none
    _object: str = ""  # an "object" block's JSON text so far
    _scan: JSONScan = field(default_factory=JSONScan)

    def __post_init__(self) -> None:
        self._calls_began = self.calls_only

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._step(events):
            pass
        return merged_arguments(events)

    def finish(self) -> list[Event]:
        """The rest: held content if the answer made no call; an open call stays as written so far (cut short: its
        arguments do not parse); an open block that is not yet a call is dropped."""
        events: list[Event] = []
        if not self._calls_began and self._blank + self._pending:
            events.append(self._blank + self._pending)
        self._pending, self._blank, self._block, self._object = "", "", None, ""
        return events

    def _step(self, events: list[Event]) -> bool:
        """Handle what `_pending` allows; True when something changed and another step may do more."""
        if not self._calls_began:
            return self._content_step(events)
        if self._block is None:
            return self._next_block()
        if self._block == "head":
            return self._head_step(events)
        return self._body_step(events)

    def _content_step(self, events: list[Event]) -> bool:
        start = self._pending.find(START)
        if start < 0:
            keep = partial_tag(self._pending, START)
            self._content(self._pending[:len(self._pending) - keep], events)
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        self._content(self._pending[:start], events)
        self._blank, self._calls_began = "", True  # whitespace before the calls is no content
        self._pending = self._pending[start:]
        return True

    def _next_block(self) -> bool:
        """Between blocks (or past the last call allowed): skip to the next <tool_call>."""
        full = self.max_calls is not None and len(self.calls) >= self.max_calls
        start = -1 if full else self._pending.find(START)
        if start < 0:
            self._pending = "" if full else self._pending[len(self._pending) - partial_tag(self._pending, START):]
            return False
        self._pending, self._block, self._scan = self._pending[start + len(START):], "head", JSONScan()
        return True

    def _head_step(self, events: list[Event]) -> bool:
        """A block's first text: the template's layout starts a call as soon as its name is complete; any other
        layout is read as a whole JSON object."""
        text = self._pending.lstrip()
        head = HEAD.match(text)
        if head:
            call = ToolCall(len(self.calls), call_id(), head.group(1))
            self.calls.append(call)
            events.append(call)
            self._pending, self._block = text[head.end() - 1:], "args"  # from the arguments' "{"
            return True
        if could_be_head(text):
            return False
        self._block = "object" if text.startswith("{") else None  # not JSON: not a call
        return True

    def _body_step(self, events: list[Event]) -> bool:
        """An open block's arguments ("args": passed on as they come) or whole object ("object": parsed once it
        closes); a `<` outside a string ends a block whose JSON never closed."""
        read, state = self._scan.feed(self._pending)
        piece, self._pending = self._pending[:read], self._pending[read:]
        call = self.calls[-1] if self._block == "args" else None
        if call is not None and piece:
            call.arguments += piece
            events.append(Arguments(call.index, piece))
        elif call is None:
            self._object += piece
        if state == "open" or state == "stopped" and END.startswith(self._pending) and len(self._pending) < len(END):
            return False  # more to come, or maybe the end tag
        if call is not None:
            call.complete = state == "closed"
        elif state == "closed" and (parsed := parse_block(self._object, len(self.calls))) is not None:
            self.calls.append(parsed)
            events += [parsed, Arguments(parsed.index, parsed.arguments)]
        self._block, self._object = None, ""
        return True

    def _content(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if not self._shown and not text.strip():
            self._blank += text
            return
        events.append(self._blank + text)
        self._blank, self._shown = "", True


def merged_arguments(events: list[Event]) -> list[Event]:
    """The events with consecutive pieces of one call's arguments joined (fewer, larger stream chunks)."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, Arguments) and out and isinstance(out[-1], Arguments):
            out[-1] = Arguments(event.index, out[-1].text + event.text)
        else:
            out.append(event)
    return out


def could_be_head(text: str) -> bool:
    """True when `text` (a block's start, leading whitespace removed) may still become a call's head in the
    template's layout."""
    if len(text) <= len(HEAD_START):
        return HEAD_START.startswith(text)
    if not text.startswith(HEAD_START):
        return False
    name = re.match(r"[A-Za-z0-9_-]*", text[len(HEAD_START):]).group()
    return len(name) <= 64 and HEAD_END.startswith(text[len(HEAD_START) + len(name):])


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer's content (None when it is empty, or only whitespace before calls) and its calls: a fresh
    streaming parser fed the whole answer once."""
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None), parser.calls
