"""pj.logits composes with JAX transformations: jit (over tokens and over params), vmap, grad, sharded inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pocketjax as pj
from pocketjax.errors import RequestError


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"))


@pytest.fixture(scope="module")
def tokens(model):
    return jnp.asarray(np.random.default_rng(3).integers(0, model.config.vocab_size, (4, 12)), jnp.int32)


def assert_close(got, want, rel=1e-6):
    """Max error relative to the largest |logit|: float32 programs compiled in two ways may round differently."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= rel * np.max(np.abs(want)), np.max(np.abs(got - want))


def test_jit_over_tokens_and_over_params_equals_eager(model, tokens):
    eager = pj.logits(model, tokens)
    assert_close(jax.jit(lambda t: pj.logits(model, t))(tokens), eager)
    over_params = jax.jit(lambda p, t: pj.logits(pj.Model(model.config, p), t))
    assert_close(over_params(model.params, tokens), eager)


def test_vmap_equals_eager(model, tokens):
    eager = pj.logits(model, tokens)
    assert_close(jax.vmap(lambda t: pj.logits(model, t[None])[0])(tokens), eager)
    assert_close(jax.jit(jax.vmap(lambda t: pj.logits(model, t)))(tokens[:, None])[:, 0], eager)


def test_sharded_tokens_equal_eager(model, tokens):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    sharded = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    assert_close(pj.logits(model, sharded), pj.logits(model, tokens))


def nll(params, config, tokens):
    """A loss built on the logits: mean next-token negative log-likelihood."""
    logp = jax.nn.log_softmax(pj.logits(pj.Model(config, params), tokens[:, :-1]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_grad_matches_finite_differences(model, tokens):
    grad = jax.jit(jax.grad(nll), static_argnums=1)(model.params, model.config, tokens)
    eager_grad = jax.grad(nll)(model.params, model.config, tokens)
    for g, e in zip(jax.tree.leaves(grad), jax.tree.leaves(eager_grad)):
        assert_close(g, e, rel=1e-5)
    # central difference along one random direction of unit norm: d/de L(p + e v) = <grad L, v>
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    v = [jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)]
    norm = jnp.sqrt(sum(jnp.sum(d * d) for d in v))
    v = [d / norm for d in v]
    eps = 1e-2
    shifted = lambda s: jax.tree.unflatten(tree, [x + s * eps * d for x, d in zip(leaves, v)])  # noqa: E731
    fd = (nll(shifted(1), model.config, tokens) - nll(shifted(-1), model.config, tokens)) / (2 * eps)
    analytic = sum(jnp.sum(g * d) for g, d in zip(jax.tree.leaves(grad), v))
    # float32 loss ~5: a difference over 2e-2 resolves ~5e-5; the O(eps^2) truncation is far below that
    assert abs(float(fd) - float(analytic)) <= 2e-3 * max(abs(float(analytic)), 1.0), (float(fd), float(analytic))


def test_eager_bad_input_still_raises_and_traced_checks_shapes(model):
    vocab = model.config.vocab_size
    with pytest.raises(RequestError, match="token ids must lie"):
        pj.logits(model, [[1, 2, vocab]])
    with pytest.raises(RequestError, match="integer token ids"):
        pj.logits(model, [[1.5, 2.0]])
    with pytest.raises(RequestError, match="non-empty"):
        jax.jit(lambda t: pj.logits(model, t))(jnp.zeros((2, 3, 4), jnp.int32))
    with pytest.raises(RequestError, match="integer token ids"):
        jax.jit(lambda t: pj.logits(model, t))(jnp.ones((1, 3), jnp.float32))
