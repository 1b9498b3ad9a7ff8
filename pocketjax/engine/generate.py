"""`pj.generate`: prompts in, tokens and logprobs out, as one pure program that a caller's `jax.jit` can hold.

Prefill, the first-token sampler and every decode step run in one traced function with its own KV cache (prompts'
width + max_new_tokens positions, one slot per prompt), so an RL step can roll out, score and update in one jitted
call. It reuses the engine's pieces as they are: `decoder.prefill_forward` / `decode_forward` for the forward
passes and `sampling.sample` for each token, in the engine's forms (`resolve_impl`, `default_kv_dtype`); the engine
is batch invariant (a request's bits do not depend on its batch, chunking or kv length), so these shapes give the
engine's tokens and logprobs bit for bit for the same seeds (tests/test_generate.py).

The loop is a `lax.scan` of static length `max_new_tokens` (a known trip count), each step a sample then a decode:
rows that stop (an EOS or stop token, or their `max_tokens`) become inactive rows, which write nothing to the cache;
their outputs are padding. The sampler's parts (`sampling.Paths`) are chosen on the host from the rows' parameters,
so no branch is decided on the device. A pure function cannot draw seeds on the host, so a sampled row needs
one: `SamplingParams.seed`, or `seeds=` (a traced uint32 [B] array is fine: `jax.random.bits(key, (B,), jnp.uint32)`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import ConfigError, RequestError, SamplingError
from ..model.config import ModelConfig, read_eos_ids
from ..model.decoder import Model, Params, decode_forward, is_stacked, prefill_forward
from ..model.kv_cache import check_kv_dtype, default_kv_dtype, init_cache
from ..model.layers import resolve_impl
from ..model.quant import untiled_params
from .processors import clear
from .sampling import Paths, SamplingArrays, pack_sampling, paths_for, sample
from .sampling_params import DEFAULT_LOGPROBS_MODE, SamplingParams, check_logprobs_mode

# Generation.finish_reasons codes: FINISH_REASONS[code] is the engine's name ("length": max_tokens or
# max_new_tokens reached; "stop": an EOS id or one of stop_token_ids was generated, and is the row's last token).
FINISH_REASONS = ("length", "stop")
LENGTH, STOP = 0, 1

# SamplingParams fields that need the host between tokens or outputs Generation has no place for: refused by name.
# (skip_special_tokens and include_stop_str_in_output shape text only; generate returns no text.)
_UNSUPPORTED = {
    "stop": "stop strings are matched on decoded text, on the host (use stop_token_ids)",
    "structured": "structured outputs advance a grammar on the host after every token",
    "bad_words": "bad words are matched against the output on the host",
    "logit_bias": "not implemented in generate",
    "allowed_token_ids": "not implemented in generate",
    "hook": "not implemented in generate",
    "steer": "not implemented in generate",
    "return_hidden": "not implemented in generate",
    "prompt_logprobs": "not implemented in generate (pj.logits scores prompts)",
    "logprobs": "top logprobs are not returned (Generation.logprobs holds each token's own logprob)",
}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Generation:
    """What `generate` returns, arrays over B prompts and N = max_new_tokens (a pytree: jit returns it whole).

    Row b's tokens are `tokens[b, :lengths[b]]`; past its end `tokens` holds the pad id and `logprobs` 0.
    """

    tokens: jax.Array  # int32 [B, N]
    logprobs: jax.Array  # float32 [B, N]: as the engine's logprobs_mode says (default: raw log_softmax)
    lengths: jax.Array  # int32 [B]: tokens generated per row, in [1, N]
    finish_reasons: jax.Array  # int32 [B]: FINISH_REASONS[code]

    def finish_reason(self, row: int) -> str:
        """Row `row`'s finish reason by name (host side: reads the array)."""
        return FINISH_REASONS[int(self.finish_reasons[row])]


def generate(model: Model, prompts, sampling: SamplingParams | Sequence[SamplingParams], max_new_tokens: int, *,
             lengths=None, seeds=None, kv_dtype: str | None = None, attention_impl: str = "auto",
             logprobs_mode: str = DEFAULT_LOGPROBS_MODE, pad_id: int = 0) -> Generation:
    """Returns a `Generation`: up to `max_new_tokens` (static) tokens per prompt, sampled as `pj.Engine` samples
    them (the same bits for the same seeds), from one program with no host step inside.

    `prompts`: a list of token-id lists, or an int array [B, T] with `lengths` [B] (each row's prompt is its first
    lengths[b] ids; may be traced). `sampling`: one SamplingParams for every prompt or one per prompt; a row stops at
    an EOS id of the model (unless ignore_eos), at one of its stop_token_ids, or after min(max_tokens,
    max_new_tokens) tokens; min_tokens bans EOS and stop ids before it as the engine does. `seeds` uint32 [B] (may
    be traced) replaces SamplingParams.seed, which must then be None; a sampled row needs one or the other.
    `kv_dtype`, `attention_impl`, `logprobs_mode`: as the engine's options of those names (the same defaults).
    `model` may hold traced params (`dataclasses.replace(model, params=params)` inside the caller's jit): pass them
    as an argument of that jit, as the engine does; closed over, they are constants XLA folds in other bits.
    Values are checked only where concrete; under tracing an out-of-range id is clamped as in any jnp indexing.
    """
    config = model.config
    if model.mesh is not None:
        raise ConfigError("pj.generate runs on one device: a model on a mesh (tp > 1) is served by pj.Engine")
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be a static int >= 1, got {max_new_tokens!r}")
    tokens, lengths = _prompt_arrays(prompts, lengths, config.vocab_size)
    rows = tokens.shape[0]
    params = _sampling_rows(sampling, rows, config.vocab_size)
    arrays = _sampling_arrays(params, seeds, rows)
    check_kv_dtype(kv_dtype)
    check_logprobs_mode(logprobs_mode)
    kv_dtype = kv_dtype or default_kv_dtype(model.dtype)
    impl = resolve_impl(attention_impl, kv_dtype, batch_invariant=True)
    weights = model.params if impl == "cpu" else untiled_params(model.params)  # as Engine does for XLA's forms
    eos = read_eos_ids(config, model.path)
    stops = [sorted({*p.stop_token_ids, *(() if p.ignore_eos else eos)}) for p in params]
    limits = np.array([min(p.max_tokens, max_new_tokens) for p in params], np.int32)
    min_tokens = np.array([p.min_tokens for p in params], np.int32)
    bans = _min_token_bans(stops, min_tokens, config.vocab_size) if min_tokens.any() else None
    paths = paths_for(arrays, config.vocab_size)  # the sampler's parts the rows need, chosen here as the engine does
    return _generate(weights, tokens, lengths, arrays, _padded(stops), limits, min_tokens, bans, config=config,
                     impl=impl, kv_dtype=kv_dtype, max_new_tokens=int(max_new_tokens), logprobs_mode=logprobs_mode,
                     pad_id=int(pad_id), paths=paths)


def _sample(logits, arrays, prompt_mask, counts, steps, allowed, logprobs_mode: str, paths: Paths):
    """The one call of the engine's sampler (the engine passes the same arguments: `steps._sample`)."""
    return sample(logits, arrays, prompt_mask, counts, steps, allowed, num_top=0, logprobs_mode=logprobs_mode,
                  paths=paths)


@partial(jax.jit, static_argnames=("config", "impl", "kv_dtype", "max_new_tokens", "logprobs_mode", "pad_id",
                                   "paths"))
def _generate(params: Params, tokens: jax.Array, lengths: jax.Array, arrays: SamplingArrays, stops: jax.Array,
              limits: jax.Array, min_tokens: jax.Array, bans: jax.Array | None, *, config: ModelConfig, impl: str,
              kv_dtype: str, max_new_tokens: int, logprobs_mode: str, pad_id: int, paths: Paths) -> Generation:
    """`generate` after its checks: prefill, then a scan of sample + decode steps."""
    b, t = tokens.shape
    vocab = config.vocab_size
    cache = init_cache(config.num_layers, b, config.num_kv_heads, t + max_new_tokens, config.head_dim, kv_dtype,
                       stacked=is_stacked(params))
    slots = jnp.arange(b, dtype=jnp.int32)
    cache, logits = prefill_forward(params, config, impl, t, cache, tokens, slots, jnp.zeros(b, jnp.int32), lengths)
    inside = jnp.arange(t)[None, :] < lengths[:, None]
    prompt_mask = jnp.zeros((b, vocab), bool).at[slots[:, None], jnp.where(inside, tokens, vocab)].set(
        True, mode="drop")

    def allowed(step: jax.Array) -> jax.Array | None:  # min_tokens: EOS and stop ids banned before it
        return None if bans is None else jnp.where((step < min_tokens)[:, None], bans, -1)

    def stopped(token: jax.Array) -> jax.Array:
        return jnp.any(token[:, None] == stops, axis=1)

    def step(carry, i):
        cache, logits, counts, done, reason = carry
        active = ~done
        steps = jnp.full(b, i, jnp.int32)
        out = _sample(logits, arrays, prompt_mask, counts, steps, allowed(steps), logprobs_mode, paths)
        counts = counts.at[slots, out.tokens].add(active.astype(jnp.int32))
        stop = active & stopped(out.tokens)
        reason = jnp.where(stop, STOP, reason)
        done = done | stop | (i + 1 >= limits)
        emitted = (jnp.where(active, out.tokens, pad_id), jnp.where(active, out.logprobs, 0.0), active)
        going = ~done  # the next token's logits; a row that has ended writes nothing (the last step: no row)
        cache, logits = decode_forward(params, config, impl, t + max_new_tokens, cache, out.tokens, slots,
                                       jnp.where(going, lengths + i, 0), going, dense=True)
        return (cache, logits, counts, done, reason), emitted

    # The sampler sits once in the loop (compiled once): the last step's forward, whose logits nothing samples, is
    # the price (every row inactive, so it writes nothing).
    carry = (cache, logits, jnp.zeros((b, vocab), jnp.int32), jnp.zeros(b, bool), jnp.full(b, LENGTH, jnp.int32))
    (*_, reason), (tokens_out, logprobs, on) = lax.scan(step, carry, jnp.arange(max_new_tokens, dtype=jnp.int32))
    tokens_out, logprobs = tokens_out.T.astype(jnp.int32), logprobs.T.astype(jnp.float32)
    generated = jnp.sum(on, axis=0, dtype=jnp.int32)
    return Generation(tokens=tokens_out, logprobs=logprobs, lengths=generated, finish_reasons=reason.astype(jnp.int32))


def _prompt_arrays(prompts, lengths, vocab: int) -> tuple[jax.Array | np.ndarray, jax.Array | np.ndarray]:
    """(tokens int32 [B, T], lengths int32 [B]) from a list of id lists, or from an array and its lengths."""
    if isinstance(prompts, (list, tuple)) and (not prompts or not np.isscalar(prompts[0])) and lengths is None:
        if not prompts or any(not isinstance(p, (list, tuple, np.ndarray)) or len(p) == 0 for p in prompts):
            raise RequestError("prompts must be a non-empty list of non-empty token-id lists (or an int array "
                               "[B, T] with lengths=)")
        for p in prompts:
            if any(not isinstance(x, (int, np.integer)) or isinstance(x, bool) for x in p):
                raise RequestError(f"prompts must hold integer token ids, got {list(p)[:8]!r}")
        sizes = np.array([len(p) for p in prompts], np.int32)
        tokens = np.zeros((len(prompts), int(sizes.max())), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths = sizes
    else:
        if lengths is None:
            raise RequestError("prompts given as an array need lengths= (int [B]: each row's prompt length)")
        tokens, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
        if not jnp.issubdtype(tokens.dtype, jnp.integer) or not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise RequestError(f"prompts and lengths must be integer arrays, got {tokens.dtype} and {lengths.dtype}")
        if tokens.ndim != 2 or tokens.shape[1] == 0 or lengths.shape != tokens.shape[:1]:
            raise RequestError(f"prompts must be [B, T] with T >= 1 and lengths [B], got {tokens.shape} and "
                               f"{lengths.shape}")
        tokens, lengths = tokens.astype(jnp.int32), lengths.astype(jnp.int32)
        concrete = not isinstance(lengths, jax.core.Tracer)
        if concrete and (int(lengths.min()) < 1 or int(lengths.max()) > tokens.shape[1]):
            raise RequestError(f"lengths must lie in [1, {tokens.shape[1]}], got {np.asarray(lengths).tolist()}")
    if not isinstance(tokens, jax.core.Tracer):
        inside = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
        ids = np.asarray(tokens)[inside]
        if ids.min() < 0 or ids.max() >= vocab:
            raise RequestError(f"token ids must lie in [0, {vocab}), got range [{ids.min()}, {ids.max()}]")
    return tokens, lengths


def _sampling_rows(sampling, rows: int, vocab: int) -> list[SamplingParams]:
    """One validated SamplingParams per row; SamplingError naming a field generate does not implement."""
    params = [sampling] * rows if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != rows or not all(isinstance(p, SamplingParams) for p in params):
        raise SamplingError(f"sampling must be one SamplingParams or one per prompt ({rows}), got {sampling!r:.200}")
    default = SamplingParams()
    for p in params:
        p.validate(vocab)
        for name, why in _UNSUPPORTED.items():
            if getattr(p, name) != getattr(default, name):
                raise SamplingError(f"SamplingParams.{name} is not supported by pj.generate: {why}")
    return params


def _sampling_arrays(params: list[SamplingParams], seeds, rows: int) -> SamplingArrays:
    """The rows' SamplingArrays, seeds from `seeds` (possibly traced) or from each SamplingParams.seed."""
    if seeds is not None:
        if any(p.seed is not None for p in params):
            raise SamplingError("give seeds one way: seeds= or SamplingParams.seed, not both")
        seeds = jnp.asarray(seeds)
        if seeds.shape != (rows,) or not jnp.issubdtype(seeds.dtype, jnp.integer):
            raise SamplingError(f"seeds must be an integer array [{rows}], got {seeds.dtype}{list(seeds.shape)}")
        return replace(pack_sampling(params, [0] * rows), seed=seeds.astype(jnp.uint32))
    unseeded = [i for i, p in enumerate(params) if p.seed is None and not p.greedy]
    if unseeded:
        raise SamplingError(f"rows {unseeded} sample without a seed: a pure function draws none on the host "
                            "(set SamplingParams.seed, or pass seeds=)")
    return pack_sampling(params, [p.seed or 0 for p in params])


def _padded(stops: list[list[int]]) -> np.ndarray:
    """int32 [B, K] stop ids per row, padded with -1 (no token)."""
    out = np.full((len(stops), max(1, max(map(len, stops)))), -1, np.int32)
    for i, ids in enumerate(stops):
        out[i, :len(ids)] = ids
    return out


def _min_token_bans(stops: list[list[int]], min_tokens: np.ndarray, vocab: int) -> np.ndarray:
    """int32 [B, ceil(V / 32)] masks (the sampler's `allowed` layout) without each row's stop ids where it has
    min_tokens: what the engine's `processors.TokenLimits.ban` ANDs in before min_tokens."""
    words = np.full((len(stops), -(-vocab // 32)), -1, np.int32)
    for i, ids in enumerate(stops):
        if min_tokens[i]:
            clear(words[i], ids)
    return words
