"""The slotted KV cache: an immutable pytree with one row per running request, and its pure update functions.

Layout per layer is head-major `[slots, kv_heads, max_seq_len, head_dim]`, so an attention kernel reads one
contiguous `[T, D]` tile per (slot, kv head). Two layouts of the layers, matching the model's (`decoder.layer_stack`):
a tuple of per-layer arrays for the unrolled layer loop (indexed statically: each buffer donated and updated in
place), or one stacked `[layers, slots, kv_heads, max_seq_len, head_dim]` array per K and V for the `lax.scan`
loop, which carries it and scatters each layer's tokens into it in place (a traced layer index).
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
    """k, v: one [slots, kv_heads, max_seq_len, head_dim] array per layer (a tuple), or one stacked
    [layers, slots, kv_heads, max_seq_len, head_dim] array; lengths: valid tokens per slot.

    k_scale, v_scale: for a quantized cache (int8, float8), float32 [slots, kv_heads, max_seq_len] per layer, in the
    same layout as k and v; empty tuples otherwise.
    """

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array
    lengths: jax.Array
    k_scale: tuple[jax.Array, ...] | jax.Array = ()
    v_scale: tuple[jax.Array, ...] | jax.Array = ()

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def stacked(self) -> bool:
        """True for the scan layout: one [layers, ...] array per K and V."""
        return not isinstance(self.k, tuple)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0] if self.stacked else len(self.k)

    @property
    def max_seq_len(self) -> int:
        return (self.k if self.stacked else self.k[0]).shape[-2]

    @property
    def quantized(self) -> bool:
        return not isinstance(self.k_scale, tuple) or len(self.k_scale) > 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree.leaves((self.k, self.v, self.k_scale, self.v_scale)))

    def layer(self, i: int | jax.Array, kv_len: int | None = None) -> tuple[jax.Array, ...]:
        """Layer i's first `kv_len` positions (default all) as the attention functions take them: (k, v), or
        (k, v, k_scale, v_scale) when quantized. i may be traced (scan layout): then one dynamic slice per array
        that reads only the kv_len positions, not the whole layer."""
        arrays = (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ())
        if not self.stacked:
            return tuple(a[i][:, :, :kv_len] for a in arrays)
        def take(a):
            sizes = (1,) + a.shape[1:3] + (kv_len or a.shape[3],) + a.shape[4:]
            return jax.lax.dynamic_slice(a, (i,) + (0,) * (a.ndim - 1), sizes)[0]
        return tuple(take(a) for a in arrays)

    def write(self, i: int | jax.Array, slots: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array
              ) -> KVCache:
        """A cache whose layer i holds k, v [B, T, kv_heads, D] at rows `slots`, `positions` (quantized if the
        cache is); positions >= max_seq_len are dropped. Stacked: one in-place scatter into the [layers, ...] array."""
        def put(arrays, value: jax.Array):
            if self.stacked:
                return write_tokens(arrays, slots, positions, value, layer=i)
            return arrays[:i] + (write_tokens(arrays[i], slots, positions, value),) + arrays[i + 1:]

        dtype = (self.k if self.stacked else self.k[0]).dtype
        if not self.quantized:
            return replace(self, k=put(self.k, k), v=put(self.v, v))
        (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
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


def init_cache(num_layers: int, slots: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype,
               stacked: bool = False) -> KVCache:
    """A zeroed cache; every slot starts empty. dtype "int8" or "float8_e4m3fn" adds per-token, per-head scales.
    `stacked`: one [layers, ...] array per K and V (and scale), for a model loaded with scan_layers."""
    shape = (slots, kv_heads, max_seq_len, head_dim)
    quantized = jnp.dtype(dtype).name in QMAX

    def zeros(shape, dtype):
        if stacked:
            return jnp.zeros((num_layers,) + shape, dtype)
        return tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))

    return KVCache(k=zeros(shape, dtype), v=zeros(shape, dtype), lengths=jnp.zeros((slots,), jnp.int32),
                   k_scale=zeros(shape[:3], jnp.float32) if quantized else (),
                   v_scale=zeros(shape[:3], jnp.float32) if quantized else ())


def write_tokens(cache: jax.Array, slots: jax.Array, positions: jax.Array, values: jax.Array,
                 layer: int | jax.Array | None = None) -> jax.Array:
    """Write values [B, T, kv_heads, ...] at cache[slots[b], :, positions[b, t]] (cache[layer, ...] for a stacked
    cache); out-of-range positions are dropped."""
    index = (slots[:, None], slice(None), positions)
    return cache.at[index if layer is None else (layer,) + index].set(values.astype(cache.dtype), mode="drop")


def copy_prefix(cache: KVCache, src: jax.Array, dst: jax.Array, length: jax.Array) -> KVCache:
    """Copy slot `src`'s first `length` positions into slot `dst` (shared-prefix reuse), on device."""
    def copy(layer: jax.Array) -> jax.Array:
        keep = (jnp.arange(layer.shape[2]) < length).reshape((1, -1) + (1,) * (layer.ndim - 3))
        row = jnp.where(keep, layer[src], layer[dst])
        return jax.lax.dynamic_update_slice(layer, row[None], (dst,) + (0,) * (layer.ndim - 1))

    def each(arrays):  # stacked: the same copy on every layer's [slots, ...] view
        return jax.vmap(copy)(arrays) if cache.stacked else tuple(copy(a) for a in arrays)

    quantized = cache.quantized
    return KVCache(k=each(cache.k), v=each(cache.v), lengths=cache.lengths.at[dst].set(length),
                   k_scale=each(cache.k_scale) if quantized else (), v_scale=each(cache.v_scale) if quantized else ())
