"""Training: the loss and its gradient, the update loop, packing, and the saved folder against transformers."""
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.training import data, evaluation, train
from pocketjax.model.checkpoint import SafetensorsFile
from pocketjax.model.config import ModelConfig
from pocketjax.errors import ConfigError, RequestError
from pocketjax.serve.tokenizer import Tokenizer

from conftest import oracle

torch = oracle("torch")
transformers = oracle("transformers")

ASSET = Path(train.__file__).parents[1] / "assets" / "pocket-coder"
ARCH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
VOCAB = 64


def tiny(tie: bool = True, dtype: str = "float32") -> tuple[dict, ModelConfig]:
    config_dict = train.hf_config(ARCH, VOCAB, (1, 2), bos_token_id=1, pad_token_id=1, dtype=dtype,
                                  tie_word_embeddings=tie)
    return config_dict, ModelConfig.from_dict(config_dict)


def random_params(config: ModelConfig, seed: int = 0):
    """Weights large enough that logits are far from uniform, norms away from 1 so a swapped tensor shows."""
    rng = np.random.default_rng(seed)
    params = train.init_params(config, jax.random.key(seed), std=0.15)
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + 0.2 * rng.standard_normal(x.shape, np.float32))
                        if x.ndim == 1 else x, params)


def progressions(batch: int, seed: int, length: int = 17) -> np.ndarray:
    """Rows start + step * t (mod VOCAB): learnable from context within a few steps. One length throughout,
    so every test reuses the same compiled programs."""
    rng = np.random.default_rng(seed)
    start, step = rng.integers(0, VOCAB, (batch, 1)), rng.integers(1, 4, (batch, 1))
    return ((start + step * np.arange(length)) % VOCAB).astype(np.int32)


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def test_init_loss_is_near_uniform():
    _, config = tiny()
    params = train.init_params(config, jax.random.key(0))
    value = train.loss(params, progressions(2, 0), config)
    assert value.dtype == jnp.float32 and value.shape == ()
    assert abs(float(value) - math.log(VOCAB)) < 0.05  # std 0.02 init: nearly uniform predictions
    norms = [params["final_norm"]] + [p[k] for p in params["layers"] for k in p if k.endswith("norm")]
    assert all(bool(jnp.all(n == 1)) for n in norms)


def test_loss_takes_a_model_or_params_and_validates():
    _, config = tiny()
    params = random_params(config)
    tokens = progressions(2, 1)
    by_params = train.loss(params, tokens, config)
    assert np.isfinite(float(by_params))
    assert float(train.loss(pj.Model(config, params), tokens)) == float(by_params)
    with pytest.raises(ConfigError):
        train.loss(params, tokens)
    with pytest.raises(RequestError):
        train.loss(params, tokens[0], config)


def test_grad_matches_finite_differences():
    _, config = tiny()
    params = random_params(config)
    tokens = progressions(2, 2)
    grads = jax.jit(jax.grad(train.loss), static_argnames="config")(params, tokens, config)

    def at(tree, path):
        for key in path:
            tree = tree[key]
        return tree

    def loss_shifted(path, delta: np.ndarray) -> float:
        shifted = jax.tree.map(lambda x: x, params)
        parent = at(shifted, path[:-1])
        parent[path[-1]] = jnp.asarray(np.asarray(parent[path[-1]]) + delta)
        return float(train.loss(shifted, tokens, config))

    eps = 1e-2
    for path in [("embed",), ("layers", 0, "q_norm"), ("layers", 1, "down"), ("final_norm",)]:
        g = np.asarray(at(grads, path))
        direction = g / np.linalg.norm(g)  # float32 differences need a large directional derivative
        numeric = (loss_shifted(path, eps * direction) - loss_shifted(path, -eps * direction)) / (2 * eps)
        assert numeric == pytest.approx(float(np.linalg.norm(g)), rel=2e-2), path
    # and one scalar: the largest gradient entry of one layer's up projection
    path = ("layers", 0, "up")
    g = np.asarray(at(grads, path))
    idx = np.unravel_index(np.argmax(np.abs(g)), g.shape)
    unit = np.zeros(g.shape, np.float32)
    unit[idx] = 1.0
    numeric = (loss_shifted(path, eps * unit) - loss_shifted(path, -eps * unit)) / (2 * eps)
    assert numeric == pytest.approx(float(g[idx]), rel=2e-2)


def test_training_decreases_loss():
    _, config = tiny()
    batches = (progressions(8, seed) for seed in range(1000))
    params, history = train.train(config, batches, steps=40, lr=1e-2, warmup=5, log_every=10, log=None)
    assert [h["step"] for h in history] == [10, 20, 30, 40]
    assert all(np.isfinite(h["loss"]) for h in history)
    assert history[-1]["loss"] < history[0]["loss"] - 0.5
    assert evaluation.evaluate(params, config, progressions(8, 5000), batch_size=2) < math.log(VOCAB) - 1.0


def test_training_is_reproducible_and_leaves_its_input():
    _, config = tiny()
    windows = progressions(32, 7)
    start = random_params(config)
    runs = [train.train(config, data.shuffled_batches(windows, 8, seed=3), steps=3, lr=1e-2, warmup=2,
                        params=start, log=None)[0] for _ in range(2)]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(runs[0]["embed"]), np.asarray(start["embed"]))  # start not donated


def test_pack_overlaps_rows_by_one_token():
    rows = data.pack([[1, 2, 3], [4, 5]], separator=0, seq_len=2)
    np.testing.assert_array_equal(rows, [[1, 2, 3], [3, 0, 4], [4, 5, 0]])
    assert data.pack([[1]], separator=0, seq_len=4).shape == (0, 5)


@pytest.mark.parametrize("tie", [True, False])
def test_saved_folder_matches_transformers(tmp_path, tie):
    config_dict, config = tiny(tie=tie)
    params = random_params(config, seed=3)
    folder = train.save_checkpoint(params, config_dict, tmp_path / "model")
    names = set(SafetensorsFile(folder / "model.safetensors").keys())
    assert ("lm_head.weight" in names) == (not tie)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3ForCausalLM"] and saved["dtype"] == saved["torch_dtype"] == "float32"
    generation = transformers.GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id == [1, 2]

    model = pj.load_model(folder)
    for ours, loaded in zip(jax.tree.leaves(params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(loaded))  # exact round trip
    tokens = progressions(2, 4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert rel_err(pj.logits(model, tokens), ref) <= 1e-5


def test_bfloat16_folder_loads_as_float32(tmp_path):
    config_dict, config = tiny(dtype="bfloat16")
    params = random_params(config, seed=4)
    folder = train.save_checkpoint(params, config_dict, tmp_path / "model")
    assert SafetensorsFile(folder / "model.safetensors").header["model.embed_tokens.weight"]["dtype"] == "BF16"
    model = pj.load_model(folder, dtype="float32")
    for ours, loaded in zip(jax.tree.leaves(train.round_to(params, "bfloat16")), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(loaded))


@pytest.mark.skipif(not (ASSET / "model.safetensors").exists(), reason="embedded model not built")
def test_embedded_model_greedy_matches_transformers():
    tokenizer = transformers.AutoTokenizer.from_pretrained(ASSET)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ASSET).eval()  # as-is: the folder's own dtype
    model = pj.load_model(ASSET, dtype="float32")
    hf = hf.float()
    ours_tokenizer = Tokenizer.from_folder(ASSET)
    stop = model.config.eos_token_ids
    for prompt in ["def add(a, b):\n    return", "import os\n\n\ndef main():\n", "class Point:\n    def "]:
        ids = tokenizer(prompt, return_tensors="pt")
        assert ours_tokenizer.encode(prompt) == ids.input_ids[0].tolist()
        with torch.no_grad():
            out = hf.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        theirs = out[0, ids.input_ids.shape[1]:].tolist()
        ours = train.greedy(model.params, model.config, ids.input_ids[0].tolist(), 16, stop_ids=stop)
        assert ours == theirs, (prompt, tokenizer.decode(ours), tokenizer.decode(theirs))
        assert tokenizer.decode(ours).strip()  # real text, not only special tokens
