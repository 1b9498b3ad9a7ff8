"""Plain-JAX attention with the kernels' signatures: the test oracle and the engine's "xla" path.

GQA is an einsum over q reshaped to [.., kv_heads, G, D] (query head h uses kv head h // G, the
HF/Qwen repeat_interleave convention), so K/V are never repeated. Logits and softmax are float32;
P is cast to V's dtype for the second matmul (as the kernels do), accumulating in float32.
Block/interpret arguments are accepted and ignored. With `slots`, the cache rows are gathered first
(a copy of the selected rows); pass slots=None when cache row s already belongs to query row s.
The kernels use this module's numerics: `MASK_VALUE`, `precision`, `compute_dtype`.

A quantized cache (int8 / float8 values with float32 scales [S, kv_heads, T], one per token and head) is read
as it is stored: values are converted to q's dtype (exact: |int8| <= 127 and float8 fit bfloat16's mantissa),
the key scales multiply the logits' columns and the value scales multiply P's columns, so a dequantized
copy of the cache never exists.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# Masked logits: finite, so subtracting a row's max never computes inf - inf (NaN).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def precision(dtype):
    """float32 gets exact products (the GPU default would be TF32); 16-bit inputs are exact anyway."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _rows(cache: jax.Array, slots: jax.Array | None, n: int) -> jax.Array:
    """The cache rows of the n query rows: slots[i], or row i (a free slice) when slots is None."""
    return cache[:n] if slots is None else jnp.take(cache, slots, axis=0)


def compute_dtype(q, cache):
    """The dtype of the attention products: the cache's, or q's when the cache is quantized (1-byte values)."""
    return q.dtype if jnp.dtype(cache.dtype).itemsize == 1 else cache.dtype


def _attend(logits, mask, v, pv_spec, v_scale=None, dtype=None):
    """Masked float32 softmax then P @ V; a row with no visible key comes out as exact zeros.

    v_scale [.., T] (broadcast like P's last axis) rescales P's columns for a quantized V.
    """
    dtype = dtype or v.dtype
    logits = jnp.where(mask, logits, MASK_VALUE)
    p = jnp.where(mask, jnp.exp(logits - logits.max(axis=-1, keepdims=True)), 0.0)
    denom = p.sum(axis=-1)[..., None]
    pv = p if v_scale is None else p * v_scale
    o = jnp.einsum(pv_spec, pv.astype(dtype), v.astype(dtype), preferred_element_type=jnp.float32,
                   precision=precision(dtype))
    return jnp.where(denom > 0, o / jnp.maximum(denom, 1e-30), 0.0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret", "num_splits"))
def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale=None, block_k=None, interpret=False,
                     slots=None, num_splits=None, k_scale=None, v_scale=None):
    """[S, q_heads, D] attention of each query row over the first lengths[s] keys of its cache row."""
    del block_k, interpret, num_splits
    s, q_heads, d = q.shape
    kv_heads, t = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    dtype = compute_dtype(q, k_cache)
    k, v = _rows(k_cache, slots, s), _rows(v_cache, slots, s)
    qg = q.reshape(s, kv_heads, q_heads // kv_heads, d).astype(dtype)
    if jax.default_backend() == "cpu":
        # K @ q^T, then transposed: XLA:CPU reads the cache faster as the dot's row-major left operand than as
        # q @ K^T's transposed right operand (`benchmarks/xla_cpu_matmul.py --suites attention` measures it); the
        # barrier keeps XLA from folding the transpose back into the dot.
        logits = lax.dot_general(k.astype(dtype), qg, (((3,), (3,)), ((0, 1), (0, 1))),
                                 preferred_element_type=jnp.float32, precision=precision(dtype))
        logits = jnp.swapaxes(lax.optimization_barrier(logits), 2, 3) * scale
    else:
        logits = jnp.einsum("skgd,sktd->skgt", qg, k.astype(dtype), preferred_element_type=jnp.float32,
                            precision=precision(dtype)) * scale
    vs = None
    if k_scale is not None:
        logits = logits * _rows(k_scale, slots, s)[:, :, None, :]
        vs = _rows(v_scale, slots, s)[:, :, None, :]
    mask = (jnp.arange(t)[None, :] < lengths[:, None])[:, None, None, :]
    o = _attend(logits, mask, v, "skgt,sktd->skgd", vs, dtype)
    return o.reshape(s, q_heads, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_k", "interpret"))
def prefill_attention(q, k_cache, v_cache, starts, q_lengths, *, sm_scale=None, block_q=None,
                      block_k=None, interpret=False, slots=None, k_scale=None, v_scale=None):
    """[B, Tq, q_heads, D] causal attention of new tokens at starts[b] + i over their cache row.

    Rows i >= q_lengths[b] are padding and come out as zeros.
    """
    del block_q, block_k, interpret
    b, tq, q_heads, d = q.shape
    kv_heads, t = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    dtype = compute_dtype(q, k_cache)
    k, v = _rows(k_cache, slots, b), _rows(v_cache, slots, b)
    qg = q.reshape(b, tq, kv_heads, q_heads // kv_heads, d).astype(dtype)
    logits = jnp.einsum("bqkgd,bktd->bkgqt", qg, k.astype(dtype), preferred_element_type=jnp.float32,
                        precision=precision(dtype)) * scale
    vs = None
    if k_scale is not None:
        logits = logits * _rows(k_scale, slots, b)[:, :, None, None, :]
        vs = _rows(v_scale, slots, b)[:, :, None, None, :]
    row = jnp.arange(tq)[None, :]
    pos = starts[:, None] + row                                                 # [B, Tq]
    mask = ((jnp.arange(t)[None, None, :] <= pos[:, :, None])
            & (row < q_lengths[:, None])[:, :, None])                           # [B, Tq, T]
    o = _attend(logits, mask[:, None, None], v, "bkgqt,bktd->bkgqd", vs, dtype)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, tq, q_heads, d).astype(q.dtype)
