"""The K/V block steps both attention kernels are built from: read a cache block, attend to it, normalize; and the
inputs both kernel families (Pallas here, Triton in `triton_*.py`) start from (`decode_inputs`, `prefill_inputs`).

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

from pallas_kernels import tuning
from pallas_kernels.reference import MASK_VALUE, compute_dtype, precision
from pallas_kernels.tuning import plgpu

LOG2E = math.log2(math.e)


def softmax_scale_log2(sm_scale: float | None, head_dim: int) -> float:
    """The logits' scale in log2 units: sm_scale (default 1 / sqrt(head_dim)) times log2(e)."""
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    return scale * LOG2E


def decode_inputs(q, k_cache, v_cache, lengths, slots, block_k: int | None, num_splits: int | None, target):
    """What a decode kernel (Pallas or Triton) starts from: q as [S, kv_heads, Gp, Dp] tiles in the compute dtype,
    the slots and lengths clamped so a bad value can never make the GPU read outside the cache, and the launch
    choice {block_k, num_splits, num_warps, num_stages} for `target` (a tuning target, or None: the default device).
    Gp >= 16: the GPU dot's minimum rows."""
    s, q_heads, d = q.shape
    s_cache, kv_heads, t, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape or q_heads % kv_heads:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    g = q_heads // kv_heads
    gp, dp = max(16, tuning.next_pow2(g)), tuning.padded_head_dim(d)
    cfg = tuning.block_sizes("decode", d, k_cache.dtype, target)
    bk = tuning.next_pow2(block_k or cfg["block_k"])
    bk = max(16, min(bk, tuning.next_pow2(t)))
    n_blocks = pl.cdiv(t, bk)
    splits, per_split = tuning.split_plan(n_blocks, tuning.num_cores(target), num_splits)

    slots = jnp.arange(s) if slots is None else slots
    slots = jnp.clip(slots.astype(jnp.int32), 0, s_cache - 1)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, t)
    qg = q.astype(compute_dtype(q, k_cache)).reshape(s, kv_heads, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, dp - d)))
    launch = dict(block_k=bk, num_splits=splits, blocks_per_split=per_split, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    return qg, slots, lengths, launch


def prefill_inputs(q, k_cache, v_cache, starts, q_lengths, slots, block_q: int | None, block_k: int | None, target):
    """What a prefill kernel (Pallas or Triton) starts from: q as token-major rows [B, kv_heads, n_q * block_q * Gp,
    Dp] (row r = token r // Gp, head r % Gp) in the compute dtype, slots / starts / q_lengths clamped inside the
    cache, and the launch choice {block_q, block_k, group, num_warps, num_stages} for `target`. block_q counts
    tokens (>= 16 rows for the GPU dot); both block sizes round up to powers of 2."""
    b, tq, q_heads, d = q.shape
    s_cache, kv_heads, t, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape or q_heads % kv_heads:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    g = q_heads // kv_heads
    gp, dp = tuning.next_pow2(g), tuning.padded_head_dim(d)
    cfg = tuning.block_sizes("prefill", d, k_cache.dtype, target)
    bq = tuning.next_pow2(block_q or max(1, cfg["block_m"] // gp))
    bq = max(min(bq, tuning.next_pow2(tq)), pl.cdiv(16, gp))
    bk = tuning.next_pow2(block_k or cfg["block_k"])
    bk = max(16, min(bk, tuning.next_pow2(t)))
    n_q = pl.cdiv(tq, bq)

    slots = jnp.arange(b) if slots is None else slots
    slots = jnp.clip(slots.astype(jnp.int32), 0, s_cache - 1)
    starts = jnp.clip(starts.astype(jnp.int32), 0, t)
    q_lengths = jnp.clip(q_lengths.astype(jnp.int32), 0, jnp.minimum(tq, t - starts))
    qg = q.astype(compute_dtype(q, k_cache)).reshape(b, tq, kv_heads, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, n_q * bq - tq), (0, 0), (0, gp - g), (0, dp - d)))
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, n_q * bq * gp, dp)
    launch = dict(block_q=bq, block_k=bk, group=gp, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return qg, slots, starts, q_lengths, launch


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
