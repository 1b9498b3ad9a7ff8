"""The sampler of commit 8a0ce4b (the parent of b853eee, issue 66), kept as a file for the GPU check only.

`benchmarks/device_check_decode.py sampler` times it beside today's: the device machine gets a copy of the working
tree without git history, so the old sampler must be a file. Generated, not edited (its own docstring dropped):

    git show 8a0ce4b:pocketjax/engine/sampling.py   # lines 23 on, the two relative imports made absolute

Its branches are the ones issue 66 removed: `lax.cond` on "does any row sample / penalize / filter" and a
`lax.while_loop` whose trip count depends on the data (`_bisect`). Nothing in pocketjax imports it; it needs jax
(unlike the peers beside it, which run in other venvs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pocketjax.model.numerics import fixed_logsumexp, fixed_sum, opaque
from pocketjax.engine.sampling_params import DEFAULT_LOGPROBS_MODE, GREEDY_EPS, SamplingParams, check_logprobs_mode

NUM_CANDIDATES = 256  # tokens per row the filtering fast path inspects; top_k above it takes the exact fallback


@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    """SamplingParams of every slot as arrays, one row per slot, so one compiled sampler serves any mix."""

    temperature: jax.Array  # f32[S]
    top_k: jax.Array  # i32[S]
    top_p: jax.Array  # f32[S]
    min_p: jax.Array  # f32[S]
    repetition_penalty: jax.Array  # f32[S]
    presence_penalty: jax.Array  # f32[S]
    frequency_penalty: jax.Array  # f32[S]
    seed: jax.Array  # u32[S]


@jax.tree_util.register_dataclass
@dataclass
class SampleOutput:
    """What `sample` returns per row: the token, its logprob, and the top-n (n static, may be 0), each as the
    engine's `logprobs_mode` says (default: log_softmax of the raw logits).

    The prompt scorer returns the same per prompt position: every field then has a [B, T] prefix instead of [S].
    """

    tokens: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S]: by default log_softmax(raw logits)[token], vLLM's "raw_logprobs"
    top_ids: jax.Array  # i32[S, n]
    top_logprobs: jax.Array  # f32[S, n]


# Rows past the real requests: greedy and neutral, so they never switch on a costly branch.
_NEUTRAL = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                presence_penalty=0.0, frequency_penalty=0.0, seed=0)
_DTYPES = dict(temperature=np.float32, top_k=np.int32, top_p=np.float32, min_p=np.float32,
               repetition_penalty=np.float32, presence_penalty=np.float32, frequency_penalty=np.float32,
               seed=np.uint32)


def pack_sampling(params: Sequence[SamplingParams], seeds: Sequence[int], pad_to: int | None = None) -> SamplingArrays:
    """Returns host numpy rows for `params` (+ greedy neutral padding up to `pad_to`); fixed dtypes, so jit never
    recompiles on values. `seeds` are the resolved seeds (the engine draws one on the host when `seed` is None)."""
    rows = len(params) if pad_to is None else pad_to
    if len(seeds) != len(params) or rows < len(params):
        raise ValueError(f"pack_sampling: {len(params)} params, {len(seeds)} seeds, pad_to={pad_to}")
    columns = {name: np.full(rows, value, _DTYPES[name]) for name, value in _NEUTRAL.items()}
    for i, (p, seed) in enumerate(zip(params, seeds)):
        for name in _NEUTRAL:
            columns[name][i] = seed if name == "seed" else getattr(p, name)
    return SamplingArrays(**columns)


def apply_penalties(logits: jax.Array, arrays: SamplingArrays, prompt_mask: jax.Array,
                    output_counts: jax.Array) -> jax.Array:
    """Returns penalized f32[S, V] logits.

    Repetition (HF/vLLM): a token seen in the prompt or the output gets logit / p when positive, logit * p
    otherwise, so p > 1 always makes it less likely. Presence and frequency (OpenAI/vLLM) look at the output
    only: logit -= presence * (count > 0) + frequency * count.
    """
    counts = output_counts.astype(jnp.float32)
    rp = arrays.repetition_penalty[:, None]
    seen = prompt_mask | (output_counts > 0)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    presence = opaque(arrays.presence_penalty[:, None] * (counts > 0))  # products never contracted into the
    return logits - presence - opaque(arrays.frequency_penalty[:, None] * counts)  # sums (numerics.opaque)


def any_penalized(arrays: SamplingArrays) -> jax.Array:
    """Whether any row has a non-neutral repetition, presence or frequency penalty (a traced bool)."""
    return jnp.any((arrays.repetition_penalty != 1) | (arrays.presence_penalty != 0) | (arrays.frequency_penalty != 0))



@partial(jax.jit, static_argnames=("num_top", "num_candidates", "logprobs_mode"))
def sample(logits: jax.Array, arrays: SamplingArrays, prompt_mask: jax.Array | None, output_counts: jax.Array | None,
           steps: jax.Array, allowed: jax.Array | None = None, bias_ids: jax.Array | None = None,
           bias: jax.Array | None = None, *, num_top: int = 0, num_candidates: int = NUM_CANDIDATES,
           logprobs_mode: str = DEFAULT_LOGPROBS_MODE) -> SampleOutput:
    """Returns each row's next token, its logprob and the top-`num_top` logprobs, as `logprobs_mode` says.

    logits f32[S, V] are the model's raw next-token logits; prompt_mask bool[S, V] and output_counts i32[S, V]
    feed the penalties (both None: no row penalizes, and no penalty state is read); steps i32[S] is the index of
    the token being generated (0 for the first). A row's randomness is keyed by fold_in(key(seed), step) only, so
    its token never depends on the other rows, on its slot, or on which branch the batch took. `num_candidates`
    (static) only trades speed between the fast path and the exact fallback: the tokens are the same.

    `allowed` i32[S, ceil(V / 32)] (structured outputs: bit t % 32 of word t // 32 allows token t) sets every
    disallowed logit to -inf first, before penalties, temperature and filtering, so only allowed tokens are drawn.
    A row whose words are all ones is untouched bit for bit; None (no constrained row) compiles today's program.
    `bias_ids` i32[S, K] / `bias` f32[S, K] (logit_bias; padding ids are V, dropped) are added to the masked
    logits; a row with only padding is untouched.

    `logprobs_mode` (static, one per engine): "raw_*" report the input logits as they came (no mask, bias,
    penalty, temperature or filter), so a masked row reports what it would unmasked; "processed_*" the
    distribution the token was drawn from: masked, biased, penalized, divided by the temperature, and -inf outside
    the top_k / top_p / min_p kept set. A greedy row (temperature < GREEDY_EPS or top_k == 1) has no temperature or
    filter to apply (as vLLM, which applies neither to greedy rows): its processed values are its masked, biased,
    penalized logits at temperature 1. "*_logits" report those values themselves, "*_logprobs" their log_softmax.
    The default compiles the very program this sampler had before modes existed.
    """
    check_logprobs_mode(logprobs_mode)
    raw = logits = logits.astype(jnp.float32)
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    if bias is not None:
        logits = add_bias(logits, bias_ids, bias)
    processed = logprobs_mode.startswith("processed")
    as_logits = logprobs_mode.endswith("logits")
    if prompt_mask is None:  # the caller knows no row penalizes (neutral penalties are an exact identity)
        penalize = lambda x: x  # noqa: E731
    else:
        penalize = partial(apply_penalties, arrays=arrays, prompt_mask=prompt_mask, output_counts=output_counts)
    sampled = (arrays.temperature >= GREEDY_EPS) & (arrays.top_k != 1)
    if processed:  # the penalized logits are reported, so they are computed once, outside any branch
        penalized = penalize(logits)  # neutral penalties are an exact identity: the same tokens as below
        greedy = _argmax(penalized)
        tokens, tau = lax.cond(
            jnp.any(sampled),
            lambda: _where_sampled(sampled, _draw(penalized, arrays, steps, sampled, num_candidates, True), greedy),
            lambda: (greedy, jnp.full(greedy.shape, -jnp.inf, jnp.float32)),
        )
        return token_logprobs(_processed(penalized, arrays, sampled, tau), tokens, num_top, as_logits=as_logits)
    if prompt_mask is None:
        greedy = _argmax(logits)
    else:  # Branches return tokens, never [S, V] arrays: a cond that returns the logits costs a 4.8 MB copy per step.
        greedy = lax.cond(any_penalized(arrays), lambda: _argmax(penalize(logits)), lambda: _argmax(logits))
    tokens = lax.cond(
        jnp.any(sampled),  # neutral penalties are an exact identity, so sampling applies them unconditionally
        lambda: jnp.where(sampled, _draw(penalize(logits), arrays, steps, sampled, num_candidates), greedy),
        lambda: greedy,
    )
    return token_logprobs(raw, tokens, num_top, as_logits=as_logits)


def _where_sampled(sampled: jax.Array, drawn: tuple[jax.Array, jax.Array], greedy: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """(tokens, thresholds) of a batch with sampled rows: greedy rows keep their argmax."""
    tokens, tau = drawn
    return jnp.where(sampled, tokens, greedy), tau


def _processed(penalized: jax.Array, arrays: SamplingArrays, sampled: jax.Array, tau: jax.Array) -> jax.Array:
    """Returns f32[S, V]: the values each row's token was drawn from. Sampled rows: penalized / temperature, -inf
    outside the kept set (at or above `tau`, the top_k / top_p threshold `_draw` used, and min_p's bound); greedy
    rows: the penalized logits, unfiltered."""
    s = penalized / jnp.where(sampled, arrays.temperature, 1.0)[:, None]  # the very scaling `_draw` applies
    kept = (s >= tau[:, None]) & _min_p_kept(s, jnp.max(s, axis=-1, keepdims=True), arrays.min_p)
    return jnp.where(kept | ~sampled[:, None], s, -jnp.inf)


def mask_logits(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """f32[S, V] logits with -inf where allowed i32[S, W] (llguidance's bitmask layout) has a 0 bit.

    The bits unpack by one broadcast shift of every word by 0..31 (no gather per token), then a reshape."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (allowed[:, :, None] >> shifts) & 1  # arithmetic shift: bit 31 of a negative word is still read right
    keep = bits.reshape(allowed.shape[0], -1)[:, :logits.shape[-1]] == 1
    return jnp.where(keep, logits, -jnp.inf)


def add_bias(logits: jax.Array, bias_ids: jax.Array, bias: jax.Array) -> jax.Array:
    """f32[S, V] logits plus each row's sparse bias (ids i32[S, K], values f32[S, K]); ids >= V are dropped, so a
    row's padding leaves its logits bit for bit."""
    rows = lax.broadcasted_iota(jnp.int32, bias_ids.shape, 0)
    return logits.at[rows, bias_ids].add(bias, mode="drop")


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int, *, as_logits: bool = False) -> SampleOutput:
    """Returns `tokens` [...] with their log_softmax under f32 logits [..., V] and the top-`num_top`; `as_logits`
    (static): the logit values themselves instead (the "*_logits" modes).

    Shared by the sampler (one row per slot) and the prompt scorer (one row per prompt position).
    """
    values = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    lse = None if as_logits else fixed_logsumexp(logits)  # fixed order: a row's logprobs never depend on its batch
    logprobs = values if lse is None else values - lse
    if num_top:
        top_values, top_ids = _top_k(logits, num_top)
        top_ids, top_logprobs = top_ids.astype(jnp.int32), top_values if lse is None else top_values - lse[..., None]
    else:
        top_ids = jnp.zeros((*logits.shape[:-1], 0), jnp.int32)
        top_logprobs = jnp.zeros((*logits.shape[:-1], 0), jnp.float32)
    return SampleOutput(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)


@jax.tree_util.register_dataclass
@dataclass
class _Cut:
    """The fast path's verdict per row: threshold(s) found among the best candidates, and whether they suffice."""

    values: jax.Array  # f32[S, C]: the C best scaled logits, descending
    ids: jax.Array  # i32[S, C]
    tau_k: jax.Array  # f32[S]: top_k threshold (exact whenever 1 <= top_k < C; -inf when top_k is off)
    tau: jax.Array  # f32[S]: max(top_k, top_p) threshold, meaningful where resolved
    resolved: jax.Array  # bool[S]: the row's kept set lies inside its candidates
    num_candidates: int = field(metadata=dict(static=True))


def _draw(penalized: jax.Array, arrays: SamplingArrays, steps: jax.Array, sampled: jax.Array,
          num_candidates: int, with_threshold: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Returns i32[S] tokens drawn by Gumbel-max over each row's kept set (only `sampled` rows are meaningful);
    `with_threshold` (static): also f32[S], each row's top_k / top_p threshold (min_p applies on top of it), which
    the processed logprobs mask with. Without it the branches return tokens only (the default mode's program)."""
    vocab = penalized.shape[1]
    s = penalized / jnp.where(sampled, arrays.temperature, 1.0)[:, None]
    top_k = jnp.where(arrays.top_k >= vocab, 0, arrays.top_k)  # keeping the whole vocabulary is no filter
    filtered = sampled & ((top_k > 0) | (arrays.top_p < 1) | (arrays.min_p > 0))
    bits = _row_bits(arrays.seed, steps)
    width = min(num_candidates + 1, vocab)  # one extra candidate tells whether the kept set stops inside
    cut = lax.cond(jnp.any(filtered), lambda: _candidate_cut(s, top_k, arrays, width),
                   lambda: _no_cut(s.shape[0], width))
    pick = (lambda out: out) if with_threshold else (lambda out: out[0])  # noqa: E731
    return lax.cond(
        jnp.any(sampled & ~cut.resolved),
        lambda: pick(_draw_full(s, top_k, arrays, bits, cut, sampled)),
        lambda: pick(_draw_candidates(arrays, bits, cut)),
    )


def _no_cut(rows: int, width: int) -> _Cut:
    """Returns the cut of a batch with no filtered row: nothing resolved, so every row draws from the full vocab."""
    inf = jnp.full((rows,), -jnp.inf, jnp.float32)
    return _Cut(values=jnp.zeros((rows, width), jnp.float32), ids=jnp.zeros((rows, width), jnp.int32),
                tau_k=inf, tau=inf, resolved=jnp.zeros((rows,), bool), num_candidates=width)


def _candidate_cut(s: jax.Array, top_k: jax.Array, arrays: SamplingArrays, width: int) -> _Cut:
    """Returns top_k/top_p thresholds computed from each row's `width` best tokens, exact where `resolved`."""
    vocab = s.shape[1]
    values, ids = _top_k(s, width)
    weights = jnp.exp(values - values[:, :1])  # unnormalized probabilities, the top one is 1
    has_outside = width < vocab
    k_known = (top_k < width) if has_outside else jnp.ones_like(top_k, bool)
    kth = jnp.take_along_axis(values, jnp.clip(top_k - 1, 0, width - 1)[:, None], axis=1)[:, 0]
    tau_k = jnp.where(top_k > 0, kth, -jnp.inf)
    # The top-k set is inside the candidates unless the last candidate ties with the k-th value.
    k_inside = (top_k > 0) & k_known & ((values[:, -1] < tau_k) if has_outside else True)
    in_k = weights * (values >= tau_k[:, None])
    # top_p renormalizes over the top-k set; without top_k that is the whole vocabulary.
    full_mass = fixed_sum(jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)))
    mass = jnp.where(k_inside, fixed_sum(in_k), full_mass)
    before = jnp.cumsum(in_k, axis=-1) - in_k  # mass strictly above each candidate
    n_p = jnp.maximum(jnp.sum(before < (arrays.top_p * mass)[:, None], axis=-1), 1)
    nucleus_on = arrays.top_p < 1
    tau_p = jnp.where(nucleus_on, jnp.take_along_axis(values, (n_p - 1)[:, None], axis=1)[:, 0], -jnp.inf)
    tau = jnp.maximum(tau_k, tau_p)
    p_known = ~nucleus_on | k_inside | (top_k == 0)
    if has_outside:
        last_kept = (values[:, -1] >= tau) & _min_p_kept(values[:, -1:], values[:, :1], arrays.min_p)[:, 0]
        resolved = k_known & p_known & ~last_kept
    else:
        resolved = jnp.ones_like(p_known)
    return _Cut(values=values, ids=ids.astype(jnp.int32), tau_k=tau_k, tau=tau, resolved=resolved,
                num_candidates=width)


def _draw_candidates(arrays: SamplingArrays, bits: jax.Array, cut: _Cut) -> tuple[jax.Array, jax.Array]:
    """Returns (tokens, thresholds) when every sampled row is resolved: Gumbel-max over its kept candidates only."""
    kept = (cut.values >= cut.tau[:, None]) & _min_p_kept(cut.values, cut.values[:, :1], arrays.min_p)
    scores = jnp.where(kept, cut.values + _gumbel(bits, cut.ids.astype(jnp.uint32)), -jnp.inf)
    return jnp.take_along_axis(cut.ids, _argmax(scores)[:, None], axis=1)[:, 0], cut.tau


def _draw_full(s: jax.Array, top_k: jax.Array, arrays: SamplingArrays, bits: jax.Array, cut: _Cut,
               sampled: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns (tokens, thresholds) by Gumbel-max over the whole vocabulary; rows the fast path could not resolve
    get their thresholds by exact bisection, resolved rows reuse the fast path's (so both branches agree)."""
    unresolved = sampled & ~cut.resolved
    by_count = unresolved & (top_k >= cut.num_candidates)  # the k-th value is not among the candidates
    by_mass = unresolved & (arrays.top_p < 1)
    tau_k, tau_p = lax.cond(
        jnp.any(by_count | by_mass),
        lambda: _exact_thresholds(s, top_k, arrays.top_p, cut.tau_k, by_count, by_mass),
        lambda: (cut.tau_k, jnp.full_like(cut.tau, -jnp.inf)),
    )
    tau = jnp.where(cut.resolved, cut.tau, jnp.maximum(tau_k, tau_p))
    kept = (s >= tau[:, None]) & _min_p_kept(s, jnp.max(s, axis=-1, keepdims=True), arrays.min_p)
    token_ids = lax.broadcasted_iota(jnp.uint32, (1, s.shape[1]), 1)
    scores = jnp.where(kept, s + _gumbel(bits, token_ids), -jnp.inf)
    return _argmax(scores), tau


def _min_p_kept(s: jax.Array, best: jax.Array, min_p: jax.Array) -> jax.Array:
    """Returns where p >= min_p * p_max, written as s - s_max >= log(min_p): no exp pass, and min_p = 0 keeps all."""
    return s - best >= jnp.log(min_p)[:, None]


def _exact_thresholds(s: jax.Array, top_k: jax.Array, top_p: jax.Array, tau_k: jax.Array, by_count: jax.Array,
                      by_mass: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns (tau_k, tau_p) f32[S]: top_k's threshold by counting where `by_count`, then top_p's by mass over
    the top-k survivors where `by_mass` (-inf elsewhere)."""
    tau_k = lax.cond(jnp.any(by_count),
                     lambda: jnp.where(by_count, _bisect(s, top_k.astype(jnp.float32), by_count, counting=True), tau_k),
                     lambda: tau_k)
    # The survivors' weights order tokens as their logits do, so the mass phase bisects the weights themselves and
    # each pass reads one array (measured 2x faster than logit keys plus weights).
    weights = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)) * (s >= tau_k[:, None])
    found = _bisect(weights, top_p * fixed_sum(weights), by_mass, counting=False)
    nucleus = jnp.min(jnp.where(weights >= found[:, None], s, jnp.inf), axis=-1)  # as a logit threshold
    return tau_k, jnp.where(by_mass, nucleus, -jnp.inf)


def _argmax(x: jax.Array) -> jax.Array:
    """Returns i32[S]: the first index of each row's maximum, like jnp.argmax.

    Two plain reductions: XLA:CPU runs jnp.argmax's (value, index) reduction unvectorized, and with the Gumbel
    noise fused into it that took ~40 ms for 8 x 151,936 against ~6 ms this way (measured). A row holding NaN has no
    maximum (nothing equals it): it gets 0, never the out-of-vocabulary id V; its logprob is not finite, which the
    scheduler fails that request on.
    """
    best = jnp.max(x, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    first = jnp.min(jnp.where(x == best, index, x.shape[-1]), axis=-1)
    return jnp.where(first < x.shape[-1], first, 0)


def _top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Returns lax.top_k(x, k), kept as XLA:CPU's partial-sort TopK call (~5 ms for 8 x 151,936, k=257).

    Without the barrier XLA fuses consumers into the sort it lowers top_k to and then keeps the full sort
    (~400-800 ms) instead of rewriting it to TopK; measured, and visible as `sort` in the compiled HLO.
    One barrier per output: a single barrier over the (values, ids) pair aborts XLA:CPU's TopkDecomposer when
    the call is partitioned over several devices (tensor parallelism; "cannot be downcasted to GetTupleElement").
    """
    values, ids = lax.top_k(x, k)
    return lax.optimization_barrier(values), lax.optimization_barrier(ids)


def _bisect(values: jax.Array, target: jax.Array, active: jax.Array, *, counting: bool) -> jax.Array:
    """Returns f32[S]: per active row, the largest t with sum(w[values >= t]) >= target, where w = 1 when
    `counting` else the values themselves (non-negative weights).

    Bisects the u32 keys of f32 values, so the answer is always one of the row's values and the threshold is
    exact; at most 32 passes (one per key bit). `counting` is static: a traced weight choice made each pass
    2x slower on XLA:CPU (measured).
    """
    lo = _sortable(jnp.min(values, axis=-1))  # everything kept: the whole mass, always enough
    hi = jnp.where(active, _sortable(jnp.max(values, axis=-1)) + 1, lo + 1)  # inactive rows start converged

    def body(bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        open_ = hi - lo > 1
        mid = lo + (hi - lo) // 2
        kept = values >= _unsortable(mid)[:, None]
        # counts are exact in any order; a mass is summed in a fixed order (batch invariance)
        mass = (jnp.sum if counting else fixed_sum)(jnp.where(kept, 1.0 if counting else values, 0.0), axis=-1)
        ok = mass >= target
        return jnp.where(open_ & ok, mid, lo), jnp.where(open_ & ~ok, mid, hi)

    lo, _ = lax.while_loop(lambda b: jnp.any(b[1] - b[0] > 1), body, (lo, hi))
    return _unsortable(lo)


def _sortable(x: jax.Array) -> jax.Array:
    """Returns u32 keys ordered like the f32 values (flip negatives, set the sign bit of non-negatives)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _unsortable(keys: jax.Array) -> jax.Array:
    bits = jnp.where(keys >> 31 == 1, keys ^ jnp.uint32(0x80000000), ~keys)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _row_bits(seed: jax.Array, steps: jax.Array) -> jax.Array:
    """Returns u32[S, 2], the data of fold_in(key(seed), step): the whole of a row's randomness for this step.

    The folded key is itself a threefry hash, so its two words serve as the noise key directly; drawing bits
    from it as well would add a second threefry, which doubled this part's compile time (0.8 s -> 1.6 s).
    """
    keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.key)(seed), steps.astype(jnp.int32))
    return jax.random.key_data(keys).astype(jnp.uint32)


def _hash32(x: jax.Array) -> jax.Array:
    """Wellons' "triple32" integer hash: a bijection on u32 with near-ideal avalanche."""
    x = x ^ (x >> 17)
    x = x * jnp.uint32(0xED5AD4BB)
    x = x ^ (x >> 11)
    x = x * jnp.uint32(0xAC4C1F6B)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x31848BAB)
    return x ^ (x >> 14)


def _gumbel(bits: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Returns f32 Gumbel noise for (row, token id) pairs, a pure function of the row's bits and the id.

    Counter-based so the fast path can draw noise for its candidates only and still match the full-vocabulary
    path token for token. A keyed hash instead of threefry per token: measured 2-4 ms vs 10-15 ms for 8 x 151,936
    on CPU. Uniforms have 24 bits, so noise lies in [-2.9, 17.3]: tokens ~20 nats below the best never win.
    """
    h = _hash32(_hash32(token_ids + bits[:, :1]) ^ bits[:, 1:])
    u = ((h >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
    return -jnp.log(-jnp.log(u))


def logprob_entry(out: SampleOutput, index: int | tuple[int, ...], n: int) -> tuple[float, dict[int, float]]:
    """One token's (logprob, {top id: logprob} of its n best) from host `out` at `index` (row, or row and
    position), in the engine's logprobs_mode: the format of `BatchedRequest.logprobs` and `.prompt_logprobs`."""
    ids, values = out.top_ids[index][:n], out.top_logprobs[index][:n]  # -inf: outside the processed distribution
    return float(out.logprobs[index]), {int(t): float(lp) for t, lp in zip(ids, values) if lp != -np.inf}
