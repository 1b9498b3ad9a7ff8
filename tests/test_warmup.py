"""Warm-up (engine/runner.py, Device.warmup) compiles every step signature an engine can produce, and leaves its state alone."""
import jax
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.runner import STEP_FUNCTIONS
from pocketjax.engine.plan import Signature, signatures

from test_engine import run

# Off sizes on purpose: 3 slots, 96 positions and chunks of 48 cap every bucket below the next power of two, and no
# other test compiles these shapes. The compile cache is off explicitly: no test writes into the user's folder.
OPTIONS = dict(max_batch_size=3, max_seq_len=96, prefill_chunk=48, min_kv_bucket=32, compile_cache_dir="off")


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"))


def test_signatures_follow_the_engines_buckets(model):
    calls = signatures(pj.Engine(model, **OPTIONS, batch_invariant=False).rules)  # XLA's attention: kv buckets
    prefill = [(c.width, c.kv_len) for c in calls if c.step == "prefill" and c.rows == 1]
    # a chunk of 33..48 tokens ends at position 33 or later: never attends over only 32
    assert prefill == [(16, 32), (16, 64), (16, 96), (32, 32), (32, 64), (32, 96), (48, 64), (48, 96)]
    assert sorted({c.rows for c in calls if c.rows}) == [1, 2, 3]
    assert {(c.rows, c.num_top) for c in calls if c.step == "decode_sample"} == {(r, t) for r in (1, 2, 3)
                                                                                 for t in (0, 20)}
    assert sorted({c.kv_len for c in calls if c.step == "decode_sample" and c.rows == 3}) == [32, 64, 96]
    assert calls[-1] == Signature("copy_prefix") and len(calls) == len(set(calls))
    pallas = signatures(pj.Engine(model, **{**OPTIONS, "attention_impl": "pallas_interpret"}).rules)
    assert {c.kv_len for c in pallas if c.kv_len} == {96}  # the kernels always read max_seq_len
    native = signatures(pj.Engine(model, **OPTIONS).rules)  # the native CPU kernel reads each row to its position
    assert {c.kv_len for c in native if c.kv_len} == {96} and len(native) < len(calls)
    one_slot = pj.Engine(model, **{**OPTIONS, "max_batch_size": 1})
    assert not any(c.step == "copy_prefix" for c in signatures(one_slot.rules))


def run_until_done(sched: pj.Scheduler) -> None:
    while sched.has_work():
        sched.step()


@pytest.mark.timeout(600)
def test_after_warmup_a_mixed_workload_compiles_nothing(model):
    engine = pj.Engine(model, **OPTIONS)
    for f in STEP_FUNCTIONS:  # other tests' engines share the step functions: count from nothing
        f.clear_cache()
    assert engine.warmup(progress=False) == len(signatures(engine.rules))  # each call one new signature, none dead
    assert engine.warmup(progress=False) == 0
    compiled = engine.compiled_count()

    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    options = [pj.SamplingParams(max_tokens=5, temperature=0.0),
               pj.SamplingParams(max_tokens=4, temperature=0.8, top_k=20, top_p=0.9, seed=1, logprobs=3),
               pj.SamplingParams(max_tokens=6, temperature=1.0, min_p=0.05, repetition_penalty=1.3,
                                 presence_penalty=0.5, frequency_penalty=0.2, logprobs=20),
               pj.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]  # 90 + 40 runs into the end
    sched = pj.Scheduler(engine)  # pipelined: decode steps fed on device; prefill in chunk-sized token budgets
    handles = []
    for i, length in enumerate([1, 2, 15, 16, 17, 31, 33, 47, 48, 49, 64, 80, 90, 95]):
        handles.append(sched.submit(rng.integers(0, vocab, length).tolist(), options[i % len(options)]))
        if i % 3 == 2:  # bursts of 1..3 concurrent requests
            run_until_done(sched)
    run_until_done(sched)
    shared = rng.integers(0, vocab, 40).tolist()
    first = sched.submit(shared, pj.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    sched.step(), sched.step()  # prefilled and decoding in its slot when the next one arrives
    second = sched.submit(shared + [5, 6, 7], pj.SamplingParams(max_tokens=3, logprobs=1))  # its prefix copied
    run_until_done(sched)
    again = sched.submit(shared + [5, 6, 7, 8], pj.SamplingParams(max_tokens=2))  # a freed slot's prefix reused
    run_until_done(sched)
    assert all(h.result().finish_reason in ("stop", "length") for h in handles + [first, second, again])
    assert second.cached_prefix_len == 40 and again.cached_prefix_len == 43

    sched = pj.Scheduler(engine, pipeline=False, prefill_token_budget=70)  # decode fed from the host
    for length in (3, 50, 70):
        sched.submit(rng.integers(0, vocab, length).tolist(), pj.SamplingParams(max_tokens=3, logprobs=2))
    run_until_done(sched)
    # the batch API without a budget: every prompt in one call per chunk
    run(engine, [rng.integers(0, vocab, n).tolist() for n in (60, 20, 94)], pj.SamplingParams(max_tokens=3))
    assert engine.compiled_count() == compiled


def test_warmup_on_a_mesh_covers_the_state_in_its_sharded_form(hf_checkpoint):
    """tp=2 over the two CPU devices: the sampler hands the penalties back replicated over the mesh."""
    sharded = pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"), tp=2)
    engine = pj.Engine(sharded, max_batch_size=2, max_seq_len=32, prefill_chunk=16, compile_cache_dir="off")
    engine.warmup(progress=False)
    compiled = engine.compiled_count()
    sched = pj.Scheduler(engine)
    handles = [sched.submit([1, 2, 3], pj.SamplingParams(max_tokens=3))]  # alone: warm-up's first sampler shape
    run_until_done(sched)
    handles += [sched.submit(list(range(1, n)), pj.SamplingParams(max_tokens=3, logprobs=n % 3)) for n in (20, 29)]
    run_until_done(sched)
    assert [h.result().finish_reason for h in handles] == ["length"] * 3
    assert engine.compiled_count() == compiled


def host_state(engine: pj.Engine):
    return (jax.device_get((engine.cache, engine.slot_state)), [list(t) for t in engine.slots.tokens],
            list(engine.slots.free), dict(engine.slots.owner))


def test_warmup_leaves_slots_cache_and_penalties_as_they_were(model, capsys):
    engine = pj.Engine(model, **OPTIONS)
    reqs = [BatchedRequest(i, list(range(3 + 10 * i, 30 + 20 * i)), pj.SamplingParams(max_tokens=8, seed=i))
            for i in range(2)]
    for req in reqs:
        engine.allocate_slot(req)
    engine.batch_prefill(reqs)
    engine.batch_decode_step(reqs)
    engine.free_slot(0, "length")  # slot 0 free with its tokens cached; slot 1 held mid-request
    before = host_state(engine)
    engine.warmup()
    assert "pocketjax warm-up" in capsys.readouterr().err  # the progress bar
    after = host_state(engine)
    assert jax.tree.all(jax.tree.map(np.array_equal, before[0], after[0]))
    assert before[1:] == after[1:]
    while not reqs[1].finished:
        engine.batch_decode_step([reqs[1]])  # the held request goes on from where it was
    assert len(reqs[1].generated_tokens) == 8
