"""Causal flash-attention prefill over one layer of the slotted KV cache, as a Pallas (Triton) kernel.

One program per (sequence b, kv head h, block of block_q new tokens). GQA is folded into the rows:
the tile holds block_q tokens x Gp heads (G padded to a power of two), row r = token r // Gp, head
r % Gp, so each K/V block is loaded once for all heads sharing it. Token i of sequence b sits at
absolute position starts[b] + i and sees keys 0..that position of cache row slots[b], which already
holds the cached prefix and the new tokens' K/V.

Blocks are walked from key 0: blocks entirely at or below the first query row's position run with no
mask; the ones crossing the diagonal (or the end of the sequence) are masked; blocks above the last
valid row's position and query blocks past q_lengths[b] are skipped, never loaded. Padding rows
(i >= q_lengths[b]) come out as zeros. Layout rules (power-of-two dims, padded head dims, whole cache
as one block indexed by the slot) are those of decode_attention, whose block step and quantized-cache
handling (k_scale / v_scale) this file reuses.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels.decode_attention import attend_block, cache_operands, init_carry, load_kv, normalize
from pallas_kernels.reference import compute_dtype

_LOG2E = math.log2(math.e)


def _prefill_kernel(slots_ref, starts_ref, q_lengths_ref, q_ref, *refs, scale_log2: float, block_q: int,
                    group: int, block_k: int, head_dim: int):
    """q_ref, o_ref [block_q * group, Dp] token-major rows; refs = k_ref, v_ref [S_cache, T_pad, Dp]
    (+ k/v scale refs [S_cache, T_pad] for a quantized cache), then o_ref."""
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
    s_cache, kv_heads, t, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape or q_heads % kv_heads:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    g = q_heads // kv_heads
    gp, dp = tuning.next_pow2(g), tuning.padded_head_dim(d)
    cfg = tuning.block_sizes("prefill", d, k_cache.dtype, "cpu" if interpret else None)
    bq = tuning.next_pow2(block_q or max(1, cfg["block_m"] // gp))
    bq = max(min(bq, tuning.next_pow2(tq)), pl.cdiv(16, gp))  # >= 16 rows for the GPU dot
    bk = tuning.next_pow2(block_k or cfg["block_k"])
    bk = max(16, min(bk, tuning.next_pow2(t)))
    n_q = pl.cdiv(tq, bq)
    t_pad = pl.cdiv(t, bk) * bk
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale

    # Clamped so bad rows, starts or lengths can never make the GPU read outside the cache.
    slots = jnp.arange(b) if slots is None else slots
    slots = jnp.clip(slots.astype(jnp.int32), 0, s_cache - 1)
    starts = jnp.clip(starts.astype(jnp.int32), 0, t)
    q_lengths = jnp.clip(q_lengths.astype(jnp.int32), 0, jnp.minimum(tq, t - starts))
    qg = q.astype(compute_dtype(q, k_cache)).reshape(b, tq, kv_heads, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, n_q * bq - tq), (0, 0), (0, gp - g), (0, dp - d)))
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, n_q * bq * gp, dp)

    row_spec = pl.BlockSpec((1,), lambda i, h, j: (i,))
    cache, cache_specs = cache_operands(k_cache, v_cache, k_scale, v_scale, t_pad, dp,
                                        lambda i, h, j: (0, h, 0, 0))
    tile_spec = pl.BlockSpec((None, None, bq * gp, dp), lambda i, h, j: (i, h, j, 0))
    kernel = functools.partial(_prefill_kernel, scale_log2=scale * _LOG2E, block_q=bq, group=gp,
                               block_k=bk, head_dim=d)
    o = pl.pallas_call(
        kernel,
        grid=(b, kv_heads, n_q),
        in_specs=[row_spec, row_spec, row_spec, tile_spec, *cache_specs],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=tuning.compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="pocketjax_prefill_attention",
    )(slots, starts, q_lengths, qg, *cache)
    o = o.reshape(b, kv_heads, n_q * bq, gp, dp)[:, :, :tq, :g, :d]
    return o.transpose(0, 2, 1, 3, 4).reshape(b, tq, q_heads, d)
