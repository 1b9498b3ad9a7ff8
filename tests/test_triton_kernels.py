"""The Triton attention kernels (pallas_kernels/triton_*.py): compiled offline by official Triton for sm75, sm80 and
sm90 with the resources read from the binaries, numerics in Triton's interpreter against the XLA reference, and
the dispatch rule that picks them.

Triton makes a kernel compiled or interpreted when it is defined (TRITON_INTERPRET at import time), so the
numerics run in one subprocess, this file run as a script with TRITON_INTERPRET=1, and the compile tests in this
process. POCKETJAX_KERNEL_TEST_MODE=gpu (benchmarks/device_check.sh) runs the same numerics in this process
through jax-triton on the GPU instead.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

pytest.importorskip("triton")  # a dev dependency on Linux x86_64 only

import jax
import jax.numpy as jnp

from pallas_kernels import reference, tuning

GPU_MODE = os.environ.get("POCKETJAX_KERNEL_TEST_MODE", "interpret") == "gpu"
# max |err| / max |reference|: float32 is exact up to summation order; float16 rounds P and the output.
TOL = {"float32": 1e-5, "float16": 2e-3}


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str                   # "decode" | "prefill"
    dtype: str = "float32"      # q's dtype (and the cache's unless int8)
    int8: bool = False          # int8 cache with float32 scales per (token, head)
    head_dim: int = 64
    group: int = 4
    kv_heads: int = 2
    seq: int = 72               # not a multiple of the blocks: the last block ends mid-block
    block_k: int = 16
    num_splits: int = 1
    block_q: int = 4


CASES = [
    Case("decode"),
    Case("decode", head_dim=80, group=2, num_splits=3),                 # padded head dim, split-K
    Case("decode", dtype="float16", head_dim=128, group=8, kv_heads=1, seq=100, block_k=32, num_splits=2),
    Case("decode", int8=True, num_splits=2),
    Case("decode", dtype="float16", int8=True, head_dim=128, group=7),  # padded GQA group
    Case("prefill"),
    Case("prefill", dtype="float16", head_dim=80, group=2, block_k=32),
    Case("prefill", int8=True, group=8, kv_heads=1, block_q=2),
]


def _inputs(case: Case):
    """Random q, cache (+ scales) and row arrays; lengths 0, 1, block-1, block, block+1, T and a random one."""
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    bk, t, s_cache = case.block_k, case.seq, 9
    q_heads, d = case.kv_heads * case.group, case.head_dim
    cache_shape = (s_cache, case.kv_heads, t, d)
    if case.int8:
        k, v = (jnp.asarray(rng.integers(-127, 128, cache_shape), jnp.int8) for _ in range(2))
        scales = {name: jnp.asarray(rng.uniform(0.002, 0.02, cache_shape[:3]), jnp.float32)
                  for name in ("k_scale", "v_scale")}
    else:
        k, v = (jnp.asarray(rng.standard_normal(cache_shape), case.dtype) for _ in range(2))
        scales = {}
    if case.kind == "decode":
        lengths = np.array([0, 1, bk - 1, bk, bk + 1, t, int(rng.integers(2, t))], np.int32)
        q = jnp.asarray(rng.standard_normal((len(lengths), q_heads, d)), case.dtype)
        rows = (jnp.asarray(lengths),)
    else:
        tq = 11
        starts = np.array([0, bk - 3, 40, t - 5], np.int32)
        q_lengths = np.array([tq, 6, 0, 5], np.int32)
        q = jnp.asarray(rng.standard_normal((len(starts), tq, q_heads, d)), case.dtype)
        rows = (jnp.asarray(starts), jnp.asarray(q_lengths))
    slots = jnp.asarray(rng.permutation(s_cache)[: q.shape[0]].astype(np.int32))
    return q, k, v, rows, slots, scales


def numerics_errors(interpret: bool) -> dict[str, float]:
    """Each case's max |kernel - reference| / max |reference| (NaN when the kernel output holds NaN/inf: the
    interpreter's outputs start as NaN, so an unwritten element shows)."""
    from pallas_kernels import triton_launch

    errors = {}
    for case in CASES:
        q, k, v, rows, slots, scales = _inputs(case)
        if case.kind == "decode":
            got = triton_launch.decode_attention(q, k, v, *rows, slots=slots, block_k=case.block_k,
                                                 num_splits=case.num_splits, interpret=interpret, **scales)
            want = reference.decode_attention(q, k, v, *rows, slots=slots, **scales)
        else:
            got = triton_launch.prefill_attention(q, k, v, *rows, slots=slots, block_q=case.block_q,
                                                  block_k=case.block_k, interpret=interpret, **scales)
            want = reference.prefill_attention(q, k, v, *rows, slots=slots, **scales)
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        finite = np.isfinite(got).all()
        errors[repr(case)] = float(np.abs(got - want).max() / np.abs(want).max()) if finite else float("nan")
    return errors


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    if GPU_MODE:
        pytest.importorskip("jax_triton", reason="the GPU numerics launch through jax-triton (not installed here)")
        return numerics_errors(interpret=False)
    if importlib.util.find_spec("torch") is None:  # CI's torch-free leg
        pytest.skip("Triton's interpreter runs the kernels on torch CPU tensors (torch not installed)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=root,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_numerics_match_xla_reference(errors, case: Case):
    err = errors[repr(case)]
    assert np.isfinite(err), "kernel output has NaN/inf: an element was not written or padding was read"
    assert err <= TOL[case.dtype], f"{err:.2e} > {TOL[case.dtype]}"


# --- compiled offline: what each preset's binary uses, against its target's limits ---------------------------------

TARGETS = {"sm75": 75, "sm80": 80, "sm90": 90}
MAX_REGISTERS = 255  # per thread, every target since sm35
# sm75 is where the Triton path runs: every dtype it serves, both padded head dims. sm80 / sm90 (Pallas's by
# default, Triton when forced or in the H200 device check): the 16-bit kernels.
COMPILES = ([(kind, "sm75", dtype, d) for kind in ("decode", "prefill") for dtype in ("float16", "float32", "int8")
             for d in (128,)]
            + [(kind, "sm75", "float16", 64) for kind in ("decode", "prefill")]
            + [(kind, tgt, "float16", 128) for kind in ("decode", "prefill") for tgt in ("sm80", "sm90")])


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory):
    """Compile into a fresh Triton cache: each test really compiles, and ~/.triton stays untouched."""
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    yield
    if old is None:
        os.environ.pop("TRITON_CACHE_DIR")
    else:
        os.environ["TRITON_CACHE_DIR"] = old


def _launch(kind: str, tgt: str, dtype: str, head_dim: int):
    """The launch of a Qwen-like shape (GQA group 8, 2048 cached tokens) with `tgt`'s presets."""
    from pallas_kernels import triton_decode, triton_prefill

    q_dtype = "float16" if dtype == "int8" else dtype
    cache = jnp.zeros((4, 2, 2048, head_dim), dtype)
    scales = dict(k_scale=jnp.zeros(cache.shape[:3]), v_scale=jnp.zeros(cache.shape[:3])) if dtype == "int8" else {}
    rows = jnp.zeros((4,), jnp.int32)
    if kind == "decode":
        return triton_decode.plan_decode(jnp.zeros((4, 16, head_dim), q_dtype), cache, cache, rows, target=tgt,
                                         **scales)
    return triton_prefill.plan_prefill(jnp.zeros((4, 256, 16, head_dim), q_dtype), cache, cache, rows, rows,
                                       target=tgt, **scales)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="kernels defined as interpreted")
@pytest.mark.parametrize("kind, tgt, dtype, head_dim", COMPILES)
def test_compiled_kernel_fits_target(triton_cache, kind, tgt, dtype, head_dim):
    from pallas_kernels import triton_launch

    compiled = triton_launch.compile_offline(_launch(kind, tgt, dtype, head_dim), TARGETS[tgt])
    usage = triton_launch.resource_usage(compiled)
    assert usage["shared"] <= tuning.SMEM_BYTES[tgt], usage
    assert usage["registers"] <= MAX_REGISTERS, usage
    assert usage["spill_stores"] == usage["spill_loads"] == 0, f"registers spill with the {tgt} preset: {usage}"
    # Turing has no mma for these dots: official Triton emits FMA there, tensor-core mma from sm80 on.
    has_mma = "mma.sync" in compiled.asm["ptx"] or "wgmma" in compiled.asm["ptx"]
    if tgt == "sm75":
        assert not has_mma
    elif dtype == "float16":
        assert has_mma


# --- dispatch -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FakeDevice:
    compute_capability: str | None = None
    platform: str = "gpu"
    core_count: int = 40


def test_dispatch_picks_triton_below_sm80(monkeypatch, caplog):
    """auto: Pallas from 8.0, the Triton kernels below it when jax-triton imports, XLA otherwise; "triton" forces."""
    import types

    from pocketjax.model.layers import resolve_impl

    monkeypatch.setitem(sys.modules, "jax_triton", None)  # import fails, as on a JAX without CUDA
    with caplog.at_level("INFO", logger="pocketjax"):
        assert resolve_impl("auto", device=FakeDevice("7.5")) == "xla"
    assert "jax-triton" in caplog.records[-1].getMessage(), "the log line says why"
    assert resolve_impl("triton", device=FakeDevice("9.0")) == "xla"

    monkeypatch.setitem(sys.modules, "jax_triton", types.ModuleType("jax_triton"))  # installed
    with caplog.at_level("INFO", logger="pocketjax"):
        assert resolve_impl("auto", device=FakeDevice("7.5")) == "triton"
    assert "8.0" in caplog.records[-1].getMessage() and "jax-triton" in caplog.records[-1].getMessage()
    assert resolve_impl("auto", "float16", FakeDevice("7.5")) == "triton"
    assert resolve_impl("auto", "int8", FakeDevice("7.0")) == "triton"
    assert resolve_impl("auto", "bfloat16", FakeDevice("7.5")) == "xla"          # no bf16 on Turing
    assert resolve_impl("auto", "float8_e4m3fn", FakeDevice("7.5")) == "xla"
    assert resolve_impl("pallas", device=FakeDevice("7.5")) == "xla"              # Pallas itself still refused
    assert resolve_impl("auto", device=FakeDevice("8.0")) == "pallas"
    assert resolve_impl("auto", device=FakeDevice("9.0")) == "pallas"
    assert resolve_impl("triton", device=FakeDevice("9.0")) == "triton"
    assert resolve_impl("triton", "bfloat16", FakeDevice("9.0")) == "triton"
    assert resolve_impl("triton", device=FakeDevice(platform="cpu")) == "xla"


if __name__ == "__main__":  # the interpreter run of `errors` (TRITON_INTERPRET=1, CPU)
    jax.config.update("jax_platforms", "cpu")
    print(json.dumps(numerics_errors(interpret=True)))
