"""An independent float64 NumPy forward of the Qwen2/2.5/3 dense decoder, read straight from a checkpoint folder.

It is the reference the parity tests fall back on where transformers is absent (CI's torch-free leg), so it is written
from the architecture as transformers' modeling_qwen2/qwen3 define it and imports neither pocketjax nor jax: a bug in
pocketjax's layers or config parsing cannot be shared by it. Everything runs in float64, so its own rounding is far
below the float32 it checks. tests/test_numpy_reference.py holds it to transformers in the leg that has both.
"""
import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def read_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def read_weights(folder) -> dict[str, np.ndarray]:
    """Every tensor as float64, from model.safetensors or from each shard model.safetensors.index.json names."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights = {}
    for file in files:
        weights |= load_file(folder / file)
    return {name: array.astype(np.float64) for name, array in weights.items()}


def head_dim(config: dict) -> int:
    """Qwen3 states head_dim; Qwen2 derives it (a Qwen2 config.json may also state it)."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def rope_parameters(config: dict) -> dict:
    """transformers 5's rope_parameters, or the rope_theta + rope_scaling pair older configs write, as one dict."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def inverse_frequencies(config: dict) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim/2], attention factor) for the RoPE types the test checkpoints use: default, linear, YaRN."""
    rope, dim = rope_parameters(config), head_dim(config)
    theta, kind = float(rope["rope_theta"]), rope["rope_type"]
    inv_freq = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":  # position interpolation: every position divided by the factor
        return inv_freq / float(rope["factor"]), 1.0
    if kind == "yarn":
        return yarn_frequencies(rope, dim, theta, inv_freq, config["max_position_embeddings"])
    raise NotImplementedError(f"rope_type {kind!r}: numpy_qwen implements default, linear and yarn")


def yarn_frequencies(rope: dict, dim: int, theta: float, inv_freq: np.ndarray,
                     max_positions: int) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): NTK-by-parts between interpolated and original frequencies, plus a temperature."""
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        raise NotImplementedError("YaRN mscale / mscale_all_dim (DeepSeek's variant)")
    original = rope.get("original_max_position_embeddings") or max_positions
    factor = float(rope.get("factor") or max_positions / original)
    attention = rope.get("attention_factor") or (1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0)

    def dimension(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(rope.get("beta_fast") or 32), dimension(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    interpolate = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)  # 0: keep, 1: divide by factor
    return inv_freq * (1 - interpolate) + inv_freq / factor * interpolate, float(attention)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE (transformers' convention: the two halves of each head are the pairs) on x [B, T, H, D]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def linear(x: np.ndarray, w: dict, name: str) -> np.ndarray:
    """x @ W.T (+ b): weights stored [out, in] as transformers saves them; the bias only where the checkpoint has one."""
    bias = w.get(name + ".bias")
    return x @ w[name + ".weight"].T + (0.0 if bias is None else bias)


def attention(x: np.ndarray, w: dict, prefix: str, config: dict, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Causal grouped-query self-attention of one layer; Qwen3's per-head q_norm/k_norm come before RoPE."""
    (batch, length, _), dim = x.shape, head_dim(config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    q = linear(x, w, prefix + "q_proj").reshape(batch, length, heads, dim)
    k = linear(x, w, prefix + "k_proj").reshape(batch, length, kv_heads, dim)
    v = linear(x, w, prefix + "v_proj").reshape(batch, length, kv_heads, dim)
    if prefix + "q_norm.weight" in w:
        q = rms_norm(q, w[prefix + "q_norm.weight"], config["rms_norm_eps"])
        k = rms_norm(k, w[prefix + "k_norm.weight"], config["rms_norm_eps"])
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k, v = (np.repeat(t, heads // kv_heads, axis=2) for t in (k, v))  # query head h reads KV head h // group
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dim)
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, heads * dim)
    return linear(out, w, prefix + "o_proj")


def mlp(x: np.ndarray, w: dict, prefix: str) -> np.ndarray:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate = linear(x, w, prefix + "gate_proj")
    return linear(gate / (1.0 + np.exp(-gate)) * linear(x, w, prefix + "up_proj"), w, prefix + "down_proj")


def check_supported(config: dict) -> None:
    """Refuse what this reference does not implement rather than silently computing another model."""
    if config["model_type"] not in ("qwen2", "qwen3"):
        raise NotImplementedError(f"model_type {config['model_type']!r}")
    if config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {config['hidden_act']!r}")
    if config.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention")


def forward(folder, tokens) -> tuple[np.ndarray, np.ndarray]:
    """(logits [B, T, vocab], hidden [layers + 1, B, T, hidden_size]) in float64 for int tokens [B, T].

    hidden holds the embedding and then each layer's output: the residual stream before the final norm (what
    pocketjax's return_hidden gives; transformers' last hidden state is after the norm instead).
    """
    config, w = read_config(folder), read_weights(folder)
    check_supported(config)
    tokens = np.asarray(tokens)
    inv_freq, attention_factor = inverse_frequencies(config)
    angles = np.arange(tokens.shape[1], dtype=np.float64)[:, None] * inv_freq
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles) * attention_factor, np.sin(angles) * attention_factor
    eps = config["rms_norm_eps"]
    x = w["model.embed_tokens.weight"][tokens]
    hidden = [x]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + attention(rms_norm(x, w[p + "input_layernorm.weight"], eps), w, p + "self_attn.", config, cos, sin)
        x = x + mlp(rms_norm(x, w[p + "post_attention_layernorm.weight"], eps), w, p + "mlp.")
        hidden.append(x)
    head = w["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else w["lm_head.weight"]
    return rms_norm(x, w["model.norm.weight"], eps) @ head.T, np.stack(hidden)


def logits(folder, tokens) -> np.ndarray:
    """float64 logits [B, T, vocab] of int tokens [B, T]."""
    return forward(folder, tokens)[0]
