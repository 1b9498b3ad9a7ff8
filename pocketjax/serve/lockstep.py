"""The lockstep protocol: how every process of a multi-process job makes the same engine calls.

JAX is multi-controller: every process runs the same program, and each jitted step is one SPMD program over every
process's devices, so every process must make the same engine calls with the same arguments. Everything the
engine and the scheduler decide is a pure function of what they were asked before (slot choice, bucketing, the
seeds of unseeded requests, stop tokens, stop strings with the same tokenizer), except what comes from outside:
which requests arrive, which are cancelled, and when serving stops. Process 0 owns those; every process runs the
same scheduler loop over its own Engine, and:

- Process 0 takes requests into an inbox and cancellations into a list. Each step starts with one broadcast of
  what it holds (`ProcessGroup.exchange`), which every process, process 0 included, applies to its queues before
  it touches its engine, so the processes never diverge. A request cancelled before it was sent ends at once.
- The other processes follow: their loop blocks in that broadcast; `cancel()` there does nothing (process 0's
  cancellation ends the request everywhere); a `submit()` there is matched, in order, with the next request
  process 0 sent, so an SPMD script that submits the same requests on every process gets the same handles and
  results everywhere. A follower that never submits (`pocketjax serve`) keeps only the last UNCLAIMED of them.
- New weights (`Scheduler.update_params`, called on every process with its view of the same global params): process
  0's broadcast numbers its calls ("update 3 joins the queue at this step"), and every process queues its own call of
  that number at that step, so the queue, and with it the step each update is applied at (`finish_running`: the first
  with no request running) and the admissions it holds back, is the same everywhere. A follower whose own call has not
  come yet waits for it there, at most `update_wait_s` (DistributedError past that: process 0 waits in the next
  broadcast meanwhile, and a dead process 0 ends this one through JAX's client as ever). In a job the new leaves must
  already have the engine's shardings: placing any other would run a computation beside the loop's collectives.
- Process 0 steps at least every `keepalive_s` (one empty broadcast when idle), so a dead peer is noticed within
  that. Its stop is the job's last broadcast and stops every process (stop() elsewhere waits for it); a stopped
  job cannot restart. A step that fails other than with a request's own typed error means the processes can no
  longer stay in step: DistributedError, which ends the job (see distributed.py for how a dead process shows).

The scheduler reaches the protocol only through the entry points of `Local` (one process: submits and
cancellations reach the queues at once, nothing is exchanged), which `Lockstep` implements for a job. `protocol()`
picks one.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..engine.request import BatchedRequest
from ..engine.sampling_params import SamplingParams
from ..engine.weights import placed
from ..errors import DistributedError, PocketJaxError, RequestError, StoppedError
from .distributed import ProcessGroup
from .handle import RequestHandle
from .tokenizer import StopStringMatcher

UNCLAIMED = 4096  # followers keep at most this many of process 0's requests that no local submit claimed
UPDATE_WAIT_S = 100.0  # a follower waits this long for its own update_params call (JAX's default heartbeat timeout)
POLL_S = 0.1  # how often a caller waiting for its update_params looks whether the scheduler stopped or died
Update = tuple[Any, bool, threading.Event]  # new params queued for a step boundary: (params, finish_running, applied)


def protocol(group: ProcessGroup | None, waiting: deque[RequestHandle], live: dict[Any, RequestHandle],
             open_handle: Callable[[BatchedRequest], RequestHandle], validate: Callable[[BatchedRequest], None],
             keepalive_s: float = 1.0) -> Local:
    """The protocol a scheduler with these queues runs: `Lockstep` in a job of several processes, else `Local`."""
    if group is None or group.num_processes == 1:
        return Local(waiting, live)
    return Lockstep(group, waiting, live, open_handle, validate, keepalive_s)


def cancel_now(handle: RequestHandle, waiting: deque[RequestHandle], live: dict[Any, RequestHandle]) -> None:
    """A waiting request ends now; a running one is marked, and ends (and frees its slot) at the next step."""
    if handle in waiting:
        waiting.remove(handle)
        live.pop(handle.request_id, None)
        handle.finish("cancelled")
    else:
        handle.cancel_requested = True


class Local:
    """One process: what callers submit and cancel reaches the scheduler's queues at once; nothing to exchange.

    The scheduler calls these entry points, and only these, under its lock except where noted.
    """

    group: ProcessGroup | None = None

    def __init__(self, waiting: deque[RequestHandle], live: dict[Any, RequestHandle]):
        self.waiting = waiting  # the scheduler's queue and its request_id -> handle map, which this feeds
        self.live = live

    def check(self, request: BatchedRequest) -> None:
        """Raise the RequestError of a request that cannot be sent to the other processes."""

    def claim(self, request: BatchedRequest) -> RequestHandle | None:
        """A follower's submit: the handle of process 0's matching request; None where submits are taken here."""
        return None

    def held(self) -> int:
        """Requests taken here and not yet in the waiting queue (they count towards the scheduler's max_waiting)."""
        return 0

    def add(self, handle: RequestHandle) -> None:
        """Queue an accepted request."""
        self.waiting.append(handle)

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel an unfinished request."""
        cancel_now(handle, self.waiting, self.live)

    def sync(self, lock: threading.Condition, stop: Callable[[], None]) -> bool:
        """Start a step, called without `lock`: apply what came from outside since the last one; False (after
        `stop()`, under `lock`) when the job stopped."""
        return True

    def idle(self, cond: threading.Condition, work: Callable[[], bool], stopping: Callable[[], bool]) -> bool:
        """The loop between steps: sleep on `cond` until there is work or a stop; False when the loop ends."""
        cond.wait_for(lambda: stopping() or work())
        return not stopping()

    def leave(self) -> None:
        """Serving stops here: tell the other processes."""

    def restart(self) -> None:
        """Raise StoppedError where a stopped scheduler cannot start again."""

    def drop(self) -> list[RequestHandle]:
        """The handles held here rather than in the scheduler's queues, forgotten; the scheduler ends them."""
        return []

    def step_failed(self, error: Exception) -> None:
        """Raise DistributedError when an engine call that raised `error` leaves the processes out of step."""

    def check_params(self, current: Any, new: Any) -> None:
        """Raise the ConfigError of new weights that this process cannot take as they are (before any is placed)."""

    def update(self, entry: Update, updates: deque[Update]) -> None:
        """Queue new weights (`Scheduler.update_params`): here they join the step-boundary queue `updates` at once."""
        updates.append(entry)

    def announced(self, updates: deque[Update]) -> None:
        """At a step boundary, after `sync`: move the updates this step's broadcast announced into `updates`."""

    def await_update(self, applied: threading.Event, failure: Callable[[], PocketJaxError | None],
                     timeout: float | None) -> None:
        """Return once `applied` is set; raise `failure()` where the scheduler stopped or died first (a job's loop
        ends under its callers when a peer dies), TimeoutError past `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not applied.wait(POLL_S if deadline is None else max(min(POLL_S, deadline - time.monotonic()), 0)):
            error = failure()
            if error is not None:
                raise error
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"the new params were not in use within {timeout} s (running requests still "
                                   f"finishing)")


class Lockstep(Local):
    """A multi-process job's side of the scheduler: process 0 leads, the others follow (the module docstring)."""

    def __init__(self, group: ProcessGroup, waiting: deque[RequestHandle], live: dict[Any, RequestHandle],
                 open_handle: Callable[[BatchedRequest], RequestHandle], validate: Callable[[BatchedRequest], None],
                 keepalive_s: float = 1.0):
        super().__init__(waiting, live)
        self.group = group
        self.open_handle = open_handle  # a handle that cancels through the scheduler
        self.validate = validate  # the engine's own check of a request
        self.keepalive_s = keepalive_s
        self.left = False  # followers: process 0 stopped the job
        self._inbox: list[RequestHandle] = []  # process 0: submitted, not yet broadcast
        self._cancels: list[Any] = []  # process 0: ids of cancellations not yet broadcast
        self._expected: deque[RequestHandle] = deque()  # followers: local submits waiting for process 0's request
        self._unclaimed: deque[RequestHandle] = deque(maxlen=UNCLAIMED)  # followers: process 0's, not submitted here
        self.update_wait_s = UPDATE_WAIT_S
        self._numbered = 0  # update_params calls announced so far: the next one process 0 sends is number +1
        self._updates_out: list[Update] = []  # process 0: update_params calls not yet broadcast
        self._calls: deque[Update] = deque()  # followers: this process's calls, not yet announced by process 0
        self._ready: list[Update] = []  # announced at this step, with this process's own params

    # ---- entry points (see Local) --------------------------------------------------------------------------------
    def check(self, request: BatchedRequest) -> None:
        if not isinstance(request.request_id, (str, int)) or isinstance(request.request_id, bool):
            raise RequestError(f"request_id must be a str or an int in a multi-process job (process 0 sends it to "
                               f"the others), got {type(request.request_id).__name__}")
        if getattr(request.sampling, "hook", None) is not None:
            raise RequestError("SamplingParams.hook cannot be sent to the other processes of a multi-process job")

    def claim(self, request: BatchedRequest) -> RequestHandle | None:
        if self.group.leader:
            return None
        handle = self.open_handle(request)
        try:
            self.validate(request)  # process 0 refuses the same request the same way
            StopStringMatcher(request.sampling.stop)
        except PocketJaxError as error:
            handle.fail(error)
            return handle
        if not self._unclaimed:
            self._expected.append(handle)
            return handle
        sent = self._unclaimed.popleft()
        if not same_request(request, sent.request):
            handle.fail(mismatch(self.group, request, sent.request))
            return handle
        return sent

    def held(self) -> int:
        return len(self._inbox)

    def add(self, handle: RequestHandle) -> None:
        self._inbox.append(handle)

    def cancel(self, handle: RequestHandle) -> None:
        """Process 0: a request not broadcast yet ends now, any other at the start of the next step everywhere.
        Elsewhere nothing: process 0's cancellation ends it."""
        if not self.group.leader:
            return
        if handle in self._inbox:
            self._inbox.remove(handle)
            self.live.pop(handle.request_id, None)
            handle.finish("cancelled")
        elif handle.request_id not in self._cancels:
            self._cancels.append(handle.request_id)

    def sync(self, lock: threading.Condition, stop: Callable[[], None]) -> bool:
        with lock:
            message, sent, updates = self._news()
        message = self.group.exchange(message)  # a follower waits here for process 0's next step
        with lock:
            self._take_updates(message.get("update", ()), updates, lock)
            if self._apply(message, sent):
                return True
            stop()
            return False

    def idle(self, cond: threading.Condition, work: Callable[[], bool], stopping: Callable[[], bool]) -> bool:
        """Process 0 also wakes for news and every keepalive_s, and tells the others when it stops. A follower
        never sleeps here (it waits in the next step's broadcast) and ends only on process 0's stop."""
        if not self.group.leader:
            return not self.left
        news = lambda: bool(self._inbox or self._cancels or self._updates_out)  # noqa: E731
        cond.wait_for(lambda: stopping() or work() or news(), self.keepalive_s)
        if stopping():
            self.leave()
            return False
        return True

    def leave(self) -> None:
        """Process 0: tell every process to stop (the last exchange). Elsewhere nothing: stop() waits for it."""
        if not self.group.leader:
            return
        try:
            self.group.exchange({"stop": True})
        except DistributedError:
            pass  # the others are gone already: there is no one left to tell

    def restart(self) -> None:
        raise StoppedError("a multi-process scheduler cannot restart: the other processes stopped with it")

    def drop(self) -> list[RequestHandle]:
        held = self._inbox + list(self._expected)
        self._inbox.clear()
        self._expected.clear()
        return held

    def check_params(self, current: Any, new: Any) -> None:
        """Only leaves used as they are (`weights.placed`: a jax.Array, not weakly typed, on the engine's sharding):
        placing any other (a reshard, or host values that device_put compares across processes) runs collectives
        on the caller's thread, which would interleave with the loop's differently on each process."""
        placed(current, new, refuse_copies="in a multi-process job placing it would run collectives beside the "
               "serving loop's. Pass arrays laid out as the engine's, e.g. from a train step jitted with "
               "out_shardings=jax.tree.map(lambda x: x.sharding, llm.model.params)")

    def update(self, entry: Update, updates: deque[Update]) -> None:
        """Process 0: broadcast at the next step. Elsewhere: kept for process 0's call of the same number."""
        (self._updates_out if self.group.leader else self._calls).append(entry)

    def announced(self, updates: deque[Update]) -> None:
        updates.extend(self._ready)
        self._ready.clear()

    def step_failed(self, error: Exception) -> None:
        if not isinstance(error, PocketJaxError):
            # a peer gone mid-step (gloo: "Connection reset by peer"), or a failure the others may not share:
            # either way the processes can no longer run the same steps
            raise DistributedError(f"process {self.group.process_id}: a step failed, so the processes can no "
                                   f"longer stay in step: {error}") from error

    # ---- the step's message --------------------------------------------------------------------------------------
    def _news(self) -> tuple[dict[str, Any] | None, list[RequestHandle], list[Update]]:
        """Process 0: the message for this step (new requests, cancellations, update_params calls), the handles
        and the updates it adds. Elsewhere (None, [], []): the message comes from process 0."""
        if not self.group.leader:
            return None, [], []
        sent, self._inbox = self._inbox, []
        cancels, self._cancels = self._cancels, []
        updates, self._updates_out = self._updates_out, []
        message: dict[str, Any] = {}
        if sent:
            message["add"] = [[h.request_id, list(map(int, h.request.prompt_tokens)), asdict(h.request.sampling)]
                              for h in sent]
        if cancels:
            message["cancel"] = cancels
        if updates:  # [number, finish_running]: process 0's choice of finish_running holds for every process
            message["update"] = [[self._numbered + i + 1, finish] for i, (_, finish, _) in enumerate(updates)]
        return message, sent, updates

    def _take_updates(self, announced: list[list], updates: list[Update], lock: threading.Condition) -> None:
        """Queue the updates process 0 announced for this step: its own calls on process 0; elsewhere this process's
        call of each number, waited for (at most `update_wait_s`) where it has not come yet."""
        if self.group.leader:
            self._ready.extend(updates)
            self._numbered += len(updates)
            return
        for number, finish_running in announced:
            if number != self._numbered + 1:
                raise DistributedError(f"process {self.group.process_id}: process 0 announced update_params call "
                                       f"number {number} after {self._numbered}: the processes are out of step")
            if not lock.wait_for(lambda: bool(self._calls), self.update_wait_s):
                raise DistributedError(f"process {self.group.process_id}: process 0 applies its update_params call "
                                       f"number {number} at this step, and this process's did not come within "
                                       f"{self.update_wait_s:g} s: call update_params on every process, as often")
            params, _, applied = self._calls.popleft()
            self._ready.append((params, finish_running, applied))
            self._numbered = number

    def _apply(self, message: dict[str, Any], sent: list[RequestHandle]) -> bool:
        """Apply process 0's message (on process 0 too: every process changes its queues at the same point);
        False when it says stop."""
        if self.group.leader:
            self.waiting.extend(sent)
        else:
            for request_id, prompt, sampling in message.get("add", ()):
                params = SamplingParams(**sampling)
                handle = self._bind(BatchedRequest(request_id, prompt, params))
                self.live[request_id] = handle
                self.waiting.append(handle)
        for request_id in message.get("cancel", ()):
            handle = self.live.get(request_id)
            if handle is not None:
                cancel_now(handle, self.waiting, self.live)
        if message.get("stop"):
            self.left = True
            return False
        return True

    def _bind(self, request: BatchedRequest) -> RequestHandle:
        """A follower's handle for a request process 0 sent: the local submit waiting for it, if any."""
        if self._expected:
            local = self._expected.popleft()
            if same_request(local.request, request):
                local.request.request_id = request.request_id
                return local
            local.fail(mismatch(self.group, local.request, request))
        handle = self.open_handle(request)
        self._unclaimed.append(handle)
        return handle


def same_request(local: BatchedRequest, sent: BatchedRequest) -> bool:
    """True when a follower's own submit is the request process 0 sent (the id only if the follower gave one)."""
    return (list(local.prompt_tokens) == list(sent.prompt_tokens) and local.sampling == sent.sampling
            and local.request_id in (None, sent.request_id))


def mismatch(group: ProcessGroup, local: BatchedRequest, sent: BatchedRequest) -> RequestError:
    return RequestError(f"process {group.process_id} submitted a request (prompt of {len(local.prompt_tokens)} "
                        f"tokens) where process 0 sent another ({sent.request_id!r}, {len(sent.prompt_tokens)} "
                        f"tokens): submit the same requests in the same order on every process, or only on process 0")
