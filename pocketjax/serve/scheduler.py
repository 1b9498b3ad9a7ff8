"""FCFS continuous-batching scheduler: requests join and leave the engine's slots between steps.

One step admits waiting requests into free slots (oldest first), runs ONE budgeted prefill call, then ONE decode
call for every request whose prompt was already in its slot, and hands the new tokens to the requests' handles.
The token budget bounds how long a long prompt can hold up the running decodes: at most one chunk per step.

How the running requests decode (pipelined, speculative, the step in flight) is `engine.decode_policy`'s: the
scheduler owns admission, delivery and failure isolation, and hands its isolation to the policy as `guard`.

Only the thread that runs `step()` touches the engine. Other threads submit and cancel under one Condition,
which the background loop sleeps on when there is nothing to do.

In a multi-process job (`group`) every process runs this loop over its own Engine, in step: lockstep.py's protocol
keeps them so. The scheduler reaches it only through `self.lockstep` (`Local` in one process), never asking how
many processes there are.
"""
from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import numpy as np

from ..engine.decode_policy import DecodePolicy
from ..engine.engine import Engine
from ..engine.request import BatchedRequest, RequestStatus
from ..engine.sampling_params import SamplingParams
from ..engine.slots import hashable
from ..engine.weights import placed
from ..errors import (CapacityError, ConfigError, DistributedError, NumericsError, PocketJaxError, RequestError,
                      StoppedError)
from .distributed import ProcessGroup
from .handle import RequestHandle
from .lockstep import protocol
from .tokenizer import StopStringMatcher, Tokenizer


class Scheduler:
    """FCFS continuous batching over one Engine; `step()` by hand, or `start()` a background loop."""

    def __init__(self, engine: Engine, max_waiting: int = 1024, prefill_token_budget: int | None = None,
                 tokenizer: Tokenizer | None = None, pipeline: bool = True, group: ProcessGroup | None = None,
                 keepalive_s: float = 1.0):
        budget = engine.config.prefill_chunk if prefill_token_budget is None else prefill_token_budget
        for name, value in (("max_waiting", max_waiting), ("prefill_token_budget", budget)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.prefill_token_budget = budget
        self.tokenizer = tokenizer
        engine.use_tokenizer(tokenizer)  # structured outputs compile against it (where the engine has none)
        self.waiting: deque[RequestHandle] = deque()
        self.running: list[RequestHandle] = []  # admitted: holding a slot, prefilling or decoding
        self._live: dict[Any, RequestHandle] = {}  # request_id -> handle, waiting or running
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False  # stop() was called (or the loop died) and start() not since: submit refuses
        self._error: DistributedError | None = None  # why a multi-process loop died: later submits raise it
        # new weights to serve from the next step boundary: (params, wait for the running requests, applied event)
        self._updates: deque[tuple[Any, bool, threading.Event]] = deque()
        # how submits, cancellations and stops reach the queues: at once, or in lockstep with the other processes of
        # a job (process 0 then steps at least every keepalive_s, so a dead peer is noticed even when idle)
        self.lockstep = protocol(group, self.waiting, self._live, self._open, engine.validate, keepalive_s)
        self.group = self.lockstep.group  # None: one process
        # pipelining, speculation and the step in flight; in a job every process decides by tokens, not its clock
        self.decoder = DecodePolicy(engine, pipeline, clocked=self.group is None)

    # ---- callers (any thread) ------------------------------------------------------------------------------------
    def submit(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None = None,
               request_id: Any = None) -> RequestHandle:
        """Queue a request without blocking; raises CapacityError when the waiting queue is full.

        An invalid request does not raise here: its handle fails with the typed error, as it would at admission,
        so a caller handles every per-request failure in one place (result() or the stream).
        """
        return self.submit_many([(prompt_tokens, sampling, request_id)])[0]

    def submit_many(self, jobs: Sequence[tuple[Sequence[int], SamplingParams | None, Any]]) -> list[RequestHandle]:
        """`submit` for (prompt_tokens, sampling, request_id) jobs queued together: the loop sees all of them at
        its next step, so a batch of prompts is admitted as one (as vLLM's LLM.generate adds its requests before
        stepping) and the step shapes it runs do not depend on how fast the caller's thread queued them. All or
        none: a queue too full for every job raises CapacityError with none of them queued (the ones queued before
        the refusal are cancelled under the lock, before the loop can admit them), so a caller that gets the error
        has nothing left running unseen."""
        prepared = [self._prepared(prompt, sampling, request_id) for prompt, sampling, request_id in jobs]
        with self._cond:
            handles: list[RequestHandle] = []
            try:
                for request, assigned, invalid in prepared:
                    handles.append(self._queued(request, assigned, invalid))
            except BaseException:
                for handle in handles:
                    if not handle.done():
                        self.lockstep.cancel(handle)
                raise
            self._cond.notify_all()
            return handles

    def _prepared(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None,
                  request_id: Any) -> tuple[BatchedRequest, Any, PocketJaxError | None]:
        """A request validated outside the lock, under the id it will have: compiling a constraint (seconds at
        Qwen's vocabulary) must not stall the scheduler loop nor other submitters."""
        ids = isinstance(prompt_tokens, (Sequence, np.ndarray)) and not isinstance(prompt_tokens, str)
        prompt = list(prompt_tokens) if ids else prompt_tokens  # anything else fails its handle in _validate
        request = BatchedRequest(request_id, prompt, SamplingParams() if sampling is None else sampling)
        request.request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        try:
            self._validate(request)
        except PocketJaxError as error:
            invalid = error
        else:
            invalid = None
        assigned, request.request_id = request.request_id, request_id  # a follower matches process 0's by the given id
        return request, assigned, invalid

    def _queued(self, request: BatchedRequest, assigned: Any, invalid: PocketJaxError | None) -> RequestHandle:
        """A prepared request's handle, queued (or failed with its error); under self._cond."""
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise StoppedError("the scheduler was stopped: start() it again before submitting")
        claimed = self.lockstep.claim(request)  # not process 0 of a job: the handle of process 0's request
        if claimed is not None:
            return claimed
        if len(self.waiting) + self.lockstep.held() >= self.max_waiting:
            raise CapacityError(f"waiting queue is full ({self.max_waiting} requests)")
        request.request_id = assigned
        try:
            if invalid is not None:
                raise invalid
            self._check(request)
        except PocketJaxError as error:
            handle = RequestHandle(request)
            handle.fail(error)
            return handle
        handle = RequestHandle(request, self.tokenizer, on_cancel=self.cancel)
        self._live[request.request_id] = handle
        self.lockstep.add(handle)
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request: a waiting one ends now; a running one ends (and frees its slot) at the next step."""
        with self._cond:
            if handle.done():
                return
            self.lockstep.cancel(handle)
            self._cond.notify_all()

    def update_params(self, params: Any, *, finish_running: bool = False, timeout: float | None = None) -> None:
        """Serve `params` from the next step boundary on (`Engine.update_params`: same tree, shapes and dtypes, no
        recompile; a ConfigError here, in the caller's thread, changes nothing). Returns once they are in use.

        Requests in flight continue on the new weights from their next step; with `finish_running` the running
        ones finish on the old weights first while no new request is admitted (the waiting ones then start on the
        new). In a multi-process job every process calls it with its view of the same global params, leaves on the
        engine's shardings: each process swaps in its own call at the step process 0's broadcast names, so all swap
        at the same step (lockstep.py; process 0's `finish_running` holds for all). No background loop: in use at
        once in one process, from the next `step()` in a job. StoppedError (DistributedError: the job lost a
        process) when the scheduler stops before they are in use."""
        self.lockstep.check_params(self.engine.model.params, params)
        params = placed(self.engine.model.params, params)
        applied = threading.Event()
        with self._cond:
            if self._error is not None:
                raise self._error
            self.lockstep.update((params, finish_running, applied), self._updates)  # in a job: at process 0's word
            if self._thread is None:  # no loop: apply now unless running requests must finish first (step() does)
                self._apply_updates()
                return
            self._cond.notify_all()
        self.lockstep.await_update(applied, self._update_failure, timeout)

    def _update_failure(self) -> StoppedError | None:
        """Why queued params will not come into use: the job lost a process, or the scheduler stopped."""
        with self._cond:
            if self._error is not None:
                return self._error
            return StoppedError("the scheduler stopped before the new params were in use") if self._stopped else None

    def _apply_updates(self) -> None:
        """Swap in the weights waiting for a step boundary (this is one; in a job, with those this step's broadcast
        announced); one that waits for the running requests stays queued, and admission with it, until they
        finished. Holds `self._cond`."""
        self.lockstep.announced(self._updates)
        while self._updates:
            params, finish_running, applied = self._updates[0]
            if finish_running and self.running:
                return
            self.engine.update_params(params)
            self._updates.popleft()
            applied.set()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._updates)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One blocking iteration: admit, prefill one budget, decode every running request, deliver; True if
        work remains."""
        with self._cond:
            if self._thread is not None and threading.current_thread() is not self._thread:
                raise RuntimeError("step() is driven by the background loop while it runs; call stop() first")
        if not self.lockstep.sync(self._cond, self._end):  # a follower waits here for process 0's next step
            return False
        with self._cond:
            self._retire_cancelled()
            self._apply_updates()
            if not self._updates:  # weights waiting for the running requests to finish: admit nobody meanwhile
                self._admit()
            batch = list(self.running)
        prefilling = [h for h in batch if h.request.status is RequestStatus.PREFILLING]
        decoding = [h for h in batch if h.request.status is RequestStatus.DECODING]
        self.decoder.prefill([h.request for h in prefilling], guard=partial(self._run, prefilling),
                             token_budget=self.prefill_token_budget, alone=self._prefill_alone)
        self.decoder.advance([h.request for h in decoding], guard=partial(self._run, decoding),
                             deliver=partial(self._hand_out, decoding), timed=not prefilling,
                             waiting=bool(prefilling or self.waiting))
        self._hand_out(batch)
        with self._cond:
            return self.has_work()

    def start(self) -> Scheduler:
        """Run `step()` on a background thread that sleeps while there is no work."""
        with self._cond:
            if self._thread is not None:
                return self
            if self._error is not None:
                raise self._error
            if self._stopped:
                self.lockstep.restart()  # raises in a multi-process job: the other processes stopped with this one
            self._stopping = self._stopped = False
            self._thread = threading.Thread(target=self._loop, name="pocketjax-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the background loop; requests still waiting or running end "cancelled" (result() returns).

        In a multi-process job process 0's stop stops every process; elsewhere stop() waits for it.
        """
        with self._cond:
            if self._thread is None and not self._stopped:
                self.lockstep.leave()  # no loop to tell the other processes: tell them here
            self._stopping = self._stopped = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cond:
            self._cancel_all()

    def _cancel_all(self) -> None:
        """End every request not finished yet with "cancelled". Holds `self._cond`."""
        for handle in list(self.waiting) + self.lockstep.drop():
            handle.finish("cancelled")
        self.waiting.clear()
        for handle in self.running:
            handle.cancel_requested = True
        self._retire_cancelled()
        self._live.clear()

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self.lockstep.idle(self._cond, self.has_work, lambda: self._stopping):
                        return
                try:
                    self.step()
                except DistributedError as error:
                    self._die(error)
                    return
                except Exception as error:  # noqa: BLE001 - a bug in delivery must not kill the loop and hang readers
                    self._fail_running(error)
        except BaseException as error:  # the thread dies (SystemExit, KeyboardInterrupt...): no handle may hang
            with self._cond:
                self._stopped, self._thread = True, None
                for handle in list(self.waiting) + list(self.running):
                    self._release(handle)
                    handle.fail(StoppedError(f"the scheduler loop died: {error!r}"))
                self.waiting.clear()
            raise

    # ---- internals (the loop thread; `self._cond` held where noted) ----------------------------------------------
    def _validate(self, request: BatchedRequest) -> None:
        """Raise the typed error a request would hit later, so it fails at submit: what needs no scheduler state
        (the engine's checks, its constraint compiled), run without the lock."""
        self.engine.validate(request)
        if request.sampling.stop and self.tokenizer is None:
            raise RequestError("stop strings need a Scheduler created with a tokenizer")
        StopStringMatcher(request.sampling.stop)

    def _check(self, request: BatchedRequest) -> None:
        """The checks against requests in flight and the job's other processes. Holds `self._cond`."""
        if not hashable(request.request_id):
            raise RequestError(f"request_id must be hashable, got {type(request.request_id).__name__}")
        if request.request_id in self._live:
            raise RequestError(f"request_id {request.request_id!r} is already in flight")
        self.lockstep.check(request)

    def _admit(self) -> None:
        """Move waiting requests, oldest first, into free slots (the engine picks the slot with the longest
        cached prefix of the prompt). Holds `self._cond`."""
        while self.waiting and self.engine.num_free_slots:
            handle = self.waiting.popleft()
            try:
                self.engine.allocate_slot(handle.request)
            except PocketJaxError as error:
                self._live.pop(handle.request_id, None)
                handle.fail(error)
                continue
            handle.admitted()
            self.running.append(handle)

    def _run(self, handles: list[RequestHandle], call, *args: Any, alone=None, **kwargs: Any) -> Any:
        """One engine call for `handles`; if it raises, only they fail (their slots are freed) and it returns None.

        With `alone` (a function running one handle's request by itself), a failed call that left the requests and
        the cache as they were is retried request by request, so only the ones that fail alone fail (a request whose
        hook raises at the real shapes, say) and the others make their step: one request cannot fail its batch-mates.
        """
        if not handles:
            return None
        before = _progress(handles)
        try:
            return call(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any failure belongs to these requests, not to the loop
            self.lockstep.step_failed(error)  # raises DistributedError where the processes can no longer stay in step
            if (alone is not None and len(handles) > 1 and self.group is None and _progress(handles) == before
                    and self._engine_intact()):
                for handle in handles:
                    if handle.done() or handle.request.finished:
                        continue
                    try:
                        alone(handle.request)
                    except Exception as own:  # noqa: BLE001 - this request's own failure
                        self._fail(handle, own)
                return None
            for handle in handles:
                self._fail(handle, error)
            return None

    def _fail(self, handle: RequestHandle, error: BaseException) -> None:
        with self._cond:
            if not handle.done():  # one that already finished keeps its result
                self._release(handle)
                handle.fail(error)

    def _prefill_alone(self, request: BatchedRequest) -> None:
        self.engine.batch_prefill([request], token_budget=self.prefill_token_budget)

    def _engine_intact(self) -> bool:
        """False when a failed call had already donated the cache (its buffers are gone): nothing can be re-run."""
        leaves = jax.tree_util.tree_leaves((self.engine.cache, self.engine.slot_state))
        return not any(getattr(leaf, "is_deleted", lambda: False)() for leaf in leaves)

    def _hand_out(self, handles: list[RequestHandle]) -> None:
        """Deliver the new tokens of each handle's request."""
        with self._cond:
            for handle in handles:
                try:
                    self._deliver(handle)
                except Exception as error:  # noqa: BLE001 - a failure delivering one request is that request's
                    self._fail(handle, error)

    def _deliver(self, handle: RequestHandle) -> None:
        """Pass a request's new tokens to its handle; retire it if it finished. Holds `self._cond`."""
        if handle.done():
            return
        req = handle.request
        if req.error is not None:  # the engine ended it (a grammar that can allow no token): it fails with that
            self._release(handle)
            handle.fail(req.error)
            return
        fresh = req.logprobs[handle.num_delivered:len(req.generated_tokens)]
        if any(entry is not None and not math.isfinite(entry[0]) for entry in fresh):  # NaN or inf logits
            self._release(handle)
            handle.fail(NumericsError(f"request {req.request_id!r}: the model's logits were not finite (NaN or inf), so "
                                      f"no token can be sampled; a broken checkpoint, or a hook that made them NaN"))
            return
        stopped = handle.push(req.generated_tokens[handle.num_delivered:])  # True: a stop string ended the text
        if stopped or req.finished:
            reason = "stop" if stopped else req.finish_reason
            self._release(handle, reason)
            handle.finish(reason)

    def _fail_running(self, error: BaseException) -> None:
        with self._cond:
            for handle in list(self.running):
                self._release(handle)
                handle.fail(error)

    def _retire_cancelled(self) -> None:
        """End running requests whose cancel() arrived since the last step. Holds `self._cond`."""
        for handle in [h for h in self.running if h.cancel_requested]:
            self._release(handle)
            handle.finish("cancelled")

    def _release(self, handle: RequestHandle, reason: str = "cancelled") -> None:
        """Give a running request's slot back to the engine, which ends it with `reason` if it is unfinished (its
        rows in decode steps in flight are then dropped). Holds `self._cond`."""
        if handle in self.running:
            self.running.remove(handle)
            self.engine.free_slot(handle.request_id, reason)
        self._live.pop(handle.request_id, None)

    # ---- what the lockstep protocol calls back, and the end of a job ----------------------------------------------
    def _open(self, request: BatchedRequest) -> RequestHandle:
        """A handle for a request this scheduler runs (a follower's, from process 0's message or a local submit)."""
        return RequestHandle(request, self.tokenizer, on_cancel=self.cancel)

    def _end(self) -> None:
        """Process 0 stopped the job: this process stops too, and every request not finished ends "cancelled".
        Holds `self._cond`."""
        self._stopping = self._stopped = True
        self._cancel_all()

    def _die(self, error: DistributedError) -> None:
        """The job lost a process: every open request fails with `error`, and so does every later submit."""
        with self._cond:
            self._error, self._stopped, self._thread = error, True, None
            for handle in list(self.waiting) + list(self.running) + self.lockstep.drop():
                handle.fail(error)
            self.waiting.clear()
            self.running.clear()
            self._live.clear()


def _progress(handles: list[RequestHandle]) -> list[tuple]:
    """What an engine call advances in each request: equal before and after a failed call means it changed nothing."""
    return [(r.num_prefilled, len(r.generated_tokens), r.in_flight, r.status, r.finished)
            for r in (h.request for h in handles)]

