"""Causal flash-attention prefill over one layer of the slotted KV cache, in Triton, for GPUs Pallas cannot use.

The same algorithm as `prefill_attention.py` (read its docstring): one program per (sequence b, kv head h,
block of BLOCK_Q new tokens), GQA folded into the rows (row r = token r // Gp, head r % Gp), keys walked from 0
up to the last valid row's position, padding rows (token >= q_lengths[b]) written as zeros. One loop with
masked loads and a causal mask on every block (the Pallas kernel skips the mask below the diagonal).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.blocks import prefill_inputs, softmax_scale_log2
from pallas_kernels.triton_blocks import NEG_MAX, Launch, attend_block, load_kv


@triton.jit
def prefill_kernel(
    slots_ptr,      # int32 [B]: cache row of each sequence
    starts_ptr,     # int32 [B]: position of its first new token
    q_lengths_ptr,  # int32 [B]: its new tokens
    q_ptr,          # [B, kv_heads, n_q * BLOCK_Q * GP, DP]: token-major rows per kv head
    k_ptr,          # [S_cache, kv_heads, T, D]
    v_ptr,          # [S_cache, kv_heads, T, D]
    ks_ptr,         # float32 [S_cache, kv_heads, T] (a 1-element dummy when not QUANTIZED)
    vs_ptr,         # float32 [S_cache, kv_heads, T] (likewise)
    o_ptr,          # like q_ptr, in the output dtype
    scale_log2: tl.constexpr,
    KV_HEADS: tl.constexpr,
    SEQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    N_ROWS: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    jq = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    start = tl.load(starts_ptr + b)
    q_len = tl.load(q_lengths_ptr + b)
    ROWS: tl.constexpr = BLOCK_Q * GP
    q_lo = jq * BLOCK_Q
    q_hi = tl.minimum(q_lo + BLOCK_Q, q_len)
    kv_end = tl.where(q_hi > q_lo, start + q_hi, 0)  # keys the last valid row sees
    n_blocks = tl.cdiv(kv_end, BLOCK_K)

    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, DP)
    token = q_lo + rows // GP
    pos = start + token
    q_rows = ((b * KV_HEADS + h) * N_ROWS + jq * ROWS + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * DP + cols[None, :])
    scale_row = (slot * KV_HEADS + h) * SEQ
    tile = scale_row * HEAD_DIM
    acc = tl.zeros([ROWS, DP], tl.float32)
    m = tl.full([ROWS], NEG_MAX, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    for i in range(n_blocks):
        keys = i * BLOCK_K + tl.arange(0, BLOCK_K)
        key_ok = keys < kv_end
        k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, tile, scale_row, keys, key_ok, cols,
                                         HEAD_DIM, QUANTIZED)
        visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        acc, m, l = attend_block(q, k, v, visible, acc, m, l, k_scale, v_scale, scale_log2, QUANTIZED)

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    o = tl.where(((token < q_len) & (l > 0))[:, None], o, 0.0)
    tl.store(o_ptr + q_rows[:, None] * DP + cols[None, :], o.to(o_ptr.dtype.element_ty))


def plan_prefill(q, k_cache, v_cache, starts, q_lengths, *, sm_scale=None, block_q=None, block_k=None,
                 slots=None, k_scale=None, v_scale=None, target=None) -> Launch:
    """The launch of `prefill_kernel` for prefill_attention's arguments (see `prefill_attention.prefill_attention`).

    target: a `tuning` target string or None for the default device (picks the block preset).
    """
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    b, tq, q_heads, d = q.shape
    kv_heads, t = k_cache.shape[1:3]
    g = q_heads // kv_heads
    qg, slots, starts, q_lengths, launch = prefill_inputs(q, k_cache, v_cache, starts, q_lengths, slots, block_q,
                                                          block_k, target)
    gp, dp, n_rows = launch["group"], qg.shape[3], qg.shape[2]
    quantized = k_scale is not None
    if not quantized:
        k_scale = v_scale = jnp.zeros((1,), jnp.float32)

    def finish(outs):
        (o,) = outs
        o = o.reshape(b, kv_heads, -1, gp, dp)[:, :, :tq, :g, :d]
        return o.transpose(0, 2, 1, 3, 4).reshape(b, tq, q_heads, d)

    return Launch(
        kernel=prefill_kernel,
        args=(slots, starts, q_lengths, qg, k_cache, v_cache, k_scale.astype(jnp.float32),
              v_scale.astype(jnp.float32)),
        out_shape=(jax.ShapeDtypeStruct(qg.shape, q.dtype),),
        grid=(b, kv_heads, n_rows // (launch["block_q"] * gp)),
        num_warps=launch["num_warps"],
        num_stages=launch["num_stages"],
        meta=dict(scale_log2=softmax_scale_log2(sm_scale, d), KV_HEADS=kv_heads, SEQ=t, HEAD_DIM=d, GP=gp, DP=dp,
                  BLOCK_Q=launch["block_q"], BLOCK_K=launch["block_k"], N_ROWS=n_rows, QUANTIZED=quantized),
        finish=finish,
    )
