"""The device side of the engine: jitted, buffer-donating step functions and the per-slot penalty state.

Each takes everything it reads as arguments and returns the updated state; the cache (and the penalty state) is
donated, so XLA updates it in place and no step copies it. The forward steps and the sampler are separate jitted
calls, chained on device without a host sync: the sampler then compiles once per batch bucket instead of once per
(batch, chunk, attention length) shape. Every shape comes from `bucket`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from ..model.config import ModelConfig
from ..model.decoder import Hook, Params, decode_forward, lm_head, prefill_forward
from ..model.kv_cache import KVCache, copy_prefix
from .plan import bucket  # noqa: F401 - re-exported: the engine, warm-up and benchmarks import it from here
from .sampling import SampleOutput, SamplingArrays, sample, token_logprobs


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Penalties:
    """Per-slot sampling state on device: the prompt's tokens and the generated-token counts.

    Updates address slots; a row aimed at slot `num_slots` (padding, inactive) is dropped.
    """

    prompt_mask: jax.Array  # bool [slots, vocab]: tokens of each slot's prompt (repetition penalty)
    output_counts: jax.Array  # int32 [slots, vocab]: generated-token counts (presence/frequency penalty)

    @classmethod
    def zeros(cls, slots: int, vocab: int) -> Penalties:
        return cls(jnp.zeros((slots, vocab), bool), jnp.zeros((slots, vocab), jnp.int32))

    @property
    def num_slots(self) -> int:
        return self.prompt_mask.shape[0]

    def restart(self, slots: jax.Array, prompt_masks: jax.Array) -> Penalties:
        """A new prompt in each of `slots` [R]: its mask bool [R, vocab] replaces the old one, counts go to 0."""
        return Penalties(self.prompt_mask.at[slots].set(prompt_masks, mode="drop"),
                         self.output_counts.at[slots].set(0, mode="drop"))

    def count(self, slots: jax.Array, tokens: jax.Array) -> Penalties:
        """One more occurrence of tokens [R] in the outputs of slots [R]."""
        return Penalties(self.prompt_mask, self.output_counts.at[slots, tokens].add(1, mode="drop"))


def row_hooks(hooks: tuple[Hook, ...], selector: jax.Array | None) -> Hook | None:
    """One hook for a batch whose row b runs `hooks[selector[b] - 1]` (0: none); None when `hooks` is empty.

    Every hook sees the whole batch and its output is kept only on its own rows, so a row without a hook gets its
    residual stream back untouched (bit for bit) and a row's result never depends on the others' hooks, provided
    each hook treats rows independently. A batch with no hooks passes neither argument and compiles the same
    program as before hooks existed; each distinct `hooks` tuple (static) compiles its own programs.
    """
    if not hooks:
        return None

    def hook(layer, x: jax.Array) -> jax.Array:
        out = x
        for i, fn in enumerate(hooks, 1):
            out = jnp.where((selector == i)[:, None, None], fn(layer, x), out)
        return out

    return hook


@partial(jax.jit, static_argnames=("config", "impl", "kv_len", "hooks"), donate_argnames=("cache",))
def prefill_step(params, cache: KVCache, tokens, slots, starts, lengths, selector=None, *, config: ModelConfig,
                 impl: str, kv_len: int, hooks: tuple[Hook, ...] = ()) -> tuple[KVCache, jax.Array]:
    """Write one prompt chunk per row into the cache; logits [B, vocab] of each row's last chunk token.
    `hooks` / `selector` int32 [B]: per-row intervention hooks (`row_hooks`)."""
    return prefill_forward(params, config, impl, kv_len, cache, tokens, slots, starts, lengths,
                           hook=row_hooks(hooks, selector))


@partial(jax.jit, static_argnames=("config", "impl", "kv_len", "num_top", "hooks"), donate_argnames=("cache",))
def prefill_scored_step(params, cache: KVCache, tokens, slots, starts, lengths, targets, scored, selector=None, *,
                        config: ModelConfig, impl: str, kv_len: int, num_top: int, hooks: tuple[Hook, ...] = ()
                        ) -> tuple[KVCache, jax.Array, SampleOutput]:
    """`prefill_step`, plus each position's log-probability of the token after it (`score_positions`).

    A variant of its own, called only for chunks where some row asked for prompt logprobs: the plain step never
    computes the [T, vocab] logits of every position.
    """
    cache, logits, hidden = prefill_forward(params, config, impl, kv_len, cache, tokens, slots, starts, lengths,
                                            return_hidden=True, hook=row_hooks(hooks, selector))
    return cache, logits, score_positions(params, hidden, targets, scored, num_top)


def score_positions(params: Params, hidden: jax.Array, targets: jax.Array, scored: jax.Array,
                    num_top: int) -> SampleOutput:
    """Raw logprob of targets [B, T] under the logits at each position of hidden [B, T, H], and the top-`num_top`
    ([B, T] and [B, T, num_top]); rows not `scored` [B] get zeros without computing their logits.

    One row at a time (`lax.map`), so the largest live array is one row's [T, vocab] logits, not the chunk's:
    at Qwen's vocab of 151,936 and T=512 that is 311 MB per row in float32 instead of 2.5 GB for 8 rows.
    """
    def row(args: tuple[jax.Array, jax.Array, jax.Array]) -> SampleOutput:
        h, target, on = args
        t = target.shape[0]
        skipped = SampleOutput(target, jnp.zeros(t, jnp.float32), jnp.zeros((t, num_top), jnp.int32),
                               jnp.zeros((t, num_top), jnp.float32))
        return lax.cond(on, lambda: token_logprobs(lm_head(params, h), target, num_top), lambda: skipped)

    return lax.map(row, (hidden, targets, scored))


@partial(jax.jit, static_argnames=("config", "impl", "kv_len", "dense", "hooks"), donate_argnames=("cache",))
def decode_step(params, cache: KVCache, tokens, slots, positions, active, selector=None, *, config: ModelConfig,
                impl: str, kv_len: int, dense: bool, hooks: tuple[Hook, ...] = ()) -> tuple[KVCache, jax.Array]:
    """One token per row. `dense`: row i is slot i for every slot, so attention reads the cache in place.
    `hooks` / `selector`: per-row intervention hooks (`row_hooks`)."""
    return decode_forward(params, config, impl, kv_len, cache, tokens, slots, positions, active, dense=dense,
                          hook=row_hooks(hooks, selector))


@partial(jax.jit, static_argnames=("num_top",), donate_argnames=("penalties",))
def sample_first(penalties: Penalties, logits, slots, final, prompt_masks, sampling: SamplingArrays, *,
                 num_top: int) -> tuple[Penalties, SampleOutput]:
    """First token of rows whose prompt ended (`final`); restarts those slots' penalty state with the new prompt."""
    zeros = jnp.zeros(prompt_masks.shape, jnp.int32)
    out = sample(logits, sampling, prompt_masks, zeros, jnp.zeros_like(slots), num_top=num_top)
    rows = jnp.where(final, slots, penalties.num_slots)
    return penalties.restart(rows, prompt_masks).count(rows, out.tokens), out


@partial(jax.jit, static_argnames=("num_top",), donate_argnames=("penalties",))
def sample_next(penalties: Penalties, logits, slots, active, steps, sampling: SamplingArrays, *,
                num_top: int) -> tuple[Penalties, SampleOutput]:
    """Next token of every active row, with penalties from its slot's state; counts the new tokens."""
    out = sample(logits, sampling, penalties.prompt_mask[slots], penalties.output_counts[slots], steps,
                 num_top=num_top)
    return penalties.count(jnp.where(active, slots, penalties.num_slots), out.tokens), out


@partial(jax.jit, donate_argnames=("cache",))
def copy_slot_prefix(cache: KVCache, src, dst, length) -> KVCache:
    """Copy the first `length` cached positions of slot src into slot dst (a shared prompt prefix)."""
    return copy_prefix(cache, src, dst, length)


STEP_FUNCTIONS = (prefill_step, prefill_scored_step, decode_step, sample_first, sample_next, copy_slot_prefix)
