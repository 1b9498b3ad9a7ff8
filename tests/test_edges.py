"""Every edge answers: malformed arguments get typed errors naming them, no handle waits forever, memory is checked
before XLA allocates, and random malformed traffic leaves the engine serving (Hypothesis)."""
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pocketjax as pj
from pocketjax.engine.request import BatchedRequest
from pocketjax.errors import CapacityError, PocketJaxError, RequestError, StoppedError
from pocketjax.model import memory
from pocketjax.serve.cli import main
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.scheduler import Scheduler

pytestmark = pytest.mark.leg1_only  # HTTP / host-side: the same under any JAX (.ci/run's leg 2 runs the engine's tests)

GREEDY = pj.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TIMEOUT = 120


@pytest.fixture(scope="module")
def model():
    return pj.load_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def llm(model):
    with pj.LLM(model, max_batch_size=4, max_seq_len=64, prefill_chunk=16) as llm:
        yield llm


def test_malformed_prompts_and_sampling_name_what_was_expected(llm):
    cases = [(None, "prompts must be a string, a list of token ids"), (3.5, "a string, a list of token ids"),
             ([[1, None]], "non-integer token id None"), ([np.float32(2.0)], "non-integer token id"),
             ([[]], "empty prompt"), ([list(range(70))], "does not fit max_seq_len")]
    for prompts, match in cases:
        with pytest.raises(RequestError, match=match):
            llm.generate(prompts, GREEDY)
    with pytest.raises(RequestError, match="sampling must be a SamplingParams"):
        llm.generate("x", {"temperature": 0})
    with pytest.raises(RequestError, match="sampling must be a SamplingParams"):
        llm.generate(["x"], ["not params"])
    ids = llm.generate([np.array([5, 6, 7], np.int64)], GREEDY)[0].token_ids  # numpy integers are fine
    assert ids == llm.generate([[5, 6, 7]], GREEDY)[0].token_ids


def test_text_chat_and_load_arguments_are_checked(llm, hf_checkpoint):
    with pytest.raises(RequestError, match="text cannot be encoded"):
        llm.generate("lone surrogate \ud800", GREEDY)
    for messages, match in [([{"content": "hi"}], "message 0 must be a dict with a 'role'"),
                            (["hi"], "message 0 must be a dict"),
                            ([{"role": "user", "content": 5}], "message 0: 'content' must be a string"),
                            ([{"role": "user", "content": ["part"]}], "content parts"), ([], "empty conversation")]:
        with pytest.raises(RequestError, match=match):
            llm.chat(messages, GREEDY)
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    for kwargs, error, match in [({"tp": True}, pj.errors.ConfigError, "tp must be a positive integer"),
                                 ({"tp": "2"}, pj.errors.ConfigError, "tp must be a positive integer"),
                                 ({"dtype": 32}, pj.errors.ConfigError, "dtype=32"),
                                 ({"quantize": 8}, pj.errors.ConfigError, "quantize=8")]:
        with pytest.raises(error, match=match):
            pj.load_model(folder, **kwargs)
    with pytest.raises(pj.errors.CheckpointError, match="123 is not a checkpoint folder"):
        pj.load_model(123)


def test_engine_batch_api_rejects_what_is_not_a_request(model):
    engine = pj.Engine(model, max_batch_size=2, max_seq_len=64)
    for call, arg, match in [(engine.batch_prefill, [1, 2], "BatchedRequest objects"),
                             (engine.batch_prefill, "abc", "list of BatchedRequest"),
                             (engine.batch_decode_step, [None], "BatchedRequest objects"),
                             (engine.allocate_slot, ["unhashable"], "hashable"),
                             (engine.free_slot, ["unhashable"], "holds no slot")]:
        with pytest.raises(RequestError, match=match):
            call(arg)
    for prompt in ("some text", None):  # checked when the slot is asked for, as at prefill
        with pytest.raises(RequestError, match="prompt_tokens must be a list of token ids"):
            engine.allocate_slot(BatchedRequest("r", prompt, GREEDY))
    engine.allocate_slot("r")  # by id: the request is checked at prefill
    with pytest.raises(RequestError, match="prompt_tokens must be a list of token ids, got str"):
        engine.batch_prefill([BatchedRequest("r", "some text", GREEDY)])
    with pytest.raises(RequestError, match="token_budget"):
        engine.batch_prefill([BatchedRequest("r", [1, 2], GREEDY)], token_budget=0)
    engine.free_slot("r")
    assert not engine.slots.owner


def test_scheduler_submit_fails_the_handle_of_a_malformed_request(model):
    sched = Scheduler(pj.Engine(model, max_batch_size=2, max_seq_len=64))
    for prompt, kwargs, match in [(None, {}, "list of token ids"), ("text", {}, "got str"),
                                  ([1, 2], {"request_id": ["x"]}, "hashable"),
                                  ([1, 2], {"sampling": "greedy"}, "SamplingParams")]:
        handle = sched.submit(prompt, **kwargs) if "sampling" not in kwargs else sched.submit(prompt, kwargs["sampling"])
        with pytest.raises(RequestError, match=match):
            handle.result(timeout=0)
    assert not sched.waiting


def test_stopped_scheduler_refuses_and_restarts(model):
    sched = Scheduler(pj.Engine(model, max_batch_size=2, max_seq_len=64)).start()
    assert sched.submit([1, 2, 3], GREEDY).result(timeout=TIMEOUT).finish_reason == "length"
    sched.stop()
    with pytest.raises(StoppedError, match="stopped"):
        sched.submit([1, 2, 3], GREEDY)
    with sched:  # started again: serving
        assert len(sched.submit([1, 2, 3], GREEDY).result(timeout=TIMEOUT).token_ids) == 4


def test_iteration_timeout_and_a_dead_loop_end_every_handle(model, monkeypatch):
    engine = pj.Engine(model, max_batch_size=2, max_seq_len=64)
    idle = Scheduler(engine)  # never stepped: nothing arrives
    with pytest.raises(TimeoutError, match="nothing new"):
        next(idle.submit([1, 2], GREEDY).tokens(timeout=0.05))
    entered = threading.Event()

    def die(*args, **kwargs):  # what a KeyboardInterrupt or SystemExit in the loop thread looks like
        entered.set()
        raise SystemExit("injected")

    monkeypatch.setattr(engine, "prefill_dispatch", die)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's death is the point
    sched = Scheduler(engine, max_waiting=16)
    handles = [sched.submit([i + 1, 2, 3], GREEDY) for i in range(5)]  # 2 admitted, 3 waiting
    sched.start()
    assert entered.wait(TIMEOUT)
    for handle in handles:
        with pytest.raises(StoppedError, match="loop died"):
            handle.result(timeout=TIMEOUT)
    with pytest.raises(StoppedError):
        sched.submit([1], GREEDY)
    assert not engine.slots.owner


def test_memory_is_checked_before_allocating(model, monkeypatch, hf_checkpoint):
    with pytest.raises(CapacityError, match=r"KV cache of 64 slots .* needs [\d.]+ GiB but host memory has "
                                            r"[\d.]+ GiB free: use fewer slots"):
        pj.Engine(model, max_batch_size=64, max_seq_len=2**26)  # ~16 TiB: refused before XLA tries
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    with pytest.raises(CapacityError, match=r"loading .* needs [\d.]+ GiB but host memory has 0.000 GiB free: "
                                            r"quantize="):
        pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"))


def test_cli_reports_bad_input_in_one_line(capsys, tmp_path):
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pocketjax: ") and "Traceback" not in err


# ---- random traffic ----------------------------------------------------------------------------------------------

VOCAB = 4096  # the embedded model's vocabulary size (checked in the fixture below)
ints = st.integers(-3, VOCAB + 3)
prompts = st.one_of(
    st.text(max_size=24), st.lists(ints, max_size=70), st.lists(st.integers(0, 400), min_size=1, max_size=12),
    st.lists(st.floats(allow_nan=True), max_size=3), st.none(), st.integers(), st.booleans(),
    st.lists(st.one_of(st.text(max_size=3), st.none(), st.booleans()), max_size=3))
samplings = st.one_of(st.none(), st.just("greedy"), st.builds(
    pj.SamplingParams, max_tokens=st.one_of(st.integers(-1, 5), st.floats(0, 3)),
    temperature=st.one_of(st.floats(-1, 2), st.just(float("nan"))), top_k=st.integers(-1, 50),
    top_p=st.floats(-0.5, 1.5), min_p=st.floats(-0.1, 1.1), seed=st.one_of(st.none(), st.integers(-1, 2**33)),
    stop_token_ids=st.lists(ints, max_size=2), stop=st.lists(st.text(max_size=3), max_size=2),
    presence_penalty=st.floats(-3, 3), logprobs=st.integers(-1, 25), ignore_eos=st.booleans()))
GOOD = [[11, 12, 13], list(range(100, 140))]  # checked against the same prompts run alone


@pytest.fixture(scope="module")
def alone(model):
    assert model.config.vocab_size == VOCAB
    with pj.LLM(model, max_batch_size=1, max_seq_len=64, prefill_chunk=16) as solo:
        return [solo.generate([p], GREEDY)[0].token_ids for p in GOOD]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(traffic=st.lists(st.tuples(prompts, samplings), max_size=4), good=st.sampled_from(range(len(GOOD))))
def test_random_malformed_traffic_keeps_serving(llm, alone, traffic, good):
    handles = []
    for prompt, sampling in traffic:
        try:
            handles.append(llm.submit(prompt, sampling))
        except PocketJaxError:
            pass
    reference = llm.submit(GOOD[good], GREEDY)  # a valid request amid the traffic
    for handle in handles:
        try:
            handle.result(timeout=TIMEOUT)
        except PocketJaxError:
            pass
    assert reference.result(timeout=TIMEOUT).token_ids == alone[good]
    assert not llm.engine.slots.owner and not llm.scheduler.running and not llm.scheduler.waiting
