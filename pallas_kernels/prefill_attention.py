"""Causal flash-attention prefill over one layer of the slotted KV cache, as a Pallas (Triton) kernel.

One program per (sequence b, kv head h, block of block_q new tokens). GQA is folded into the rows:
the tile holds block_q tokens x Gp heads (G padded to a power of two), row r = token r // Gp, head
r % Gp, so each K/V block is loaded once for all heads sharing it. Token i of sequence b sits at
absolute position starts[b] + i and sees keys 0..that position of cache row slots[b], which already
holds the cached prefix and the new tokens' K/V.

Blocks are walked from key 0: blocks entirely at or below the first query row's position run with no
mask; the ones crossing the diagonal (or the end of the sequence) are masked; blocks above the last
valid row's position and query blocks past q_lengths[b] are skipped, never loaded. Padding rows
(i >= q_lengths[b]) come out as zeros. Cache layout, head-dim padding, the block step and quantized
caches (k_scale / v_scale) are shared with decode_attention: see `blocks`.
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
    init_carry,
    load_kv,
    normalize,
    prefill_inputs,
    softmax_scale_log2,
)


def _prefill_kernel(
    slots_ref,      # int32 [1]: the cache row of this sequence
    starts_ref,     # int32 [1]: position of its first new token
    q_lengths_ref,  # int32 [1]: its number of new tokens
    q_ref,          # [block_q * group, Dp]: token-major rows (token r // group, head r % group)
    *refs,          # k_ref, v_ref [S_cache, T_pad, Dp] of this kv head (+ k/v scale refs [S_cache, T_pad]),
                    # then o_ref [block_q * group, Dp]
    scale_log2: float,
    block_q: int,
    group: int,
    block_k: int,
    head_dim: int,
):
    """Causal attention of query block program_id(2) over the keys its valid rows see; padding rows get zeros."""
    *kv_refs, o_ref = refs
    slot, start, q_len = slots_ref[0], starts_ref[0], q_lengths_ref[0]
    rows, dp = q_ref.shape
    q_lo = pl.program_id(2) * block_q
    q_hi = jnp.minimum(q_lo + block_q, q_len)
    kv_end = jnp.where(q_hi > q_lo, start + q_hi, 0)           # keys the last valid row sees
    n_blocks = pl.cdiv(kv_end, block_k)
    n_full = jnp.minimum((start + q_lo + 1) // block_k, n_blocks)  # visible to every row
    token = q_lo + lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(group))
    pos = start + token
    q = q_ref[...]

    def body(masked: bool):
        def step(i, carry):
            k_start = pl.multiple_of(i * block_k, block_k)
            key = k_start + jnp.arange(block_k, dtype=jnp.int32)
            row_ok = key < kv_end if masked else None
            k, v, k_scale, v_scale = load_kv(kv_refs, slot, k_start, block_k, row_ok, head_dim, q.dtype)
            mask = ((key[None, :] <= pos[:, None]) & row_ok[None, :]) if masked else None
            return attend_block(q, k, v, mask, carry, scale_log2, k_scale, v_scale)
        return step

    carry = lax.fori_loop(0, n_full, body(False), init_carry(rows, dp))
    acc, _, l = lax.fori_loop(n_full, n_blocks, body(True), carry)
    o = normalize(acc, l)
    o_ref[...] = jnp.where((token < q_len)[:, None], o, 0.0).astype(o_ref.dtype)


def _prefill_call(
    slots,      # int32 [B], in [0, S_cache)
    starts,     # int32 [B], in [0, T]
    q_lengths,  # int32 [B], in [0, min(Tq, T - starts)]
    qg,         # [B, kv_heads, n_q * block_q * group, Dp]: token-major rows per kv head
    k_cache,    # [S_cache, kv_heads, T, D]
    v_cache,    # [S_cache, kv_heads, T, D]
    k_scale,    # float32 [S_cache, kv_heads, T], or None
    v_scale,    # float32 [S_cache, kv_heads, T], or None
    *,
    out_dtype,
    scale_log2: float,
    block_q: int,
    group: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    """[B, kv_heads, n_q * block_q * group, Dp] in out_dtype, from grid (B, kv_heads, n_q query blocks)."""
    b, kv_heads, n_rows, dp = qg.shape
    t_pad = pl.cdiv(k_cache.shape[2], block_k) * block_k
    cache, cache_specs = cache_operands(k_cache, v_cache, k_scale, v_scale, t_pad, dp,
                                        lambda i, h, j: (0, h, 0, 0))
    row_spec = pl.BlockSpec((1,), lambda i, h, j: (i,))
    tile_spec = pl.BlockSpec((None, None, block_q * group, dp), lambda i, h, j: (i, h, j, 0))
    kernel = functools.partial(_prefill_kernel, scale_log2=scale_log2, block_q=block_q, group=group,
                               block_k=block_k, head_dim=k_cache.shape[3])
    return pl.pallas_call(
        kernel,
        grid=(b, kv_heads, n_rows // (block_q * group)),
        in_specs=[row_spec, row_spec, row_spec, tile_spec, *cache_specs],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, out_dtype),
        compiler_params=tuning.compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="pocketjax_prefill_attention",
    )(slots, starts, q_lengths, qg, *cache)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_k", "interpret"))
def prefill_attention(q, k_cache, v_cache, starts, q_lengths, *, sm_scale=None, block_q=None,
                      block_k=None, interpret=False, slots=None, k_scale=None, v_scale=None):
    """[B, Tq, q_heads, D] causal attention of new tokens at positions starts[b] + i.

    q [B, Tq, q_heads, D]; k_cache, v_cache [S_cache, kv_heads, T, D] holding prefix + new K/V in
    row slots[b] (None -> b); starts, q_lengths int32 [B]. Rows i >= q_lengths[b] are zeros.
    k_scale, v_scale float32 [S_cache, kv_heads, T]: a quantized cache (see decode_attention).
    block_q counts tokens (rows = block_q * next_pow2(G)); both block sizes round up to powers of 2.
    """
    b, tq, q_heads, d = q.shape
    kv_heads = k_cache.shape[1]
    g = q_heads // kv_heads
    qg, slots, starts, q_lengths, launch = prefill_inputs(q, k_cache, v_cache, starts, q_lengths, slots, block_q,
                                                          block_k, "cpu" if interpret else None)
    o = _prefill_call(slots, starts, q_lengths, qg, k_cache, v_cache, k_scale, v_scale, out_dtype=q.dtype,
                      scale_log2=softmax_scale_log2(sm_scale, d), interpret=interpret, **launch)
    gp, dp = launch["group"], qg.shape[-1]
    o = o.reshape(b, kv_heads, -1, gp, dp)[:, :, :tq, :g, :d]
    return o.transpose(0, 2, 1, 3, 4).reshape(b, tq, q_heads, d)
