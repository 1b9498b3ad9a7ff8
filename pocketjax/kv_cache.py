"""The slotted KV cache: an immutable pytree with one row per running request, and its pure update functions.

Layout per layer is head-major `[slots, kv_heads, max_seq_len, head_dim]`, so an attention kernel reads one
contiguous `[T, D]` tile per (slot, kv head). Layers are a tuple of arrays rather than one stacked array because the
layer loop indexes them statically: no per-layer slice copy, and each buffer is donated and updated in place.
Writes are scatters with mode="drop": a write aimed at position `max_seq_len` (padding rows, inactive slots) is
discarded instead of being clamped onto valid data, which is what `dynamic_update_slice` would do at the edge.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """k, v: one [slots, kv_heads, max_seq_len, head_dim] array per layer; lengths: valid tokens per slot."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


def init_cache(num_layers: int, slots: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype) -> KVCache:
    """A zeroed cache; every slot starts empty."""
    shape = (slots, kv_heads, max_seq_len, head_dim)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        lengths=jnp.zeros((slots,), jnp.int32),
    )


def write_tokens(layer_cache: jax.Array, slots: jax.Array, positions: jax.Array, values: jax.Array) -> jax.Array:
    """Write values [B, T, kv_heads, D] at cache[slots[b], :, positions[b, t]]; out-of-range positions are dropped."""
    return layer_cache.at[slots[:, None], :, positions].set(values.astype(layer_cache.dtype), mode="drop")


def copy_prefix(cache: KVCache, src: jax.Array, dst: jax.Array, length: jax.Array) -> KVCache:
    """Copy slot `src`'s first `length` positions into slot `dst` (shared-prefix reuse), on device."""
    def copy(layer: jax.Array) -> jax.Array:
        keep = jnp.arange(layer.shape[2]) < length
        row = jnp.where(keep[None, :, None], layer[src], layer[dst])
        return jax.lax.dynamic_update_slice(layer, row[None], (dst, 0, 0, 0))

    return KVCache(
        k=tuple(copy(a) for a in cache.k),
        v=tuple(copy(a) for a in cache.v),
        lengths=cache.lengths.at[dst].set(length),
    )
