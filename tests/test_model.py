"""Parity of pj.logits with transformers' forward on the same random-weight checkpoints, and with tests/numpy_qwen.py's
float64 NumPy forward, which needs no torch: CI's torch-free leg checks the model against that one."""
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.errors import RequestError

import numpy_qwen
from conftest import TINY_CONFIGS, oracle

torch = oracle("torch")
transformers = oracle("transformers")


def hf_logits(folder, tokens: np.ndarray, dtype=None) -> np.ndarray:
    """transformers' logits for tokens, in dtype (default torch.float32)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def float32_logits(hf_checkpoint):
    """name -> (folder, tokens, pj.logits in float32), computed once for both references."""
    cache = {}

    def run(name: str):
        if name not in cache:
            folder = hf_checkpoint(name)
            model = pj.load_model(folder)
            seq = 160 if "yarn" in name or "linear" in name else 37  # past original_max_position_embeddings for yarn
            tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, size=(2, seq))
            cache[name] = folder, tokens, np.asarray(pj.logits(model, tokens))
        return cache[name]

    return run


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_float32_logits_match_transformers(float32_logits, name):
    folder, tokens, ours = float32_logits(name)
    ref = hf_logits(folder, tokens)
    assert ours.shape == ref.shape == (*tokens.shape, TINY_CONFIGS[name]["vocab_size"])
    assert rel_err(ours, ref) <= 1e-5, rel_err(ours, ref)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_float32_logits_match_numpy_reference(float32_logits, name):
    """The same bound against the float64 NumPy forward, so the torch-free leg checks the model too: float32
    rounding through 2-3 layers stays within 1e-6 of the largest logit (measured), so 1e-5 leaves a margin, and a
    wrong eps (1e-5 for 1e-6) already moves it to 1.3e-4 or more, ignored RoPE scaling or interleaved RoPE to 0.06+."""
    folder, tokens, ours = float32_logits(name)
    ref = numpy_qwen.logits(folder, tokens)
    assert ours.shape == ref.shape == (*tokens.shape, TINY_CONFIGS[name]["vocab_size"])
    assert rel_err(ours, ref) <= 1e-5, rel_err(ours, ref)


def test_bfloat16_logits_within_bound(hf_checkpoint):
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    tokens = np.random.default_rng(2).integers(0, 301, size=(1, 24))
    ours = np.asarray(pj.logits(pj.load_model(folder, dtype="bfloat16"), tokens))
    ref32 = hf_logits(folder, tokens)
    ref16 = hf_logits(folder, tokens, dtype=torch.bfloat16)
    # Stated bound: bfloat16 keeps 8 mantissa bits; through 3 layers the logits stay within 5% of float32,
    # and within the same distance of transformers' own bfloat16 forward.
    assert rel_err(ours, ref32) < 5e-2
    assert rel_err(ours, ref16) < 5e-2


def test_bfloat16_logits_within_bound_of_numpy_reference(hf_checkpoint):
    """The bfloat16 bound above, against the float64 NumPy forward (runs without torch)."""
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    tokens = np.random.default_rng(2).integers(0, 301, size=(1, 24))
    ours = np.asarray(pj.logits(pj.load_model(folder, dtype="bfloat16"), tokens))
    assert rel_err(ours, numpy_qwen.logits(folder, tokens)) < 5e-2


def test_sharded_checkpoint_loads_identically(hf_checkpoint):
    single = pj.load_model(hf_checkpoint("qwen2_mha_untied"))
    sharded = pj.load_model(hf_checkpoint("qwen2_mha_untied", max_shard_size="20KB"))
    import pathlib
    assert (pathlib.Path(hf_checkpoint("qwen2_mha_untied", max_shard_size="20KB"))
            / "model.safetensors.index.json").exists()
    tokens = np.arange(12)[None] % 300
    np.testing.assert_array_equal(np.asarray(pj.logits(single, tokens)), np.asarray(pj.logits(sharded, tokens)))


def test_logits_rejects_bad_tokens(hf_checkpoint):
    model = pj.load_model(hf_checkpoint("qwen2_gqa2_tied"))
    with pytest.raises(RequestError, match="token ids"):
        pj.logits(model, [[1, 2, 257]])
    with pytest.raises(RequestError, match="non-empty"):
        pj.logits(model, np.zeros((1, 0), np.int32))
