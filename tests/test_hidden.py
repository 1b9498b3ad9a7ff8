"""pj.logits(return_hidden=True) and hook=: hidden states and residual-stream patching against transformers (hidden
states against tests/numpy_qwen.py's float64 forward too, which needs no torch), in the unrolled and the scan layout."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.errors import RequestError
from pocketjax.model import layers

import numpy_qwen
from conftest import oracle

torch = oracle("torch")
transformers = oracle("transformers")

NAME = "qwen3_gqa4_headdim"  # 3 layers, QK-norm, untied lm_head
PATCHED_LAYER = 1


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    """scan_layers -> pocketjax's model; torch-free, so the tests that need no reference run in CI's second leg."""
    return {scan: pj.load_model(hf_checkpoint(NAME), scan_layers=scan) for scan in (False, True)}


@pytest.fixture(scope="module")
def hf(hf_checkpoint):
    """transformers' float32 model of the same checkpoint: the reference (skips where transformers is absent)."""
    return transformers.AutoModelForCausalLM.from_pretrained(hf_checkpoint(NAME), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokens(models):
    return np.random.default_rng(5).integers(0, models[False].config.vocab_size, (2, 13))


def rel_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def add_at(layer_index: int, vector):
    """A hook adding `vector` to the residual stream after layer `layer_index` (int or traced: jnp.where)."""
    def hook(layer, hidden):
        return hidden + jnp.where(layer == layer_index, 1.0, 0.0) * vector
    return hook


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_hidden_states_match_transformers(hf, models, tokens, scan):
    model = models[scan]
    logits, hidden = pj.logits(model, tokens, return_hidden=True)
    c = model.config
    assert hidden.shape == (c.num_layers + 1, 2, 13, c.hidden_size) and hidden.dtype == jnp.float32
    with torch.no_grad():
        out = hf(torch.tensor(tokens), output_hidden_states=True)
    ref = [h.numpy() for h in out.hidden_states]
    assert len(ref) == c.num_layers + 1
    for i in range(c.num_layers):  # the embedding, then each layer's output
        assert rel_err(hidden[i], ref[i]) <= 1e-5, i
    # transformers' last entry is after the final norm; ours is the residual stream before it
    normed = layers.rms_norm(hidden[-1], model.params["final_norm"], c.rms_norm_eps)
    assert rel_err(normed, ref[-1]) <= 1e-5
    assert rel_err(hidden[-1], ref[-1]) > 1e-2  # it really is the un-normed stream
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(pj.logits(model, tokens)))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_hidden_states_match_numpy_reference(hf_checkpoint, models, tokens, scan):
    """Every entry of return_hidden (the embedding, each layer's output, all before the final norm) against the
    float64 NumPy forward, which needs no torch; the same 1e-5 bound as against transformers."""
    _, ref = numpy_qwen.forward(hf_checkpoint(NAME), tokens)
    _, hidden = pj.logits(models[scan], tokens, return_hidden=True)
    assert hidden.shape == ref.shape
    for i in range(len(ref)):
        assert rel_err(hidden[i], ref[i]) <= 1e-5, (i, rel_err(hidden[i], ref[i]))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_hook_adding_a_vector_equals_transformers_forward_hook(hf, models, tokens, scan):
    model = models[scan]
    vector = np.random.default_rng(6).normal(0, 0.5, model.config.hidden_size).astype(np.float32)
    patched, hidden = pj.logits(model, tokens, hook=add_at(PATCHED_LAYER, vector), return_hidden=True)

    def torch_hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + torch.from_numpy(vector),) + tuple(output[1:])
        return output + torch.from_numpy(vector)

    handle = hf.model.layers[PATCHED_LAYER].register_forward_hook(torch_hook)
    try:
        with torch.no_grad():
            ref = hf(torch.tensor(tokens)).logits.numpy()
    finally:
        handle.remove()
    assert rel_err(patched, ref) <= 1e-5
    plain, unpatched = pj.logits(model, tokens, return_hidden=True)
    assert rel_err(patched, plain) > 1e-3  # the patch changed the output
    np.testing.assert_array_equal(np.asarray(hidden[:PATCHED_LAYER + 1]), np.asarray(unpatched[:PATCHED_LAYER + 1]))
    np.testing.assert_allclose(np.asarray(hidden[PATCHED_LAYER + 1] - unpatched[PATCHED_LAYER + 1]),
                               np.broadcast_to(vector, hidden.shape[1:]), atol=1e-5)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_identity_hook_leaves_logits_unchanged_and_hooks_jit(models, tokens, scan):
    model = models[scan]
    seen = []

    def identity(layer, hidden):
        seen.append(layer)
        return hidden

    np.testing.assert_array_equal(np.asarray(pj.logits(model, tokens, hook=identity)),
                                  np.asarray(pj.logits(model, tokens)))
    # the layer index: a Python int per unrolled layer (traced once each), one traced int32 under scan
    if scan:
        assert len(seen) == 1 and isinstance(seen[0], jax.core.Tracer) and seen[0].dtype == jnp.int32
    else:
        assert seen == list(range(model.config.num_layers))
    # jit-compatible: the patch vector is a traced argument of an outer jit
    vector = jnp.full((model.config.hidden_size,), 0.25, jnp.float32)
    jitted = jax.jit(lambda t, v: pj.logits(model, t, hook=add_at(PATCHED_LAYER, v)))
    np.testing.assert_allclose(np.asarray(jitted(tokens, vector)),
                               np.asarray(pj.logits(model, tokens, hook=add_at(PATCHED_LAYER, vector))), atol=1e-5)


def test_hook_must_be_callable(models, tokens):
    with pytest.raises(RequestError, match="hook"):
        pj.logits(models[False], tokens, hook=3)
