"""Engine: greedy parity with transformers, batched == alone, chunking, prefix reuse, buckets, errors."""
import gc
from dataclasses import replace

import numpy as np
import psutil
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine, PendingDecode
from pocketjax.engine.request import BatchedRequest
from pocketjax.errors import CapacityError, RequestError, SamplingError
from pocketjax.engine.sampling_params import SamplingParams

from conftest import oracle

torch = oracle("torch")
transformers = oracle("transformers")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompts, params, ids=None) -> list[BatchedRequest]:
    """Allocate, prefill and decode to completion; frees the slots; returns the finished requests."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [BatchedRequest(i if ids is None else ids[i], list(p), s) for i, (p, s) in enumerate(zip(prompts, params))]
    for r in reqs:
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        engine.batch_decode_step(reqs)
    for r in reqs:
        engine.free_slot(r.request_id)
    return reqs


def random_prompts(seed, lengths, vocab):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


@pytest.fixture(scope="module")
def qwen3(hf_checkpoint):
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    return folder, pj.load_model(folder)


@pytest.mark.parametrize("name", ["qwen3_gqa4_headdim", "qwen2_gqa2_tied"])
def test_greedy_matches_transformers_generate(hf_checkpoint, name):
    folder = hf_checkpoint(name)
    model = pj.load_model(folder)
    prompts = random_prompts(0, (5, 40, 17), model.config.vocab_size)
    ours = run(Engine(model, max_batch_size=4, max_seq_len=128, prefill_chunk=32), prompts, GREEDY)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for req, prompt in zip(ours, prompts):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=None, output_scores=True, return_dict_in_generate=True)
        ref = out.sequences[0, len(prompt):].tolist()
        for step, (a, b) in enumerate(zip(req.generated_tokens, ref)):
            if a != b:  # allowed only where transformers' top-2 logits are a near-tie
                top2 = torch.topk(out.scores[step][0], 2).values
                assert float(top2[0] - top2[1]) < 1e-4, (step, req.generated_tokens, ref)
                break
        assert len(req.generated_tokens) == 12 and req.finish_reason == "length"


MIXED = [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=1.0, top_k=20, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, repetition_penalty=1.3, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, ignore_eos=True),
    SamplingParams(max_tokens=11, temperature=1.2, min_p=0.05, seed=99, ignore_eos=True),
    SamplingParams(max_tokens=5, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, seed=2**32 - 1, ignore_eos=True),
]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_batched_equals_alone(qwen3, n):
    _, model = qwen3
    prompts = random_prompts(n, [3 + 7 * i for i in range(n)], model.config.vocab_size)
    params = MIXED[:n]
    engine = Engine(model, max_batch_size=8, max_seq_len=128, prefill_chunk=32)
    together = run(engine, prompts, params)
    for prompt, sp, req in zip(prompts, params, together):
        alone = run(Engine(model, max_batch_size=1, max_seq_len=128, prefill_chunk=32), [prompt], sp)[0]
        assert alone.generated_tokens == req.generated_tokens
        assert len(req.generated_tokens) == sp.max_tokens


def test_unseeded_requests_differ_and_seeded_repeat(qwen3):
    _, model = qwen3
    engine = Engine(model, max_batch_size=4, max_seq_len=64)
    prompt = random_prompts(3, [6], model.config.vocab_size)
    hot = SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True)
    a, b = run(engine, prompt * 2, hot)
    assert a.generated_tokens != b.generated_tokens
    seeded = SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
    c, d = run(engine, prompt * 2, seeded)
    assert c.generated_tokens == d.generated_tokens


def test_chunked_prefill_equals_one_chunk_and_handles_4k(hf_checkpoint):
    model = pj.load_model(hf_checkpoint("qwen3_kv1", max_position_embeddings=8192))
    prompts = random_prompts(5, (300, 90), model.config.vocab_size)
    whole = run(Engine(model, max_batch_size=2, max_seq_len=512, prefill_chunk=512), prompts, GREEDY)
    chunked = run(Engine(model, max_batch_size=2, max_seq_len=512, prefill_chunk=64), prompts, GREEDY)
    assert [r.generated_tokens for r in whole] == [r.generated_tokens for r in chunked]
    long_prompt = random_prompts(6, [4000], model.config.vocab_size)
    engine = Engine(model, max_batch_size=1, max_seq_len=4096, prefill_chunk=512)
    (req,) = run(engine, long_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    ref = np.asarray(pj.logits(model, [long_prompt[0] + req.generated_tokens[:-1]]))[0]
    assert req.generated_tokens == ref[3999:].argmax(-1).tolist()


def test_token_budget_prefills_one_bounded_chunk(qwen3):
    _, model = qwen3
    engine = Engine(model, max_batch_size=2, max_seq_len=128, prefill_chunk=32)
    req = BatchedRequest(0, random_prompts(8, [70], model.config.vocab_size)[0], GREEDY)
    engine.allocate_slot(req)
    assert engine.batch_prefill([req], token_budget=32) == [None] and req.num_prefilled == 32
    assert engine.batch_prefill([req], token_budget=32) == [None] and req.num_prefilled == 64
    (first,) = engine.batch_prefill([req], token_budget=32)
    assert first == req.generated_tokens[0] and req.num_prefilled == 70


def test_no_recompilation_after_warmup(qwen3):
    _, model = qwen3
    engine = Engine(model, max_batch_size=4, max_seq_len=256, prefill_chunk=64)

    def workload(seed):
        rng = np.random.default_rng(seed)
        for n in (1, 3, 4, 2):
            lengths = rng.integers(5, 60, n)
            run(engine, random_prompts(seed + n, lengths, model.config.vocab_size),
                SamplingParams(max_tokens=int(rng.integers(3, 9)), temperature=0.0, ignore_eos=True))

    workload(0)
    workload(0)
    before = engine.compiled_count()
    workload(0)  # same shapes, different tokens and lengths within the buckets
    assert engine.compiled_count() == before


def test_prefix_reuse_follow_up_turn_and_shared_prompt(qwen3):
    _, model = qwen3
    vocab = model.config.vocab_size
    system, turn1, turn2 = random_prompts(9, (40, 10, 8), vocab)
    engine = Engine(model, max_batch_size=3, max_seq_len=256, prefill_chunk=32)
    (first,) = run(engine, [system + turn1], GREEDY)
    follow_up = system + turn1 + first.generated_tokens + turn2
    (second,) = run(engine, [follow_up], GREEDY)
    # generated tokens before the last were fed back, so they are cached too
    assert second.cached_prefix_len == len(system + turn1) + len(first.generated_tokens) - 1
    fresh = run(Engine(model, max_batch_size=1, max_seq_len=256), [follow_up], GREEDY)[0]
    assert second.generated_tokens == fresh.generated_tokens
    # a shared system prompt held by a running request is copied into another slot
    holder = BatchedRequest("holder", system + turn1, GREEDY)
    engine.allocate_slot(holder)
    engine.batch_prefill([holder])
    other = BatchedRequest("other", system + turn2, GREEDY)
    engine.allocate_slot(other)
    assert other.slot_id != holder.slot_id and other.cached_prefix_len == len(system)
    engine.batch_prefill([other])
    while not other.finished:
        engine.batch_decode_step([other])
    alone = run(Engine(model, max_batch_size=1, max_seq_len=256), [system + turn2], GREEDY)[0]
    assert other.generated_tokens == alone.generated_tokens


def test_slot_cycles_leave_no_stale_state(qwen3):
    _, model = qwen3
    engine = Engine(model, max_batch_size=2, max_seq_len=64, prefill_chunk=16)
    prompts = random_prompts(10, (9, 13), model.config.vocab_size)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    expected = [r.generated_tokens for r in run(engine, prompts, short)]
    rss = []
    for cycle in range(1000):
        got = run(engine, prompts, short, ids=[f"a{cycle}", f"b{cycle}"])
        assert [r.generated_tokens for r in got] == expected
        if cycle in (200, 999):
            gc.collect()
            rss.append(psutil.Process().memory_info().rss)
    assert sorted(engine.slots.free) == [0, 1] and not engine.slots.owner
    assert rss[1] - rss[0] < 32 * 2**20, rss


def test_stop_tokens_eos_and_logprobs(qwen3):
    _, model = qwen3
    engine = Engine(model, max_batch_size=2, max_seq_len=64)
    prompt = random_prompts(11, [7], model.config.vocab_size)
    (free,) = run(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3))
    stop_at = free.generated_tokens[3]
    (stopped,) = run(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_at]))
    cut = free.generated_tokens.index(stop_at) + 1
    assert stopped.generated_tokens == free.generated_tokens[:cut] and stopped.finish_reason == "stop"
    logits = np.asarray(pj.logits(model, [prompt[0] + free.generated_tokens]))[0, len(prompt[0]) - 1:-1]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    for step, (lp, top) in enumerate(free.logprobs):
        assert lp == pytest.approx(ref[step, free.generated_tokens[step]], abs=1e-4)
        assert list(top) == list(np.argsort(-ref[step])[:3])


def test_errors_are_typed_and_engine_keeps_serving(qwen3):
    _, model = qwen3
    engine = Engine(model, max_batch_size=2, max_seq_len=32)
    good = random_prompts(12, [5], model.config.vocab_size)
    bad_requests = [
        ([], GREEDY, RequestError, "empty"),
        (list(range(40)), GREEDY, RequestError, "max_seq_len"),
        ([1, 2, model.config.vocab_size], GREEDY, RequestError, "vocabulary"),
        ([1.5, 2], GREEDY, RequestError, "non-integer token id 1.5"),
        ([1, True], GREEDY, RequestError, "non-integer token id True"),
        ([1, 2], SamplingParams(temperature=-1.0), SamplingError, "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), SamplingError, "top_p"),
        ([1, 2], SamplingParams(top_k=-1), SamplingError, "top_k"),
        ([1, 2], SamplingParams(max_tokens=0), SamplingError, "max_tokens"),
        ([1, 2], SamplingParams(presence_penalty=3.0), SamplingError, "presence_penalty"),
    ]
    for i, (prompt, sp, error, match) in enumerate(bad_requests):
        req = BatchedRequest(f"bad{i}", prompt, sp)
        engine.allocate_slot(req.request_id)
        with pytest.raises(error, match=match):
            engine.batch_prefill([req])
        engine.free_slot(req.request_id)
    engine.allocate_slot("x")
    with pytest.raises(RequestError, match="already holds"):
        engine.allocate_slot("x")
    engine.allocate_slot("y")
    with pytest.raises(CapacityError, match="no free slot"):
        engine.allocate_slot("z")
    with pytest.raises(RequestError, match="holds no slot"):
        engine.free_slot("z")
    with pytest.raises(RequestError, match="holds no slot"):
        engine.batch_prefill([BatchedRequest("z", [1, 2], GREEDY)])
    with pytest.raises(CapacityError):
        engine.allocate_batch_slots(4)
    engine.free_slot("x")
    engine.free_slot("y")
    assert engine.supports_batching()
    (req,) = run(engine, good, GREEDY)
    assert len(req.generated_tokens) == GREEDY.max_tokens


def test_pallas_interpret_generation_equals_xla(hf_checkpoint):
    model = pj.load_model(hf_checkpoint("qwen3_kv1"))
    prompts = random_prompts(13, (5, 21), model.config.vocab_size)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    xla = run(Engine(model, max_batch_size=2, max_seq_len=64, prefill_chunk=16, attention_impl="xla"),
              prompts, short)
    kernels = run(Engine(model, max_batch_size=2, max_seq_len=64, prefill_chunk=16,
                         attention_impl="pallas_interpret"), prompts, short)
    assert [r.generated_tokens for r in kernels] == [r.generated_tokens for r in xla]


def decode_in_flight(engine: Engine, reqs: list[BatchedRequest]) -> list[tuple[PendingDecode, bool]]:
    """Decode to completion keeping one step in flight (dispatch N+1, then collect N), as the scheduler does;
    returns every dispatched step and whether it was fed its tokens on device."""
    steps = []

    def dispatch(after=None):
        step = engine.decode_dispatch(reqs, after=after)
        steps.append((step, after is not None))

    dispatch()
    while not all(r.finished for r in reqs):
        dispatch(after=steps[-1][0])
        engine.decode_collect(steps[-2][0])
    engine.decode_collect(steps[-1][0])
    return steps


def test_decode_in_flight_equals_host_fed_steps_and_discards_rows_past_a_stop(qwen3):
    _, model = qwen3
    new_engine = lambda: Engine(model, max_batch_size=8, max_seq_len=128, prefill_chunk=32)  # noqa: E731
    prompts = random_prompts(21, [4, 9, 13, 6, 11, 5], model.config.vocab_size)
    free = run(new_engine(), prompts, MIXED[:6])
    # the first four stop on a token of their own at different steps while the last two run to max_tokens
    params = [replace(sp, stop_token_ids=(f.generated_tokens[1 + i],)) if i < 4 else sp
              for i, (sp, f) in enumerate(zip(MIXED[:6], free))]
    host = new_engine()
    expected = run(host, prompts, params)
    engine = new_engine()
    reqs = [BatchedRequest(i, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs:
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    steps = decode_in_flight(engine, reqs)
    for r in reqs:
        engine.free_slot(r.request_id)
    for r, e in zip(reqs, expected):
        assert (r.generated_tokens, r.finish_reason) == (e.generated_tokens, e.finish_reason), r.request_id
        assert [lp for lp, _ in r.logprobs] == pytest.approx([lp for lp, _ in e.logprobs], abs=1e-5)
        # a slot records the tokens whose K/V it holds: never the input of a discarded row
        assert engine.slots.tokens[r.slot_id] == host.slots.tokens[e.slot_id] == r.prompt_tokens + r.generated_tokens[:-1]
    assert [r.finish_reason for r in reqs] == ["stop"] * 4 + ["length"] * 2
    assert sum(chained for _, chained in steps) >= len(steps) - 2
    discarded = [r.request_id for step, _ in steps for r, token in zip(step.requests, step.results)
                 if token is None and any(row is r for row in step.rows)]
    assert discarded and set(discarded) <= {0, 1, 2, 3} and len(set(discarded)) == len(discarded)
    # the slot a discarded row wrote past its records serves a follow-up turn as a fresh engine would, penalties too
    stopped = reqs[discarded[0]]
    follow_up = stopped.prompt_tokens + stopped.generated_tokens + [5, 6]
    penalized = SamplingParams(max_tokens=6, temperature=0.0, presence_penalty=1.0, frequency_penalty=1.0,
                               repetition_penalty=1.3, ignore_eos=True)
    (again,) = run(engine, [follow_up], penalized)
    assert again.slot_id == stopped.slot_id
    assert again.cached_prefix_len == len(stopped.prompt_tokens) + len(stopped.generated_tokens) - 1
    assert again.generated_tokens == run(new_engine(), [follow_up], penalized)[0].generated_tokens


def test_a_request_that_joins_rides_the_queued_step_without_a_drain(qwen3, monkeypatch):
    """A request prefilled while a decode step is in flight joins the next step queued behind it, read from its
    slot's state on device: no host read between the two dispatches, and every token (and logprob) is the one it
    gets alone."""
    import pocketjax.engine.engine as engine_module

    _, model = qwen3
    new_engine = lambda: Engine(model, max_batch_size=4, max_seq_len=64, prefill_chunk=32)  # noqa: E731
    prompts = random_prompts(5, [7, 12], model.config.vocab_size)
    params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=5, temperature=0.8, seed=3)]
    alone = [run(new_engine(), [p], sp)[0] for p, sp in zip(prompts, params)]
    engine = new_engine()
    first, joining = (BatchedRequest(i, list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params)))
    engine.allocate_slot(first)
    engine.batch_prefill([first])
    in_flight = engine.decode_dispatch([first])
    engine.allocate_slot(joining)
    engine.batch_prefill([joining])
    reads = []
    monkeypatch.setattr(engine_module, "to_host", lambda x, read=engine_module.to_host: reads.append(1) or read(x))
    queued = engine.decode_dispatch([first, joining], after=in_flight)  # before the step in flight is read
    assert reads == [] and all(r is not None for r in queued.rows[:2])
    engine.decode_collect(in_flight)
    steps = [queued]
    while not (first.finished and joining.finished):
        steps.append(engine.decode_dispatch([first, joining], after=steps[-1]))
        engine.decode_collect(steps[-2])
    engine.decode_collect(steps[-1])
    assert len(reads) == 1 + sum(bool(step.rows) for step in steps)  # one read per step that ran, nothing more
    for got, want in zip((first, joining), alone):
        assert got.generated_tokens == want.generated_tokens and got.logprobs == want.logprobs


def test_one_slot_decode_never_copies_the_cache(qwen3):
    """A 1-slot engine decodes through the gather path: the dense path's one-row write makes XLA:CPU copy every
    layer's cache several times per step once attention reads all of it (kv bucket == max_seq_len)."""
    import re

    from pocketjax.engine.plan import Signature

    _, model = qwen3
    engine = Engine(model, max_batch_size=1, max_seq_len=128)  # the smallest kv bucket is the whole cache
    req = BatchedRequest(0, random_prompts(21, [9], model.config.vocab_size)[0], GREEDY)
    engine.allocate_slot(req)
    engine.batch_prefill([req])
    step = engine.decode_dispatch([req])
    engine.decode_collect(step)
    assert step.plan.dense is False
    c = model.config
    shape = rf"f32\[1,{c.num_kv_heads},128,{c.head_dim}\]"
    hlo = engine.lower(Signature("decode", rows=1, kv_len=128)).compile().as_text()
    assert len(re.findall(shape + r"\S* parameter\(", hlo)) >= 2 * c.num_layers  # the pattern sees the cache
    assert not re.findall(shape + r"\S* copy\(", hlo)  # (dense=True: 8 copies per layer with jax 0.10.2)
