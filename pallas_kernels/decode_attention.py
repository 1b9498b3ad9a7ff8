"""Flash-decoding GQA attention over one layer of the slotted KV cache, as a Pallas (Triton) kernel.

One program per (query row s, kv head h, split j) handles every query head of kv head h at once: the
G = q_heads / kv_heads heads are rows of one [Gp, D] tile (padded to >= 16 rows for the GPU dot), so
each K/V block is read from memory once per kv head. The program reads its cache row `slots[s]` and
length from small int32 inputs (cache layout, head-dim padding and quantized caches: see `blocks`), and
loops only over the blocks below the length: blocks past it are never loaded, and only the last, partial
block pays for a mask.

Split-K (flash-decoding): with few slots and long contexts, S * kv_heads programs cannot fill a GPU,
so the keys are cut into splits of a FIXED number of key blocks (`tuning.split_plan`): split j covers
blocks [j * per, (j + 1) * per) whatever the row count or the row's length, so a row's reduction tree, and
its bits, never depend on the batch (issue 43; the split count used to follow the row count). Each split
writes an unnormalized float32 partial with its running max and sum; `_combine` merges them in split order
(splits past a row's length contribute exact zeros). One split (the CPU default) normalizes in the kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels.blocks import (
    attend_block,
    cache_operands,
    decode_inputs,
    init_carry,
    load_kv,
    normalize,
    softmax_scale_log2,
)


def _decode_kernel(
    slots_ref,    # int32 [1]: the cache row of this query row
    lengths_ref,  # int32 [1]: its number of visible keys
    q_ref,        # [Gp, Dp]: the query heads of this kv head
    *refs,        # k_ref, v_ref [S_cache, T_pad, Dp] of this kv head (+ k/v scale refs [S_cache, T_pad]),
                  # then o_ref [Gp, Dp] and, when split, m_ref, l_ref [Gp]
    scale_log2: float,
    block_k: int,
    num_splits: int,
    blocks_per_split: int,
    head_dim: int,
    quantized: bool,
):
    """Split program_id(2) of the keys below the length; split: o_ref gets the unnormalized float32 partial."""
    n_kv = 4 if quantized else 2
    kv_refs, (o_ref, *stat_refs) = refs[:n_kv], refs[n_kv:]
    slot, length = slots_ref[0], lengths_ref[0]
    rows, dp = q_ref.shape
    n_blocks = pl.cdiv(length, block_k)
    first = pl.program_id(2) * blocks_per_split  # fixed shares of the key positions (module docstring)
    last = jnp.minimum(first + blocks_per_split, n_blocks)
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


def _combine(o, m, l):
    """Merge split partials o [.., splits, Gp, Dp], m/l [.., splits, Gp] into normalized [.., Gp, Dp], summing the
    splits in split order (elementwise adds: XLA's reduce would pick its order from the shapes)."""
    w = jnp.exp2(m - m.max(axis=-2, keepdims=True))  # a max is exact in any order
    l_total, acc = l[..., 0, :] * w[..., 0, :], o[..., 0, :, :] * w[..., 0, :, None]
    for j in range(1, m.shape[-2]):
        l_total = l_total + l[..., j, :] * w[..., j, :]
        acc = acc + o[..., j, :, :] * w[..., j, :, None]
    return jnp.where(l_total[..., None] > 0, acc / jnp.where(l_total > 0, l_total, 1.0)[..., None], 0.0)


def _decode_call(
    slots,    # int32 [S], in [0, S_cache)
    lengths,  # int32 [S], in [0, T]
    qg,       # [S, kv_heads, Gp, Dp]
    k_cache,  # [S_cache, kv_heads, T, D]
    v_cache,  # [S_cache, kv_heads, T, D]
    k_scale,  # float32 [S_cache, kv_heads, T], or None
    v_scale,  # float32 [S_cache, kv_heads, T], or None
    *,
    out_dtype,
    scale_log2: float,
    block_k: int,
    num_splits: int,
    blocks_per_split: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """[S, kv_heads, Gp, Dp] from grid (S, kv_heads, num_splits): out_dtype, or float32 when splits are combined."""
    s, kv_heads, gp, dp = qg.shape
    t_pad = pl.cdiv(k_cache.shape[2], block_k) * block_k
    cache, cache_specs = cache_operands(k_cache, v_cache, k_scale, v_scale, t_pad, dp,
                                        lambda i, h, j: (0, h, 0, 0))
    row_spec = pl.BlockSpec((1,), lambda i, h, j: (i,))
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((s, kv_heads, gp, dp), out_dtype)
        out_specs = pl.BlockSpec((None, None, gp, dp), lambda i, h, j: (i, h, 0, 0))
    else:
        out_shape = (jax.ShapeDtypeStruct((s, kv_heads, num_splits, gp, dp), jnp.float32),  # o
                     jax.ShapeDtypeStruct((s, kv_heads, num_splits, gp), jnp.float32),      # m
                     jax.ShapeDtypeStruct((s, kv_heads, num_splits, gp), jnp.float32))      # l
        out_specs = (pl.BlockSpec((None, None, None, gp, dp), lambda i, h, j: (i, h, j, 0, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)))
    kernel = functools.partial(_decode_kernel, scale_log2=scale_log2, block_k=block_k, num_splits=num_splits,
                               blocks_per_split=blocks_per_split, head_dim=k_cache.shape[3],
                               quantized=k_scale is not None)
    out = pl.pallas_call(
        kernel,
        grid=(s, kv_heads, num_splits),
        in_specs=[row_spec, row_spec,
                  pl.BlockSpec((None, None, gp, dp), lambda i, h, j: (i, h, 0, 0)), *cache_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=tuning.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="pocketjax_decode_attention",
    )(slots, lengths, qg, *cache)
    return out if num_splits == 1 else _combine(*out)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret", "num_splits"))
def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale=None, block_k=None, interpret=False,
                     slots=None, num_splits=None, k_scale=None, v_scale=None):
    """[S, q_heads, D] attention of query row s over keys 0..lengths[s]-1 of cache row slots[s].

    q [S, q_heads, D]; k_cache, v_cache [S_cache, kv_heads, T, D]; lengths int32 [S] (0 -> zeros);
    slots int32 [S] or None (row s). num_splits overrides the split-K heuristic. k_scale, v_scale
    float32 [S_cache, kv_heads, T]: the cache is quantized (int8 / float8 values times these scales).
    """
    s, q_heads, d = q.shape
    g = q_heads // k_cache.shape[1]
    qg, slots, lengths, launch = decode_inputs(q, k_cache, v_cache, lengths, slots, block_k, num_splits,
                                               "cpu" if interpret else None)
    o = _decode_call(slots, lengths, qg, k_cache, v_cache, k_scale, v_scale, out_dtype=q.dtype,
                     scale_log2=softmax_scale_log2(sm_scale, d), interpret=interpret, **launch)
    return o[:, :, :g, :d].reshape(s, q_heads, d).astype(q.dtype)
