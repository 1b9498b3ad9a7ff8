"""The K/V block steps both attention kernels are built from: read a cache block, attend to it, normalize.

Cache layout: the Triton backend has no scalar prefetch, so a kernel gets the whole [S_cache, T_pad, Dp] cache
of its kv head as one block (`cache_operands`) and picks row `slots[s]` with a dynamic index read from a
small int32 input. Triton needs every tensor dimension to be a power of two: head dims 80 and 96 are padded to
128, q in the wrapper (small), K/V not at all: their BlockSpec is wider than the array and the padded columns
are masked at load (`load_block`), as are rows past a sequence's length.

A quantized cache (int8 / float8 values + float32 scales per token and kv head, `k_scale`/`v_scale`
[S, kv_heads, T]) is read as stored: each block is converted to q's dtype in registers, the key scales
multiply the logits' columns and the value scales P's columns (`attend_block`), so a kernel moves about half
the bytes of a 16-bit cache and never writes a dequantized copy.

Online softmax in float32, in log2 units (exp2 is the GPU's native exponential): the logits are scaled by
`softmax_scale_log2`, and the carry is (accumulator, running max, running sum) from `init_carry`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.reference import MASK_VALUE, precision
from pallas_kernels.tuning import plgpu

LOG2E = math.log2(math.e)


def softmax_scale_log2(sm_scale: float | None, head_dim: int) -> float:
    """The logits' scale in log2 units: sm_scale (default 1 / sqrt(head_dim)) times log2(e)."""
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    return scale * LOG2E


def cache_operands(k_cache, v_cache, k_scale, v_scale, t_pad: int, dp: int, index_map):
    """The cache arrays a kernel reads and their BlockSpecs: the whole [S_cache, T_pad, Dp] of one kv head
    (index_map picks the head), plus the matching [S_cache, T_pad] scale rows of a quantized cache."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    s_cache, kv_heads, t, _ = k_cache.shape
    if k_scale is not None and (k_scale.shape != (s_cache, kv_heads, t) or v_scale.shape != k_scale.shape):
        raise ValueError(f"scales must be [S, kv_heads, T] = {(s_cache, kv_heads, t)}, got {k_scale.shape}, "
                         f"{v_scale.shape}")
    tile = pl.BlockSpec((s_cache, None, t_pad, dp), index_map)
    if k_scale is None:
        return (k_cache, v_cache), (tile, tile)
    row = pl.BlockSpec((s_cache, None, t_pad), lambda *ids: index_map(*ids)[:3])
    return (k_cache, v_cache, k_scale, v_scale), (tile, tile, row, row)


def load_kv(refs, slot, start, size: int, row_ok, head_dim: int, dtype):
    """The K and V blocks [size, Dp] in `dtype`, with their scales [size] when refs holds scale refs too.

    refs = (k_ref, v_ref) or (k_ref, v_ref, k_scale_ref, v_scale_ref); returns (k, v, k_scale, v_scale),
    the scales None for a cache that is not quantized.
    """
    k, v = (load_block(r, slot, start, size, row_ok, head_dim).astype(dtype) for r in refs[:2])
    scales = [load_block(r, slot, start, size, row_ok, None) for r in refs[2:]] or [None, None]
    return k, v, *scales


def load_block(ref, slot, start, size: int, row_ok, head_dim: int | None):
    """ref[slot, start:start+size, :], reading rows where row_ok is False and padded columns as 0.

    Masked loads keep the GPU inside the real array and turn whatever lies past a row's length
    (stale cache, interpret-mode NaN padding) into zeros, so 0 * garbage never reaches P @ V.
    head_dim None: ref is a [S, T] row of scales and the block is [size].
    """
    if head_dim is None:
        idx, mask = (slot, pl.ds(start, size)), row_ok
    else:
        idx, mask = _tile_index_and_mask(ref, slot, start, size, row_ok, head_dim)
    if mask is None:
        return ref[idx]
    if plgpu is None:  # interpret-only fallback: the interpreter pads arrays, so the read is in bounds
        return jnp.where(mask, ref[idx], 0)
    return plgpu.load(ref.at[idx], mask=mask, other=0.0)


def _tile_index_and_mask(ref, slot, start, size: int, row_ok, head_dim: int):
    """Index of a [size, Dp] K/V tile and its load mask (rows past the length, padded head columns), or None."""
    idx = (slot, pl.ds(start, size), slice(None))
    dp = ref.shape[-1]
    mask = None
    if row_ok is not None:
        mask = jnp.broadcast_to(row_ok[:, None], (size, dp))
    if head_dim != dp:
        col_ok = jnp.broadcast_to((jnp.arange(dp) < head_dim)[None, :], (size, dp))
        mask = col_ok if mask is None else mask & col_ok
    return idx, mask


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b.T accumulated in float32 (lax.dot_general: stable across JAX versions, unlike pl.dot)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision(a.dtype),
                           preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision(a.dtype),
                           preferred_element_type=jnp.float32)


def init_carry(rows: int, dp: int):
    """Online-softmax state: float32 accumulator, running max (log2 units) and running sum."""
    return (jnp.zeros((rows, dp), jnp.float32),
            jnp.full((rows,), -float(np.finfo(np.float32).max), jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def attend_block(q, k, v, mask, carry, scale_log2: float, k_scale=None, v_scale=None):
    """One flash-attention step of q [rows, D] over a K/V block [bk, D]; mask [rows, bk] or None.

    Every processed block holds at least one visible key for each real row (blocks are walked from
    key 0 and stop at the last visible one), so the running max is finite after the first step and
    masked logits contribute exp2(MASK - max) == 0. k_scale, v_scale [bk]: a quantized block's scales.
    """
    acc, m, l = carry
    s = dot_nt(q, k) * scale_log2
    if k_scale is not None:
        s = s * k_scale[None, :]
    if mask is not None:
        s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + p.sum(axis=1)
    pv = p if v_scale is None else p * v_scale[None, :]
    acc = acc * alpha[:, None] + dot_nn(pv.astype(v.dtype), v)
    return acc, m_new, l


def normalize(acc, l):
    """acc / l per row, exact zeros where nothing was visible (inactive slot, padding)."""
    return jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
