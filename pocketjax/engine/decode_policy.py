"""The decode policy: how running requests advance by one decode step, and the one step kept in flight.

One home for what used to live in the scheduler, the engine and the step clock: pipelining (queue step N+1 behind
step N before reading N, so the host's delivery work overlaps the device), when to verify speculative drafts
(`Speculator.pays`, from this machine's measured step times), and the bookkeeping of the step in flight. The
Scheduler calls `advance` once per loop step with its failure isolation as `guard`; `Engine.batch_speculative_step`
runs the same policy unpipelined, so an Engine user gets the server's speculation.

Whichever step kind runs, the tokens are the plain decode's, bit for bit (`steps.verify_sample_step`): the clock
decides only how fast they come, never which they are. In a multi-process job (`clocked=False`) every process must
take the same decision, so it verifies whenever drafts exist (by tokens only, never by its own clock).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .pending import PendingDecode, PendingPrefill, PendingStep, PendingVerify
from .request import BatchedRequest

Requests = Sequence[BatchedRequest]


def unguarded(call: Callable, *args: Any, alone: Callable | None = None, **kwargs: Any) -> Any:
    """The guard of a caller without failure isolation: the call, raising what it raises."""
    return call(*args, **kwargs)


def _decoding(step: PendingStep | None) -> bool:
    """Whether a decode or verify step is among `step` and the steps in flight before it."""
    while step is not None and not step.collected:
        if not isinstance(step, PendingPrefill):
            return True
        step = step.previous
    return False


class Timed(NamedTuple):
    """A step whose time the next `advance` observes (`speculative.StepClock`)."""

    kind: str  # "plain", "verify", "fed" (a plain step queued from the host after a verify), "untimed"
    rows: int
    start: float  # perf_counter when it was queued (a plain pipelined step) or the device went idle for it
    compiled: int  # compiled_count then: a step that compiled is no step time


class DecodePolicy:
    """Advances running requests one decode step at a time over one Engine, keeping at most one step in flight.

    `guard(call, *args, alone=fn, **kwargs)` runs each engine call: the scheduler's isolates failures (returns None
    when the call failed, retrying request by request with `alone(request)`); `unguarded` raises. `pipeline=False`
    reads every step before returning (nothing is left in flight).
    """

    def __init__(self, engine: Any, pipeline: bool = True, clocked: bool = True):  # an engine.Engine (which
        # imports this module)
        self.engine = engine
        self.pipeline = pipeline
        self.clocked = clocked
        self.pending: PendingStep | None = None  # the latest step in flight: read at the next advance (with the
        # steps before it that are still in flight: a prefill and the decode step before it)
        self._timed: Timed | None = None
        self._prefill_guard: Callable = unguarded  # the guard of the requests of a prefill in flight

    def prefill(self, requests: Requests, guard: Callable = unguarded, token_budget: int | None = None,
                alone: Callable | None = None) -> None:
        """One prefill call over `requests` (`Engine.prefill_dispatch`). Pipelined, its first tokens stay in flight
        behind the decode step in flight and are read with it at the next `advance`, after the decode step that
        follows them is queued: an admission drains nothing. Otherwise (speculation, `pipeline=False`) they are read
        at once."""
        if not requests:
            return
        deferred = self.pipeline and self.engine.speculator is None
        step = guard(self.engine.prefill_dispatch, requests, token_budget=token_budget,
                     after=self.pending if deferred else None, alone=alone)
        if step is None:
            return
        if deferred:
            self.pending, self._prefill_guard = step, guard
        else:
            guard(self.engine.collect, step)

    def advance(self, requests: Requests, guard: Callable = unguarded, deliver: Callable[[], None] = lambda: None,
                timed: bool = True, waiting: bool = False) -> None:
        """One decode step for every unfinished request (a request that just joined rides in it: nothing drains);
        afterwards the tokens read are in the requests. `deliver()` hands them out early, while the device runs the
        step just queued (speculative steps); `timed`: no prefill ran since the last advance, so the interval since
        then measures the decode step before it; `waiting`: requests wait for admission or are being prefilled.

        How many steps one dispatch runs (`EngineConfig.decode_steps`, N): 1 while `waiting` (a new request joins
        the next step, and prefill chunks alternate with single steps, so time to first token does not grow), with
        speculation, or when a row needs the host between steps (`Engine.multi_step`: token masks, hidden states);
        N otherwise. Which it is never changes a token, only how many come per dispatch."""
        if self.engine.speculator is not None:
            self._speculative(requests, guard, deliver, timed)
        elif self.pipeline:
            self._pipelined(requests, guard, 1 if waiting else self.engine.config.decode_steps)
        else:
            guard(self.engine.batch_decode_step, requests, alone=self._decode_alone)

    def _decode_alone(self, request: BatchedRequest) -> None:
        self.engine.batch_decode_step([request])

    def _speculate_alone(self, request: BatchedRequest) -> None:
        self.engine.batch_speculative_step([request])

    def _pipelined(self, requests: Requests, guard: Callable, steps: int = 1) -> None:
        """Queue the next decode step behind the one in flight, then read that one and what is in flight before it
        (with no decode step in flight: queue two, read the first); each runs up to `steps` steps. Tokens read may end a request (a stop token or string);
        its row in the step queued after them is discarded by the engine."""
        pending, self.pending = self.pending, None
        several = {"steps": steps} if steps > 1 else {}
        if not _decoding(pending) and any(not r.finished for r in requests):
            after = {"after": pending} if pending is not None else {}  # behind a prefill still in flight
            first = guard(self.engine.decode_dispatch, requests, alone=self._decode_alone, **after, **several)
            if first is None and pending is not None:  # it failed: the prefill before it is read all the same
                self._collect(pending, guard)
            pending = first
        if pending is None:
            return
        following = (guard(self.engine.decode_dispatch, requests, after=pending, **several)
                     if any(not r.finished for r in requests) else None)
        if self._collect(pending, guard):
            self.pending = following

    def _collect(self, step: PendingStep, guard: Callable) -> bool:
        """Read `step` and the steps in flight before it, oldest first (a prefill's with the guard of its requests);
        False when reading `step` itself failed. A step whose read failed counts as read (its requests failed), so
        the ones after it are still read."""
        chain = []
        while step is not None and not step.collected:
            chain.append(step)
            step = step.previous
        read = True
        for step in reversed(chain):
            own = self._prefill_guard if isinstance(step, PendingPrefill) else guard
            read = own(self.engine.collect, step) is not None
            if not step.collected:  # a guard over no live request skips the call: its rows are all discarded
                self.engine.collect(step)
        return read

    def _speculative(self, requests: Requests, guard: Callable, deliver: Callable[[], None], timed: bool) -> None:
        """A step that verifies reads the step in flight first (a draft needs its tokens), drafts on the host, queues
        ONE verify step (rows without a draft decode in it), then delivers the tokens read while the device runs it.
        It verifies only when the drafts are expected to pay for the verify (`Speculator.pays`); otherwise, and
        whenever no request is due to draft (all backing off, `speculative.Backoff`), the step is the plain one.

        What the clock is fed: a pipelined plain step costs the time from its call to the next (the device always
        has a step queued then); a verify, and a plain step queued from the host after one ("fed"), cost the time
        from the moment the device went idle for them (everything before collected) to the moment their tokens were
        read; unpipelined, every step is timed from its dispatch to its read. Steps that compiled are not timed."""
        engine, spec = self.engine, self.engine.speculator
        pays = spec.pays if self.clocked else (lambda *_: True)
        running = [r for r in requests if not r.finished]
        rows, now = engine.rules.rows(max(len(running), 1)), time.perf_counter()
        last, self._timed = self._timed, None
        timed = timed and last is not None and last.compiled == engine.compiled_count()
        if timed and last.kind == "plain" and last.rows == rows:
            spec.clock.observe("plain", rows, now - last.start)
        due = spec.due(requests)
        pending, optimistic = self.pending, [spec.expected(r) for r, on in zip(requests, due) if on]
        if not (optimistic and pays(rows, len(running), optimistic)):
            self._plain(requests, guard, rows, now, last if timed else None)
            return
        self.pending = None
        if pending is not None:
            guard(engine.collect, pending)
            if timed and last.kind in ("verify", "fed"):
                spec.clock.observe(last.kind, last.rows, time.perf_counter() - last.start)
        if all(r.finished for r in requests):
            return
        idle = time.perf_counter()  # nothing in flight: the device waits from here until the next step is queued
        compiled = engine.compiled_count()
        drafts = engine.draft(requests, due)
        gains = [spec.expected(r) for r, d in zip(requests, drafts) if d]
        verify_rows = engine.rules.rows(len([r for r in requests if not r.finished]))
        if gains and pays(verify_rows, len(running), gains):
            step, kind = guard(engine.verify_dispatch, requests, drafts, alone=self._speculate_alone), "verify"
        else:
            step, kind = guard(engine.decode_dispatch, requests, alone=self._decode_alone), "plain"
        if not self.pipeline:
            if step is not None:
                guard(engine.collect, step)
                if compiled == engine.compiled_count():
                    spec.clock.observe(kind, verify_rows, time.perf_counter() - idle)
            return
        deliver()  # what the collected step brought, while the device runs the new one
        self.pending = step
        if kind == "plain":  # queued from the host: after a verify it is what leaving speculation costs
            kind = "fed" if isinstance(pending, PendingVerify) else "untimed"
        self._timed = Timed(kind, verify_rows, idle, compiled) if step is not None else None

    def _plain(self, requests: Requests, guard: Callable, rows: int, now: float, last: Timed | None) -> None:
        """The plain step of a speculative engine, timed for the clock (`last`: the step before, when timed)."""
        engine, clock = self.engine, self.engine.speculator.clock
        pending, compiled = self.pending, engine.compiled_count()
        running = any(not r.finished for r in requests)
        if not self.pipeline:  # nothing is ever in flight here: the step's own latency is its time
            guard(engine.batch_decode_step, requests, alone=self._decode_alone)
            if running and compiled == engine.compiled_count():
                clock.observe("plain", rows, time.perf_counter() - now)
            return
        self._pipelined(requests, guard)  # (after a verify: the next step follows it on device, accepted counts unread)
        if last is not None and last.kind == "fed" and last.rows == rows and compiled == engine.compiled_count():
            clock.observe("fed", rows, time.perf_counter() - last.start)  # the host-fed step just read
        if last is not None and last.kind == "verify" and isinstance(pending, PendingVerify):  # read just now
            clock.observe("verify", last.rows, time.perf_counter() - last.start)
        if running:  # the call that read a verify waited for it: its interval is no plain step's time
            self._timed = Timed("untimed" if isinstance(pending, PendingVerify) else "plain", rows, now, compiled)
