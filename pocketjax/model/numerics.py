"""Numerics whose bits do not depend on the program they are compiled into (issue 43: batch invariance).

XLA chooses a reduction's summation order from the shapes it sees, and lets LLVM contract a * b + c into one FMA
wherever the multiply and the add share a fused loop, which varies with the program. These helpers fix both for
the jnp code around pocketjax's kernels: `fixed_sum` sums in one order for every batch, `opaque` keeps a product
from being contracted into the sum it feeds.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


# `opaque`'s 16-bit float dtypes: infinity's bits (a NaN's magnitude bits exceed them)
_INF16 = {jnp.dtype(jnp.bfloat16): 0x7F80, jnp.dtype(jnp.float16): 0x7C00}


@jax.custom_jvp
def opaque(x: jax.Array) -> jax.Array:
    """x, as a value the compiler cannot see as the product it may be: its bits OR-ed with a runtime zero (1 for a
    NaN, which stays NaN). Why: XLA:CPU lets LLVM contract a * b + c into one FMA (one rounding
    instead of two) wherever the multiply and the add land in one fused loop, and which ops share a fusion varies
    with the program (the row count, a decode fed from the host or the device): measured, RoPE's x * cos + r * sin
    was an FMA at 2 rows and not at 1, so a request's bits depended on its batch (issue 43). Wrapping a product
    that feeds a sum in `opaque` makes it round on its own in every program; an optimization barrier does not
    (XLA:CPU removes barriers before fusion). A few integer ops per element.

    The NaN test: `x != x` for float32; for 16-bit floats on the bits (magnitude above infinity's), as jaxlib
    0.11.2's LLVM aborts compiling a bf16 `x != x` fused with an fp8 conversion on an AVX512_BF16 CPU ("Cannot
    select ... X86ISD::CMPP", a Zen 5; a float32 `x != x` there compiles). Not the bits for float32 too: on that Zen 5
    an int8 decode step at 8 rows took 60 ms with them against 45 with `x != x`. The same bits either way."""
    bits_type = jnp.uint32 if jnp.dtype(x.dtype) == jnp.float32 else jnp.uint16
    bits = jax.lax.bitcast_convert_type(x, bits_type)
    nan = x != x if bits_type == jnp.uint32 else (bits & jnp.uint16(0x7FFF)) > jnp.uint16(_INF16[jnp.dtype(x.dtype)])
    return jax.lax.bitcast_convert_type(bits | nan.astype(bits_type), x.dtype)


@opaque.defjvp
def _opaque_jvp(primals, tangents):
    """The identity's derivative (bitcasts have none): training through a forward that uses `opaque` works."""
    (x,), (dx,) = primals, tangents
    return opaque(x), dx


def fixed_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """The sum over `axis` in a fixed order: a pairwise tree of elementwise adds over the axis zero-padded to a power
    of two. XLA reorders a reduce's additions by the shapes it sees (on XLA:CPU a 1024-wide row summed alone and in
    a batch of 2 gave different bits, issue 43); elementwise adds it never reassociates, so each row's sum here
    depends on that row alone. Zero padding adds exact zeros in the tree's right branches, so two lengths that pad
    to the same power of two (or a length and its zero-padded bucket) give the same bits."""
    x = opaque(jnp.moveaxis(x, axis, -1))  # a product fused into the first level is never contracted into an FMA
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    out = x[..., 0]
    return jnp.expand_dims(out, axis) if keepdims else out


def fixed_logsumexp(x: jax.Array, axis: int = -1) -> jax.Array:
    """log(sum(exp(x))) over `axis` with the sum a `fixed_sum` (batch-invariant bits); -inf for an all -inf row."""
    m = jnp.max(x, axis=axis, keepdims=True)  # exact in any order
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return jnp.log(fixed_sum(jnp.exp(x - m), axis)) + jnp.squeeze(m, axis)


