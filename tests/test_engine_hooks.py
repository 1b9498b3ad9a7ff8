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
