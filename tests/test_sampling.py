"""Sampler tests against independent numpy references (sort-based filters, as HF/vLLM write them).

Distribution tests draw one sample per row: a batch of N copies of the same logits with steps 0..N-1 gives N
independent draws, because a row's randomness is keyed by (seed, step) only. Every test uses one vocabulary size
and two batch sizes, so the whole file compiles the sampler only a handful of times.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pocketjax.errors import SamplingError
from pocketjax.engine.sampling import SamplingArrays, apply_penalties, pack_sampling, sample
from pocketjax.engine.sampling_params import MAX_LOGPROBS, SamplingParams

P = SamplingParams
V = 400  # > 257, so the default fast path has tokens outside its candidates
N = 8192  # draws per distribution test
RNG = np.random.default_rng(1234)
# 48 live tokens and 352 at -30 (never drawn), so a per-token chi-square has enough draws per token.
PEAKED = np.concatenate([RNG.standard_normal(48) * 1.5, np.full(V - 48, -30.0)]).astype(np.float32)
WIDE = (RNG.standard_normal(V) * 0.3).astype(np.float32)  # flat: kept sets larger than 256 candidates


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ref_kept(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """HF order with a full sort: top_k, then top_p over the renormalized survivors, then min_p."""
    order = np.argsort(-scaled, kind="stable")
    keep = np.ones(scaled.shape, bool)
    if 0 < top_k < scaled.size:
        keep[order[top_k:]] = False
    p = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    sorted_p = p[order] / p.sum()
    keep[order[np.cumsum(sorted_p) - sorted_p >= top_p]] = False  # drop once the mass above reaches top_p
    keep &= np.exp(scaled - scaled.max()) >= min_p
    return keep


def ref_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    scaled = logits.astype(np.float64) / params.temperature
    p = np.where(ref_kept(scaled, params.top_k, params.top_p, params.min_p), np.exp(scaled - scaled.max()), 0.0)
    return p / p.sum()


def batch(logits: np.ndarray, params: list, seeds: list, steps=None, prompt=None, counts=None, **kw):
    """Runs `sample` on a batch, with empty penalty state unless given; steps default to 0..S-1."""
    return sample(
        jnp.asarray(logits), pack_sampling(params, seeds),
        jnp.zeros(logits.shape, bool) if prompt is None else jnp.asarray(prompt),
        jnp.zeros(logits.shape, jnp.int32) if counts is None else jnp.asarray(counts),
        jnp.arange(logits.shape[0], dtype=jnp.int32) if steps is None else jnp.asarray(steps), **kw)


def draw(logits: np.ndarray, params: SamplingParams, n: int = 64, seed: int = 0, **kw) -> np.ndarray:
    """n draws from one row of logits: n rows, one seed, steps 0..n-1."""
    rows = np.broadcast_to(logits.reshape(1, -1), (n, logits.size))
    return np.asarray(batch(rows, [params] * n, [seed] * n, **kw).tokens)


def assert_matches(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Support exactly right, and a chi-square test at p ~ 1e-6 (Wilson-Hilferty quantile)."""
    counts = np.bincount(tokens, minlength=probs.size)
    outside = np.flatnonzero((counts > 0) & (probs == 0))
    assert outside.size == 0, f"tokens outside the kept set were drawn: {outside}"
    expected = probs * tokens.size
    big = expected >= 5  # pool the rare tokens into one category so the chi-square approximation holds
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    if expected.size == 1:
        return
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = expected.size - 1
    limit = df * (1 - 2 / (9 * df) + 4.75 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit:.1f} (df {df})"


@pytest.mark.parametrize("num_candidates", [256, 4], ids=["candidates", "bisection"])
@pytest.mark.parametrize("params", [
    P(temperature=0.7),
    P(temperature=1.3, top_k=5),
    P(temperature=1.0, top_p=0.6),
    P(temperature=0.8, min_p=0.2),
    P(temperature=1.0, top_k=12, top_p=0.7, min_p=0.1),
], ids=["temperature", "top_k", "top_p", "min_p", "combined"])
def test_options_shape_the_distribution_as_defined(params, num_candidates):
    tokens = draw(PEAKED, params, N, seed=7, num_candidates=num_candidates)
    assert_matches(tokens, ref_probs(PEAKED, params))


@pytest.mark.parametrize("params", [P(top_p=0.9), P(top_k=300, top_p=0.95), P(top_k=350, min_p=0.3)],
                         ids=["top_p", "top_k+top_p", "top_k+min_p"])
def test_large_kept_sets_fall_back_exactly(params):
    """Kept sets larger than the candidates: exact support from the full-vocabulary bisection."""
    probs = ref_probs(WIDE, params)
    assert (probs > 0).sum() > 257
    tokens = draw(WIDE, params, N, seed=3)
    assert not np.any((np.bincount(tokens, minlength=V) > 0) & (probs == 0))
    # Too many tokens for a per-token chi-square at this N: test the mass of 8 probability-ranked bins.
    bins = np.minimum(np.argsort(np.argsort(-probs)) * 8 // (probs > 0).sum(), 7)
    assert_matches(bins[tokens], np.bincount(bins, weights=probs, minlength=8))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = (RNG.standard_normal(V) * 2).astype(np.float32)
    for params in (P(temperature=1.5, top_k=1), P(temperature=1.5, top_p=1e-6), P(temperature=2.0, min_p=1.0)):
        assert set(draw(logits, params, seed=5).tolist()) == {int(np.argmax(logits))}


def test_logprobs_and_top_n_are_raw_log_softmax():
    """Greedy rows (penalized or not) and sampled rows alike report log_softmax of the raw logits."""
    logits = (RNG.standard_normal((64, V)) * 3).astype(np.float32)
    params = [P(temperature=0.0)] * 31 + [P(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0)]
    params += [P(temperature=0.5, top_k=10, repetition_penalty=1.3)] * 32
    counts = np.zeros((64, V), np.int32)
    counts[31, np.argmax(logits[31])] = 2  # the penalties move row 31's argmax; its logprob stays raw
    prompt = np.zeros((64, V), bool)
    prompt[32:] = True
    out = batch(logits, params, list(range(64)), prompt=prompt, counts=counts, num_top=MAX_LOGPROBS)
    penalized = np.asarray(apply_penalties(jnp.asarray(logits), pack_sampling(params, [0] * 64),
                                           jnp.asarray(prompt), jnp.asarray(counts)))
    ref = log_softmax(logits)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens[:32], penalized[:32].argmax(-1))
    assert tokens[31] != np.argmax(logits[31])
    np.testing.assert_allclose(out.logprobs, ref[np.arange(64), tokens], atol=1e-5)
    top = np.argsort(-ref, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, top)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, top, -1), atol=1e-5)
    shapes = jax.eval_shape(lambda: batch(logits, params, list(range(64))))  # num_top=0, checked without compiling
    assert shapes.top_ids.shape == (64, 0) and shapes.top_logprobs.shape == (64, 0)


def test_apply_penalties_follows_the_definitions():
    logits = np.array([[2.0, -2.0, 3.0, -1.0, 0.5], [1.0, 1.0, -1.0, -1.0, 4.0]], np.float32)
    prompt = np.array([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], bool)
    counts = np.array([[0, 0, 3, 1, 0], [2, 0, 1, 0, 0]], np.int32)
    params = [P(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
              P(repetition_penalty=0.5, presence_penalty=-1.0, frequency_penalty=0.0)]
    got = apply_penalties(jnp.asarray(logits), pack_sampling(params, [0, 0]), jnp.asarray(prompt),
                          jnp.asarray(counts))
    want = np.array([
        # seen: 0, 1 (prompt), 2, 3 (output): positive / 2, negative * 2; output also -0.5 - 0.25 * count
        [2.0 / 2, -2.0 * 2, 3.0 / 2 - 0.5 - 0.75, -1.0 * 2 - 0.5 - 0.25, 0.5],
        # seen: 0, 2 (output): p = 0.5 favours them; presence -1 adds 1 to output tokens
        [1.0 / 0.5 + 1.0, 1.0, -1.0 * 0.5 + 1.0, -1.0, 4.0],
    ], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_row_depends_only_on_its_own_seed_and_step():
    """Permute rows, or swap the neighbours for ones that send the batch down other branches: same tokens."""
    logits = (RNG.standard_normal((64, V)) * 2).astype(np.float32)
    kinds = [P(temperature=0.9, top_k=40, top_p=0.9), P(temperature=1.0), P(temperature=0.0),
             P(temperature=0.6, min_p=0.1), P(temperature=1.1, top_p=0.97), P(temperature=0.8, top_k=280),
             P(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5)]
    params = [kinds[i % len(kinds)] for i in range(64)]
    seeds, steps = list(range(100, 164)), RNG.integers(0, 1000, 64).astype(np.int32)
    prompt = RNG.random((64, V)) < 0.05
    counts = (RNG.random((64, V)) < 0.05).astype(np.int32)

    def run(rows, others=None):
        ps = [params[i] if others is None or n == 0 else others for n, i in enumerate(rows)]
        out = batch(logits[rows], ps, [seeds[i] for i in rows], steps=steps[rows], prompt=prompt[rows],
                    counts=counts[rows])
        return np.asarray(out.tokens)

    base = run(np.arange(64))
    perm = RNG.permutation(64)
    np.testing.assert_array_equal(run(perm), base[perm])
    for i in range(len(kinds)):  # row i first; the others all greedy, or all unfiltered (full-vocabulary branch)
        rows = np.roll(np.arange(64), -i)
        assert run(rows, others=P(temperature=0.0))[0] == base[i]
        assert run(rows, others=P(temperature=1.0))[0] == base[i]


def test_candidate_width_never_changes_the_tokens():
    """4: nearly every filtered row bisects; 256: the default; 1024: the whole vocabulary is the candidate set."""
    logits = (RNG.standard_normal((64, V)) * 1.5).astype(np.float32)
    params = [P(temperature=t, top_k=k, top_p=p, min_p=m) for t in (0.6, 1.3) for k in (0, 3, 50, 300)
              for p in (1.0, 0.5, 0.95) for m in (0.0, 0.05)]  # 48 mixes; the last 16 repeat with other seeds
    params = (params + params)[:64]
    tokens = [np.asarray(batch(logits, params, list(range(64)), num_candidates=c, num_top=MAX_LOGPROBS).tokens)
              for c in (4, 256, 1024)]  # num_top as in the logprobs test: one compilation fewer
    np.testing.assert_array_equal(tokens[1], tokens[0])
    np.testing.assert_array_equal(tokens[2], tokens[0])


def test_seeds_and_steps_change_the_draw():
    logits = np.zeros(V, np.float32)  # every token equally likely
    same_step = batch(np.zeros((64, V), np.float32), [P()] * 64, list(range(64)), steps=np.zeros(64, np.int32))
    by_seed, by_step = np.asarray(same_step.tokens), draw(logits, P(), seed=4)
    assert len(set(by_seed.tolist())) > 50 and len(set(by_step.tolist())) > 50  # ~59 distinct expected of 64
    assert np.mean(by_step == draw(logits, P(), seed=5)) < 0.1


def test_jit_compiles_once_for_any_parameter_values():
    logits = RNG.standard_normal((64, V)).astype(np.float32)
    batch(logits, [P()] * 64, [0] * 64)
    compiled = sample._cache_size()
    for ps in ([P(temperature=0.0)] * 60, [P(top_k=3, top_p=0.5, repetition_penalty=1.2)] * 60,
               [P(temperature=0.5, min_p=0.3), P(), P(top_k=299)] * 20):
        arrays = pack_sampling(ps, list(range(len(ps))), pad_to=64)  # padded rows: the same shapes
        sample(jnp.asarray(logits), arrays, jnp.zeros((64, V), bool), jnp.zeros((64, V), jnp.int32),
               jnp.arange(64, dtype=jnp.int32))
    assert sample._cache_size() == compiled


def test_pack_sampling_pads_with_greedy_neutral_rows():
    arrays = pack_sampling([P(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
                              presence_penalty=0.3, frequency_penalty=-0.4)], [2**32 - 1], pad_to=3)
    assert isinstance(arrays, SamplingArrays)
    want = dict(temperature=[0.5, 0, 0], top_k=[7, 0, 0], top_p=[0.9, 1, 1], min_p=[0.1, 0, 0],
                repetition_penalty=[1.2, 1, 1], presence_penalty=[0.3, 0, 0], frequency_penalty=[-0.4, 0, 0],
                seed=[2**32 - 1, 0, 0])
    dtypes = dict(top_k=np.int32, seed=np.uint32)
    for name, values in want.items():
        column = getattr(arrays, name)
        assert column.dtype == dtypes.get(name, np.float32), name
        np.testing.assert_allclose(column, np.array(values, column.dtype), err_msg=name)
    with pytest.raises(ValueError):
        pack_sampling([P(), P()], [1, 2], pad_to=1)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -1), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("presence_penalty", 2.5),
    ("presence_penalty", -2.01), ("frequency_penalty", 3.0), ("max_tokens", 0), ("max_tokens", 1.0),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("seed", -1), ("seed", 2**32), ("seed", 1.5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop", [3]), ("stop", [""]), ("ignore_eos", 1),
])
def test_validate_names_the_bad_field(field, value):
    params = P(**{field: value})  # constructing never raises: the engine validates, with the vocabulary size
    with pytest.raises(SamplingError, match=field):
        params.validate()


def test_validate_accepts_good_params_and_normalizes_sequences():
    params = P(stop_token_ids=[5, 9], stop=["</s>"], seed=2**32 - 1, top_p=1.0, min_p=1.0, logprobs=MAX_LOGPROBS)
    assert params.stop_token_ids == (5, 9) and params.stop == ("</s>",)
    hash(params)
    params.validate(vocab_size=10)
    assert P(stop="\n").stop == ("\n",)
    with pytest.raises(SamplingError, match="stop_token_ids"):
        params.validate(vocab_size=9)
    assert P(temperature=0.0).greedy and P(top_k=1).greedy and not P().greedy


MIXES = {  # rows of each batch; the variant `paths_for` picks is in the id
    "greedy": [P(temperature=0.0)] * 3,
    "greedy+penalties": [P(temperature=0.0), P(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.4)],
    "sampled": [P(temperature=0.0), P(temperature=0.8), P(temperature=1.3, frequency_penalty=0.3)],
    "nucleus": [P(temperature=0.0), P(top_p=0.9), P(top_k=20), P(min_p=0.2), P(temperature=2.0, top_p=0.99)],
    "exact": [P(top_k=300), P(top_k=300, top_p=0.95), P(top_p=0.5), P(temperature=0.0)],
}


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("mix", MIXES)
def test_every_variant_that_covers_a_batch_gives_its_bits(mix, mode):
    """`paths_for` picks a variant that covers each row (no device branch decides it), and every larger variant, the
    rows alone or together, gives the same tokens and logprobs bit for bit: rows choose their parts with where."""
    from pocketjax.engine import sampling
    from pocketjax.engine.sampling import VARIANTS, covers, paths_for

    params = MIXES[mix]
    rows = np.stack([WIDE if i % 2 else PEAKED for i in range(len(params))]) * np.float32(3.0)
    prompt = np.zeros(rows.shape, bool)
    prompt[:, :5] = True
    counts = np.zeros(rows.shape, np.int32)
    counts[:, 3:9] = 2
    picked = paths_for(pack_sampling(params, list(range(len(params)))), V)
    assert picked == getattr(sampling, {"greedy+penalties": "sampled"}.get(mix, mix).upper())
    want = jax.device_get(batch(rows, params, list(range(len(params))), prompt=prompt, counts=counts,
                                logprobs_mode=mode, num_top=3, paths=VARIANTS[-1]))
    for variant in [v for v in VARIANTS if covers(v, picked)]:
        got = jax.device_get(batch(rows, params, list(range(len(params))), prompt=prompt, counts=counts,
                                   logprobs_mode=mode, num_top=3, paths=variant))
        assert jax.tree.all(jax.tree.map(np.array_equal, got, want)), variant
    for i, p in enumerate(params):  # each row alone, in the smallest variant that covers it
        alone = pack_sampling([p], [i])
        got = jax.device_get(batch(rows[i:i + 1], [p], [i], steps=[i], prompt=prompt[i:i + 1],
                                   counts=counts[i:i + 1], logprobs_mode=mode, num_top=3, paths=paths_for(alone, V)))
        assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b[i:i + 1]), got, want)), i
