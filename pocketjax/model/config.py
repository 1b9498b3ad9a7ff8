"""ModelConfig parsed from a Hugging Face config.json, and the RoPE frequencies it implies.

Both spellings are accepted: what released Qwen checkpoints carry (`rope_theta`, `rope_scaling`, `torch_dtype`)
and what transformers 5 writes (`rope_parameters`, `dtype`). Anything we cannot run exactly raises ConfigError,
including an AWQ/GPTQ `quantization_config` we cannot read (parsed here once into a QuantizationConfig).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE base and scaling; `params` keeps the scaling keys (factor, beta_fast, ...) as a sorted tuple."""

    theta: float
    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class QuantizationConfig:
    """How an AWQ (GEMM) or GPTQ int4 checkpoint stores its linear weights: its checked `quantization_config`.

    The reader takes GPTQ's row order from each weight's g_idx; `desc_act` is kept for planning (a desc_act weight is
    stored with an int32 [in] permutation).
    """

    method: str  # "awq" | "gptq"
    bits: int  # 4
    group_size: int  # input rows per scale and zero; -1: one group over the whole input dim
    zero_offset: int  # added to every stored zero: GPTQ checkpoint_format "gptq" (v1) stores zero - 1
    desc_act: bool = False  # GPTQ: input rows stored in activation order (a permutation per weight)

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Qwen2/Qwen2.5/Qwen3 dense decoder: everything the forward pass needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # How the checkpoint stores its weights, not the architecture: left out of == and hash, so the jitted functions
    # (config is a static argument) compile once per architecture, as before.
    quantization: QuantizationConfig | None = field(default=None, compare=False)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count, counting a tied embedding once."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        layer = attn + 3 * h * i + norms
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Parse and check a config.json dict; raises ConfigError naming the offending field."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ConfigError(f"config.json is missing the required field {key!r}")
            if not isinstance(cfg[key], int) or cfg[key] <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {cfg[key]!r}")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(
                f"num_key_value_heads={kv_heads!r} must be a positive divisor of num_attention_heads={heads}"
            )
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(
                    f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and no head_dim is given"
                )
            head_dim = hidden // heads
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even integer, got {head_dim!r}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (Qwen uses 'silu')")
        if cfg.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported (sliding-window attention)")
        eps = cfg.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or eps <= 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {eps!r}")
        max_pos = cfg.get("max_position_embeddings", 32768)
        if not isinstance(max_pos, int) or max_pos <= 0:
            raise ConfigError(f"max_position_embeddings must be a positive integer, got {max_pos!r}")
        if model_type == "qwen2":
            bias = cfg.get("attention_bias", True)
            if bias is False:
                raise ConfigError("attention_bias=false contradicts model_type 'qwen2', which always has QKV bias")
        else:
            bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            rope=parse_rope(cfg),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            qk_norm=model_type == "qwen3",
            dtype=parse_dtype(cfg),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            quantization=parse_quantization(cfg),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        """Read `path/config.json`; a missing or unparsable file raises ConfigError."""
        file = Path(path) / "config.json"
        try:
            cfg = json.loads(file.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{file} not found") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from e
        return cls.from_dict(cfg)


def parse_dtype(cfg: dict[str, Any]) -> str:
    """The checkpoint dtype from `torch_dtype` (released checkpoints) or `dtype` (transformers 5)."""
    spellings = {k: cfg[k] for k in ("torch_dtype", "dtype") if cfg.get(k) is not None}
    values = {str(v).removeprefix("torch.") for v in spellings.values()}
    if len(values) > 1:
        raise ConfigError(f"torch_dtype and dtype disagree: {spellings}")
    value = values.pop() if values else "float32"
    if value not in DTYPES:
        raise ConfigError(f"torch_dtype={value!r} is not supported (supported: {', '.join(DTYPES)})")
    return value


def parse_quantization(cfg: dict[str, Any]) -> QuantizationConfig | None:
    """The AWQ/GPTQ scheme `quantization_config` declares; None for a float checkpoint."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ConfigError(f"quantization_config.quant_method={method!r} is not supported (supported: awq, gptq)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ConfigError(f"{method} with bits={bits!r} is not supported (supported: 4)")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise ConfigError(f"quantization_config.group_size={group!r} must be a positive integer or -1")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"AWQ version={version!r} is not supported (supported: gemm)")
        if qc.get("zero_point", True) is not True:
            raise ConfigError("AWQ zero_point=false is not supported (AWQ GEMM checkpoints store zeros)")
        return QuantizationConfig("awq", 4, group, zero_offset=0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"GPTQ checkpoint_format={fmt!r} is not supported (supported: gptq, gptq_v2)")
    return QuantizationConfig("gptq", 4, group, zero_offset=1 if fmt == "gptq" else 0,
                              desc_act=qc.get("desc_act", False) is True)


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    """RoPE theta and scaling from `rope_theta`/`rope_scaling` or `rope_parameters`; they must agree if both exist."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError("rope_parameters and rope_scaling must be JSON objects")
    theta_old, theta_new = cfg.get("rope_theta"), params.get("rope_theta")
    if theta_old is not None and theta_new is not None and float(theta_old) != float(theta_new):
        raise ConfigError(f"rope_theta={theta_old} contradicts rope_parameters.rope_theta={theta_new}")
    theta = theta_new if theta_new is not None else theta_old
    if theta is None:
        theta = 10000.0
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"rope_theta must be positive, got {theta!r}")
    merged = {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}
    for key in set(scaling) & set(params):
        if scaling[key] != params[key]:
            raise ConfigError(f"rope_scaling.{key}={scaling[key]!r} contradicts rope_parameters.{key}={params[key]!r}")
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if rope_type in ("linear", "yarn"):
        factor = merged.get("factor")
        if not isinstance(factor, (int, float)) or factor < 1:
            raise ConfigError(f"rope_scaling.factor must be a number >= 1 for {rope_type!r}, got {factor!r}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=tuple(sorted(merged.items())))


def rope_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [head_dim/2], attention_factor), computed the way transformers' rope init functions do."""
    dim, base, rope = config.head_dim, config.rope.theta, config.rope
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exponents, dtype=np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    factor = float(rope.get("factor"))
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32), 1.0
    return yarn_frequencies(config, pos_freqs, factor)


def yarn_frequencies(config: ModelConfig, pos_freqs: np.ndarray, factor: float) -> tuple[np.ndarray, float]:
    """YaRN (NTK-by-parts + attention temperature), Qwen2.5's recipe for 64K+ contexts, as transformers computes it."""
    rope, dim, base = config.rope, config.head_dim, config.rope.theta
    original_max = rope.get("original_max_position_embeddings") or config.max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (np.float32(1) - ramp).astype(np.float32)
    inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)
