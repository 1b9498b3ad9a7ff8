"""Flash-decoding GQA attention over one layer of the slotted KV cache, as a Pallas (Triton) kernel.

One program per (query row s, kv head h, split j) handles every query head of kv head h at once: the
G = q_heads / kv_heads heads are rows of one [Gp, D] tile (padded to >= 16 rows for the GPU dot), so
each K/V block is read from memory once per kv head. The program reads its cache row `slots[s]` and
length from small int32 inputs (the Triton backend has no scalar prefetch, so the whole cache is one
block and the row is picked by a dynamic index), and loops only over the blocks below the length:
blocks past it are never loaded, and only the last, partial block pays for a mask.

Split-K (flash-decoding): with few slots and long contexts, S * kv_heads programs cannot fill a GPU,
so the keys of each row are cut into `num_splits` shares of its *actual* length (computed in the
kernel from lengths[s], so short rows in a long cache still spread their work). Each split writes an
unnormalized float32 partial with its running max and sum; `_combine` merges them in plain JAX.
Default split count (`num_splits_for`): enough programs for about two waves over the GPU's SMs,
rounded to a power of two, at most 64, and at least 4 key blocks per split of the cache capacity so
the partial writes and the combine stay small next to the K/V reads. One split (the CPU default)
normalizes in the kernel and skips the combine.

Head dims that are not powers of two (80, 96) are padded to the next one: q in the wrapper (small),
K/V not at all: their BlockSpec is wider than the array and the padded columns are masked at load.

A quantized cache (int8 / float8 values + float32 scales per token and kv head, `k_scale`/`v_scale`
[S, kv_heads, T]) is read as stored: each block is converted to q's dtype in registers, the key scales
multiply the logits' columns and the value scales P's columns (`attend_block`), so the kernel moves
about half the bytes of a 16-bit cache and never writes a dequantized copy.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels.reference import compute_dtype

try:  # the Triton backend is deprecated since JAX 0.11; interpret mode works without it
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)


def _precision(dtype):
    """IEEE products for float32 (Triton's default is TF32); 16-bit inputs are exact either way."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b.T accumulated in float32 (lax.dot_general: stable across JAX versions, unlike pl.dot)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a.dtype),
                           preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b accumulated in float32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a.dtype),
                           preferred_element_type=jnp.float32)


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


def load_kv(refs, slot, start, size: int, row_ok, head_dim: int, dtype):
    """The K and V blocks [size, Dp] in `dtype`, with their scales [size] when refs holds scale refs too.

    refs = (k_ref, v_ref) or (k_ref, v_ref, k_scale_ref, v_scale_ref); returns (k, v, k_scale, v_scale),
    the scales None for a cache that is not quantized.
    """
    k, v = (load_block(r, slot, start, size, row_ok, head_dim).astype(dtype) for r in refs[:2])
    scales = [load_block(r, slot, start, size, row_ok, None) for r in refs[2:]] or [None, None]
    return k, v, *scales


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


def _decode_kernel(slots_ref, lengths_ref, q_ref, *refs, scale_log2: float, block_k: int, num_splits: int,
                   head_dim: int, quantized: bool):
    """q_ref [Gp, Dp]; refs = k_ref, v_ref [S_cache, T_pad, Dp] (this kv head), then k/v scale refs
    [S_cache, T_pad] when quantized, then o_ref [Gp, Dp] and, when split, (m_ref, l_ref) [Gp]: o_ref then
    gets the unnormalized float32 partial.
    """
    n_kv = 4 if quantized else 2
    kv_refs, (o_ref, *stat_refs) = refs[:n_kv], refs[n_kv:]
    slot, length = slots_ref[0], lengths_ref[0]
    rows, dp = q_ref.shape
    n_blocks = pl.cdiv(length, block_k)
    per_split = pl.cdiv(n_blocks, num_splits)
    first = pl.program_id(2) * per_split
    last = jnp.minimum(first + per_split, n_blocks)
    split_full = jnp.clip(length // block_k, first, last)  # [first, split_full) needs no row mask
    q = q_ref[...]

    def body(masked: bool):
        def step(i, carry):
            start = pl.multiple_of(i * block_k, block_k)
            row_ok = start + jnp.arange(block_k) < length if masked else None
            k, v, k_scale, v_scale = load_kv(kv_refs, slot, start, block_k, row_ok, head_dim, q.dtype)
            mask = jnp.broadcast_to(row_ok[None, :], (rows, block_k)) if masked else None
            return attend_block(q, k, v, mask, carry, scale_log2, k_scale, v_scale)
        return step

    carry = lax.fori_loop(first, split_full, body(False), init_carry(rows, dp))
    acc, m, l = lax.fori_loop(split_full, last, body(True), carry)
    if stat_refs:
        m_ref, l_ref = stat_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        o_ref[...] = normalize(acc, l).astype(o_ref.dtype)


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


def _combine(o, m, l):
    """Merge split partials o [.., splits, Gp, Dp], m/l [.., splits, Gp] into normalized [.., Gp, Dp]."""
    w = jnp.exp2(m - m.max(axis=-2, keepdims=True))
    l_total = (l * w).sum(axis=-2)
    acc = (o * w[..., None]).sum(axis=-3)
    return jnp.where(l_total[..., None] > 0, acc / jnp.where(l_total > 0, l_total, 1.0)[..., None], 0.0)


def num_splits_for(slots: int, kv_heads: int, n_blocks: int, cores: int) -> int:
    """Split-K count: ~2 waves of programs over `cores` SMs, power of two, <= 64, >= 4 blocks each."""
    if cores <= 0:
        return 1
    want = tuning.next_pow2(pl.cdiv(2 * cores, slots * kv_heads))
    return max(1, min(want, 64, n_blocks // 4))


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret", "num_splits"))
def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale=None, block_k=None, interpret=False,
                     slots=None, num_splits=None, k_scale=None, v_scale=None):
    """[S, q_heads, D] attention of query row s over keys 0..lengths[s]-1 of cache row slots[s].

    q [S, q_heads, D]; k_cache, v_cache [S_cache, kv_heads, T, D]; lengths int32 [S] (0 -> zeros);
    slots int32 [S] or None (row s). num_splits overrides the split-K heuristic. k_scale, v_scale
    float32 [S_cache, kv_heads, T]: the cache is quantized (int8 / float8 values times these scales).
    """
    s, q_heads, d = q.shape
    s_cache, kv_heads, t, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape or q_heads % kv_heads:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    g = q_heads // kv_heads
    gp, dp = max(16, tuning.next_pow2(g)), tuning.padded_head_dim(d)
    cfg = tuning.block_sizes("decode", d, k_cache.dtype, "cpu" if interpret else None)
    bk = tuning.next_pow2(block_k or cfg["block_k"])
    bk = max(16, min(bk, tuning.next_pow2(t)))
    n_blocks = pl.cdiv(t, bk)
    cores = 0 if interpret else tuning.num_cores()
    splits = num_splits or num_splits_for(s, kv_heads, n_blocks, cores)
    splits = max(1, min(splits, n_blocks))
    t_pad = n_blocks * bk
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale

    # Clamped so a bad row index or length can never make the GPU read outside the cache.
    slots = jnp.arange(s) if slots is None else slots
    slots = jnp.clip(slots.astype(jnp.int32), 0, s_cache - 1)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, t)
    cache, specs = cache_operands(k_cache, v_cache, k_scale, v_scale, t_pad, dp, lambda i, h, j: (0, h, 0, 0))
    qg = q.astype(compute_dtype(q, k_cache)).reshape(s, kv_heads, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, dp - d)))

    row_spec = pl.BlockSpec((1,), lambda i, h, j: (i,))
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((s, kv_heads, gp, dp), q.dtype)
        out_specs = pl.BlockSpec((None, None, gp, dp), lambda i, h, j: (i, h, 0, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((s, kv_heads, splits, gp, dp), jnp.float32),
                     jax.ShapeDtypeStruct((s, kv_heads, splits, gp), jnp.float32),
                     jax.ShapeDtypeStruct((s, kv_heads, splits, gp), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, gp, dp), lambda i, h, j: (i, h, j, 0, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)))
    kernel = functools.partial(_decode_kernel, scale_log2=scale * _LOG2E, block_k=bk,
                               num_splits=splits, head_dim=d, quantized=k_scale is not None)
    out = pl.pallas_call(
        kernel,
        grid=(s, kv_heads, splits),
        in_specs=[row_spec, row_spec,
                  pl.BlockSpec((None, None, gp, dp), lambda i, h, j: (i, h, 0, 0)), *specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=tuning.compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="pocketjax_decode_attention",
    )(slots, lengths, qg, *cache)
    o = out if splits == 1 else _combine(*out)
    return o[:, :, :g, :d].reshape(s, q_heads, d).astype(q.dtype)
