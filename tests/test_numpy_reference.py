"""tests/numpy_qwen.py, the float64 NumPy reference CI's torch-free leg checks pocketjax against, is itself held to
transformers here (in the leg that has transformers), on every test checkpoint, sharded and bfloat16 ones too."""
import ast
from pathlib import Path

import numpy as np
import pytest

import numpy_qwen
from conftest import TINY_CONFIGS, hf_config, oracle

torch = oracle("torch")
transformers = oracle("transformers")

CHECKPOINTS = [(name, {}) for name in sorted(TINY_CONFIGS)] + [
    ("qwen2_mha_untied", {"max_shard_size": "20KB"}),  # several model-*.safetensors and their index
    ("qwen3_gqa4_headdim", {"dtype": "bfloat16"}),  # bfloat16 tensors, widened to float64 by both sides
]
IDS = [name + "".join(f"-{v}" for v in overrides.values()) for name, overrides in CHECKPOINTS]


def tokens_for(name: str) -> np.ndarray:
    seq = 160 if "yarn" in name or "linear" in name else 37  # YaRN past original_max_position_embeddings (64)
    return np.random.default_rng(1).integers(0, TINY_CONFIGS[name]["vocab_size"], size=(2, seq))


def hf_float64(folder, tokens: np.ndarray):
    """transformers' float64 forward (logits and hidden states) of tokens."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens), output_hidden_states=True)


def assert_close(ours, out, tol: float) -> None:
    """Logits, and the residual stream after the embedding and each layer but the last (transformers' last hidden
    state is after the final norm, numpy_qwen's before it), within tol absolute."""
    logits, hidden = ours
    assert logits.dtype == np.float64 and logits.shape == out.logits.shape
    assert np.max(np.abs(logits - out.logits.numpy())) <= tol
    assert hidden.shape[0] == len(out.hidden_states)
    for i in range(len(out.hidden_states) - 1):
        assert np.max(np.abs(hidden[i] - out.hidden_states[i].numpy())) <= tol, i


@pytest.mark.parametrize("name, overrides", CHECKPOINTS, ids=IDS)
def test_matches_transformers_in_float64(hf_checkpoint, name, overrides):
    """Logits and hidden states against transformers' float64 forward, as transformers ships it.

    transformers keeps two steps in float32 even in a float64 model (RMSNorm upcasts to float32, and the RoPE
    tables are built in float32), so the two differ by float32 rounding: measured at most 1.2e-6 on logits up to 2.7
    in size. 5e-6 absolute leaves that margin; a tenfold eps or RoPE frequencies off by 0.1% move the logits by
    2.5e-4 or more.
    """
    folder = hf_checkpoint(name, **overrides)
    tokens = tokens_for(name)
    assert_close(numpy_qwen.forward(folder, tokens), hf_float64(folder, tokens), tol=5e-6)


@pytest.mark.parametrize("name, overrides", CHECKPOINTS, ids=IDS)
def test_matches_transformers_to_float64_rounding(hf_checkpoint, name, overrides, monkeypatch):
    """With transformers' two float32 steps computed in float64, everything else agrees to float64 rounding
    (measured 6e-15): the same architecture, not merely a close one. Its RoPE frequencies are checked apart."""
    folder = hf_checkpoint(name, **overrides)
    tokens = tokens_for(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    inv_freq, attention_factor = numpy_qwen.inverse_frequencies(numpy_qwen.read_config(folder))
    # transformers' own tables are float32: the frequencies agree to float32 rounding, the temperature exactly
    np.testing.assert_allclose(hf.model.rotary_emb.inv_freq.numpy(), inv_freq, rtol=2e-7)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(attention_factor, rel=1e-12)

    def rope_tables(x, position_ids):
        angles = position_ids[..., None].double() * torch.from_numpy(inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * attention_factor, angles.sin() * attention_factor

    def rms_norm(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(hf.model.rotary_emb, "forward", rope_tables)
    monkeypatch.setattr(type(hf.model.norm), "forward", rms_norm)  # Qwen3's q_norm/k_norm are the same class
    with torch.no_grad():
        out = hf(torch.tensor(tokens), output_hidden_states=True)
    assert_close(numpy_qwen.forward(folder, tokens), out, tol=1e-12)


def test_unsupported_rope_types_are_refused():
    """A RoPE type it does not implement raises instead of silently computing the default rotation."""
    for scaling in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "llama3", "factor": 8.0},
                    {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}):
        with pytest.raises(NotImplementedError):
            numpy_qwen.inverse_frequencies(hf_config("qwen2_gqa2_tied", rope_scaling=scaling))


def test_is_independent_of_pocketjax_and_jax():
    """It imports only the standard library, NumPy and safetensors, so it cannot share a bug with pocketjax."""
    tree = ast.parse((Path(__file__).parent / "numpy_qwen.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= {"json", "math", "pathlib", "numpy", "safetensors"}
