"""Hostile inputs through the Python API: sampling values past what the packed arrays hold, chat templates that try
to spend unbounded time or memory, a request whose hook or logits fail inside a shared engine call, and async
readers that give up and close their loops while the scheduler is feeding them.

Each case asserts the typed error (or that the request is refused), a bound on time and memory, and that the other
requests kept being served with the tokens they get alone. The HTTP side is tests/test_server_untrusted.py; slow
sweeps are benchmarks/untrusted.py.
"""
import asyncio
import contextlib
import threading
import time
import tracemalloc

import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.sampling import pack_sampling, sample
from pocketjax.engine.sampling_params import FLOAT32_MAX, INT32_MAX, MAX_STOP_STRINGS, SamplingParams
from pocketjax.errors import NumericsError, RequestError, SamplingError
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.scheduler import Scheduler
from pocketjax.serve.template_sandbox import RenderLimits
from pocketjax.serve.tokenizer import Tokenizer

pytestmark = pytest.mark.leg1_only  # HTTP / host-side: the same under any JAX (.ci/run's leg 2 runs the engine's tests)

SLOTS, MAX_LEN, CHUNK = 8, 128, 32  # test_scheduler's engine shape: the compiled steps are shared
TIMEOUT = 120
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"))


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, max_batch_size=SLOTS, max_seq_len=MAX_LEN, prefill_chunk=CHUNK)
    yield engine
    assert not engine.slots.owner


def prompts(seed: int, n: int, length: int = 16) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 250, length)] for _ in range(n)]


def alone(engine, prompt, sampling=GREEDY) -> list[int]:
    sched = Scheduler(engine)
    handle = sched.submit(prompt, sampling)
    while sched.step():
        pass
    return handle.result(timeout=0).token_ids


# ---- sampling values -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("top_k", 2**31), ("top_k", 2**64), ("top_k", -1),
    ("temperature", 10**400), ("temperature", 1e39), ("temperature", float("nan")), ("temperature", float("inf")),
    ("repetition_penalty", 1e-50), ("repetition_penalty", 10**400), ("repetition_penalty", float("nan")),
    ("top_p", 1e-50), ("top_p", float("nan")), ("min_p", float("nan")), ("min_p", 10**400),
    ("presence_penalty", 10**400), ("frequency_penalty", float("-inf")), ("seed", 2**32), ("seed", -1),
    ("max_tokens", True), ("max_tokens", 0), ("logprobs", 10**30), ("stop", ["a"] * (MAX_STOP_STRINGS + 1)),
    ("stop", ["x" * 5000]), ("stop_token_ids", list(range(2000))), ("stop_token_ids", [2**70]),
])
def test_out_of_range_sampling_is_a_sampling_error(field, value):
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value}).validate(vocab_size=1000)


def test_range_edges_pack_exactly():
    edge = SamplingParams(top_k=INT32_MAX, temperature=FLOAT32_MAX, repetition_penalty=1e-30, top_p=1e-30,
                          stop=["s"] * MAX_STOP_STRINGS)
    edge.validate(vocab_size=1000)
    arrays = pack_sampling([edge], [2**32 - 1])
    assert int(arrays.top_k[0]) == INT32_MAX and np.isfinite(arrays.temperature[0])
    assert arrays.repetition_penalty[0] > 0 and arrays.top_p[0] > 0


def test_bad_sampling_fails_its_own_handle_only(engine):
    reference = [alone(engine, p) for p in prompts(1, 2)]
    sched = Scheduler(engine)
    good = [sched.submit(p, GREEDY) for p in prompts(1, 2)]
    bad = sched.submit(prompts(1, 1)[0], SamplingParams(top_k=2**31))
    while sched.step():
        pass
    with pytest.raises(SamplingError, match="top_k"):
        bad.result(timeout=0)
    assert [h.result(timeout=0).token_ids for h in good] == reference


def test_nan_logits_never_sample_outside_the_vocabulary():
    vocab, rows = 50, 4
    logits = np.random.default_rng(0).normal(size=(rows, vocab)).astype(np.float32)
    logits[1, 7] = np.nan
    logits[2] = np.nan
    logits[3, 3] = np.inf
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0,
              top_p=0.9, seed=1), SamplingParams(temperature=1.0, top_k=5, seed=2)]
    arrays = pack_sampling(params, [0, 0, 1, 2])
    out = sample(jnp.asarray(logits), arrays, jnp.zeros((rows, vocab), bool), jnp.zeros((rows, vocab), jnp.int32),
                 jnp.zeros(rows, jnp.int32))
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    assert ((0 <= tokens) & (tokens < vocab)).all()
    assert tokens[0] == int(np.argmax(logits[0])) and np.isfinite(logprobs[0])
    assert not np.isfinite(logprobs[1:]).any()  # the sign the scheduler fails a request on


# ---- one request's failure inside a shared engine call ---------------------------------------------------------------
def raises_at_real_shapes(layer, hidden):
    """Passes the engine's admission trace ([2, 3, H]) and raises on a prefill chunk (wider than 3 positions)."""
    if hidden.shape[1] > 3:
        raise ValueError("this hook refuses real shapes")
    return hidden


def nan_hook(layer, hidden):
    return hidden * jnp.nan


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_failing_request_does_not_fail_its_batch_mates(engine, pipeline):
    ps = prompts(2, 4)
    reference = [alone(engine, p) for p in ps[:2]]
    sched = Scheduler(engine, pipeline=pipeline)
    good = [sched.submit(p, GREEDY) for p in ps[:2]]
    raising = sched.submit(ps[2], SamplingParams(max_tokens=6, temperature=0.0, hook=raises_at_real_shapes))
    nan = sched.submit(ps[3], SamplingParams(max_tokens=6, temperature=0.7, seed=3, hook=nan_hook))
    while sched.step():
        pass
    with pytest.raises(ValueError, match="real shapes"):
        raising.result(timeout=0)
    with pytest.raises(NumericsError, match="NaN"):
        nan.result(timeout=0)
    assert [h.result(timeout=0).token_ids for h in good] == reference
    assert alone(engine, ps[0]) == reference[0]  # the engine is still sound afterwards


# ---- async readers that give up ---------------------------------------------------------------------------------------
def test_readers_that_close_their_loops_cannot_kill_the_scheduler(engine):
    with Scheduler(engine) as sched:
        slow = sched.submit(prompts(3, 1)[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))

        async def read():
            async for _ in slow:
                pass

        async def time_out():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(read(), 0.001)

        for i in range(20):
            if i % 2:
                asyncio.run(time_out())  # cancelled readers
            else:  # a loop closed under a reader still waiting: its waiter stays registered on the handle
                loop = asyncio.new_event_loop()
                loop.create_task(read())
                loop.run_until_complete(asyncio.sleep(0.002))
                loop.close()
        assert len(slow.result(timeout=TIMEOUT).token_ids) == 60
        after = sched.submit(prompts(3, 1)[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        assert after.result(timeout=TIMEOUT).token_ids == slow.result().token_ids
        assert sched._thread is not None and sched._thread.is_alive()


# ---- chat templates ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    if not (DEFAULT_MODEL / "tokenizer.json").exists():
        pytest.skip("no embedded model")
    tokenizer = Tokenizer.from_folder(DEFAULT_MODEL)
    tokenizer.render_limits = RenderLimits(seconds=0.5)
    return tokenizer


HOSTILE_TEMPLATES = {
    "nested range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "loop over a stored range": "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
    "repeat": "{{ 'x' * 200000000 }}",
    "power": "{{ 10 ** 100000000 }}",
    "power chain": "{{ 2 ** 4000 ** 4000 }}",
    "ljust": "{{ 'a'.ljust(100000000) }}",
    "center filter on a constant": "{{ 'a'|center(100000000) }}",
    "doubling joins": "{% set s = 'a' * 1000 %}" + "{% set s = s ~ s %}" * 30,
    "doubling namespace": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                          "{% endfor %}",
    "captured block": "{% set x %}{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}{% endset %}",
    "join": "{% set l = ['y' * 100000] * 10 %}{{ (l * 1000)|join }}",
    "replace": "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}",
    "indent": "{{ ('\n' * 100000)|indent(100000) }}",
    "printf width": "{{ '%0999999999d' % 1 }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "output": "{% for i in range(100000) %}{{ 'z' * 10000 }}{% endfor %}",
    "divide by zero": "{{ 1 / 0 }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "tojson indent": "{{ messages|tojson(indent=100000) }}",
    "bad attribute": "{{ messages.__class__.__mro__ }}",
}


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_templates_are_request_errors_bounded_in_time_and_memory(tok, name):
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(RequestError):
            tok.apply_chat_template(MESSAGES, chat_template=HOSTILE_TEMPLATES[name])
        elapsed, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < tok.render_limits.seconds + 3.0
    # the limit is 4 MiB of characters; nothing near a gigabyte was built (block captures are counted as they fill)
    assert peak < 64 << 20


def test_a_timed_out_render_leaves_its_thread_sound(tok):
    """The deadline's asynchronous exception never escapes a render: renders that end right at the deadline are
    followed by plain code in the same thread, which must run uninterrupted."""
    limits = tok.render_limits
    tok.render_limits = RenderLimits(seconds=0.01)
    try:
        loop = "{% for i in range(100000) %}{% if i == 99999 %}end{% endif %}{% endfor %}"
        for _ in range(30):
            with contextlib.suppress(RequestError):
                tok.apply_chat_template(MESSAGES, chat_template=loop)
            total = sum(i * i for i in range(200_000))  # an escaped RenderTimeout would land here
            assert total > 0
    finally:
        tok.render_limits = limits
    time.sleep(0.05)
    assert tok.apply_chat_template(MESSAGES).startswith("<|im_start|>user")


def test_renders_in_threads_do_not_interrupt_each_other(tok):
    """The deadline interrupts only its own render's thread."""
    errors = []

    def render(source):
        try:
            for _ in range(3):
                tok.apply_chat_template(MESSAGES, chat_template=source)
        except RequestError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=render, args=(HOSTILE_TEMPLATES["nested range"],)),
               threading.Thread(target=render, args=("{{ messages[0].content }}",))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(errors) == 1 and "longer than" in errors[0]
