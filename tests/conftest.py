"""Shared fixtures. XLA_FLAGS must be set before jax is imported anywhere, so TP2 runs on two CPU devices."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["POCKETJAX_COMPILE_CACHE_DIR"] = "off"  # tests never write the user's compile cache (their own tests opt in)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Tiny Qwen configs covering the parity matrix: Qwen2 with bias, Qwen3 with QK-norm and explicit head_dim,
# tied and untied, GQA ratios 1, 2, 3 and 4, odd vocab sizes, RoPE scaling.
TINY_CONFIGS: dict[str, dict] = {
    "qwen2_gqa2_tied": dict(model_type="qwen2", vocab_size=257, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2_mha_untied": dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3_gqa4_headdim": dict(model_type="qwen3", vocab_size=301, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                               tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3_gqa3_bias_tied": dict(model_type="qwen3", vocab_size=263, hidden_size=48, intermediate_size=80,
                                 num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                 attention_bias=True, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen3_kv1": dict(model_type="qwen3", vocab_size=280, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2_yarn": dict(model_type="qwen2", vocab_size=257, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, rope_theta=10000.0,
                       rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3_linear": dict(model_type="qwen3", vocab_size=257, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def build_hf_checkpoint(folder: Path, name: str, seed: int = 0, dtype: str = "float32",
                        max_shard_size: str | None = None, **overrides) -> Path:
    """Save a random-weight transformers Qwen2/Qwen3 model (weights scaled up so logits are far from uniform)."""
    import torch
    import transformers

    cfg = {**TINY_CONFIGS[name], **overrides}
    cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[cfg.pop("model_type")]
    torch.manual_seed(seed)
    config = cls[0](**cfg, max_window_layers=0, use_sliding_window=False)
    model = cls[1](config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, **overrides) -> folder of a saved random-weight checkpoint, built once per session."""
    cache: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        key = name + json.dumps(overrides, sort_keys=True)
        if key not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[key] = build_hf_checkpoint(folder, name, **overrides)
        return cache[key]

    return make
