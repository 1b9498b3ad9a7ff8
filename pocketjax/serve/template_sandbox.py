"""Chat-template rendering with a deadline and size bounds: a template is code, from a checkpoint or a request.

Jinja's sandbox keeps a template away from Python's internals but not from spending: nested `range` loops run
10^10 iterations, `"x" * 10**9` or `"a".ljust(10**9)` allocate a gigabyte in one C call, and `10 ** 10 ** 8` is
folded while the template compiles. Here, inside `render`:
- every size-amplifying step is checked before it runs where its size can be known (`*`, `**`, `%`, widths and
  counts passed to calls and filters, `join`, `replace`, `indent`, `expandtabs`) and right after it otherwise (`+`,
  `~`, every call's and filter's result, namespace assignments, block captures, the output), against `max_chars`;
- nothing is folded at compile time (`optimized=False`, and filters refuse to run outside a render), so compiling
  stays cheap and every step is checked;
- a wall-clock deadline is checked at each of those points, and a pure loop that touches none of them is stopped by
  an exception raised asynchronously in the rendering thread (`PyThreadState_SetAsyncExc`), which the interpreter
  delivers at the loop's next backward jump.
A template over a limit raises `RenderLimitError` (a BaseException, so no `except Exception` inside Jinja swallows
it); `Tokenizer.apply_chat_template` turns it into a RequestError.
"""
from __future__ import annotations

import contextvars
import ctypes
import functools
import math
import operator
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jinja2.compiler import CodeGenerator
from jinja2.nodes import Impossible
from jinja2.sandbox import ImmutableSandboxedEnvironment

WIDTH_IN_FORMAT = re.compile(r"\d{6,}")  # a printf/format width of 10^5 or more: "%0999999d", "{:>999999}"


@dataclass(frozen=True)
class RenderLimits:
    """How much one render may spend: wall-clock seconds, characters in the output or any value it builds, and the
    largest integer argument a call or filter may take (widths, counts). Defaults fit every Qwen template (their
    renders take well under a millisecond and a few kB per message)."""

    seconds: float = 2.0
    max_chars: int = 1 << 22
    max_int_arg: int = 100_000
    max_int_bits: int = 4096


DEFAULT_LIMITS = RenderLimits()


class RenderLimitError(BaseException):
    """A template exceeded its RenderLimits (time, size)."""


class RenderTimeout(RenderLimitError):
    """Raised asynchronously in the rendering thread at the deadline (PyThreadState_SetAsyncExc needs a class)."""


@dataclass(frozen=True)
class _Budget:
    deadline: float
    limits: RenderLimits


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("pocketjax_render_budget", default=None)


def _budget() -> _Budget | None:
    budget = _BUDGET.get()
    if budget is not None and time.monotonic() > budget.deadline:
        raise RenderLimitError(f"chat template rendering took longer than {budget.limits.seconds:g} s")
    return budget


def _too_big(what: str, size: int, limit: int) -> RenderLimitError:
    return RenderLimitError(f"chat template would build {what} of {size:,} (limit {limit:,})")


def checked(value: Any) -> Any:
    """`value` once its size is within the render's limits (strings, lists, dicts by length; ints by bits)."""
    budget = _budget()
    if budget is None:
        return value
    if isinstance(value, (str, list, tuple, dict)) and len(value) > budget.limits.max_chars:
        raise _too_big("a value", len(value), budget.limits.max_chars)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > budget.limits.max_int_bits:
        raise _too_big("an integer of bits", value.bit_length(), budget.limits.max_int_bits)
    return value


def _estimate(name: str, target: Any, args: tuple, kwargs: dict) -> int | None:
    """Characters a known amplifying string operation would produce (None: not one of them)."""
    if not isinstance(target, str):
        if name == "join" and isinstance(target, (list, tuple)):  # the `join` filter: (items, sep)
            sep = args[0] if args and isinstance(args[0], str) else ""
            return sum(len(x) if isinstance(x, str) else 32 for x in target) + len(sep) * len(target)
        return None
    if name == "join" and args and isinstance(args[0], (list, tuple)):  # str.join(items)
        return sum(len(x) if isinstance(x, str) else 32 for x in args[0]) + len(target) * len(args[0])
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = len(target) + 1 if not args[0] else target.count(args[0])
        return len(target) + count * max(len(args[1]) - len(args[0]), 0)
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return len(target) + (target.count("\n") + 1) * max(width, 0)
    if name == "expandtabs":
        size = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        return len(target) + target.count("\t") * max(size, 0) if isinstance(size, int) else None
    if name in ("format", "format_map") and WIDTH_IN_FORMAT.search(target):
        return 1 << 62
    return None


def _precheck(name: str, target: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a call or filter whose arguments alone say it would exceed the limits."""
    budget = _budget()
    if budget is None:
        return
    limits = budget.limits
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > limits.max_int_arg:
            raise RenderLimitError(f"chat template passed {arg:,} to {name or 'a call'} (limit {limits.max_int_arg:,})")
        if isinstance(arg, str) and name in ("format", "format_map") and WIDTH_IN_FORMAT.search(arg):
            raise RenderLimitError("chat template used a format width past the limit")
    size = _estimate(name, target, args, kwargs)
    if size is not None and size > limits.max_chars:
        raise _too_big(f"a string by {name}", size, limits.max_chars)


def _binop(op: str, left: Any, right: Any) -> Any:
    budget = _budget()
    if budget is not None:
        limits = budget.limits
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > limits.max_chars:
                    raise _too_big("a repeated sequence", len(seq) * n, limits.max_chars)
            if ints and left.bit_length() + right.bit_length() > limits.max_int_bits:
                raise _too_big("a product of bits", left.bit_length() + right.bit_length(), limits.max_int_bits)
        elif op == "**" and ints and abs(left) > 1 and right > 0:
            bits = right * math.log2(abs(left))
            if bits > limits.max_int_bits:
                raise _too_big("a power of bits", int(bits), limits.max_int_bits)
        elif op == "%" and isinstance(left, str) and WIDTH_IN_FORMAT.search(left):
            raise RenderLimitError("chat template used a format width past the limit")
    return checked(BINOPS[op](left, right))


BINOPS: dict[str, Callable[[Any, Any], Any]] = {"*": operator.mul, "**": operator.pow, "%": operator.mod,
                                                 "+": operator.add}


class _BoundedBuffer(list):
    """A block's output pieces (captures, macro bodies), counted as they come: a capture stops at the size limit
    when it reaches it, not at the deadline, so its memory does not follow the interpreter's speed."""

    size = 0

    def append(self, piece: Any) -> None:
        self.size += len(piece) if isinstance(piece, str) else 0
        budget = _budget()
        if budget is not None and self.size > budget.limits.max_chars:
            raise _too_big("a captured block", self.size, budget.limits.max_chars)
        super().append(piece)

    def extend(self, pieces: Any) -> None:
        for piece in pieces:
            self.append(piece)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with every `~` join passed through `checked` and block buffers counted as they fill."""

    def buffer(self, frame: Any) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.bounded_buffer()")

    def visit_Concat(self, node: Any, frame: Any) -> None:  # noqa: N802 - Jinja's visitor naming
        self.write("environment.checked(")
        super().visit_Concat(node, frame)
        self.write(")")


def _bounded_filter(name: str, fn: Callable) -> Callable:
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/environment comes first

    @functools.wraps(fn)
    def filter_(*args: Any, **kwargs: Any) -> Any:
        if _BUDGET.get() is None:  # Jinja folding a constant at compile time: leave it to the bounded render
            raise Impossible()
        target, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        _precheck(name, target, rest, kwargs)
        return checked(fn(*args, **kwargs))

    return filter_


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `render`'s bounds applied to operators, calls, filters, joins and captures."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(BINOPS)

    def __init__(self, *args: Any, **kwargs: Any):
        # no constant folding: Jinja's optimizer would run filters and calls on constants at compile time, unbounded
        super().__init__(*args, optimized=False, **kwargs)
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}

    @staticmethod
    def checked(value: Any) -> Any:
        return checked(value)

    @staticmethod
    def bounded_buffer() -> _BoundedBuffer:
        return _BoundedBuffer()

    @staticmethod
    def concat(pieces: Any) -> str:  # block captures, macro bodies: joined only if the sum fits
        pieces = list(pieces)
        budget = _budget()
        if budget is not None:
            size = sum(len(p) for p in pieces)
            if size > budget.limits.max_chars:
                raise _too_big("a captured block", size, budget.limits.max_chars)
        return "".join(pieces)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return _binop(operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's names
        # str.format reaches here wrapped by the sandbox (`__wrapped__` is the bound method)
        target = getattr(__obj, "__self__", None) or getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
        _precheck(getattr(__obj, "__name__", ""), target, args, kwargs)
        return checked(super().call(__context, __obj, *args, **kwargs))

    def add_filter(self, name: str, fn: Callable) -> None:
        self.filters[name] = _bounded_filter(name, fn)


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in another thread at its next bytecode boundary (None: clear a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def render(template: Any, variables: dict[str, Any], limits: RenderLimits = DEFAULT_LIMITS) -> str:
    """`template.render(**variables)` within `limits`; raises RenderLimitError past any of them."""
    thread, lock, state = threading.get_ident(), threading.Lock(), {"done": False, "fired": False}

    def interrupt() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _raise_in(thread, RenderTimeout)

    token = _BUDGET.set(_Budget(time.monotonic() + limits.seconds, limits))
    timer = threading.Timer(limits.seconds, interrupt)
    timer.daemon = True
    try:
        try:
            timer.start()
            pieces, size = [], 0
            for piece in template.generate(**variables):
                size += len(piece)
                if size > limits.max_chars:
                    raise _too_big("an output of characters", size, limits.max_chars)
                pieces.append(piece)
            return "".join(pieces)
        finally:
            with lock:
                state["done"] = True
                if state["fired"]:
                    _raise_in(thread, None)  # not delivered yet: drop it (delivered: it is being raised here)
            timer.cancel()
            _BUDGET.reset(token)
    except RenderTimeout:
        raise RenderLimitError(f"chat template rendering took longer than {limits.seconds:g} s") from None
