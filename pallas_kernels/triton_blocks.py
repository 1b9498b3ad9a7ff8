"""The block step of the Triton attention kernels, and what a launch of one is: `Launch`.

Why Triton source beside the Pallas kernels, not Pallas lowered to Triton: the Pallas Triton backend emits TTIR
for jaxlib's own Triton build (a different version from `pip install triton`, and deprecated since JAX 0.11), and
only a Python `@triton.jit` function runs in Triton's interpreter, which is what the CPU tests check numerics
with. So the algorithm is written twice (this file mirrors `blocks.py` step for step: masked K/V loads converted to
q's dtype, key scales on the logits' columns, value scales on P's columns, float32 online softmax in log2 units)
and the single source of truth is the numerics: both are tested against `reference.py`, with the same presets
(`tuning.py`).

Cache layout as the Pallas kernels read it: one layer, [S_cache, kv_heads, T, D], contiguous (what JAX hands
jax-triton), row `slots[s]` picked in the kernel. Offsets into it are int64: 64 slots x 8 heads x 32768 x 128
elements is already 2**31.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import triton
import triton.language as tl

from pallas_kernels.reference import MASK_VALUE

MASK = tl.constexpr(MASK_VALUE)
NEG_MAX = tl.constexpr(-3.4028234663852886e38)  # running-max start: finite, so exp2(m - m_new) is never NaN


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: the `@triton.jit` function, its array inputs in parameter order (the outputs follow
    them, then the `meta` constexprs), the outputs' shapes, the grid, and `finish`, which turns the outputs into
    the attention result. jax-triton, the interpreter and the offline compiler all start from this."""
    kernel: Any
    args: tuple[jax.Array, ...]
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    meta: dict
    finish: Callable


@triton.jit
def load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, tile, scale_row, keys, key_ok, cols,
            HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr):
    """The K and V tiles [keys, Dp] (rows past the visible keys and padded columns read as 0) and, for a
    quantized cache, their scales [keys] (1 otherwise). tile/scale_row: int64 offsets of key 0 of this row+head."""
    offs = tile + keys[:, None] * HEAD_DIM + cols[None, :]
    mask = key_ok[:, None] & (cols[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + offs, mask=mask, other=0)
    v = tl.load(v_ptr + offs, mask=mask, other=0)
    if QUANTIZED:
        k_scale = tl.load(ks_ptr + scale_row + keys, mask=key_ok, other=0)
        v_scale = tl.load(vs_ptr + scale_row + keys, mask=key_ok, other=0)
    else:
        k_scale = tl.full(keys.shape, 1.0, tl.float32)
        v_scale = tl.full(keys.shape, 1.0, tl.float32)
    return k, v, k_scale, v_scale


@triton.jit
def attend_block(q, k, v, visible, acc, m, l, k_scale, v_scale, scale_log2: tl.constexpr,
                 QUANTIZED: tl.constexpr):
    """One online-softmax step of q [rows, Dp] over a K/V block [keys, Dp]; visible [rows, keys].

    Blocks are walked from key 0, so each real row sees a key in the first block and its max is finite after
    it; masked logits then add exp2(MASK - m) == 0. "ieee" keeps float32 dots exact (the sm80+ default is TF32);
    16-bit inputs ignore it.
    """
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
    if QUANTIZED:
        s = s * k_scale[None, :]
    s = tl.where(visible, s, MASK)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if QUANTIZED:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l
