"""Flash-decoding GQA attention over one layer of the slotted KV cache, in Triton, for GPUs Pallas cannot use.

The same algorithm as `decode_attention.py` (read its docstring): one program per (query row s, kv head h,
split j) holds the G query heads of kv head h as rows of one [Gp, Dp] tile (Gp >= 16: tl.dot's minimum), walks
only the key blocks below lengths[s] in its share of them, and writes an unnormalized float32 partial with its
running max and sum, merged by `decode_attention._combine` (one split merges trivially; the partial costs
S x kv_heads x Gp x Dp x 4 bytes, small next to the K/V it read). One loop with masked loads instead of the
Pallas kernel's unmasked + masked pair: a Triton load mask is a predicate, not a select over a padded read.

Compiled with official Triton for sm75 (Turing) the dots become FMA instructions (mma is emitted from sm80);
decode reads each K/V element once and does 2 x Gp flops with it, so it stays bandwidth-bound either way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.blocks import decode_inputs, softmax_scale_log2
from pallas_kernels.decode_attention import _combine
from pallas_kernels.triton_blocks import NEG_MAX, Launch, attend_block, load_kv


@triton.jit
def decode_kernel(
    slots_ptr,    # int32 [S]: cache row of each query row
    lengths_ptr,  # int32 [S]: its visible keys
    per_ptr,      # int32 [1]: key blocks per split (tuning.split_plan; read at run time: as a constexpr the fixed
                  # trip count made Triton unroll the loop, and sm75's float32 preset spilled registers)
    q_ptr,        # [S, kv_heads, Gp, Dp]
    k_ptr,        # [S_cache, kv_heads, T, D]
    v_ptr,        # [S_cache, kv_heads, T, D]
    ks_ptr,       # float32 [S_cache, kv_heads, T] (a 1-element dummy when not QUANTIZED)
    vs_ptr,       # float32 [S_cache, kv_heads, T] (likewise)
    o_ptr,        # float32 [S, kv_heads, splits, Gp, Dp]: unnormalized partials
    m_ptr,        # float32 [S, kv_heads, splits, Gp]: running max (log2 units)
    l_ptr,        # float32 [S, kv_heads, splits, Gp]: running sum
    scale_log2: tl.constexpr,
    KV_HEADS: tl.constexpr,
    SEQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GP: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    length = tl.load(lengths_ptr + s)
    n_blocks = tl.cdiv(length, BLOCK_K)
    per_split = tl.load(per_ptr)
    first = j * per_split  # fixed shares of the key positions: the bits never depend on the batch
    last = tl.minimum(first + per_split, n_blocks)

    rows = tl.arange(0, GP)
    cols = tl.arange(0, DP)
    q = tl.load(q_ptr + ((s * KV_HEADS + h) * GP + rows[:, None]) * DP + cols[None, :])
    scale_row = (slot * KV_HEADS + h) * SEQ
    tile = scale_row * HEAD_DIM
    acc = tl.zeros([GP, DP], tl.float32)
    m = tl.full([GP], NEG_MAX, tl.float32)
    l = tl.zeros([GP], tl.float32)
    for i in range(first, last):
        keys = i * BLOCK_K + tl.arange(0, BLOCK_K)
        key_ok = keys < length
        k, v, k_scale, v_scale = load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, tile, scale_row, keys, key_ok, cols,
                                         HEAD_DIM, QUANTIZED)
        visible = tl.broadcast_to(key_ok[None, :], (GP, BLOCK_K))
        acc, m, l = attend_block(q, k, v, visible, acc, m, l, k_scale, v_scale, scale_log2, QUANTIZED)

    part = (s * KV_HEADS + h) * NUM_SPLITS + j
    tl.store(o_ptr + (part * GP + rows[:, None]) * DP + cols[None, :], acc)
    tl.store(m_ptr + part * GP + rows, m)
    tl.store(l_ptr + part * GP + rows, l)


def plan_decode(q, k_cache, v_cache, lengths, *, sm_scale=None, block_k=None, slots=None, num_splits=None,
                k_scale=None, v_scale=None, target=None) -> Launch:
    """The launch of `decode_kernel` for decode_attention's arguments (see `decode_attention.decode_attention`).

    target: a `tuning` target string ("sm75", ...) or None for the default device; it picks the block preset
    and, on a GPU, the split-K count.
    """
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    s, q_heads, d = q.shape
    kv_heads, t = k_cache.shape[1:3]
    g = q_heads // kv_heads
    qg, slots, lengths, launch = decode_inputs(q, k_cache, v_cache, lengths, slots, block_k, num_splits, target)
    gp, dp, splits = qg.shape[2], qg.shape[3], launch["num_splits"]
    quantized = k_scale is not None
    if not quantized:
        k_scale = v_scale = jnp.zeros((1,), jnp.float32)
    out_dtype = q.dtype

    def finish(outs):
        o = _combine(*outs)
        return o[:, :, :g, :d].reshape(s, q_heads, d).astype(out_dtype)

    stats = jax.ShapeDtypeStruct((s, kv_heads, splits, gp), jnp.float32)
    return Launch(
        kernel=decode_kernel,
        args=(slots, lengths, jnp.full((1,), launch["blocks_per_split"], jnp.int32), qg, k_cache, v_cache,
              k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)),
        out_shape=(jax.ShapeDtypeStruct((s, kv_heads, splits, gp, dp), jnp.float32), stats, stats),
        grid=(s, kv_heads, splits),
        num_warps=launch["num_warps"],
        num_stages=launch["num_stages"],
        meta=dict(scale_log2=softmax_scale_log2(sm_scale, d), KV_HEADS=kv_heads, SEQ=t, HEAD_DIM=d, GP=gp, DP=dp,
                  BLOCK_K=launch["block_k"], NUM_SPLITS=splits, QUANTIZED=quantized),
        finish=finish,
    )
