"""`pj.generate` (engine/generate.py): under the caller's `jax.jit`, the engine's tokens, logprobs, lengths and finish
reasons bit for bit for the same seeds, in each kind of weight and cache form of the invariance matrix; its refusals."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.generate import FINISH_REASONS
from pocketjax.errors import ConfigError, RequestError, SamplingError
from pocketjax.model import cpu_kernels

from test_batch_invariance import CHECKPOINT, MATRIX, SIZES as MATRIX_SIZES, load, make_engine
from test_host_free import device_branches
from test_speculative import run  # allocate, prefill, step to completion; frees the slots

N = 6  # max_new_tokens: every test uses the same, so the float32 program compiles once
SIZES = dict(MATRIX_SIZES, prefill_chunk=32)  # the invariance matrix's engine: its programs are compiled once


def jitted(model: pj.Model, prompts, sampling, **options) -> pj.Generation:
    """generate under jax.jit with the params as an argument (closed over, they would be compile-time constants,
    which XLA folds in other bits: see docs/research.md)."""
    step = jax.jit(lambda params: pj.generate(dataclasses.replace(model, params=params), prompts, sampling, N,
                                              **options))
    return jax.device_get(step(model.params))


def assert_engine_bits(model: pj.Model, engine_options: dict, prompts, sampling, got=None) -> pj.Generation:
    """Runs the engine and (unless given its output `got`) generate on the same requests, and asserts they agree
    bit for bit; returns generate's output."""
    want = run(make_engine(model, engine_options, **SIZES), prompts, sampling, False)  # the matrix's engine
    got = got if got is not None else jitted(model, prompts, sampling, kv_dtype=engine_options.get("kv_dtype"))
    for i, req in enumerate(want):
        n = int(got.lengths[i])
        assert np.asarray(got.tokens[i, :n]).tolist() == req.generated_tokens, f"row {i} tokens"
        engine_logprobs = np.array([lp for lp, _ in req.logprobs], np.float32)
        assert engine_logprobs.tobytes() == np.asarray(got.logprobs[i, :n]).tobytes(), f"row {i} logprobs"
        assert got.finish_reason(i) == req.finish_reason, f"row {i} finish reason"
        assert (got.tokens[i, n:] == 0).all() and (got.logprobs[i, n:] == 0).all(), "padding after the end"
    return got


def prompts_of(vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in (5, 17, 9)]


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint):
    return {dtype: hf_checkpoint(CHECKPOINT, dtype=dtype) for dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def model(checkpoints):
    return pj.load_model(checkpoints["float32"])


# Every kind of form the matrix holds, once: a form the list leaves out combines kinds it holds (bfloat16 and fp8 K/V
# in bfloat16-int4-fp8kv, int4 with int8 K/V in the speculative form), so a fifth dtype compile buys no new path.
FORMS = ("float32", "bfloat16-int4-fp8kv", "int8+head", "float32-lora", "int4-int8kv-speculative", "float32-tp2")


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: XLA's forms, not batch invariant")
@pytest.mark.parametrize("form", [f if f in FORMS[:2] + FORMS[-1:] else pytest.param(f, marks=pytest.mark.leg1_only)
                                  for f in FORMS])  # CI's second leg: float32, bf16 + int4 + fp8 K/V and TP2 (~60 s)
def test_generate_is_the_engine_bit_for_bit_in_every_form(checkpoints, form):
    """Greedy stopping at a stop token, seeded top-k/top-p, and penalized top-p cut by its max_tokens: tokens,
    logprobs, lengths and finish reasons as the engine gives them (its own shapes: one prefill of every prompt)."""
    engine_options = MATRIX[form][2]
    model = load(checkpoints, form)  # as the matrix loads it (adapters included)
    prompts = prompts_of(model.config.vocab_size, sorted(MATRIX).index(form))
    greedy = pj.SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    if model.mesh is not None:  # the engine's TP forms run shard_map'd kernels: not generate's program
        with pytest.raises(ConfigError, match="one device"):
            pj.generate(model, prompts, greedy, N)
        return
    (free,) = run(make_engine(model, engine_options, **SIZES), prompts[:1], [greedy], False)
    sampling = [pj.SamplingParams(max_tokens=N, temperature=0.0, stop_token_ids=[free.generated_tokens[3]]),
                pj.SamplingParams(max_tokens=N, temperature=0.9, top_k=30, top_p=0.9, seed=7, ignore_eos=True),
                pj.SamplingParams(max_tokens=4, temperature=1.1, top_p=0.5, repetition_penalty=1.3,
                                  presence_penalty=0.5, seed=3, ignore_eos=True)]
    got = assert_engine_bits(model, engine_options, prompts, sampling)
    assert [got.finish_reason(i) for i in range(3)] == ["stop", "length", "length"]
    assert int(got.lengths[0]) <= 4 and got.lengths[1:].tolist() == [N, 4]


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: XLA's forms, not batch invariant")
def test_min_tokens_bans_stop_ids_until_reached_as_the_engine_does(model):
    prompts = prompts_of(model.config.vocab_size, 0)
    greedy = pj.SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    (free,) = run(Engine(model, **SIZES), prompts[:1], [greedy], False)
    stop = free.generated_tokens[0]  # would end the row at once without min_tokens
    sampling = [pj.SamplingParams(max_tokens=N, temperature=0.0, stop_token_ids=[stop], min_tokens=3),
                pj.SamplingParams(max_tokens=N, temperature=0.8, top_p=0.9, seed=5, min_tokens=2, ignore_eos=True),
                greedy]
    got = assert_engine_bits(model, {}, prompts, sampling)
    assert int(got.lengths[0]) >= 3 and got.tokens[0, 0] != stop


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: XLA's forms, not batch invariant")
def test_traced_seeds_and_array_prompts_give_the_engine_bits_of_those_seeds(model):
    """A padded prompt array with lengths and seeds drawn under jit from a key (a trainer's use): the engine's bits
    for requests with those seeds; other seeds draw other tokens from the same program, which decides no branch on
    the device (no HLO conditional, every while a known trip count: the scan and the sampler's searches)."""
    prompts = prompts_of(model.config.vocab_size, 1)
    tokens = np.zeros((3, max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    unseeded = pj.SamplingParams(max_tokens=N, temperature=1.0, top_p=0.8, ignore_eos=True)
    step = jax.jit(lambda params, tokens, lengths, key: pj.generate(
        dataclasses.replace(model, params=params), tokens, unseeded, N, lengths=lengths,
        seeds=jax.random.bits(key, (3,), jnp.uint32)))
    key = jax.random.key(0)
    seeds = jax.device_get(jax.random.bits(key, (3,), jnp.uint32)).tolist()
    got = jax.device_get(step(model.params, tokens, lengths, key))
    assert_engine_bits(model, {}, prompts, [dataclasses.replace(unseeded, seed=s) for s in seeds], got)
    other = jax.device_get(step(model.params, tokens, lengths, jax.random.key(1)))
    assert not (other.tokens == got.tokens).all(), "other seeds draw other tokens"
    assert not device_branches(step.lower(model.params, tokens, lengths, key).compile().as_text())


@pytest.mark.parametrize("field, value", [("stop", ["\n"]), ("structured", {"regex": "a+"}), ("logprobs", 2),
                                          ("bad_words", ["x"]), ("logit_bias", {1: 2.0}), ("prompt_logprobs", 1),
                                          ("allowed_token_ids", [1, 2]), ("return_hidden", [1])])
def test_fields_generate_cannot_honour_are_refused_by_name(model, field, value):
    params = pj.SamplingParams(max_tokens=N, temperature=0.0, **{field: value})
    with pytest.raises(SamplingError, match=rf"SamplingParams\.{field} is not supported by pj\.generate"):
        pj.generate(model, [[1, 2, 3]], params, N)


def test_bad_arguments_get_typed_errors(model):
    sampled = pj.SamplingParams(temperature=1.0)
    with pytest.raises(SamplingError, match="without a seed"):
        pj.generate(model, [[1, 2]], sampled, N)
    with pytest.raises(SamplingError, match="seeds one way"):
        pj.generate(model, [[1, 2]], pj.SamplingParams(seed=1), N, seeds=np.array([3], np.uint32))
    with pytest.raises(SamplingError, match="one per prompt"):
        pj.generate(model, [[1, 2], [3]], [pj.SamplingParams(temperature=0.0)], N)
    with pytest.raises(RequestError, match="max_new_tokens"):
        pj.generate(model, [[1, 2]], pj.SamplingParams(temperature=0.0), 0)
    with pytest.raises(RequestError, match="outside|lie in"):
        pj.generate(model, [[1, model.config.vocab_size]], pj.SamplingParams(temperature=0.0), N)
    with pytest.raises(RequestError, match="lengths="):
        pj.generate(model, np.zeros((2, 3), np.int32), pj.SamplingParams(temperature=0.0), N)
    with pytest.raises(RequestError, match="lengths must lie"):
        pj.generate(model, np.zeros((2, 3), np.int32), pj.SamplingParams(temperature=0.0), N, lengths=[0, 3])
    assert FINISH_REASONS == ("length", "stop")
