"""Pallas attention kernels vs the plain-JAX reference and a float64 NumPy oracle.

CPU (default): kernels run with interpret=True. The interpreter pads arrays and initializes outputs
with NaN, so a block the kernel forgets to write, or padding it reads unmasked, shows up as NaN.
Each case batches its edge cases (lengths 0, 1, block-1, block, block+1, T; ragged prompts; slots that
are a permutation, not arange) into one call, because each distinct shape costs one compile.
POCKETJAX_KERNEL_TEST_MODE=gpu runs the same cases compiled for the GPU (interpret=False).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import reference, tuning

GPU_MODE = os.environ.get("POCKETJAX_KERNEL_TEST_MODE", "interpret") == "gpu"
INTERPRET = not GPU_MODE
if GPU_MODE and jax.default_backend() != "gpu":
    raise RuntimeError("POCKETJAX_KERNEL_TEST_MODE=gpu but JAX has no GPU backend (set JAX_PLATFORMS=cuda)")

# max |err| / max |oracle| per input dtype: float32 is exact up to summation order; 16-bit inputs
# lose precision in P cast to the input dtype for P @ V and in the rounded output.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
# Interpret mode builds one big XLA while-loop per call; optimizing it costs seconds and buys nothing.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _run(fn, *args, **static):
    """fn(*args, interpret=INTERPRET, **static), compiled unoptimized when interpreting on CPU."""
    f = jax.jit(functools.partial(fn, interpret=INTERPRET, **static))
    if not INTERPRET:
        return f(*args)
    return f.lower(*args).compile(_FAST_COMPILE)(*args)


def _rng(*key) -> np.random.Generator:
    """A generator seeded from the case parameters, so every case gets fresh, reproducible data."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _array(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _softmax_pv(logits, mask, v):
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def oracle_decode(q, k, v, lengths, slots, scale):
    """float64 decode attention, head by head, with the repeat_interleave GQA convention."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    s, q_heads, d = q.shape
    group = q_heads // k.shape[1]
    out = np.zeros((s, q_heads, d))
    for i in range(s):
        n = int(lengths[i])
        if n == 0:
            continue
        for h in range(q_heads):
            kh, vh = k[slots[i], h // group, :n], v[slots[i], h // group, :n]
            out[i, h] = _softmax_pv(kh @ q[i, h] * scale, np.ones(n, bool), vh)
    return out


def oracle_prefill(q, k, v, starts, q_lengths, slots, scale):
    """float64 causal prefill: token i of row b at position starts[b] + i sees keys 0..position."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    b, tq, q_heads, d = q.shape
    group = q_heads // k.shape[1]
    out = np.zeros((b, tq, q_heads, d))
    for i in range(b):
        n = int(q_lengths[i])
        if n == 0:
            continue
        pos = int(starts[i]) + np.arange(n)
        mask = np.arange(pos[-1] + 1)[None, :] <= pos[:, None]
        for h in range(q_heads):
            kh = k[slots[i], h // group, : pos[-1] + 1]
            vh = v[slots[i], h // group, : pos[-1] + 1]
            out[i, :n, h] = _softmax_pv(q[i, :n, h] @ kh.T * scale, mask, vh)
    return out


def _rel_err(got, want) -> float:
    return float(np.abs(_f64(got) - want).max() / np.abs(want).max())


def _check(got, want, ref, dtype):
    """No NaN anywhere (unwritten blocks are NaN in interpret mode) and both comparisons in bounds."""
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert np.isfinite(got).all(), "kernel output has NaN/inf: a block was not written or read padding"
    tol = TOL[dtype]
    assert _rel_err(got, want) <= tol, f"kernel vs float64 oracle: {_rel_err(got, want):.2e} > {tol}"
    assert _rel_err(ref, want) <= tol, f"reference vs float64 oracle: {_rel_err(ref, want):.2e} > {tol}"


@dataclasses.dataclass(frozen=True)
class Case:
    group: int
    head_dim: int
    dtype: type = jnp.float32
    block_k: int | None = 32
    num_splits: int | None = 1
    block_q: int | None = 8
    seq: int = 128
    kv_heads: int = 2
    use_slots: bool = True


DECODE_CASES = [
    Case(group=1, head_dim=64),
    Case(group=2, head_dim=128, block_k=16, num_splits=3, seq=100),   # T not a block multiple
    Case(group=4, head_dim=80, num_splits=2, seq=160),                 # padded head dim
    Case(group=7, head_dim=64, use_slots=False),                       # padded GQA group
    Case(group=8, head_dim=128, num_splits=4, kv_heads=1),
    Case(group=7, head_dim=80, dtype=jnp.bfloat16, num_splits=2),
    Case(group=4, head_dim=128, dtype=jnp.float16),
    Case(group=2, head_dim=64, dtype=jnp.bfloat16, block_k=None, num_splits=None),  # tuned defaults
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=repr)
def test_decode_matches_oracle(case: Case):
    rng = _rng("decode", case)
    t, bk = case.seq, case.block_k or 32
    lengths = np.array([1, bk - 1, bk, bk + 1, t, 0, int(rng.integers(2, t))], np.int32)
    s, s_cache, q_heads = len(lengths), len(lengths) + 2, case.kv_heads * case.group
    slots = rng.permutation(s_cache)[:s].astype(np.int32) if case.use_slots else np.arange(s, dtype=np.int32)
    q = _array(rng, (s, q_heads, case.head_dim), case.dtype)
    k = _array(rng, (s_cache, case.kv_heads, t, case.head_dim), case.dtype)
    v = _array(rng, (s_cache, case.kv_heads, t, case.head_dim), case.dtype)
    slot_arg = jnp.asarray(slots) if case.use_slots else None

    got = _run(pallas_kernels.decode_attention, q, k, v, jnp.asarray(lengths), slots=slot_arg,
               block_k=case.block_k, num_splits=case.num_splits)
    ref = _run(reference.decode_attention, q, k, v, jnp.asarray(lengths), slots=slot_arg)
    want = oracle_decode(q, k, v, lengths, slots, case.head_dim ** -0.5)

    assert got.shape == q.shape and got.dtype == q.dtype
    _check(got, want, ref, case.dtype)
    assert not np.asarray(got[lengths == 0], np.float32).any(), "inactive slot must output zeros"


PREFILL_CASES = [
    Case(group=1, head_dim=64, block_q=16),
    Case(group=2, head_dim=80, block_k=16, seq=100),
    Case(group=4, head_dim=128, dtype=jnp.bfloat16),
    Case(group=7, head_dim=64, block_q=4, use_slots=False),
    Case(group=8, head_dim=128, dtype=jnp.float16, kv_heads=1, block_q=2),
    Case(group=2, head_dim=64, block_q=None, block_k=None),  # tuned defaults
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=repr)
def test_prefill_matches_oracle(case: Case):
    rng = _rng("prefill", case)
    t, tq, bk = case.seq, 40, case.block_k or 32
    # (start, q_length): whole prompt; ragged chunk after a prefix; chunk ending at T; inactive row;
    # a single token right at a block edge.
    rows = [(0, tq), (37, tq - 5), (t - tq, tq), (5, 0), (bk, 1)]
    starts, q_lengths = (np.array(c, np.int32) for c in zip(*rows))
    b, s_cache, q_heads = len(rows), len(rows) + 1, case.kv_heads * case.group
    slots = rng.permutation(s_cache)[:b].astype(np.int32) if case.use_slots else np.arange(b, dtype=np.int32)
    q = _array(rng, (b, tq, q_heads, case.head_dim), case.dtype)
    k = _array(rng, (s_cache, case.kv_heads, t, case.head_dim), case.dtype)
    v = _array(rng, (s_cache, case.kv_heads, t, case.head_dim), case.dtype)
    slot_arg = jnp.asarray(slots) if case.use_slots else None
    args = (q, k, v, jnp.asarray(starts), jnp.asarray(q_lengths))

    got = _run(pallas_kernels.prefill_attention, *args, slots=slot_arg, block_q=case.block_q,
               block_k=case.block_k)
    ref = _run(reference.prefill_attention, *args, slots=slot_arg)
    want = oracle_prefill(q, k, v, starts, q_lengths, slots, case.head_dim ** -0.5)

    assert got.shape == q.shape and got.dtype == q.dtype
    _check(got, want, ref, case.dtype)
    padding = np.arange(tq)[None, :] >= q_lengths[:, None]
    assert not np.asarray(got, np.float32)[padding].any(), "padding rows must output zeros"


def test_decode_matches_jax_gqa_kernel():
    """JAX's own GQA decode kernel is an independent implementation; its cache is [B, T, kv_heads, D]."""
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode

    rng = _rng("gqa")
    s, kv_heads, group, t, d = 3, 2, 4, 128, 64
    q = _array(rng, (s, kv_heads * group, d), jnp.float32)
    k = _array(rng, (s, kv_heads, t, d), jnp.float32)
    v = _array(rng, (s, kv_heads, t, d), jnp.float32)
    lengths = jnp.array([1, 77, 128], jnp.int32)
    got = _run(pallas_kernels.decode_attention, q, k, v, lengths, block_k=32, num_splits=2)
    theirs = _run(jax_decode.gqa, q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), None, lengths,
                  block_k=32, k_splits=2)
    tol = 1e-5 if INTERPRET else 1e-2  # on a GPU JAX's kernel multiplies float32 as TF32
    assert _rel_err(got, _f64(theirs)) <= tol


@pytest.mark.parametrize("dtype, kv_dtype", [(jnp.bfloat16, None), (jnp.float32, None), (jnp.bfloat16, jnp.int8),
                                             (jnp.bfloat16, jnp.float8_e4m3fn)])
def test_kernels_lower_to_triton(dtype, kv_dtype, abstract_gpu):
    """Cross-lower for CUDA on any host: catches non-power-of-2 tensors, primitives Triton lacks, and
    loops that do not become scf.for, without a GPU. kv_dtype: a quantized cache with its scales."""
    q = jax.ShapeDtypeStruct((4, 28, 80), dtype)
    cache = jax.ShapeDtypeStruct((6, 4, 300, 80), kv_dtype or dtype)
    scale = jax.ShapeDtypeStruct((6, 4, 300), jnp.float32)
    scales = dict(k_scale=scale, v_scale=scale) if kv_dtype else {}
    rows = jax.ShapeDtypeStruct((4,), jnp.int32)
    decode = functools.partial(pallas_kernels.decode_attention, num_splits=2, block_k=64)
    prefill = functools.partial(pallas_kernels.prefill_attention, block_q=4)
    lowered = [
        jax.jit(decode).trace(q, cache, cache, rows, slots=rows, **scales).lower(lowering_platforms=("cuda",)),
        jax.jit(prefill).trace(jax.ShapeDtypeStruct((4, 50, 28, 80), dtype), cache, cache, rows, rows,
                               slots=rows, **scales).lower(lowering_platforms=("cuda",)),
    ]
    for low in lowered:
        assert "triton" in low.as_text()


def test_block_sizes_fit_every_target():
    for kind in ("decode", "prefill"):
        for tgt in ("sm75", "sm80", "sm86", "sm90", "cpu"):
            for head_dim in (64, 80, 96, 128):
                for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
                    cfg = tuning.block_sizes(kind, head_dim, dtype, tgt)
                    dp = tuning.padded_head_dim(head_dim)
                    assert tuning._smem(kind, cfg, dp, jnp.dtype(dtype).itemsize) <= tuning.SMEM_BYTES[tgt]
                    for key in ("block_k", "block_m"):
                        if key in cfg:
                            assert cfg[key] >= 16 and cfg[key] & (cfg[key] - 1) == 0, (kind, tgt, cfg)
    assert tuning.padded_head_dim(80) == tuning.padded_head_dim(96) == 128


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Stands in for a jax.Device: the GPU run has no CPU backend and the CPU run has no GPU."""
    compute_capability: str | None = None
    platform: str = "gpu"
    core_count: int = 40


def test_triton_unsupported_says_why():
    assert "CUDA compute capability" in tuning.triton_unsupported(FakeDevice(platform="cpu"))
    assert "8.0" in tuning.triton_unsupported(FakeDevice("7.5"))
    assert tuning.triton_unsupported(FakeDevice("8.6")) is None
    assert tuning.triton_unsupported(FakeDevice("8.6"), kv_dtype="int8") is None
    assert "8.9" in tuning.triton_unsupported(FakeDevice("8.6"), kv_dtype="float8_e4m3fn")
    assert tuning.triton_unsupported(FakeDevice("9.0"), kv_dtype="float8_e4m3fn") is None
    assert tuning.target(FakeDevice("7.5")) == "sm75" and tuning.target(FakeDevice("8.9")) == "sm86"


def test_resolve_impl(caplog):
    """The engine's dispatch (pocketjax.model.layers) over the kernel facts above: XLA wherever Pallas cannot run."""
    from pocketjax.errors import ConfigError
    from pocketjax.model.layers import resolve_impl

    from pocketjax.model import cpu_kernels

    native = "cpu" if cpu_kernels.available() else "xla"  # the native CPU kernels where they build
    if INTERPRET:  # the real default device of a CPU run
        assert resolve_impl("auto") == resolve_impl("auto", device=jax.devices()[0]) == native
    cpu = FakeDevice(platform="cpu")
    assert resolve_impl("auto", device=cpu) == resolve_impl("cpu", device=cpu) == native
    assert resolve_impl("auto", device=cpu, batch_invariant=False) == "xla"
    assert resolve_impl("pallas", device=cpu) == "xla"
    assert resolve_impl("xla", device=cpu) == "xla"
    assert resolve_impl("pallas_interpret", device=cpu) == "pallas_interpret"
    with caplog.at_level("INFO", logger="pocketjax"):
        assert resolve_impl("pallas", device=FakeDevice("7.5")) == "xla"
    assert "8.0" in caplog.records[-1].getMessage(), "the log line says why"
    assert resolve_impl("auto", device=FakeDevice("9.0")) == "pallas"
    assert resolve_impl("auto", device=FakeDevice("8.6")) == "pallas"
    assert resolve_impl("auto", "int8", FakeDevice("8.6")) == "pallas"
    assert resolve_impl("pallas", "float8_e4m3fn", FakeDevice("8.6")) == "xla"
    assert resolve_impl("auto", "float8_e4m3fn", FakeDevice("9.0")) == "pallas"
    with pytest.raises(ConfigError):
        resolve_impl("flash")


def test_split_plan_is_a_fixed_number_of_key_blocks_per_split():
    # 132-SM GPU: 4 key blocks per split whatever the rows (the plan does not even take them), up to 64 splits
    assert tuning.next_pow2(7) == 8
    assert tuning.split_plan(256, 132) == (64, 4)
    assert tuning.split_plan(8, 132) == (2, 4)
    assert tuning.split_plan(10, 132) == (3, 4)  # the last split is partial; a row's blocks keep their split
    assert tuning.split_plan(1024, 132) == (64, 16)  # past 64 x 4 blocks the share grows with the cache
    assert tuning.split_plan(256, 0) == (1, 256)  # interpret mode: one split
    assert tuning.split_plan(10, 132, num_splits=3) == (3, 4)  # an explicit count shares the blocks evenly


def test_decode_kernel_gives_a_row_the_same_bits_at_1_and_32_rows_and_any_cache_length(monkeypatch):
    """The split-K decode kernel (interpret mode, the GPU's split plan of a 132-SM device) computes a row the same
    way whatever the batch and whatever the length bucket of the cache slice it reads (issue 43)."""
    monkeypatch.setattr(tuning, "num_cores", lambda target=None: 132)
    rng = np.random.default_rng(9)
    rows, kv_heads, group, t, d = 32, 2, 2, 256, 32
    q = jnp.asarray(rng.standard_normal((rows, kv_heads * group, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((rows, kv_heads, t, d)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray(rng.integers(1, 120, rows), jnp.int32)
    decode = functools.partial(pallas_kernels.decode_attention, block_k=16, interpret=True)
    full = np.asarray(decode(q, k, v, lengths))  # 16 blocks: 4 splits of 4 blocks
    want = np.asarray(reference.decode_attention(q, k, v, lengths))
    np.testing.assert_allclose(full, want, atol=2e-5)
    for row in (0, 7, 31):
        alone = decode(q[row:row + 1], k, v, lengths[row:row + 1], slots=jnp.array([row]))
        assert np.array_equal(np.asarray(alone)[0], full[row]), row
        sliced = decode(q[row:row + 1], k[:, :, :128], v[:, :, :128], lengths[row:row + 1], slots=jnp.array([row]))
        assert np.array_equal(np.asarray(sliced)[0], full[row]), row  # 8 blocks: 2 splits, same partition


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_read_a_quantized_cache_like_its_dequantized_copy(kv_dtype, dtype):
    """int8 / float8 values + per-token, per-head scales, read in place (decode 1 and 2 splits, prefill, and the
    XLA reference path) == the reference over a float32 dequantized copy, which no implementation builds."""
    from pocketjax.model.kv_cache import dequantize, quantize

    rng = _rng("quantized", kv_dtype, dtype)
    s, q_heads, kv_heads, t, d = 3, 8, 2, 64, 128
    (kq, ks), (vq, vs) = (quantize(_array(rng, (s, kv_heads, t, d), jnp.float32), kv_dtype) for _ in range(2))
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    q, qp = _array(rng, (s, q_heads, d), dtype), _array(rng, (s, 24, q_heads, d), dtype)
    lengths, slots = jnp.array([5, 64, 33], jnp.int32), jnp.array([2, 0, 1], jnp.int32)
    starts, q_lengths = jnp.array([0, 20, 40], jnp.int32), jnp.array([24, 17, 3], jnp.int32)
    want_d = _f64(reference.decode_attention(q.astype(jnp.float32), kd, vd, lengths, slots=slots))
    want_p = _f64(reference.prefill_attention(qp.astype(jnp.float32), kd, vd, starts, q_lengths, slots=slots))
    scales = dict(k_scale=ks, v_scale=vs, slots=slots)
    got = {
        "reference decode": reference.decode_attention(q, kq, vq, lengths, **scales),
        "reference prefill": reference.prefill_attention(qp, kq, vq, starts, q_lengths, **scales),
        "decode": _run(pallas_kernels.decode_attention, q, kq, vq, lengths, block_k=16, num_splits=1, **scales),
        "decode split": _run(pallas_kernels.decode_attention, q, kq, vq, lengths, block_k=16, num_splits=2,
                             **scales),
        "prefill": _run(pallas_kernels.prefill_attention, qp, kq, vq, starts, q_lengths, block_q=8, block_k=16,
                        **scales),
    }
    for name, out in got.items():
        want = want_p if "prefill" in name else want_d
        assert out.dtype == dtype, name
        err = np.abs(_f64(out) - want).max() / np.abs(want).max()
        assert err <= TOL[dtype], (name, err)
