"""pocketjax's native CPU kernels (model/cpu_kernels.py, csrc/): the product of float32 and bf16 weights against the
float64 product of the same values in every code path this CPU has, and row-count invariant bit for bit; attention
against the XLA reference for every cache form, and invariant to the batch, the chunk and the cache length; their use
in `layers.linear` and the engine (single-device programs only); the build: fallback without a compiler, the cache,
its build key, an unwritable cache, and a cache that is not this user's alone (refused; loaded from the checked
descriptor)."""
import dataclasses
import logging
import os
import platform
import shutil
import stat
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pallas_kernels import reference as attention_reference
from pocketjax.errors import ConfigError
from pocketjax.model import cpu_kernels, layers, quant
from pocketjax.model.kv_cache import quantize
from pocketjax.model.sharding import make_mesh

from test_engine import run

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the kernels")
ISAS = sorted({cpu_kernels.resolved_isa_name(dt, wt, isa) for dt in (jnp.float32, jnp.bfloat16)
               for wt in (jnp.float32, jnp.bfloat16) for isa in cpu_kernels.ISAS}
              if cpu_kernels.available() else [])


def reference(x, w):
    """The product in float64 of the kernel's inputs: exact up to float64 rounding."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_the_float_product_at_any_rows_and_odd_sizes(isa, x_dtype, w_dtype):
    rng = np.random.default_rng(1)
    product = jax.jit(lambda x, w: cpu_kernels.skinny_matmul(x, w, isa))
    for rows, k, n in [(1, 37, 51), (2, 64, 33), (3, 1000, 17), (5, 17, 160), (8, 95, 48), (8, 1024, 3), (11, 40, 9),
                       (70, 300, 200)]:
        w = jnp.asarray(rng.standard_normal((n, k)), w_dtype)
        x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
        got = product(x, w)
        assert got.shape == (rows, n) and got.dtype == x_dtype
        want = reference(x, w)
        # f32 sums in another order: a few ulps of the sum of |terms|; a bf16 result adds its own rounding (2^-8)
        scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
        tol = scale * 1e-6 + (np.abs(want) * 2.0**-8 if x_dtype == jnp.bfloat16 else 0)
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), tol + 1e-30)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_each_row_of_the_product_is_the_same_bits_at_any_row_count(isa, w_dtype):
    """Batch invariance at its root: a row's result depends on that row only, not on how many rows share the call
    (1 row, a decode batch, a prefill chunk of many row blocks)."""
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.standard_normal((200, 333)), w_dtype)
    x = jnp.asarray(rng.standard_normal((70, 333)), jnp.float32)
    product = jax.jit(lambda x: cpu_kernels.skinny_matmul(x, w, isa))
    full = np.asarray(product(x))
    for start, rows in [(0, 1), (5, 1), (3, 2), (10, 7), (30, 5), (40, 6), (50, 8), (1, 9), (0, 17), (20, 50)]:
        assert np.array_equal(np.asarray(product(x[start:start + rows])), full[start:start + rows]), (start, rows)


QUANT_ISAS = sorted({cpu_kernels.resolved_isa_name(jnp.float32, jnp.float32, isa)
                    for isa in ("portable", "avx2", "avx512")} if cpu_kernels.available() else [])


def quantized_weight(rng, n, k, group, symmetric=False, bits=4):
    if bits == 8 and group != k:  # grouped int8 (prequantized checkpoints): quant.quantize makes per-channel only
        values = rng.integers(-127, 128, (n, k), np.int8)
        scale = (rng.random((n, k // group), np.float32) * np.float32(0.02)).astype(np.float32)
        zero = None if symmetric else rng.integers(-8, 9, (n, k // group), np.int8)
        return jax.tree.map(jnp.asarray, quant.QuantizedWeight(values=values, scale=scale, zero=zero, bits=8))
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :group] = np.abs(w[0, :group]) + 2.0  # an int4 group that does not hold 0 (zero outside 0..15)
    qw = quant.quantize(w, bits, group if bits == 4 else None)
    return jax.tree.map(jnp.asarray, dataclasses.replace(qw, zero=None) if symmetric else qw)


@pytest.mark.parametrize("isa", QUANT_ISAS)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_int8_kernel_is_the_float_kernel_on_the_dequantized_weight_bit_for_bit(isa, x_dtype):
    """The int8 product dequantizes in registers exactly as quant.dequantize does in memory, then sums exactly as the
    float32 kernel: the same bits at 1-8 rows (registers) and over 8 (a dequantized chunk), any group, with or
    without zeros, so every row is batch-invariant as the float kernel's. Groups of 8 (mod 16) columns, whose 16-lane
    steps (AVX-512) straddle two groups, and an input of 8 (mod 16) columns (its masked tail) included."""
    rng = np.random.default_rng(11)
    kernel = jax.jit(lambda x, w: cpu_kernels.quantized_matmul(x, w, isa))
    dense = jax.jit(lambda x, w: cpu_kernels.skinny_matmul(x, quant.dequantize(w), isa))
    for rows, n, k, group, symmetric, bits in [
            (1, 48, 64, 64, True, 8), (3, 33, 40, 40, True, 8), (8, 80, 512, 512, True, 8),
            (6, 37, 768, 384, False, 8), (7, 21, 256, 64, False, 8), (5, 9, 1024, 1024, True, 8),
            (13, 150, 192, 192, False, 8), (70, 40, 64, 64, False, 8), (4, 19, 96, 24, False, 8),
            (2, 10, 72, 24, True, 8), (5, 12, 128, 32, False, 8), (11, 17, 120, 40, False, 8)]:
        w = quantized_weight(rng, n, k, group, symmetric, bits)
        x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
        got = kernel(x, w)
        assert got.dtype == x_dtype and got.shape == (rows, n)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(dense(x, w), np.float32),
                                      err_msg=str((rows, n, k, group, symmetric, bits)))
        for start, count in [(0, 1), (rows - 1, 1), (0, min(rows, 6))]:  # each row alone or in a smaller batch
            np.testing.assert_array_equal(np.asarray(kernel(x[start:start + count], w), np.float32),
                                          np.asarray(got[start:start + count], np.float32))


def int4_model(x, w: quant.QuantizedWeight) -> np.ndarray:
    """numpy's model of the int4 kernel's steps (csrc/skinny_matmul.cc, Int4Rows): each row rounded to int16 with one
    scale, exact integer sums per lane (lane l of a 32-column chunk: its columns 2l, 2l + 1 of the group's first half
    and the same two of its second half), one float32 FMA per lane and chunk with the group's scale, the
    zeros' share (scale * zero * the row's integer sum per group: 8 lanes over groups, the rest in order), the kernel's
    horizontal tree, then the row's scale. FMAs in float64 (exact products; a double rounding is possible but has not
    occurred on these inputs). x: float32 values; returns float32."""
    x = np.asarray(x, np.float32)
    rows, k = x.shape
    n, groups = w.scale.shape
    size, half = k // groups, k // groups // 2
    amax = np.abs(x).max(axis=1)
    step = amax / np.float32(32767)
    inverse = np.float32(32767) / np.where(amax > 0, amax, np.float32(1))
    xi = np.clip(np.rint(x * np.where(amax > 0, inverse, 0)[:, None]), -32767, 32767).astype(np.int64)
    packed = np.asarray(w.values).reshape(n, groups, half)
    q = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.int64)
    chunks = half // 16
    lanes = np.einsum("ngpclk,rgpclk->rngcl", q.reshape(n, groups, 2, chunks, 8, 2),
                      xi.reshape(rows, groups, 2, chunks, 8, 2))
    lanes = lanes.astype(np.float32).astype(np.float64)
    scale = np.asarray(w.scale, np.float32)

    def fma(a, b, c):
        return (np.asarray(a, np.float64) * b + c.astype(np.float64)).astype(np.float32)

    def tree(f):
        a = f[..., :4] + f[..., 4:]
        return (a[..., 0] + a[..., 2]) + (a[..., 1] + a[..., 3])

    acc = np.zeros((rows, n, 8), np.float32)
    for g in range(groups):
        for c in range(chunks):
            acc = fma(lanes[:, :, g, c], scale[None, :, g, None].astype(np.float64), acc)
    share = np.zeros((rows, n), np.float32)
    if w.zero is not None:
        zeros = scale * np.asarray(w.zero).astype(np.float32)
        sums = xi.reshape(rows, groups, size).sum(-1).astype(np.float32)
        whole = groups // 8 * 8
        acc8 = np.zeros((rows, n, 8), np.float32)
        for g in range(0, whole, 8):
            acc8 = fma(zeros[None, :, g:g + 8], sums[:, None, g:g + 8].astype(np.float64), acc8)
        share = tree(acc8)
        for g in range(whole, groups):
            share = fma(zeros[None, :, g], sums[:, None, g].astype(np.float64), share)
    return (tree(acc) - share) * step[:, None]


@pytest.mark.parametrize("isa", QUANT_ISAS)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_int4_kernel_is_its_integer_product_bit_for_bit_at_any_row_count(isa, x_dtype):
    """The int4 product is bitwise numpy's model of its steps (`int4_model`) at 1-8 rows (one register block) and over
    8 (blocks of 8), any group that is a multiple of 32 (group counts not a multiple of 8 included), with or without
    zeros, with an outlier channel; within its 16-bit activations' rounding (half a step per value) of the float64
    product of the dequantized weight; each row alone is the same bits; a row holding a NaN gives NaNs in its row
    only."""
    rng = np.random.default_rng(11)
    kernel = jax.jit(lambda x, w: cpu_kernels.quantized_matmul(x, w, isa))
    for rows, n, k, group, symmetric in [(1, 48, 64, 32, False), (2, 37, 256, 128, False), (3, 20, 96, 32, True),
                                         (4, 64, 896, 32, False), (5, 33, 128, 64, False), (8, 80, 512, 256, True),
                                         (13, 150, 192, 32, False), (70, 40, 64, 64, False)]:
        w = quantized_weight(rng, n, k, group, symmetric)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x[:, 3] *= 300  # a massive-activation channel sets every value's step
        x = jnp.asarray(x, x_dtype)
        got = kernel(x, w)
        assert got.dtype == x_dtype and got.shape == (rows, n)
        want = np.asarray(jnp.asarray(int4_model(np.asarray(x, np.float32), w)).astype(x_dtype), np.float32)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=str((rows, n, k, group, symmetric)))
        exact = reference(x, quant.dequantize(w))
        dense = np.abs(np.asarray(quant.dequantize(w), np.float64))
        half_step = np.abs(np.asarray(x, np.float64)).max(axis=1, keepdims=True) / 32767 / 2
        bound = half_step * dense.sum(axis=1) + 1e-6 * (np.abs(np.asarray(x, np.float64)) @ dense.T)
        bound += np.abs(exact) * 2.0**-8 if x_dtype == jnp.bfloat16 else 0
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - exact), bound)
        for start, count in [(0, 1), (rows - 1, 1), (0, min(rows, 6))]:
            np.testing.assert_array_equal(np.asarray(kernel(x[start:start + count], w), np.float32),
                                          np.asarray(got[start:start + count], np.float32))
    poisoned = x.at[1, 7].set(jnp.nan)
    out = np.asarray(kernel(poisoned, w), np.float32)
    others = np.delete(np.asarray(got, np.float32), 1, axis=0)
    assert np.isnan(out[1]).all() and np.array_equal(np.delete(out, 1, axis=0), others)


@pytest.mark.parametrize("isa", QUANT_ISAS)
def test_tiled_int4_is_the_row_major_product_bit_for_bit(isa):
    """int4 values in the kernel's tiles (`quant.tile_rows`: 4 rows per tile, a 32-column chunk of the 4 a 64-byte
    line) give bitwise the row-major product at every row count (1-4 rows a tile per pass, more in blocks of 4),
    any group, with or without zeros, and every other reader (`dequantize`, `untiled`) sees the row-major weight;
    a weight that does not tile is refused."""
    rng = np.random.default_rng(13)
    kernel = jax.jit(lambda x, w: cpu_kernels.quantized_matmul(x, w, isa))
    for rows, n, k, group, symmetric in [(1, 4, 64, 32, False), (1, 48, 256, 128, False), (2, 20, 96, 32, True),
                                         (3, 64, 192, 64, False), (4, 36, 128, 32, False), (5, 152, 64, 32, False),
                                         (6, 80, 512, 256, True), (9, 40, 64, 64, False), (17, 24, 96, 32, False)]:
        w = quantized_weight(rng, n, k, group, symmetric)
        tiled = jax.tree.map(jnp.asarray, quant.tile_rows(jax.tree.map(np.asarray, w)))
        assert tiled.tiled and tiled.values.shape == w.values.shape
        assert not np.array_equal(np.asarray(tiled.values), np.asarray(w.values))
        np.testing.assert_array_equal(np.asarray(quant.untiled(tiled).values), np.asarray(w.values))
        np.testing.assert_array_equal(np.asarray(quant.dequantize(tiled)), np.asarray(quant.dequantize(w)))
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        np.testing.assert_array_equal(np.asarray(kernel(x, tiled)), np.asarray(kernel(x, w)),
                                      err_msg=str((rows, n, k, group, symmetric)))
    for bad in (quantized_weight(rng, 6, 64, 32), quantized_weight(rng, 8, 64, 32, bits=8)):
        with pytest.raises(ConfigError, match="tile_rows"):
            quant.tile_rows(bad)


@pytest.mark.parametrize("isa", [isa for isa in ("avx2", "avx512", "avx512bf16") if isa in ISAS])
def test_row_streams_are_the_adjacent_rows_bits_at_every_row_count(isa):
    """A register block's weight rows taken as NB streams apart (the default) or adjacent give the same bits for
    every weight form and row count each vector path serves, across chunk boundaries and with rows left over (N not
    a multiple of the block); only which rows share a block changes."""
    rng = np.random.default_rng(14)
    float_product = jax.jit(lambda x, w, streams: cpu_kernels.skinny_matmul(x, w, isa, streams),
                            static_argnums=2)
    quantized_product = jax.jit(lambda x, w, streams: cpu_kernels.quantized_matmul(x, w, isa, streams),
                                static_argnums=2)
    weights = [(float_product, jnp.asarray(rng.standard_normal((n, k)), dtype))
               for dtype in (jnp.float32, jnp.bfloat16) for n, k in ((37, 64), (301, 256))]
    weights += [(quantized_product, quantized_weight(rng, n, k, 32, symmetric, bits))
                for bits, symmetric in ((8, True), (8, False), (4, False)) for n, k in ((37, 64), (1203, 256))]
    for product, w in weights:
        for rows in (1, 2, 3, 4, 5, 9):
            x = jnp.asarray(rng.standard_normal((rows, w.shape[1])), jnp.float32)
            if getattr(w, "dtype", None) == jnp.bfloat16:
                x = x.astype(jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(product(x, w, True)), np.asarray(product(x, w, False)),
                                          err_msg=str((w.shape, w.dtype, rows)))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kernel_serves_quantized_models_and_differentiates_like_the_dequantized_product(bits):
    """layers.linear takes the kernel for an int8 / int4 weight in a single-device program (one custom call, no
    dequantized float32 weight in the program), gives the dequantized product within float32 rounding (int4: within
    its 16-bit activations' rounding) as XLA's forms do (int8: within the two activation digits' rounding), and its
    derivative in x and in the scale is the dequantized product's."""
    rng = np.random.default_rng(12)
    w = quantized_weight(rng, 96, 256, 32, bits=bits)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    hlo = jax.jit(lambda x, w: layers.linear(x, w)).lower(x, w).as_text()
    assert cpu_kernels.QUANTIZED_TARGET in hlo and "f32[96,256]" not in hlo
    with layers.native_forms(False):
        xla = jax.jit(lambda x, w: layers.linear(x, w))(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(w), np.float64).T
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(quant.dequantize(w), np.float64)).T
    activations = 0 if bits == 8 else (np.abs(np.asarray(x, np.float64)).max(axis=1, keepdims=True) / 32767 / 2
                                       * np.abs(np.asarray(quant.dequantize(w), np.float64)).sum(axis=1))
    np.testing.assert_array_less(np.abs(np.asarray(layers.linear(x, w), np.float64) - want),
                                 scale * 1e-6 + activations + 1e-30)
    # XLA's forms: int8 keeps 15 bits of each activation (two digits), int4 sums in another order
    np.testing.assert_array_less(np.abs(np.asarray(xla, np.float64) - want), scale * 1e-4 + 1e-30)

    def loss(product):
        return lambda x, scale: (product(x, dataclasses.replace(w, scale=scale)) ** 2).sum()

    want = jax.grad(loss(lambda x, w: x @ quant.dequantize(w).T), argnums=(0, 1))(x, w.scale)
    got = jax.grad(loss(cpu_kernels.quantized_matmul), argnums=(0, 1))(x, w.scale)
    # The cotangent carries the forward's y (2y): the sums differ in order (int8), and int4's y also by its
    # activations' rounding (~2e-5 of the largest here)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0,
                                   atol=(1e-5 if bits == 8 else 2e-4) * float(np.abs(r).max()))


CACHE_FORMS = [("float32", jnp.float32), ("bfloat16", jnp.bfloat16), ("int8", jnp.float32),
               ("float8_e4m3fn", jnp.float32), ("int8", jnp.bfloat16)]


def attention_inputs(cache_form, q_dtype, seed=0, slots=4, kv_heads=2, group=3, length=80, head_dim=24):
    """q [3, 10, heads, D] and a cache (k, v[, k_scale, v_scale]) [slots, kv_heads, length, D] of `cache_form`."""
    rng = np.random.default_rng(seed)
    shape = (slots, kv_heads, length, head_dim)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    if cache_form in ("int8", "float8_e4m3fn"):
        (kq, ks), (vq, vs) = quantize(jnp.asarray(k), cache_form), quantize(jnp.asarray(v), cache_form)
        cache = (kq, vq, ks, vs)
    else:
        cache = (jnp.asarray(k, cache_form), jnp.asarray(v, cache_form))
    q = jnp.asarray(rng.standard_normal((3, 10, kv_heads * group, head_dim)), q_dtype)
    return q, cache


def native(q, cache, slots, starts, lengths):
    k, v, *scales = cache
    return cpu_kernels.attention(q, k, v, slots, starts, lengths, 0.3, *scales)


@pytest.mark.parametrize("cache_form,q_dtype", CACHE_FORMS)
def test_attention_matches_the_reference_on_every_cache_form(cache_form, q_dtype):
    q, cache = attention_inputs(cache_form, q_dtype)
    slots, starts, lengths = jnp.array([2, 0, 3]), jnp.array([5, 0, 60]), jnp.array([10, 7, 4])
    got = np.asarray(native(q, cache, slots, starts, lengths), np.float32)
    k, v, *scales = cache
    want = attention_reference.prefill_attention(q, k, v, starts, lengths, sm_scale=0.3, slots=slots,
                                                 **dict(zip(("k_scale", "v_scale"), scales)))
    want = np.asarray(want, np.float32)
    tol = 2.0**-7 if q_dtype == jnp.bfloat16 else 1e-5  # bf16: one rounding of the output apart at most
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max())
    assert not got[1, 7:].any()  # padding rows are zeros


@pytest.mark.parametrize("cache_form,q_dtype", CACHE_FORMS)
def test_attention_of_a_query_is_the_same_bits_whatever_shares_the_call(cache_form, q_dtype):
    """A query row's output depends on its position, its query and its keys only: as one decode row, as one row of
    a prefill chunk beside others, over a cache read to its full length or cut just past the position."""
    q, cache = attention_inputs(cache_form, q_dtype, seed=1)
    slots, starts, lengths = jnp.array([2, 0, 3]), jnp.array([5, 0, 60]), jnp.array([10, 7, 4])
    chunk = np.asarray(native(q, cache, slots, starts, lengths))
    for row, i in [(0, 0), (0, 3), (1, 6), (2, 3)]:
        position = int(starts[row]) + i
        alone = native(q[row:row + 1, i:i + 1], cache, slots[row:row + 1], jnp.array([position]), jnp.array([1]))
        assert np.array_equal(np.asarray(alone)[0, 0], chunk[row, i]), (row, i)
        cut = tuple(a[:, :, :position + 1] for a in cache)
        shorter = native(q[row:row + 1, i:i + 1], cut, slots[row:row + 1], jnp.array([position]), jnp.array([1]))
        assert np.array_equal(np.asarray(shorter)[0, 0], chunk[row, i]), (row, i)


def expf_model(x) -> np.ndarray:
    """csrc/attention.cc's ExpF in numpy float32, one rounding per operation, for x <= 0."""
    f = lambda h: np.float32(float.fromhex(h))  # noqa: E731 (the kernel's hex constants, exactly)
    x = np.asarray(x, np.float32)
    big = f("0x1.8p23")
    shifted = x * f("0x1.715476p+0") + big
    n = shifted - big
    with np.errstate(invalid="ignore"):  # -inf - -inf in the lanes the cut below replaces
        r = x - n * f("0x1.63p-1")
    r = r - n * f("-0x1.bd0106p-13")
    p = np.full_like(x, f("0x1.a0d2cep-13"))
    for c in ("0x1.6e879cp-10", "0x1.11121p-7", "0x1.555382p-5", "0x1.555554p-3", "0x1p-1"):
        p = p * r + f(c)
    p = (p * (r * r) + r) + np.float32(1)
    scale = ((shifted.view(np.uint32) - np.uint32(0x4B400000) + np.uint32(127)) << np.uint32(23)).view(np.float32)
    return np.where(x < f("-0x1.5d3334p+6"), np.float32(0), p * scale)


def test_the_kernels_exp_is_within_2_ulp_of_exp():
    """expf_model (the kernel's ExpF, pinned by the attention model test) over [-87.3, 0], its cut below and NaN:
    within 2 ulp of the float64 exp, exactly 1 at 0, 0 below the normal range, NaN kept."""
    x = np.concatenate([-np.geomspace(1e-8, 87.29, 200_000), np.linspace(-87.29, 0, 200_001)]).astype(np.float32)
    got, want = expf_model(x).astype(np.float64), np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.abs(got - want).max(initial=0) <= 2 * ulp.max(initial=0) and (np.abs(got - want) <= 2 * ulp).all()
    assert expf_model(np.float32(0)) == 1 and expf_model(np.float32(-0.0)) == 1
    assert (expf_model(np.array([-87.31, -100, -np.inf], np.float32)) == 0).all()
    assert np.isnan(expf_model(np.array([np.nan], np.float32))).all()


def attention_model(q, k, v, slots, starts, lengths, sm_scale) -> np.ndarray:
    """numpy's model of csrc/attention.cc's steps for a float32 query and cache, one float32 operation at a time
    (numpy rounds each, as the kernel built without contraction does): per query row its scores over keys 0..pos,
    each a head-dim dot in 8 lanes then the kernel's tree, times sm_scale; the max; the kernel's exp of each score less
    it and their sum in key order; P @ V summed in key order per output element; divided by the sum."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    batch, queries, heads, dim = q.shape
    group, scale, lanes = heads // k.shape[1], np.float32(sm_scale), dim // 8 * 8
    out = np.zeros_like(q)
    for b, i, h in np.ndindex(batch, queries, heads):
        if i >= lengths[b]:
            continue
        keys, values = k[slots[b], h // group], v[slots[b], h // group]
        n = min(int(starts[b]) + i + 1, keys.shape[0])
        scores = np.zeros(n, np.float32)
        for t in range(n):
            acc = np.zeros(8, np.float32)
            for j in range(0, lanes, 8):
                acc = acc + q[b, i, h, j:j + 8] * keys[t, j:j + 8]
            dot = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
            for j in range(lanes, dim):
                dot = dot + q[b, i, h, j] * keys[t, j]
            scores[t] = dot * scale
        exps = expf_model(scores - scores.max())
        total, weighted = np.float32(0), np.zeros(dim, np.float32)
        for t in range(n):
            total = total + exps[t]
            weighted = weighted + exps[t] * values[t]
        out[b, i, h] = weighted / total
    return out


@pytest.mark.parametrize("group,head_dim,starts,lengths", [
    (2, 64, [5, 0, 60], [10, 7, 4]), (1, 64, [3, 9, 1], [1, 1, 1]), (3, 24, [5, 0, 60], [10, 7, 4]),
    (2, 40, [70, 2, 11], [1, 1, 1]), (2, 64, [66, 30, 60], [10, 10, 10])])
def test_attention_is_its_numpy_model_bit_for_bit(group, head_dim, starts, lengths):
    """The kernel's summation order, pinned: bitwise its numpy model at prefill and decode rows, heads sharing a kv
    head or not, head dims with and without a tail past the 8 lanes: any reordering of a dot, the softmax sum or
    P @ V (or a contraction into FMAs) shows here, where the reference and invariance tests allow it. Prefill rows
    over more keys than one of the kernel's key blocks (64) included."""
    q, (k, v) = attention_inputs("float32", jnp.float32, seed=3, group=group, head_dim=head_dim)
    slots, starts, lengths = jnp.array([2, 0, 3]), jnp.array(starts), jnp.array(lengths)
    got = np.asarray(native(q, (k, v), slots, starts, lengths))
    np.testing.assert_array_equal(got, attention_model(q, k, v, slots, starts, lengths, 0.3))


def test_attention_is_differentiable_through_the_reference():
    q, (k, v) = attention_inputs("float32", jnp.float32, seed=2)
    slots, starts, lengths = jnp.array([2, 0, 3]), jnp.array([5, 0, 60]), jnp.array([10, 7, 4])

    def loss(q, attend):
        return (attend(q) ** 2).sum()

    got = jax.grad(loss)(q, lambda q: native(q, (k, v), slots, starts, lengths))
    want = jax.grad(loss)(q, lambda q: attention_reference.prefill_attention(q, k, v, starts, lengths, sm_scale=0.3,
                                                                             slots=slots))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_is_differentiable_and_vmaps():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((24, 40)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 2, 40)), jnp.float32)
    got = jax.vmap(lambda x: cpu_kernels.skinny_matmul(x, w))(x)
    np.testing.assert_allclose(got, np.einsum("bri,oi->bro", x, np.asarray(w, np.float32)), rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda x: (cpu_kernels.skinny_matmul(x, w) ** 2).sum())(x[0])
    want = jax.grad(lambda x: ((x @ w.astype(jnp.float32).T) ** 2).sum())(x[0])
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 40])
def test_linear_uses_the_kernel_on_one_device_and_xla_on_a_mesh(rows, dtype):
    w = jnp.asarray(np.random.default_rng(3).standard_normal((64, 32)), dtype)
    x = jnp.ones((rows, 32), dtype)
    assert cpu_kernels.TARGET in jax.jit(layers.linear).lower(x, w).as_text()  # every row count
    with layers.native_forms(False):  # batch_invariant=False: XLA's forms (bf16: the kernel at 1 row only); a new
        text = jax.jit(lambda x, w: layers.linear(x, w)).lower(x, w).as_text()  # function: jit caches by function
    assert (cpu_kernels.TARGET in text) == (dtype == jnp.bfloat16 and rows <= layers.KERNEL_ROWS)
    mesh = make_mesh(2)
    sharded = jax.device_put(w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp", None)))
    assert cpu_kernels.TARGET not in jax.jit(layers.linear).lower(x, sharded).as_text()  # XLA cannot split it


def test_bf16_engine_runs_the_kernels_and_decodes_as_xla_forms_and_tp2(hf_checkpoint):
    """The bf16 engine's decode steps (2 rows) run the native kernels (both custom calls are in the compiled step),
    and greedy decode agrees with XLA's forms and with TP2 (the same bf16 weights; f32 summation orders differ)."""
    folder = hf_checkpoint("qwen3_gqa4_headdim", dtype="bfloat16")
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 301, 9)]
    greedy = pj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def decode(tp=1, batch_invariant=True):
        engine = pj.Engine(pj.load_model(folder, dtype="bfloat16", tp=tp), max_batch_size=2, max_seq_len=64,
                           batch_invariant=batch_invariant)
        tokens = [r.generated_tokens for r in run(engine, [prompt, prompt[::-1]], greedy)]
        return engine, tokens

    engine, native_tokens = decode()
    assert engine.impl == "cpu"
    from pocketjax.engine.plan import Signature
    text = engine.lower(Signature("decode", 2, kv_len=64)).as_text()
    assert cpu_kernels.TARGET in text and cpu_kernels.ATTENTION_TARGET in text
    assert native_tokens == decode(batch_invariant=False)[1] == decode(tp=2)[1]


def test_no_compiler_falls_back_to_xla_form(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("POCKETJAX_CXX", "none")
    with caplog.at_level(logging.INFO, logger="pocketjax"):
        assert cpu_kernels.build(directory=tmp_path) is None
    assert "no C++ compiler" in caplog.text and not list(tmp_path.iterdir())
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((16, 8)), jnp.bfloat16)
    x = jnp.ones((1, 8), jnp.bfloat16)
    assert cpu_kernels.TARGET not in jax.jit(layers.linear).lower(x, w).as_text()
    np.testing.assert_allclose(np.asarray(layers.linear(x, w), np.float32), reference(x, w), rtol=2**-7)
    assert layers.resolve_impl("auto") == "xla"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="a non-x86 host compiles it for real")
def test_the_sources_compile_without_the_x86_paths():
    """aarch64 and other hosts build only the portable code: with POCKETJAX_PORTABLE_ONLY (the x86 paths left out as
    there) both sources must still compile (an x86-only helper called from shared code broke this once, unseen on
    x86)."""
    compiler = cpu_kernels.find_compiler()
    cmd = [compiler, *cpu_kernels.FLAGS, "-fsyntax-only", "-DPOCKETJAX_PORTABLE_ONLY", "-isystem",
           jax.ffi.include_dir(), *map(str, cpu_kernels.SOURCES)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_failed_build_logs_and_returns_none(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pocketjax"):
        assert cpu_kernels.build(compiler="/bin/false", directory=tmp_path) is None
    assert "cannot build" in caplog.text or "build failed" in caplog.text


def session_build_in(folder: Path) -> Path:
    """The library this session built (one compile, ~40 s), copied into `folder` under its own name: a cache as
    `build(directory=folder)` would have left it, without compiling the sources again."""
    built = cpu_kernels.build()
    assert built is not None
    return Path(shutil.copy2(built, folder / built.name))


@pytest.mark.leg1_only  # the build cache: the same under any JAX
def test_cache_hit_does_not_rebuild(tmp_path, monkeypatch):
    lib = session_build_in(tmp_path)
    mtime = lib.stat().st_mtime_ns
    calls = []
    real = cpu_kernels.subprocess.run
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real(cmd, **kw))
    assert cpu_kernels.build(directory=tmp_path) == lib and lib.stat().st_mtime_ns == mtime
    assert all("--version" in c for c in calls)  # only the compiler's version, for the key: no compile
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]  # built under a temp name, renamed


@pytest.mark.leg1_only  # the build cache: the same under any JAX
def test_a_cached_file_without_its_build_key_is_rebuilt_not_loaded(tmp_path, caplog):
    lib = session_build_in(tmp_path)
    lib.write_bytes(b"\x7fELF not the library these sources build")  # stale, foreign or corrupt, same name
    with caplog.at_level(logging.WARNING, logger="pocketjax"):
        assert cpu_kernels.build(directory=tmp_path) == lib
    assert "does not carry its build key" in caplog.text
    assert cpu_kernels.carries_key(lib, lib.stem.rsplit("-", 1)[1])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_cache_logs_and_falls_back(tmp_path, caplog):
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with caplog.at_level(logging.WARNING, logger="pocketjax"):
            assert cpu_kernels.build(directory=tmp_path / "kernels") is None
    finally:
        tmp_path.chmod(stat.S_IRWXU)
    assert "cannot build" in caplog.text


def test_an_unusable_cache_folder_logs_and_falls_back(tmp_path, caplog):
    """A cache path that cannot be a folder (a file is in the way; as for a read-only cache, run as root here)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="pocketjax"):
        assert cpu_kernels.build(directory=blocker / "kernels") is None
    assert "cannot build" in caplog.text


def test_no_home_directory_builds_in_a_private_folder(monkeypatch):
    for name in ("POCKETJAX_KERNEL_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_kernels.Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    folder = cpu_kernels.cache_dir()
    assert folder.is_dir() and os.access(folder, os.W_OK)


def test_the_env_switch_turns_the_kernels_off(monkeypatch):
    w, x = jnp.ones((16, 8), jnp.bfloat16), jnp.ones((1, 8), jnp.bfloat16)
    monkeypatch.setenv("POCKETJAX_CPU_KERNELS", "off")
    assert not cpu_kernels.available()
    assert cpu_kernels.TARGET not in jax.jit(layers.linear).lower(x, w).as_text()


FAKE_CXX = """#!/bin/sh
# a compiler that writes a file carrying the build key it is given (the cache's rules without a 30 s compile)
if [ "$1" = "--version" ]; then echo "fake-cxx 1"; exit 0; fi
out=""; key=""
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift;; -DPOCKETJAX_BUILD_KEY=*) key=$(echo "${1#*=}" | tr -d '"');; esac
  shift
done
printf 'pocketjax-build-key:%s' "$key" > "$out"
"""


@pytest.fixture
def fake_cxx(tmp_path):
    path = tmp_path / "fake-c++"
    path.write_text(FAKE_CXX)
    path.chmod(0o700)
    return str(path)


def test_a_cache_folder_others_can_write_is_neither_loaded_from_nor_built_into(tmp_path, fake_cxx, caplog):
    """Issue 67: a group-writable cache folder could hold anyone's library: a file there carrying the right key is
    not returned, and the build goes to this process's private folder (0700)."""
    own = cpu_kernels.build(compiler=fake_cxx, directory=tmp_path / "own")
    assert own.parent == tmp_path / "own" and stat.S_IMODE((tmp_path / "own").stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    planted = shared / own.name
    planted.write_bytes(own.read_bytes())  # carries the key: the old check loaded it
    planted.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="pocketjax"):
        lib = cpu_kernels.build(compiler=fake_cxx, directory=shared)
    assert lib.parent == cpu_kernels.private_dir() and lib.parent != shared and lib.name == own.name
    assert stat.S_IMODE(lib.parent.stat().st_mode) == 0o700 and list(shared.iterdir()) == [planted]
    assert "writable by group or others" in caplog.text and str(shared) in caplog.text


@pytest.mark.parametrize("tamper", ["group_writable", "other_owner", "symlink"])
def test_a_cached_library_that_is_not_ours_alone_is_rebuilt_not_loaded(tmp_path, fake_cxx, caplog, tamper):
    """A cached file writable by group, owned by another user, or a symlink (to a file carrying the key) is refused
    and rebuilt: after the build the name holds our own regular file, not writable by others."""
    lib = cpu_kernels.build(compiler=fake_cxx, directory=tmp_path / "kernels")
    key = lib.stem.rsplit("-", 1)[1]
    if tamper == "group_writable":
        lib.chmod(0o775)
    elif tamper == "other_owner":
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(lib, 4242, -1)
    else:
        target = tmp_path / "elsewhere.so"
        target.write_bytes(lib.read_bytes())
        lib.unlink()
        lib.symlink_to(target)
    assert not cpu_kernels.carries_key(lib, key)
    with pytest.raises((ConfigError, OSError)):
        os.close(cpu_kernels.open_library(lib, key))
    with caplog.at_level(logging.WARNING, logger="pocketjax"):
        assert cpu_kernels.build(compiler=fake_cxx, directory=tmp_path / "kernels") == lib
    assert "rebuilding" in caplog.text
    info = lib.lstat()
    assert stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022
    assert cpu_kernels.carries_key(lib, key)


def test_the_library_loaded_is_the_file_checked_even_if_swapped_after_the_check(tmp_path, monkeypatch):
    """No check-then-load race: `load` checks and loads one descriptor, so a file swapped in at the path right after
    the check (here: junk that no loader takes) is not what is loaded."""
    real = cpu_kernels.build()  # this process's library, from the cache: no compile
    lib = tmp_path / real.name
    lib.write_bytes(real.read_bytes())
    lib.chmod(0o755)
    checked = cpu_kernels.descriptor_carries_key

    def check_then_swap(fd, key):
        ok = checked(fd, key)
        swap = tmp_path / "swap"
        swap.write_bytes(b"\x7fELF not a library")
        os.replace(swap, lib)
        return ok

    monkeypatch.setattr(cpu_kernels, "descriptor_carries_key", check_then_swap)
    loaded = cpu_kernels.load(lib)
    assert lib.read_bytes() == b"\x7fELF not a library"  # the swap happened before the load
    assert loaded.PocketjaxSkinnyMatmulIsa(0, 0, 0) in cpu_kernels.ISAS.values()
