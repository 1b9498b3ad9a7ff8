"""pocketjax.nnx: the NNX view shares the loaded arrays (no copy, shardings kept) and computes pj.logits' forward."""
import jax
import numpy as np
import pytest
from flax import nnx

import pocketjax as pj
from pocketjax.model.lora import LoraConfig
from pocketjax.nnx import Decoder


def leaves_are_shared(view: Decoder, model: pj.Model) -> bool:
    ours = jax.tree.leaves(nnx.state(view.params))
    return len(ours) == len(jax.tree.leaves(model.params)) and all(
        a is b for a, b in zip(ours, jax.tree.leaves(model.params)))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_view_shares_the_arrays_and_gives_pj_logits(hf_checkpoint, scan_layers):
    model = pj.load_model(hf_checkpoint("qwen2_gqa2_tied"), scan_layers=scan_layers)
    view = Decoder(model)
    assert leaves_are_shared(view, model)
    tokens = np.random.default_rng(0).integers(0, 257, size=(2, 10))
    np.testing.assert_array_equal(np.asarray(view(tokens)), np.asarray(pj.logits(model, tokens)))
    (logits, hidden), (ref_logits, ref_hidden) = view(tokens, return_hidden=True), pj.logits(model, tokens,
                                                                                               return_hidden=True)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(ref_logits))
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(ref_hidden))
    back = view.to_model()
    assert all(a is b for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params)))


def test_view_of_a_tp2_model_keeps_shardings(hf_checkpoint):
    model = pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"), tp=2)
    view = Decoder(model, LoraConfig(rank=2, targets=("q", "o")))
    assert leaves_are_shared(view, model)
    merged = view.to_model()  # lora_B is zero: merged weights equal the base, placed like it
    for a, b in zip(jax.tree.leaves(merged.params), jax.tree.leaves(model.params)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    tokens = np.arange(12)[None] % 301
    np.testing.assert_allclose(np.asarray(view(tokens)), np.asarray(pj.logits(model, tokens)), rtol=1e-6, atol=1e-6)


def test_lora_params_are_the_trainable_set(hf_checkpoint):
    model = pj.load_model(hf_checkpoint("qwen3_kv1"))
    view = Decoder(model, LoraConfig(rank=3, targets=("v", "gate")), rngs=nnx.Rngs(0))
    adapters = jax.tree.leaves(nnx.state(view, nnx.LoRAParam))
    shapes = sorted(x.shape for x in adapters)
    h, i, r = model.config.hidden_size, model.config.intermediate_size, 3
    kv = model.config.num_kv_heads * model.config.head_dim
    assert shapes == sorted([(r, h), (kv, r), (r, h), (i, r)] * model.config.num_layers)  # PEFT's A [r, in], B [out, r]
    base = nnx.state(view, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))  # LoRAParam subclasses Param
    assert all(a is b for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(model.params)))
    assert len(jax.tree.leaves(base)) == len(jax.tree.leaves(model.params))
