"""The lockstep protocol (pocketjax/serve/lockstep.py) in one process, over a scripted ProcessGroup: what process 0
sends, how a follower matches its own submits to process 0's requests, and the stop message. No engine runs here;
tests/test_multihost.py runs the protocol for real, in 2-process jobs.
"""
import json
import threading
from collections import deque
from dataclasses import asdict

import jax
import numpy as np
import pytest

from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.errors import ConfigError, DistributedError, RequestError, SamplingError, StoppedError
from pocketjax.serve.distributed import ProcessGroup
from pocketjax.serve.handle import RequestHandle
from pocketjax.serve.lockstep import Local, Lockstep, protocol

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class ScriptedGroup(ProcessGroup):
    """A group whose broadcast is local: process 0's messages are recorded (as JSON would carry them), a
    follower's come from `script`."""

    def __init__(self, process_id: int, script=()):
        super().__init__(process_id, 2)
        self.sent, self.script = [], deque(script)

    def exchange(self, message):
        if self.leader:
            self.sent.append(json.loads(json.dumps(message)))
            return self.sent[-1]
        return self.script.popleft()


def make(group):
    waiting, live = deque(), {}

    def validate(request):  # stands in for Engine.validate
        if not request.prompt_tokens:
            raise RequestError("empty prompt")

    return protocol(group, waiting, live, RequestHandle, validate, keepalive_s=0.01), waiting, live


def submitted(lockstep, live, request_id, prompt):
    """What the scheduler's submit does on process 0 once a request passed its checks."""
    handle = RequestHandle(BatchedRequest(request_id, prompt, GREEDY))
    live[request_id] = handle
    lockstep.add(handle)
    return handle


def test_one_process_is_local():
    lockstep, waiting, live = make(None)
    assert type(lockstep) is Local and lockstep.group is None
    assert type(make(ProcessGroup(0, 1))[0]) is Local
    handle = submitted(lockstep, live, "a", [1, 2])
    assert list(waiting) == [handle] and lockstep.held() == 0  # queued at once
    lockstep.cancel(handle)
    assert handle.done() and not waiting and not live
    lockstep.step_failed(ValueError("a bug"))  # one process: the failure is the requests' own
    assert lockstep.sync(threading.Condition(), stop=lambda: pytest.fail("nothing to stop")) is True


def test_leader_holds_news_until_the_step_and_applies_it_there():
    group = ScriptedGroup(0)
    lockstep, waiting, live = make(group)
    lock = threading.Condition()
    early, kept = submitted(lockstep, live, "early", [1, 2]), submitted(lockstep, live, "kept", [3, 4, 5])
    assert lockstep.held() == 2 and not waiting  # nothing reaches the queue before the broadcast
    lockstep.cancel(early)  # not sent yet: ends now, and is never sent
    assert early.result(timeout=1).finish_reason == "cancelled" and "early" not in live
    assert lockstep.sync(lock, stop=lambda: pytest.fail("process 0 does not receive a stop"))
    assert list(waiting) == [kept] and lockstep.held() == 0
    (message,) = group.sent
    assert [[i, p] for i, p, _ in message["add"]] == [["kept", [3, 4, 5]]] and "cancel" not in message
    lockstep.cancel(kept)
    lockstep.cancel(kept)  # sent once
    assert list(waiting) == [kept] and not kept.done()  # a sent request ends at the next step, everywhere
    lockstep.sync(lock, stop=lambda: None)
    assert group.sent[-1] == {"cancel": ["kept"]} and kept.result(timeout=1).finish_reason == "cancelled"
    assert not waiting and not live
    with lock:
        assert lockstep.idle(lock, lambda: False, lambda: False) is True  # the keepalive wakes it with no work
        assert lockstep.idle(lock, lambda: False, lambda: True) is False
    assert group.sent[-1] == {"stop": True}
    with pytest.raises(StoppedError, match="cannot restart"):
        lockstep.restart()


def test_leader_refuses_what_cannot_be_sent_and_out_of_step_failures():
    lockstep, _, _ = make(ScriptedGroup(0))
    for request_id in (("tuple",), 1.5, True):
        with pytest.raises(RequestError, match="str or an int"):
            lockstep.check(BatchedRequest(request_id, [1], GREEDY))
    with pytest.raises(RequestError, match="hook"):
        lockstep.check(BatchedRequest("h", [1], SamplingParams(hook=lambda x, info: x)))
    lockstep.check(BatchedRequest(7, [1], GREEDY))
    lockstep.step_failed(SamplingError("this request's own"))  # every process refuses it the same way
    with pytest.raises(DistributedError, match="stay in step"):
        lockstep.step_failed(ConnectionResetError("peer gone"))


def test_follower_matches_its_submits_to_process_0s_requests_in_order():
    sent = lambda *adds: {"add": [[i, p, json.loads(json.dumps(asdict(GREEDY)))] for i, p in adds]}  # noqa: E731
    group = ScriptedGroup(1, [sent(("r0", [1, 2]), ("r1", [3])), sent(("r2", [4, 5]), ("r3", [6])), {"stop": True}])
    lockstep, waiting, live = make(group)
    lock = threading.Condition()
    before = lockstep.claim(BatchedRequest(None, [1, 2], GREEDY))  # submitted before process 0's message came
    assert before is not None and not before.done()
    assert lockstep.claim(BatchedRequest(None, [], GREEDY)).done()  # refused here as process 0 refuses it
    assert lockstep.sync(lock, stop=lambda: pytest.fail("not yet"))
    assert [h.request_id for h in waiting] == ["r0", "r1"] and waiting[0] is before and set(live) == {"r0", "r1"}
    assert lockstep.claim(BatchedRequest(None, [3], GREEDY)) is waiting[1]  # after: the one process 0 sent
    wrong = lockstep.claim(BatchedRequest(None, [9, 9], GREEDY))  # waits for r2, which is another request
    lockstep.sync(lock, stop=lambda: pytest.fail("not yet"))
    with pytest.raises(RequestError, match="process 1 submitted a request"):
        wrong.result(timeout=1)
    assert [h.request_id for h in waiting][-2:] == ["r2", "r3"]
    lockstep.cancel(waiting[0])  # a follower's cancel does nothing: process 0's ends the request everywhere
    assert not waiting[0].done()
    with lock:
        assert lockstep.idle(lock, lambda: False, lambda: True) is True  # it waits in the broadcast, not here
    stopped = []
    assert lockstep.sync(lock, stop=lambda: stopped.append(lock._is_owned())) is False
    assert stopped == [True] and lockstep.left
    with lock:
        assert lockstep.idle(lock, lambda: False, lambda: False) is False  # process 0's stop ends its loop


def test_update_params_are_numbered_by_process_0_and_each_process_applies_its_own():
    """Process 0 sends its update_params calls with the step's news; a follower queues its own call of each number
    at that step (waiting for one not made yet), under process 0's finish_running; one that does not come within
    update_wait_s, or a number out of order, is DistributedError."""
    leader, _, _ = make(ScriptedGroup(0))
    lock, updates = threading.Condition(), deque()
    ours = ("params of process 0", True, threading.Event())
    leader.update(ours, updates)
    leader.announced(updates)
    assert not updates  # nothing before the broadcast
    leader.sync(lock, stop=lambda: None)
    assert leader.group.sent == [{"update": [[1, True]]}]
    leader.announced(updates)
    assert list(updates) == [ours]

    script = [{"update": [[1, True]]}, {"update": [[2, False]]}, {"update": [[3, False]]}, {"update": [[9, False]]}]
    follower, _, _ = make(ScriptedGroup(1, script))
    follower.update_wait_s = 30
    updates, first, late = deque(), threading.Event(), threading.Event()
    follower.update(("first of process 1", False, first), updates)
    assert not updates  # kept for process 0's call of the same number
    follower.sync(lock, stop=lambda: None)
    follower.announced(updates)
    assert list(updates) == [("first of process 1", True, first)]  # process 0's finish_running holds

    def call_late():
        with lock:
            follower.update(("second of process 1", False, late), updates)
            lock.notify_all()  # what Scheduler.update_params does

    threading.Timer(0.2, call_late).start()
    follower.sync(lock, stop=lambda: None)  # waits for this process's second call
    follower.announced(updates)
    assert list(updates)[-1] == ("second of process 1", False, late)
    follower.update_wait_s = 0.05
    with pytest.raises(DistributedError, match="did not come within"):
        follower.sync(lock, stop=lambda: None)
    with pytest.raises(DistributedError, match="out of step"):
        follower.sync(lock, stop=lambda: None)


def test_update_params_in_a_job_take_only_leaves_on_the_engine_sharding():
    """Placing any other leaf would run collectives on the caller's thread, beside the serving loop's: a ConfigError
    naming it, before anything is placed. One process places anything."""
    params = {"w": jax.numpy.ones((2, 2))}
    lockstep, _, _ = make(ScriptedGroup(1))
    lockstep.check_params(params, {"w": jax.numpy.zeros((2, 2))})  # the same sharding: served as it is
    with pytest.raises(ConfigError, match=r"params\['w'\] is not a jax.Array on the engine's sharding"):
        lockstep.check_params(params, {"w": np.zeros((2, 2), np.float32)})
    make(None)[0].check_params(params, {"w": np.zeros((2, 2), np.float32)})


def test_a_caller_waiting_for_its_update_hears_why_it_will_not_come():
    """A job's loop can end under a waiting update_params caller (a peer died): the wait raises its error."""
    local = make(None)[0]
    applied = threading.Event()
    gone = DistributedError("process 1 lost contact")
    with pytest.raises(DistributedError, match="lost contact"):
        local.await_update(applied, lambda: gone, timeout=None)
    with pytest.raises(TimeoutError):
        local.await_update(applied, lambda: None, timeout=0.05)
    applied.set()
    local.await_update(applied, lambda: gone, timeout=None)  # in use: the later end does not matter
