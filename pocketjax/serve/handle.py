"""RequestHandle: the caller's view of one submitted request, and the producer interface that feeds it.

Caller side (any thread): iterate token ids (sync or `async for`), `text_stream()`, `result()`, `cancel()`, `done()`.
Producer side (the thread that runs the engine: the Scheduler, or your own loop): `push(tokens)` as they are
generated, then exactly one of `finish(reason)` or `fail(error)`. Tokens and text pieces are kept in lists rather
than queues, so several readers (a token stream, a text stream, result()) can follow one request independently.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..engine.request import BatchedRequest, Completion
from ..errors import ConfigError
from .tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class RequestHandle:
    """A submitted request: stream its tokens (sync or async), wait for its Completion, or cancel it."""

    def __init__(self, request: BatchedRequest, tokenizer: Tokenizer | None = None,
                 on_cancel: Callable[[RequestHandle], None] | None = None):
        self.request = request
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._tokens: list[int] = []
        self._pieces: list[str] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self.cancel_requested = False
        self.queued_at = time.perf_counter()
        self.admitted_at: float | None = None  # when the scheduler gave it a slot (`admitted`)
        self._observer: Any = None  # told of each push and of the end: serve/http/metrics.py's RequestMetrics
        sp = request.sampling
        self._detok = (IncrementalDetokenizer(tokenizer, request.prompt_tokens, sp.skip_special_tokens)
                       if tokenizer else None)
        self._matcher = StopStringMatcher(sp.stop) if tokenizer else None

    @property
    def request_id(self) -> Any:
        return self.request.request_id

    @property
    def cached_prefix_len(self) -> int:
        """Prompt tokens this request found already cached in the engine (prefix reuse) when it was admitted."""
        return self.request.cached_prefix_len

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text (None: no stop string did), which Anthropic's API reports back."""
        return self._matcher.matched if self._matcher is not None else None

    # ---- caller side -------------------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the request finished, failed or was cancelled."""
        return self._completion is not None or self._error is not None

    def cancel(self) -> None:
        """Stop generating: a waiting request leaves the queue now, a running one frees its slot at the next step."""
        if self._on_cancel is not None:
            self._on_cancel(self)
        elif not self.done():
            self.finish("cancelled")

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request ends; raises its error if it failed, TimeoutError if `timeout` passes first."""
        with self._cond:
            if not self._cond.wait_for(self.done, timeout):
                raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._completion

    def __iter__(self) -> Iterator[int]:
        """Token ids as they are produced; raises the request's error at the end if it failed."""
        return self._follow(self._tokens)

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """Token ids as they are produced; TimeoutError when `timeout` seconds pass without a new one."""
        return self._follow(self._tokens, timeout)

    def text_stream(self, timeout: float | None = None) -> Iterator[str]:
        """Text pieces as they are produced (whole characters, cut before any stop string); needs a tokenizer.
        TimeoutError when `timeout` seconds pass without a new piece."""
        if self._detok is None:
            raise ConfigError("text_stream() needs a Scheduler created with a tokenizer")
        return self._follow(self._pieces, timeout)

    def __aiter__(self) -> AsyncIterator[int]:
        """`async for token in handle`: waits on an asyncio.Event the producer sets thread-safely, so no executor
        thread is parked per stream."""
        return self._afollow(self._tokens)

    async def deltas(self) -> AsyncIterator[tuple[list[int], str]]:
        """`async for token_ids, text in handle.deltas()`: each wake-up's new ids and the text they completed, in
        step, so a server streams text with per-token logprobs and usage (text lags ids while a character or a
        possible stop string is incomplete). Needs a tokenizer."""
        if self._detok is None:
            raise ConfigError("deltas() needs a Scheduler created with a tokenizer")
        async for tokens, pieces in self._abatches(self._tokens, self._pieces):
            yield tokens, "".join(pieces)

    def _follow(self, items: list, timeout: float | None = None) -> Iterator:
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: len(items) > i or self.done(), timeout):
                    raise TimeoutError(f"request {self.request_id!r}: nothing new within {timeout} s")
                new, finished = items[i:], self.done()  # a finished request's items are all in
            yield from new
            i += len(new)
            if finished:
                break
        self._raise_error()

    async def _afollow(self, items: list) -> AsyncIterator:
        async for (new,) in self._abatches(items):
            for item in new:
                yield item

    async def _abatches(self, *lists: list) -> AsyncIterator[tuple[list, ...]]:
        """Each wake-up's new items of `lists`, read together under the lock (so they stay in step)."""
        loop = asyncio.get_running_loop()
        seen = [0] * len(lists)
        while True:
            event = asyncio.Event()
            with self._cond:
                new, finished = tuple(items[i:] for items, i in zip(lists, seen)), self.done()
                if not any(new) and not finished:
                    self._waiters.append((loop, event))
            if not any(new) and not finished:
                try:
                    await event.wait()
                finally:  # a reader that timed out or was cancelled leaves no waiter behind
                    with self._cond:
                        if (loop, event) in self._waiters:
                            self._waiters.remove((loop, event))
                continue
            if any(new):
                yield new
            seen = [i + len(items) for i, items in zip(seen, new)]
            if finished:
                break
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def observe(self, observer: Any) -> None:
        """Tell `observer` of this request's deliveries (`observer.delivered(handle, count)`) and of its end
        (`observer.ended(handle, reason)`, reason None when it failed); what happened before this call is told at
        once, so an observer attached right after submit misses nothing."""
        with self._cond:
            self._observer = observer
            count, done = len(self._tokens), self.done()
        if count:
            observer.delivered(self, count)
        if done:
            observer.ended(self, self._completion.finish_reason if self._completion is not None else None)

    # ---- producer side -----------------------------------------------------------------------------------------
    def admitted(self) -> None:
        """The request got a slot: its queue time ends (vLLM's request_queue_time_seconds)."""
        self.admitted_at = time.perf_counter()

    @property
    def num_delivered(self) -> int:
        """How many token ids `push` has handed to readers so far."""
        return len(self._tokens)

    def push(self, tokens: Sequence[int]) -> bool:
        """Hand new tokens to readers; returns True when a stop string ended the text (the producer then finishes
        the request with "stop"; tokens after the one that completed the stop string are dropped)."""
        stopped, pieces = False, []
        for i, token in enumerate(tokens):
            if self._matcher is not None:
                pieces.append(self._text_of(token, len(self._tokens) + i))
                if self._matcher.stopped:
                    tokens, stopped = tokens[: i + 1], True
                    break
        with self._cond:
            self._tokens.extend(tokens)
            self._pieces.extend(p for p in pieces if p)
            self._wake()
            observer = self._observer
        if observer is not None and len(tokens):
            observer.delivered(self, len(tokens))
        return stopped

    def _text_of(self, token: int, index: int) -> str:
        """The text token number `index` releases. Stop strings are looked for in the text of tokens from
        min_tokens on only (vLLM); with include_stop_str_in_output the stop string that ends the text is kept."""
        sp = self.request.sampling
        piece = self._detok.add(token)
        if index < sp.min_tokens:
            return piece
        piece = self._matcher.add(piece)
        if self._matcher.stopped and sp.include_stop_str_in_output:
            piece += self._matcher.matched
        return piece

    def finish(self, reason: str | None) -> None:
        """End the request with a Completion of the pushed tokens; readers and result() return."""
        tail = ""
        if self._matcher is not None and not self._matcher.stopped:
            tail = self._matcher.add(self._detok.flush()) + self._matcher.flush()
        req = self.request
        with self._cond:
            observer = None if self.done() else self._observer
            if tail:
                self._pieces.append(tail)
            text = "".join(self._pieces) if self._detok is not None else None
            hidden = np.stack(req.hidden[: len(self._tokens)]) if req.sampling.return_hidden and self._tokens else None
            self._completion = Completion(list(self._tokens), text, reason, req.logprobs[: len(self._tokens)],
                                          list(req.prompt_tokens), req.request_id, list(req.prompt_logprobs), hidden)
            self._wake()
        if observer is not None:
            observer.ended(self, reason)

    def fail(self, error: BaseException) -> None:
        """End the request with an error: readers and result() raise it."""
        with self._cond:
            observer = None if self.done() else self._observer
            self._error = error
            self._wake()
        if observer is not None:
            observer.ended(self, None)

    def _wake(self) -> None:
        """Wake sync readers and async readers; called with self._cond held. A waiter whose event loop has closed
        (its reader gave up and the loop ended) is dropped: the producer is the scheduler's thread, which must not
        die of a reader that left."""
        self._cond.notify_all()
        for loop, event in self._waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # "Event loop is closed"
                pass
        self._waiters.clear()
