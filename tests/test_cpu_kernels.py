"""pocketjax's CPU kernel (model/cpu_kernels.py, csrc/skinny_matmul.cc): the bf16-weight decode product against the
float32 product of the same values, in every code path this CPU has; its use in `layers.linear` (single-device
programs only), in a model's decode, and the fallback when no compiler is found; the build cache."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.model import cpu_kernels, layers
from pocketjax.model.sharding import make_mesh

from test_engine import run

pytestmark = pytest.mark.skipif(not cpu_kernels.skinny_matmul_available(), reason="no C++ compiler for the kernel")
ISAS = sorted({cpu_kernels.resolved_isa_name(dt, isa) for dt in (jnp.float32, jnp.bfloat16)
               for isa in cpu_kernels.ISAS} if cpu_kernels.skinny_matmul_available() else [])


def reference(x, w):
    """The product in float64 of the kernel's inputs: exact up to float64 rounding."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_the_float_product_at_decode_rows_and_odd_sizes(isa, x_dtype):
    rng = np.random.default_rng(1)
    product = jax.jit(lambda x, w: cpu_kernels.skinny_matmul(x, w, isa))
    for rows, k, n in [(1, 37, 51), (2, 64, 33), (3, 1000, 17), (5, 17, 160), (8, 95, 48), (8, 1024, 3), (11, 40, 9)]:
        w = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
        got = product(x, w)
        assert got.shape == (rows, n) and got.dtype == x_dtype
        want = reference(x, w)
        # f32 sums in another order: a few ulps of the sum of |terms|; a bf16 result adds its own rounding (2^-8)
        scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
        tol = scale * 1e-6 + (np.abs(want) * 2.0**-8 if x_dtype == jnp.bfloat16 else 0)
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), tol + 1e-30)


def test_kernel_is_differentiable_and_vmaps():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((24, 40)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 2, 40)), jnp.float32)
    got = jax.vmap(lambda x: cpu_kernels.skinny_matmul(x, w))(x)
    np.testing.assert_allclose(got, np.einsum("bri,oi->bro", x, np.asarray(w, np.float32)), rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda x: (cpu_kernels.skinny_matmul(x, w) ** 2).sum())(x[0])
    want = jax.grad(lambda x: ((x @ w.astype(jnp.float32).T) ** 2).sum())(x[0])
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_linear_uses_the_kernel_on_one_device_and_xla_on_a_mesh(rows):
    w = jnp.asarray(np.random.default_rng(3).standard_normal((64, 32)), jnp.bfloat16)
    x = jnp.ones((rows, 32), jnp.bfloat16)
    text = jax.jit(layers.linear).lower(x, w).as_text()
    assert (cpu_kernels.TARGET in text) == (rows <= layers.KERNEL_ROWS)
    mesh = make_mesh(2)
    sharded = jax.device_put(w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp", None)))
    assert cpu_kernels.TARGET not in jax.jit(layers.linear).lower(x, sharded).as_text()  # XLA cannot split it


def test_bf16_model_greedy_decode_with_the_kernel_matches_xla_form_and_tp2(hf_checkpoint, monkeypatch):
    folder = hf_checkpoint("qwen3_gqa4_headdim", dtype="bfloat16")
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 301, 9)]
    greedy = pj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def decode(tp=1):
        engine = pj.Engine(pj.load_model(folder, dtype="bfloat16", tp=tp), max_batch_size=2, max_seq_len=64)
        return [r.generated_tokens for r in run(engine, [prompt, prompt[::-1]], greedy)]

    with_kernel = decode()
    tp2 = decode(tp=2)  # on a mesh: XLA's form, partitioned
    monkeypatch.setattr(cpu_kernels, "skinny_matmul_available", lambda: False)
    assert with_kernel == decode() == tp2  # the same bf16 weights: the forms differ in f32 summation order only


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_shaped_logits_with_the_kernel_equal_xla_forms(hf_checkpoint, monkeypatch, batch):
    from pocketjax.model import decoder

    model = pj.load_model(hf_checkpoint("qwen3_gqa4_headdim", dtype="bfloat16"), dtype="bfloat16")
    tokens = jnp.asarray([[3], [250]][:batch])  # one token per row: every linear has `batch` rows

    def step(p, t):
        return decoder.forward_logits(p, model.config, t)

    assert (cpu_kernels.TARGET in jax.jit(step).lower(model.params, tokens).as_text()) == (batch <= layers.KERNEL_ROWS)
    with_kernel = np.asarray(jax.jit(step)(model.params, tokens), np.float32)
    monkeypatch.setattr(cpu_kernels, "skinny_matmul_available", lambda: False)
    xla = np.asarray(jax.jit(step)(model.params, tokens), np.float32)
    # each product differs in f32 summation order only; its bf16 result can round one bf16 step apart, and that
    # carries through the layers: the logits agree to a few bf16 steps of their scale
    np.testing.assert_allclose(with_kernel, xla, atol=4 * 2.0**-8 * np.abs(xla).max())


def test_no_compiler_falls_back_to_xla_form(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("POCKETJAX_CXX", "none")
    with caplog.at_level(logging.INFO, logger="pocketjax"):
        assert cpu_kernels.build(directory=tmp_path) is None
    assert "no C++ compiler" in caplog.text and not list(tmp_path.iterdir())
    monkeypatch.setattr(cpu_kernels, "skinny_matmul_available", lambda: False)
    w = jnp.asarray(np.random.default_rng(5).standard_normal((16, 8)), jnp.bfloat16)
    x = jnp.ones((1, 8), jnp.bfloat16)
    assert cpu_kernels.TARGET not in jax.jit(layers.linear).lower(x, w).as_text()
    np.testing.assert_allclose(np.asarray(layers.linear(x, w), np.float32), reference(x, w), rtol=2**-7)


def test_a_failed_build_logs_and_returns_none(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pocketjax"):
        assert cpu_kernels.build(compiler="/bin/false", directory=tmp_path) is None
    assert "cannot build" in caplog.text or "build failed" in caplog.text


def test_cache_hit_does_not_rebuild(tmp_path, monkeypatch):
    lib = cpu_kernels.build(directory=tmp_path)
    assert lib is not None and lib.parent == tmp_path and lib.exists()
    mtime = lib.stat().st_mtime_ns
    calls = []
    real = cpu_kernels.subprocess.run
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real(cmd, **kw))
    assert cpu_kernels.build(directory=tmp_path) == lib and lib.stat().st_mtime_ns == mtime
    assert all("--version" in c for c in calls)  # only the compiler's version, for the key: no compile
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]  # built under a temp name, renamed


def test_the_env_switch_turns_the_kernel_off(monkeypatch):
    w, x = jnp.ones((16, 8), jnp.bfloat16), jnp.ones((1, 8), jnp.bfloat16)
    monkeypatch.setenv("POCKETJAX_CPU_KERNELS", "off")
    assert not cpu_kernels.skinny_matmul_available()
    assert cpu_kernels.TARGET not in jax.jit(layers.linear).lower(x, w).as_text()
