"""Scheduler: batched == alone under concurrency, FCFS, no starvation, cancel/stop, soak, backpressure, faults.

Every test drives ONE engine configuration (8 slots, 128 positions, 32-token chunks) and keeps prompts at 16 tokens
or fewer where it can, so the whole file compiles a handful of shapes once.
"""
import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import psutil
import pytest

import pocketjax as pj
from pocketjax.training.bpe import stdlib_files, train_tokenizer
from pocketjax.engine.engine import Engine
from pocketjax.errors import CapacityError, ConfigError, RequestError, SamplingError
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.serve.scheduler import Scheduler

SLOTS, MAX_LEN, CHUNK = 8, 128, 32
TIMEOUT = 120  # seconds any single wait may take before the test fails instead of hanging

MIXED = [
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=1.0, top_k=20, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, repetition_penalty=1.3, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.2, min_p=0.05, seed=99, ignore_eos=True),
    SamplingParams(max_tokens=3, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
    SamplingParams(max_tokens=2, temperature=0.9, seed=2**32 - 1, ignore_eos=True),
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def random_prompts(seed, lengths, vocab=301):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"))


@pytest.fixture(scope="module")
def engine(model):
    """The one shared engine; every test leaves all its slots free."""
    engine = Engine(model, max_batch_size=SLOTS, max_seq_len=MAX_LEN, prefill_chunk=CHUNK)
    yield engine
    assert not engine.slots.owner


def fresh_engine(model) -> Engine:
    return Engine(model, max_batch_size=SLOTS, max_seq_len=MAX_LEN, prefill_chunk=CHUNK)


def drain(sched: Scheduler) -> int:
    steps = 0
    while sched.step():
        steps += 1
    return steps


def alone(model, prompt, sampling) -> list[int]:
    """The request's tokens when it is the only request of a fresh engine of the same configuration."""
    sched = Scheduler(fresh_engine(model))
    handle = sched.submit(prompt, sampling)
    drain(sched)
    return handle.result().token_ids


@pytest.mark.parametrize("n", [2, 4, 8, 48])
def test_concurrent_requests_equal_alone(model, engine, n):
    prompts = random_prompts(n, [2 + (5 * i) % 15 for i in range(n)])
    params = [MIXED[(i * 3) % len(MIXED)] for i in range(n)]
    with Scheduler(engine) as sched:
        def submit(indices):
            return [(i, sched.submit(prompts[i], params[i])) for i in indices]

        with ThreadPoolExecutor(4) as pool:
            parts = pool.map(submit, [range(k, n, 4) for k in range(4)])
        handles = dict(pair for part in parts for pair in part)
        outs = {i: h.result(timeout=TIMEOUT) for i, h in handles.items()}
    assert not engine.slots.owner
    for i in range(n):
        assert outs[i].token_ids == alone(model, prompts[i], params[i]), i
        assert outs[i].finish_reason == "length" and len(outs[i].token_ids) == params[i].max_tokens
        assert outs[i].prompt_tokens == prompts[i]


def test_admission_is_fcfs(engine, monkeypatch):
    admitted = []
    allocate = engine.allocate_slot
    monkeypatch.setattr(engine, "allocate_slot", lambda req: admitted.append(req.request_id) or allocate(req))
    sched = Scheduler(engine)
    sampling = [SamplingParams(max_tokens=1 + i % 4, temperature=0.0, ignore_eos=True) for i in range(20)]
    ids = [sched.submit(p, s).request_id for p, s in zip(random_prompts(1, [3 + i % 9 for i in range(20)]), sampling)]
    while sched.step():
        assert len(sched.running) <= SLOTS
    assert admitted == ids


def test_long_prompt_does_not_starve_running_decodes(model, engine):
    sched = Scheduler(engine)
    short_prompt, long_prompt = random_prompts(2, [5, 3 * CHUNK + 10])
    short = sched.submit(short_prompt, GREEDY)
    sched.step()  # the short request is prefilled: it now decodes one token per step
    assert len(short.request.generated_tokens) == 1
    long = sched.submit(long_prompt, GREEDY)
    prefill_steps = 0
    while long.request.last_token is None:
        before, cached = len(short.request.generated_tokens), long.request.num_prefilled
        sched.step()
        prefill_steps += 1
        assert len(short.request.generated_tokens) == before + 1  # a token every step while the long prompt prefills
        assert long.request.num_prefilled - cached <= CHUNK  # at most one chunk of prefill per step
    assert prefill_steps == 4
    drain(sched)
    assert short.result().token_ids == alone(model, short_prompt, GREEDY)
    assert long.result().token_ids == alone(model, long_prompt, GREEDY)


def test_prefix_reuse_across_requests(model, engine):
    system, turn1, turn2 = random_prompts(3, (9, 4, 3))
    first_sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with Scheduler(engine) as sched:
        first = sched.submit(system + turn1, first_sampling).result(timeout=TIMEOUT)
        follow_up = system + turn1 + first.token_ids + turn2
        handle = sched.submit(follow_up, GREEDY)
        second = handle.result(timeout=TIMEOUT)
    # every generated token but the last was fed back through the cache, so the next turn finds it there
    assert handle.cached_prefix_len == len(system + turn1) + len(first.token_ids) - 1
    assert second.token_ids == alone(model, follow_up, GREEDY)
    # a system prompt held by a running request is copied into the slot of a new request that shares it
    sched = Scheduler(engine)
    holder = sched.submit(system + turn1, GREEDY)
    sched.step()
    other = sched.submit(system + turn2, GREEDY)
    sched.step()
    assert turn1[0] != turn2[0] and other.cached_prefix_len == len(system)
    drain(sched)
    assert other.result().token_ids == alone(model, system + turn2, GREEDY)
    assert holder.result().token_ids == alone(model, system + turn1, GREEDY)


def gate_collect(engine, monkeypatch, hold) -> None:
    """The loop waits (at most TIMEOUT) before reading a decode step while hold() is True: a test thread then acts
    at a known point however fast the loop runs (99 decode steps of the tiny model take ~26 ms)."""
    collect = engine.decode_collect
    monkeypatch.setattr(engine, "decode_collect", lambda step: hold() or collect(step))


def test_cancel_mid_stream_and_before_admission(engine, monkeypatch):
    holder, cancelled = [], threading.Event()
    gate_collect(engine, monkeypatch, lambda: holder and holder[0].num_delivered >= 3
                 and not cancelled.wait(TIMEOUT))
    with Scheduler(engine) as sched:
        handle = sched.submit(random_prompts(4, [6])[0], SamplingParams(max_tokens=100, temperature=0.0,
                                                                         ignore_eos=True))
        holder.append(handle)
        seen = []
        for token in handle:
            seen.append(token)
            if len(seen) == 3:
                handle.cancel()
                cancelled.set()
        out = handle.result(timeout=TIMEOUT)
    assert out.finish_reason == "cancelled" and out.token_ids == seen and 3 <= len(seen) < 100
    assert handle.done() and not engine.slots.owner

    admitted = []
    allocate = engine.allocate_slot
    monkeypatch.setattr(engine, "allocate_slot", lambda req: admitted.append(req.request_id) or allocate(req))
    sched = Scheduler(engine)
    waiting = sched.submit([1, 2, 3], GREEDY)
    kept = sched.submit([4, 5, 6], GREEDY)
    waiting.cancel()
    assert waiting.done() and waiting.result().finish_reason == "cancelled" and waiting.result().token_ids == []
    assert list(waiting) == []
    drain(sched)
    assert admitted == [kept.request_id] and kept.result().finish_reason == "length"


def test_stop_with_requests_in_flight(engine, monkeypatch):
    sched = Scheduler(engine, max_waiting=64)
    handles = []

    def until_stopping():  # once tokens flow, the loop holds until stop() has been called
        if handles and handles[0].num_delivered >= 1:
            with sched._cond:
                sched._cond.wait_for(lambda: sched._stopping, timeout=TIMEOUT)

    gate_collect(engine, monkeypatch, until_stopping)
    sched.start()
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    handles.extend(sched.submit(p, long) for p in random_prompts(5, [4] * 12))  # 8 run, 4 wait
    streamed = []
    reader = threading.Thread(target=lambda: streamed.extend(handles[0]))
    reader.start()
    next(iter(handles[0]))  # the loop is producing tokens
    sched.stop()
    reader.join(timeout=TIMEOUT)
    assert not reader.is_alive()
    outs = [h.result(timeout=TIMEOUT) for h in handles]
    assert all(o.finish_reason == "cancelled" for o in outs)
    assert streamed == outs[0].token_ids and len(outs[0].token_ids) < 120
    assert all(o.token_ids == [] for o in outs[SLOTS:])  # never admitted
    assert not engine.slots.owner and not sched.running and not sched.waiting


def test_soak_2000_short_requests(engine):
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(7)
    sched = Scheduler(engine, max_waiting=4096)

    def warm():  # every batch bucket (1, 2, 4, 8 rows) and a prefix copy, stepped by hand
        for n in (1, 2, 3, 8):
            handles = [sched.submit([9, 8, 7 + i], SamplingParams(max_tokens=2, temperature=0.0)) for i in range(n)]
            drain(sched)
            assert all(h.result().finish_reason in ("length", "stop") for h in handles)

    def wave(count):
        prompts = [[int(t) for t in rng.integers(0, vocab, rng.integers(1, 5))] for _ in range(count)]
        sampling = [SamplingParams(max_tokens=int(rng.integers(1, 3)), temperature=float(rng.choice([0.0, 1.0])),
                                   seed=int(rng.integers(2**31))) for _ in range(count)]
        with ThreadPoolExecutor(2) as pool:
            handles = list(pool.map(sched.submit, prompts, sampling))
        outs = [h.result(timeout=TIMEOUT) for h in handles]
        assert all(1 <= len(o.token_ids) <= 2 and o.finish_reason in ("length", "stop") for o in outs)
        return len(outs)

    warm()
    with sched:
        done = wave(400)
        gc.collect()
        rss, compiled = psutil.Process().memory_info().rss, engine.compiled_count()
        done += wave(1600)
        gc.collect()
        grown = psutil.Process().memory_info().rss - rss
    assert done == 2000
    assert engine.compiled_count() == compiled
    assert grown < 32 * 2**20, grown
    assert not engine.slots.owner and sorted(engine.slots.free) == list(range(SLOTS))
    assert not sched._live and not sched.running and not sched.waiting


def test_full_queue_raises_capacity_error(engine):
    sched = Scheduler(engine, max_waiting=2)
    handles = [sched.submit([1, 2], GREEDY), sched.submit([3, 4], GREEDY)]
    with pytest.raises(CapacityError, match="waiting queue is full"):
        sched.submit([5, 6], GREEDY)
    for h in handles:
        h.cancel()
    sched.submit([5, 6], GREEDY).cancel()  # room again once the queue drains
    with pytest.raises(ConfigError, match="max_waiting"):
        Scheduler(engine, max_waiting=0)
    with pytest.raises(ConfigError, match="prefill_token_budget"):
        Scheduler(engine, prefill_token_budget=0)


def test_submit_many_queues_all_or_none(engine):
    """A batch the queue cannot hold in full is refused whole: the jobs that fitted before the refusal are cancelled,
    not left running for a caller that only saw the error (LLM.generate, the HTTP server's n / prompt lists)."""
    sched = Scheduler(engine, max_waiting=3)
    first = sched.submit([1, 2], GREEDY)
    with pytest.raises(CapacityError, match="waiting queue is full"):
        sched.submit_many([([3, 4], GREEDY, None), ([5, 6], GREEDY, None), ([7, 8], GREEDY, None)])
    assert list(sched.waiting) == [first] and list(sched._live.values()) == [first]
    both = sched.submit_many([([3, 4], GREEDY, None), ([5, 6], GREEDY, None)])  # room for two
    assert list(sched.waiting) == [first, *both]
    for handle in (first, *both):
        handle.cancel()
    assert not sched.waiting and not sched._live


def test_invalid_request_fails_only_its_handle(model, engine):
    vocab = model.config.vocab_size
    engine.allocate_slot("taken")  # held outside the scheduler: admitting this id fails in the engine
    try:
        sched = Scheduler(engine)
        good = sched.submit([1, 2, 3], GREEDY)
        bad = {
            "empty": (sched.submit([], GREEDY), RequestError),
            "vocabulary": (sched.submit([1, vocab], GREEDY), RequestError),
            "temperature": (sched.submit([1, 2], SamplingParams(temperature=-1.0)), SamplingError),
            "tokenizer": (sched.submit([1, 2], SamplingParams(stop=("x",))), RequestError),
            "in flight": (sched.submit([1, 2], GREEDY, request_id=good.request_id), RequestError),
            "already holds": (sched.submit([1, 2], GREEDY, request_id="taken"), RequestError),
        }
        other = sched.submit([4, 5, 6], GREEDY)
        drain(sched)
    finally:
        engine.free_slot("taken")
    for match, (handle, error) in bad.items():
        assert handle.done()
        with pytest.raises(error, match=match):
            handle.result()
        with pytest.raises(error, match=match):
            list(handle)
    assert good.result().token_ids == alone(model, [1, 2, 3], GREEDY)
    assert other.result().token_ids == alone(model, [4, 5, 6], GREEDY)


@pytest.mark.parametrize("pipeline, method", [(False, "batch_decode_step"), (True, "decode_dispatch"),
                                              (True, "decode_collect")])
def test_step_exception_fails_that_steps_requests_and_loop_continues(model, engine, monkeypatch, pipeline, method):
    sched = Scheduler(engine, pipeline=pipeline)
    decoding = sched.submit([7, 8, 9], GREEDY)
    sched.step()  # prefilled: the next step decodes it
    prefilling = sched.submit([10, 11, 12], GREEDY)
    calls = []
    decode = getattr(engine, method)

    def fail_once(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("injected device failure")
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, method, fail_once)
    sched.step()
    with pytest.raises(RuntimeError, match="injected"):
        decoding.result(timeout=0)
    assert decoding.request_id not in engine.slots.owner and not prefilling.done()
    with sched:  # the background loop serves the survivor and new requests
        later = sched.submit([13, 14], GREEDY)
        assert prefilling.result(timeout=TIMEOUT).token_ids == alone(model, [10, 11, 12], GREEDY)
        assert later.result(timeout=TIMEOUT).token_ids == alone(model, [13, 14], GREEDY)
    assert not engine.slots.owner


def test_async_iteration(engine):
    prompts = random_prompts(6, [3, 7, 11])

    async def consume(handle):
        return [token async for token in handle]

    async def main(sched):
        handles = [sched.submit(p, GREEDY) for p in prompts]
        streams = await asyncio.gather(*(consume(h) for h in handles))
        return streams, [h.result(timeout=TIMEOUT).token_ids for h in handles]

    with Scheduler(engine) as sched:
        streams, results = asyncio.run(main(sched))
    assert streams == results and all(len(s) == GREEDY.max_tokens for s in streams)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, model):
    """A byte-level BPE tokenizer whose vocabulary fits the tiny model's 301 ids."""
    corpus = [p.read_text(encoding="utf-8") for p in stdlib_files()[:5]]
    tok = train_tokenizer(corpus, model.config.vocab_size, tmp_path_factory.mktemp("tok"))
    assert tok.vocab_size <= model.config.vocab_size
    return tok


def test_text_stop_strings_and_text_stream(engine, tokenizer):
    prompt = random_prompts(9, [6])[0]  # a random model's greedy text: '1\ufffdiied\ufffdi\x13' (few repeats)
    with Scheduler(engine, tokenizer=tokenizer) as sched:
        free = sched.submit(prompt, GREEDY)
        pieces = list(free.text_stream())
        full = free.result(timeout=TIMEOUT)
        assert full.text == "".join(pieces) == tokenizer.decode(full.token_ids)
        text = full.text
        stop = next(text[i:i + 2] for i in range(1, len(text) - 3)
                    if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
        stopped = sched.submit(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                      stop=(stop, "never-generated")))
        cut = "".join(stopped.text_stream())
        out = stopped.result(timeout=TIMEOUT)
    assert out.finish_reason == "stop" and out.text == cut == text[:text.find(stop)]
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    assert stop in tokenizer.decode(out.token_ids)  # the token that completed the stop string ends the ids
    assert stop not in tokenizer.decode(out.token_ids[:-1])


def record_dispatches(engine, monkeypatch) -> list[tuple]:
    """Spy on engine.decode_dispatch: each dispatched step and whether it was fed its tokens on device."""
    steps = []
    dispatch = engine.decode_dispatch

    def spy(requests, after=None):
        step = dispatch(requests, after=after)
        steps.append((step, after is not None))
        return step

    monkeypatch.setattr(engine, "decode_dispatch", spy)
    return steps


def serve(engine, prompts, params, pipeline: bool) -> list:
    """The requests submitted at once and stepped by hand to the end; their handles."""
    sched = Scheduler(engine, pipeline=pipeline)
    handles = [sched.submit(p, s) for p, s in zip(prompts, params)]
    drain(sched)
    return handles


def test_pipelined_loop_equals_unpipelined_and_alone(model, engine, monkeypatch):
    n = 12  # more than SLOTS: the last requests join while others decode
    prompts = random_prompts(12, [2 + (3 * i) % 13 for i in range(n)])
    free = [MIXED[i % len(MIXED)] for i in range(n)]
    outs = [h.result().token_ids for h in serve(engine, prompts, free, pipeline=False)]
    # three in four stop on a token of their own, at different steps, while the others run to max_tokens
    params = [replace(s, stop_token_ids=(o[min(1 + i % 3, len(o) - 1)],)) if i % 4 else s
              for i, (s, o) in enumerate(zip(free, outs))]
    plain = [h.result() for h in serve(engine, prompts, params, pipeline=False)]
    steps = record_dispatches(engine, monkeypatch)
    handles = serve(engine, prompts, params, pipeline=True)
    for i, (h, p) in enumerate(zip(handles, plain)):
        out = h.result()
        assert (out.token_ids, out.finish_reason) == (p.token_ids, p.finish_reason), i
        assert out.token_ids == alone(model, prompts[i], params[i]), i
        assert h.request.generated_tokens == out.token_ids and len(out.logprobs) == len(out.token_ids)
    assert {p.finish_reason for p in plain} == {"stop", "length"}
    assert sum(chained for _, chained in steps) > len(steps) // 2
    discarded = {r.request_id for step, _ in steps if step.collected  # the last one may stay in flight, unread
                 for r, token in zip(step.requests, step.results)
                 if token is None and any(row is r for row in step.rows)}
    assert discarded and discarded <= {h.request_id for h in handles if h.result().finish_reason == "stop"}
    assert not engine.slots.owner


def test_pipelined_stop_keeps_slot_records_and_prefix_reuse(model, engine):
    prompt, other = random_prompts(13, [7, 5])
    free = alone(model, prompt, GREEDY)
    stop = replace(GREEDY, stop_token_ids=(free[3],))
    sched = Scheduler(engine)
    sched.submit(other, GREEDY)  # keeps decoding after the stop, so the loop stays pipelined
    handle = sched.submit(prompt, stop)
    drain(sched)
    out = handle.result()
    assert out.finish_reason == "stop" and out.token_ids == free[:free.index(free[3]) + 1]
    assert engine.slots.tokens[handle.request.slot_id] == prompt + out.token_ids[:-1]
    # the next turn finds every token but the last cached, and its penalties start from zero in that slot
    follow_up = prompt + out.token_ids + [3, 4]
    penalized = SamplingParams(max_tokens=6, temperature=0.0, presence_penalty=1.0, frequency_penalty=1.0,
                               repetition_penalty=1.3, ignore_eos=True)
    turn = sched.submit(follow_up, penalized)
    drain(sched)
    assert turn.request.slot_id == handle.request.slot_id
    assert turn.cached_prefix_len == len(prompt) + len(out.token_ids) - 1
    assert turn.result().token_ids == alone(model, follow_up, penalized)


def test_pipelined_stop_string_discards_the_token_in_flight(engine, tokenizer):
    prompt = random_prompts(9, [6])[0]
    with Scheduler(engine, tokenizer=tokenizer) as sched:
        text = sched.submit(prompt, GREEDY).result(timeout=TIMEOUT).text
        stop = next(text[i:i + 2] for i in range(2, len(text) - 3)
                    if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
        # decodes on after the stop, so the loop reads the step in flight that still holds the stopped request
        keep = sched.submit(random_prompts(10, [5])[0], replace(GREEDY, max_tokens=40))
        handle = sched.submit(prompt, replace(GREEDY, stop=(stop,)))
        out = handle.result(timeout=TIMEOUT)
        keep.result(timeout=TIMEOUT)
    assert out.finish_reason == "stop" and out.text == text[:text.find(stop)]
    assert handle.request.generated_tokens == out.token_ids
    assert engine.slots.tokens[handle.request.slot_id] == prompt + out.token_ids[:-1]


def test_pipelined_loop_does_not_recompile_after_warmup(engine, monkeypatch):
    prompts = random_prompts(14, [3, 9, 14, 5, 12, 7, 4, 10, 6, 13])

    def workload(seed):
        params = [SamplingParams(max_tokens=3 + i % 6, temperature=float(i % 2), seed=seed + i, ignore_eos=True)
                  for i in range(len(prompts))]
        return [h.result().token_ids for h in serve(engine, prompts, params, pipeline=True)]

    steps = record_dispatches(engine, monkeypatch)
    workload(0)
    workload(0)  # the slots now hold these prompts: the prefix reuse of every later run
    compiled = engine.compiled_count()
    assert workload(1) != workload(0)  # other sampled tokens, same shapes
    assert engine.compiled_count() == compiled
    assert any(chained for _, chained in steps)
