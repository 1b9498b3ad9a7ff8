"""Per-request intervention hooks (SamplingParams.hook) in the engine's prefill and decode: greedy generation equals a
cache-free loop over pj.logits(hook=), batched rows equal their requests alone, prefixes are shared only under the
same hook, the scan layout works, and a bad hook fails only its own request."""
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.errors import SamplingError

from test_engine import random_prompts, run

NAME = "qwen3_gqa4_headdim"  # 3 layers
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
WIDTH = 48  # the reference's padded length: one compiled forward per hook


def steer_at(layer_index: int, vector: np.ndarray):
    """A steering hook: adds `vector` to the residual stream after one layer (traced layer: jnp.where)."""
    def hook(layer, hidden):
        return hidden + jnp.where(layer == layer_index, 1.0, 0.0) * vector
    return hook


def scale_all(factor: float):
    """A hook on every layer that rescales the stream (not an addition: a second kind of intervention)."""
    def hook(layer, hidden):
        return hidden * factor
    return hook


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    folder = hf_checkpoint(NAME)
    return {scan: pj.load_model(folder, scan_layers=scan) for scan in (False, True)}


@pytest.fixture(scope="module")
def hooks(models):
    # std 1.0: at 0.4 one prompt's repeated greedy token outlasted the steering on the seed-0 test checkpoint
    vector = np.random.default_rng(3).normal(0, 1.0, models[False].config.hidden_size).astype(np.float32)
    return steer_at(1, vector), scale_all(1.5)


def reference(model, prompt, n, hook):
    """Greedy tokens from full causal forwards without cache (pj.logits), padded to WIDTH: causal, so the padding
    cannot change the logits read (the hooks here act on each position alone)."""
    ids = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, :len(ids)] = ids
        ids.append(int(np.asarray(pj.logits(model, padded, hook=hook))[0, len(ids) - 1].argmax()))
    return ids[len(prompt):]


def test_llm_greedy_with_a_hook_equals_the_cache_free_reference_and_a_mixed_batch_equals_alone(models, hooks):
    model = models[False]
    a, b = hooks
    prompts = random_prompts(1, (7, 12, 5, 9), model.config.vocab_size)
    params = [replace(GREEDY, hook=a), replace(GREEDY, hook=b), GREEDY, replace(GREEDY, hook=a)]
    with pj.LLM(model, max_batch_size=4, max_seq_len=64, prefill_chunk=16) as llm:
        mixed = [o.token_ids for o in llm.generate(prompts, params)]  # the scheduler's pipelined decode (after=)
        alone = [llm.generate([p], s)[0].token_ids for p, s in zip(prompts, params)]
        plain = llm.generate(prompts[:2], GREEDY)
    assert mixed == alone
    for prompt, sp, out in zip(prompts, params, mixed):
        assert out == reference(model, prompt, GREEDY.max_tokens, sp.hook)
    # the hooks change the output, so the comparisons above can fail
    assert plain[0].token_ids != mixed[0] and plain[1].token_ids != mixed[1]


def test_chunked_prefill_and_prefix_reuse_only_under_the_same_hook(models, hooks):
    model = models[False]
    a, b = hooks
    engine = Engine(model, max_batch_size=2, max_seq_len=64, prefill_chunk=4, min_prefill_bucket=4)
    (prompt,) = random_prompts(2, (11,), model.config.vocab_size)
    # three chunks through the prompt-scoring prefill (prompt_logprobs), then batch_decode_step
    (first,) = run(engine, [prompt], replace(GREEDY, hook=a, prompt_logprobs=0))
    assert first.generated_tokens == reference(model, prompt, GREEDY.max_tokens, a)
    padded = np.zeros((1, WIDTH), np.int32)
    padded[0, :len(prompt)] = prompt
    expected = jax.nn.log_softmax(pj.logits(model, padded, hook=a)[0], axis=-1)
    np.testing.assert_allclose([lp for lp, _ in first.prompt_logprobs[1:]],
                               [expected[t - 1, prompt[t]] for t in range(1, len(prompt))], atol=1e-4)
    follow_up = prompt + first.generated_tokens + [5, 6, 7]
    (again,) = run(engine, [follow_up], replace(GREEDY, hook=a))
    assert again.cached_prefix_len == len(prompt) + GREEDY.max_tokens - 1  # the hooked K/V are reused
    assert again.generated_tokens == reference(model, follow_up, GREEDY.max_tokens, a)
    for hook in (None, b):  # K/V written under hook a serve no other hook
        (other,) = run(engine, [follow_up], replace(GREEDY, hook=hook))
        assert other.cached_prefix_len == 0
        assert other.generated_tokens == reference(model, follow_up, GREEDY.max_tokens, hook)


def test_scan_layout_runs_hooks_with_a_traced_layer_index(models, hooks):
    model = models[True]
    a, _ = hooks
    prompts = random_prompts(5, (6, 10), model.config.vocab_size)
    params = [replace(GREEDY, hook=a), GREEDY]
    out = run(Engine(model, max_batch_size=2, max_seq_len=64, prefill_chunk=8, min_prefill_bucket=8), prompts, params)
    for prompt, sp, req in zip(prompts, params, out):
        assert req.generated_tokens == reference(model, prompt, GREEDY.max_tokens, sp.hook)
    assert out[0].generated_tokens != reference(model, prompts[0], GREEDY.max_tokens, None)


def test_batches_without_hooks_compile_nothing_new(models, hooks):
    model = models[False]
    engine = Engine(model, max_batch_size=1, max_seq_len=32, prefill_chunk=16)  # one slot: fewest shapes to warm
    engine.warmup(progress=False)
    warm = engine.compiled_count()
    prompts = random_prompts(5, (4, 9), model.config.vocab_size)
    for prompt in prompts:
        run(engine, [prompt], GREEDY)
    assert engine.compiled_count() == warm  # no hook: the programs warm-up compiled, exactly
    run(engine, prompts[:1], replace(GREEDY, hook=hooks[0]))
    assert engine.compiled_count() > warm  # a hook set compiles its own programs (warm-up cannot know them)


def bad_hooks():
    def wrong_shape(layer, hidden):
        return hidden[..., :8]

    def wrong_dtype(layer, hidden):
        return hidden.astype(jnp.bfloat16)

    def raises(layer, hidden):
        raise ValueError("boom")

    def python_branch(layer, hidden):  # fine unrolled (an int), fails under scan (a traced index)
        return hidden * 2 if layer == 1 else hidden

    class Unhashable:
        __hash__ = None

        def __call__(self, layer, hidden):
            return hidden

    return [(3, False, "must be None or a function"), (Unhashable(), False, "hashable"),
            (wrong_shape, False, "shape and dtype"), (wrong_dtype, False, "shape and dtype"),
            (raises, False, "raised ValueError"), (python_branch, True, "raised")]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_bad_hooks_fail_their_own_request_and_the_engine_keeps_serving(models, hooks, scan):
    model = models[scan]
    prompt = random_prompts(6, (5,), model.config.vocab_size)[0]
    cases = [(hook, match) for hook, scan_only, match in bad_hooks() if scan or not scan_only]
    engine = Engine(model, max_batch_size=2, max_seq_len=32, prefill_chunk=16)
    for hook, match in cases:  # the batch API: refused before a slot is taken
        with pytest.raises(SamplingError, match=match):
            engine.allocate_slot(BatchedRequest("bad", prompt, replace(GREEDY, hook=hook)))
    assert engine.num_free_slots == 2
    with pj.LLM(model, max_batch_size=2, max_seq_len=32, prefill_chunk=16) as llm:
        good = llm.submit(prompt, replace(GREEDY, hook=hooks[0]))
        bad = [llm.submit(prompt, replace(GREEDY, hook=hook)) for hook, _ in cases]
        for handle, (_, match) in zip(bad, cases):
            with pytest.raises(SamplingError, match=match):
                handle.result(timeout=60)
        assert good.result(timeout=60).token_ids == reference(model, prompt, GREEDY.max_tokens, hooks[0])


# ---- steering vectors as data (SamplingParams.steer) -------------------------------------------------------------

def steering(model, seed: int, layer: int) -> dict:
    return {layer: np.random.default_rng(seed).normal(0, 1.0, model.config.hidden_size).astype(np.float32)}


def test_a_steered_request_equals_the_same_hook_and_leaves_its_batch_mates_untouched(models):
    """steer={layer: v} is the hook x + v after that layer, as data: the engine's tokens and logprobs equal (==) a
    hook-based request's, its greedy tokens the cache-free pj.logits(hook=) reference's, and an unsteered request
    beside it gets exactly what it gets alone."""
    model = models[False]
    steer = steering(model, 3, 1)
    sp = replace(GREEDY, logprobs=2)
    steered_sp, hooked_sp = replace(sp, steer=steer), replace(sp, hook=steer_at(1, steer[1]))
    p0, p1 = random_prompts(1, (7, 12), model.config.vocab_size)
    engine = Engine(model, max_batch_size=2, max_seq_len=64, prefill_chunk=16)
    (steered,) = run(engine, [p0], steered_sp)
    (hooked,) = run(engine, [p0], hooked_sp)
    expected = reference(model, p0, GREEDY.max_tokens, hooked_sp.hook)
    assert steered.generated_tokens == hooked.generated_tokens == expected
    assert steered.logprobs == hooked.logprobs
    mixed = run(engine, [p0, p1], [steered_sp, sp])
    (alone,) = run(engine, [p1], sp)
    assert mixed[0].generated_tokens == steered.generated_tokens and mixed[0].logprobs == steered.logprobs
    assert mixed[1].generated_tokens == alone.generated_tokens and mixed[1].logprobs == alone.logprobs
    (plain,) = run(engine, [p0], sp)
    assert plain.generated_tokens != steered.generated_tokens  # the steering matters, so the checks above can fail


def test_steering_vectors_compile_nothing_after_warmup_and_share_prefixes_only_under_the_same_vectors(models):
    model = models[True]  # the scan layout: the vectors ride the scan beside the layers
    engine = Engine(model, max_batch_size=2, max_seq_len=32, prefill_chunk=16)
    engine.warmup(progress=False, steering=True)
    warm = engine.compiled_count()
    prompts = random_prompts(7, (9, 5), model.config.vocab_size)
    outs = []
    for seed in range(4):  # four different vectors at different layers, alone and beside an unsteered request
        sp = replace(GREEDY, steer=steering(model, seed, seed % model.config.num_layers))
        outs.append(run(engine, prompts, [sp, GREEDY])[0].generated_tokens)
    assert engine.compiled_count() == warm
    assert len({tuple(o) for o in outs}) > 1
    steer = replace(GREEDY, steer=steering(model, 0, 0))
    (first,) = run(engine, prompts[:1], steer)
    follow_up = prompts[0] + first.generated_tokens
    assert run(engine, [follow_up], steer)[0].cached_prefix_len > 0  # the same vectors reuse the steered K/V
    assert run(engine, [follow_up], replace(GREEDY, steer=steering(model, 1, 0)))[0].cached_prefix_len == 0
    assert run(engine, [follow_up], GREEDY)[0].cached_prefix_len == 0


def test_bad_steering_fails_its_own_request(models):
    model = models[False]
    engine = Engine(model, max_batch_size=1, max_seq_len=32, prefill_chunk=16)
    h = model.config.hidden_size
    for steer in ({model.config.num_layers: np.zeros(h)}, {0: np.zeros(h + 1)}, {"a": np.zeros(h)}, {0: [np.nan] * h}):
        with pytest.raises(SamplingError, match="steer"):
            engine.allocate_slot(BatchedRequest("bad", [1, 2, 3], replace(GREEDY, steer=steer)))
    assert run(engine, [[1, 2, 3]], GREEDY)[0].finish_reason == "length"  # the engine keeps serving


# ---- activations from generation (SamplingParams.return_hidden) --------------------------------------------------

def test_captured_activations_equal_pj_logits_hidden_and_batch_mates_are_untouched(models):
    """Completion.hidden[j] is the residual stream at the position whose logits gave token j, at the asked indices
    of pj.logits(return_hidden=True) on the same tokens (within float32 rounding: different programs); a request
    beside it is bitwise what it is alone; a steered request's activations carry its steering."""
    model = models[False]
    layers = (0, 2, model.config.num_layers)  # the embedding output, after layer 1, after the last layer
    sp = replace(GREEDY, logprobs=1)
    captured_sp = replace(sp, return_hidden=layers, steer=steering(model, 5, 1))
    p0, p1 = random_prompts(8, (6, 11), model.config.vocab_size)
    with pj.LLM(model, max_batch_size=2, max_seq_len=64, prefill_chunk=16) as llm:
        mixed = llm.generate([p0, p1], [captured_sp, sp])  # the scheduler's pipelined decode
        alone = llm.generate([p1], sp)[0]
    out = mixed[0]
    assert out.hidden.shape == (len(out.token_ids), len(layers), model.config.hidden_size)
    tokens = p0 + out.token_ids[:-1]
    padded = np.zeros((1, WIDTH), np.int32)
    padded[0, :len(tokens)] = tokens
    _, hidden = pj.logits(model, padded, return_hidden=True, hook=steer_at(1, np.float32(captured_sp.steer[0][1])))
    expected = np.asarray(hidden)[list(layers), 0, len(p0) - 1: len(tokens)].transpose(1, 0, 2)
    np.testing.assert_allclose(out.hidden, expected, rtol=1e-4, atol=1e-4)
    assert mixed[1].token_ids == alone.token_ids and mixed[1].logprobs == alone.logprobs and mixed[1].hidden is None
    with pytest.raises(SamplingError, match="return_hidden"):
        Engine(model, max_batch_size=1, max_seq_len=32).allocate_slot(
            BatchedRequest("bad", [1, 2], replace(GREEDY, return_hidden=(model.config.num_layers + 1,))))
