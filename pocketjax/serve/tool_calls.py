"""Tool calling on /v1/chat/completions: the request's tools checked, the grammar that enforces a call, the messages
the chat template reads, and the Hermes-style `<tool_call>` blocks of the answer parsed into OpenAI's tool calls.

Qwen2.5 and Qwen3 answer a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (their chat
templates say so and render past calls that way), the format vLLM's `hermes` parser reads. `tool_choice` "required"
or a named function is enforced by a Lark grammar of such blocks whose arguments follow each tool's parameters
schema (llguidance's `%json`), so the answer always parses; "auto" leaves the model free and parses what it writes;
"none" parses nothing (the tools are still rendered, as vLLM renders them by default).

One parser serves both shapes of the answer: `ToolCallParser` reads text as it streams, and the whole answer is the
same parser fed once, so a streamed answer accumulates to exactly the non-streamed one. A block becomes a call when
it closes (or the answer ends) and its JSON is an object with a string "name" and an object "arguments"; any other
block stays in the content, markup included, as vLLM leaves it. A call's arguments are the JSON text the model wrote
for them (what OpenAI's clients `json.loads`).
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
# Arguments laid out as the chat template writes past calls (tojson: ", " and ": ", no other whitespace), the layout
# the model was trained on; llguidance's default would let a weak model spend its tokens on whitespace.
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The arguments' text inside a block as Qwen's template writes it: {"name": "...", "arguments": <this>}
ARGUMENTS = re.compile(r'^\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"arguments"\s*:\s*(.*?)\s*\}$', re.S)


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools: `tools` as the chat template gets them, each function's parameters schema,
    `choice` ("none", "auto", "required" or a function's name) and whether several calls may come at once."""

    tools: list[dict[str, Any]]
    parameters: dict[str, dict[str, Any]]
    choice: str
    parallel: bool = True

    @property
    def enforced(self) -> bool:
        """True when a grammar makes the answer one or more calls ("required" or a named function)."""
        return self.choice not in ("none", "auto")

    @property
    def parsed(self) -> bool:
        """True when the answer's <tool_call> blocks become tool calls (every choice but "none")."""
        return self.choice != "none"

    def grammar(self, special_tags: bool) -> str:
        """The Lark grammar (llguidance's dialect) of the answers this choice allows: one block per call, each
        naming a function and giving arguments that follow its parameters schema; one call unless `parallel`.

        `special_tags`: the tokenizer has <tool_call> and </tool_call> as tokens of their own (Qwen's do): the grammar
        names those tokens, the ones the model was trained to emit (llguidance treats added tokens as special, so a
        quoted "<tool_call>" would only match it spelled out in pieces)."""
        names = [self.choice] if self.choice in self.parameters else list(self.parameters)
        start, end = (START, END) if special_tags else (json.dumps(START), json.dumps(END))
        more = ' ("\\n" call)*' if self.parallel else ""  # calls one per line, as the template writes them
        lines = [f"start: call{more}", "call: " + " | ".join(f"call_{i}" for i in range(len(names)))]
        for i, name in enumerate(names):
            head = json.dumps('\n{"name": ' + json.dumps(name) + ', "arguments": ')
            lines.append(f'call_{i}: {start} {head} args_{i} "}}\\n" {end}')
            schema = {"x-guidance": TEMPLATE_JSON, **self.parameters[name]}
            lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        return "\n".join(lines) + "\n"


def tool_request(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
                 ) -> ToolRequest | None:
    """The checked tools of a request, or None without tools; 400 naming the field for a malformed tool, a
    parameters schema that does not compile, or a tool_choice that names no tool."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not tools:
        raise APIError(400, "tools must not be empty (leave it out for no tools)", param="tools")
    rendered, parameters = [], {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise APIError(400, f"{where}: unknown field {sorted(unknown)[0]!r}", param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object", param="tools")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise APIError(400, f"{where}.function: unknown field {sorted(unknown)[0]!r}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}",
                           param="tools")
        if name in parameters:
            raise APIError(400, f"{where}.function.name {name!r} is given twice", param="tools")
        if not isinstance(function.get("description", ""), str):
            raise APIError(400, f"{where}.function.description must be a string", param="tools")
        if not isinstance(function.get("strict", False), bool):
            raise APIError(400, f"{where}.function.strict must be a boolean", param="tools")
        schema = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema (an object)", param="tools")
        error = schema_error(schema)
        if error:
            raise APIError(400, f"{where}.function.parameters is not a JSON schema this server compiles: {error}",
                           param="tools")
        parameters[name] = schema
        rendered.append({"type": "function", "function": function})
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
    missing content as "" (Qwen3's template searches it for </think>). 400 for arguments that are not a JSON object."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if calls:
            if not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls must be a list", param="messages")
            message = {**message, "content": message.get("content") or "", "tool_calls": [
                template_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]}
        out.append(message)
    return out


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


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: its position among the answer's calls, id, function name and arguments (JSON text)."""

    index: int
    id: str
    name: str
    arguments: str

    def message(self) -> dict[str, Any]:
        """The call as message.tool_calls lists it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self) -> list[dict[str, Any]]:
        """The call as a stream sends it (OpenAI's incremental shape): index, id, type and name with empty
        arguments first, then the arguments (clients append every fragment of an index)."""
        return [{"index": self.index, "id": self.id, "type": "function",
                 "function": {"name": self.name, "arguments": ""}},
                {"index": self.index, "function": {"arguments": self.arguments}}]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_block(body: str, index: int) -> ToolCall | None:
    """The call a block's text (between the tags) spells, or None when it is not one."""
    text = body.strip()
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments")  # other keys are ignored, as vLLM's hermes parser ignores them
    if not isinstance(arguments, dict):
        return None
    raw = ARGUMENTS.match(text)
    written = raw.group(1) if raw else None
    try:  # the model's own text when the layout is the template's, else the value re-encoded
        exact = written is not None and json.loads(written) == arguments
    except ValueError:
        exact = False
    return ToolCall(index, call_id(), value["name"], written if exact else json.dumps(arguments, ensure_ascii=False))


@dataclass
class ToolCallParser:
    """Reads an answer's text piece by piece: `feed(text)` and, at the end, `finish()` each return the events
    ready to send: content text (str) and complete calls (ToolCall), in order.

    Content is released as soon as it cannot be the start of a <tool_call> tag; a block is held until it closes as a
    call (or a new block or the end shows it is not one). Content that is only whitespace is held until something
    else comes: an answer that is only calls has no content.
    """

    calls: list[ToolCall] = field(default_factory=list)
    _pending: str = ""  # text not yet released: a possible tag start, or an open block
    _blank: str = ""  # whitespace-only content held back (no visible content sent yet)
    _shown: bool = False  # visible content has been sent

    def feed(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        events: list[str | ToolCall] = []
        while self._pending:
            if not self._pending.startswith(START):
                start = self._pending.find(START)
                if start < 0:
                    keep = partial_tag(self._pending, START)
                    self._content(self._pending[:len(self._pending) - keep], events)
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                self._content(self._pending[:start], events)
                self._pending = self._pending[start:]
            if not self._close(events):
                break
        return events

    def _close(self, events: list[str | ToolCall]) -> bool:
        """End the open block at the first </tool_call> before which its text is a call (a JSON string may spell
        the tag out); False while it may still become one. A block that a new <tool_call> interrupts is content."""
        pending = self._pending
        nested = pending.find(START, len(START))
        end = pending.find(END, len(START))
        while end >= 0 and (nested < 0 or end < nested):
            call = parse_block(pending[len(START):end], len(self.calls))
            if call is not None:
                self.calls.append(call)
                events.append(call)
                self._pending = pending[end + len(END):]
                return True
            end = pending.find(END, end + 1)
        if nested >= 0:
            self._content(pending[:nested], events)
            self._pending = pending[nested:]
            return True
        return False

    def finish(self) -> list[str | ToolCall]:
        """The rest: an unclosed block is a call if its text is one (the answer was cut after the JSON), else
        content; held whitespace is content only if the answer made no call."""
        events: list[str | ToolCall] = []
        rest, self._pending = self._pending, ""
        body = rest[len(START):]
        body = body[:len(body) - partial_tag(body, END)]
        call = parse_block(body, len(self.calls)) if rest.startswith(START) else None
        if call is not None:
            self.calls.append(call)
            events.append(call)
        else:
            self._content(rest, events)
        if self._blank and not self.calls:
            events.append(self._blank)
        self._blank = ""
        return events

    def _content(self, text: str, events: list[str | ToolCall]) -> None:
        if not text:
            return
        if not self._shown and not text.strip():
            self._blank += text
            return
        events.append(self._blank + text)
        self._blank, self._shown = "", True


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer's content (None when it is empty or only whitespace around calls) and its calls."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None), parser.calls
