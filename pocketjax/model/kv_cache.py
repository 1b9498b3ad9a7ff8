"""The slotted KV cache: an immutable pytree with one row per running request, and its pure update functions.

Layout per layer is head-major `[slots, kv_heads, max_seq_len, head_dim]`, so an attention kernel reads one
contiguous `[T, D]` tile per (slot, kv head). Layers are a tuple of arrays rather than one stacked array because the
layer loop indexes them statically: no per-layer slice copy, and each buffer is donated and updated in place.
Writes are scatters with mode="drop": a write aimed at position `max_seq_len` (padding rows, inactive slots) is
discarded instead of being clamped onto valid data, which is what `dynamic_update_slice` would do at the edge.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from ..errors import ConfigError
from .config import DTYPES


# Quantized cache dtypes: values are stored as round(x / scale) with one float32 scale per (token, kv head),
# scale = max|x| / QMAX over head_dim (vLLM's per-token-head scheme). Attention factors the scales out of its
# two products (QK^T columns, P rows), so the cache is never dequantized as a whole.
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
QUANTIZED_KV_DTYPES = tuple(QMAX)
KV_DTYPES = DTYPES + QUANTIZED_KV_DTYPES


def default_kv_dtype(model_dtype) -> str:
    """The model's dtype, except float32 on CPU for a 16-bit model: XLA:CPU has no 16-bit float scatter or gather,
    so every step would convert each layer's whole cache to float32 and back (measured on a bfloat16 Qwen3-0.6B-
    shaped layer, 8 slots x 256 positions: 4.3 ms/step with a bfloat16 cache, 1.6 ms with a float32 one, where the
    float32 model takes 1.4). The weights stay 16-bit; `kv_dtype=` forces any cache dtype ("int8" is as fast)."""
    name = jnp.dtype(model_dtype).name
    if jnp.dtype(model_dtype).itemsize == 2 and jax.default_backend() == "cpu":
        logging.getLogger("pocketjax").info("pocketjax: %s model, float32 KV cache on CPU (no fast 16-bit cache "
                                            "writes on XLA:CPU; kv_dtype= forces one)", name)
        return "float32"
    return name


def check_kv_dtype(kv_dtype: str | None) -> None:
    """ConfigError for a KV cache dtype pocketjax cannot store (None: the model's own dtype)."""
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype={kv_dtype!r} is not supported (supported: {', '.join(KV_DTYPES)})")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """k, v: one [slots, kv_heads, max_seq_len, head_dim] array per layer; lengths: valid tokens per slot.

    k_scale, v_scale: for a quantized cache (int8, float8), one float32 [slots, kv_heads, max_seq_len] array per
    layer; empty tuples otherwise.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    k_scale: tuple[jax.Array, ...] = ()
    v_scale: tuple[jax.Array, ...] = ()

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def quantized(self) -> bool:
        return bool(self.k_scale)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v + self.k_scale + self.v_scale)

    def layer(self, i: int) -> tuple[jax.Array, ...]:
        """Layer i as the attention functions take it: (k, v), or (k, v, k_scale, v_scale) when quantized."""
        if self.quantized:
            return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]
        return self.k[i], self.v[i]

    def write(self, i: int, slots: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """A cache whose layer i holds k, v [B, T, kv_heads, D] at rows `slots`, `positions` (quantized if the
        cache is); positions >= max_seq_len are dropped."""
        def put(arrays: tuple, value: jax.Array) -> tuple:
            return arrays[:i] + (write_tokens(arrays[i], slots, positions, value),) + arrays[i + 1:]

        if not self.quantized:
            return replace(self, k=put(self.k, k), v=put(self.v, v))
        (kq, ks), (vq, vs) = quantize(k, self.k[i].dtype), quantize(v, self.v[i].dtype)
        return replace(self, k=put(self.k, kq), v=put(self.v, vq), k_scale=put(self.k_scale, ks),
                       v_scale=put(self.v_scale, vs))


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] in `dtype`, float32 scales [...]) with x ~= values * scales[..., None]."""
    name = jnp.dtype(dtype).name
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / QMAX[name]
    y = xf * jnp.where(scale > 0, 1.0 / scale, 0.0)[..., None]
    if name == "int8":
        y = jnp.clip(jnp.round(y), -QMAX[name], QMAX[name])
    return y.astype(dtype), scale


def dequantize(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """values [..., D] * scales [...] in `dtype` (tests and debugging: attention never materializes this)."""
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


def init_cache(num_layers: int, slots: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype) -> KVCache:
    """A zeroed cache; every slot starts empty. dtype "int8" or "float8_e4m3fn" adds per-token, per-head scales."""
    shape = (slots, kv_heads, max_seq_len, head_dim)
    quantized = jnp.dtype(dtype).name in QMAX
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        lengths=jnp.zeros((slots,), jnp.int32),
        k_scale=tuple(jnp.zeros(shape[:3], jnp.float32) for _ in range(num_layers)) if quantized else (),
        v_scale=tuple(jnp.zeros(shape[:3], jnp.float32) for _ in range(num_layers)) if quantized else (),
    )


def write_tokens(layer_cache: jax.Array, slots: jax.Array, positions: jax.Array, values: jax.Array) -> jax.Array:
    """Write values [B, T, kv_heads, ...] at cache[slots[b], :, positions[b, t]]; out-of-range positions are dropped."""
    return layer_cache.at[slots[:, None], :, positions].set(values.astype(layer_cache.dtype), mode="drop")


def copy_prefix(cache: KVCache, src: jax.Array, dst: jax.Array, length: jax.Array) -> KVCache:
    """Copy slot `src`'s first `length` positions into slot `dst` (shared-prefix reuse), on device."""
    def copy(layer: jax.Array) -> jax.Array:
        keep = (jnp.arange(layer.shape[2]) < length).reshape((1, -1) + (1,) * (layer.ndim - 3))
        row = jnp.where(keep, layer[src], layer[dst])
        return jax.lax.dynamic_update_slice(layer, row[None], (dst,) + (0,) * (layer.ndim - 1))

    return KVCache(
        k=tuple(copy(a) for a in cache.k),
        v=tuple(copy(a) for a in cache.v),
        lengths=cache.lengths.at[dst].set(length),
        k_scale=tuple(copy(a) for a in cache.k_scale),
        v_scale=tuple(copy(a) for a in cache.v_scale),
    )
