"""The Hermes-style `<tool_call>` blocks of an answer read into OpenAI's tool calls, as the text streams.

Qwen2.5 and Qwen3 answer a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (their chat
templates say so and render past calls that way), the format vLLM's `hermes` parser reads. What the answer becomes,
as vLLM's hermes parser makes it: `content` is the text before the first `<tool_call>` (None when empty or only
whitespace); from that tag on the answer is calls, and text between or after blocks is dropped (vLLM's non-streamed
parser keeps only the text before the first tag too). Where vLLM's non-streamed parser returns the whole answer,
markup included, as content when any block fails to parse, here a block that is not a call is dropped (as vLLM's
streamed parser drops it): `content` holds `<tool_call>` markup only where a call was cut short (below).

One parser serves both shapes of the answer: `ToolCallParser` reads text as it streams, and the whole answer is the
same parser fed once, so a streamed answer accumulates to exactly the non-streamed one (a call cut short aside). A
block written in the template's layout (`{"name": "f", "arguments": {`) starts a call as soon as its name is
complete, and its arguments are the JSON text the model writes, passed on as it arrives and ending where that object
closes; a block in any other layout becomes a call when its JSON object closes, if it is one (a string "name", an
object "arguments"), its arguments re-encoded.

A call whose arguments never closed (max_tokens, a stop string, or the end tag inside them) is no call: the whole
answer (`parse_tool_calls`) returns it as content, the text the model wrote from its `<tool_call>` tag on, so a
client never gets (nor sends back) arguments that are not JSON. A stream has sent its head and arguments by the time
the cut is known; it keeps them as they went out, and finish_reason ("length" at max_tokens) tells the client.

Which calls a request allows, and the grammar that enforces them, are `tool_calls.py`'s.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

START, END = "<tool_call>", "</tool_call>"
# A call's head in the template's layout; the arguments object starts at its last character.
HEAD_START, HEAD_END = '{"name": "', '", "arguments": {'
HEAD = re.compile(re.escape(HEAD_START) + r"([A-Za-z0-9_-]{1,64})" + re.escape(HEAD_END))


@dataclass
class ToolCall:
    """One call of an answer: its position among the answer's calls, id, function name and arguments (the JSON
    text the model wrote, grown as it streams); `complete` once that JSON object has closed; `written`, once its
    block ended, the block's text as the model wrote it (the content a call that never closed becomes)."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False
    written: str = ""

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
    _written: str = ""  # the open block's text so far, from its <tool_call> tag on
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
        if self._block == "args":
            self.calls[-1].written = self._written + self._pending
        self._pending, self._blank, self._block, self._object, self._written = "", "", None, "", ""
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
        self._written = START
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
            read = len(self._pending) - len(text) + head.end() - 1
            self._written += self._pending[:read]
            self._pending, self._block = self._pending[read:], "args"  # from the arguments' "{"
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
        self._written += piece
        call = self.calls[-1] if self._block == "args" else None
        if call is not None and piece:
            call.arguments += piece
            events.append(Arguments(call.index, piece))
        elif call is None:
            self._object += piece
        if state == "open" or state == "stopped" and END.startswith(self._pending) and len(self._pending) < len(END):
            return False  # more to come, or maybe the end tag
        if call is not None:
            call.complete, call.written = state == "closed", self._written
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
    streaming parser fed the whole answer once; a call whose JSON never closed is content (the text it was written
    as, after the text before the first call), never a call."""
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    content += "".join(call.written for call in parser.calls if not call.complete)
    return (content or None), [call for call in parser.calls if call.complete]
