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
from .files import contained

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "linear", "yarn")
# Upper bounds far past any released Qwen (the largest: 64 layers, hidden 8192, vocab 152K, 1M positions), so a
# config.json cannot make the planner or the loader loop or allocate without end (num_hidden_layers: 10**9 hung it).
MAX_SIZES = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
             "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024,
             "max_position_embeddings": 1 << 24, "num_experts": 1024, "num_experts_per_tok": 1024,
             "moe_intermediate_size": 1 << 18, "shared_expert_intermediate_size": 1 << 18, "decoder_sparse_step": 1024}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size(cfg: dict[str, Any], key: str, default: Any = None) -> int:
    """A positive integer field within MAX_SIZES, else ConfigError naming it."""
    value = cfg.get(key, default)
    if not _is_int(value) or not 0 < value <= MAX_SIZES[key]:
        raise ConfigError(f"{key} must be an integer in [1, {MAX_SIZES[key]}], got {value!r:.80}")
    return value


def _number(value: Any, name: str, low: float, high: float = math.inf) -> float:
    """A finite real number in (low, high), else ConfigError (NaN, Infinity, strings and bools are not numbers)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r:.80}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and low < number < high):
        raise ConfigError(f"{name} must be a finite number in ({low:g}, {high:g}), got {value!r:.80}")
    return number


def read_json_object(file: Path, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """A checkpoint's JSON file holding one object: any way it is not one is `error`, never a TypeError."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise error(f"{file} not found") from e
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise error(f"{file} is not valid JSON: {e}") from e
    except RecursionError:
        raise error(f"{file} nests too deeply") from None
    if not isinstance(data, dict):
        raise error(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def token_ids(value: Any, name: str, vocab_size: int) -> tuple[int, ...]:
    """An id or list of ids (eos_token_id) as a tuple, each in [0, vocab_size); None is ()."""
    ids = () if value is None else tuple(value) if isinstance(value, list) else (value,)
    if not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
        raise ConfigError(f"{name} must be token ids in [0, {vocab_size}), got {value!r:.80}")
    return ids


def read_generation_eos(folder: str | Path, vocab_size: int) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (what generate() stops on), checked; () when the file is absent."""
    file = Path(folder) / "generation_config.json"
    if not file.exists():
        return ()
    return token_ids(read_json_object(contained(folder, file.name)).get("eos_token_id"),
                     "generation_config.json eos_token_id", vocab_size)


def read_eos_ids(config: ModelConfig, path: str | Path | None) -> tuple[int, ...]:
    """EOS ids: config.json's, and generation_config.json's (what generate() stops on) when the checkpoint folder
    `path` has one (checked: ids in the vocabulary, the file inside the folder; ConfigError otherwise)."""
    ids = set(config.eos_token_ids) | (set(read_generation_eos(path, config.vocab_size)) if path else set())
    return tuple(sorted(ids))


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
class MoeConfig:
    """A mixture-of-experts MLP (qwen2_moe / qwen3_moe; model/moe.py): `num_experts` experts of width
    `intermediate_size`, `top_k` of them per token (the router's softmax, renormalized over the k when `norm_topk_prob`),
    and qwen2_moe's shared expert of width `shared_intermediate_size` (0: none) behind its sigmoid gate. Layer i is
    sparse unless it is in `mlp_only_layers` or (i + 1) % `sparse_step` != 0 (transformers' rule); the others keep the
    dense MLP of `ModelConfig.intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) runs the experts rather than the dense MLP."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Qwen2/Qwen2.5/Qwen3 decoder, dense or mixture-of-experts (`moe`): everything the
    forward pass needs."""

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
    moe: MoeConfig | None = None  # qwen2_moe / qwen3_moe: the sparse MLP and which layers run it
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # How the checkpoint stores its weights, not the architecture: left out of == and hash, so the jitted functions
    # (config is a static argument) compile once per architecture, as before.
    quantization: QuantizationConfig | None = field(default=None, compare=False)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` runs experts (`MoeConfig.sparse`); always False for a dense model."""
        return self.moe is not None and self.moe.sparse(layer)

    @property
    def mixed_layers(self) -> bool:
        """True when some layers are sparse and others dense: their params differ, so they cannot be stacked."""
        return len({self.sparse(n) for n in range(self.num_layers)}) > 1

    def num_params(self, active: bool = False) -> int:
        """Parameter count, counting a tied embedding once; `active`: what one token reads (of each sparse layer's
        experts only its top_k, the router and the shared expert in full)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        total = 0
        for n in range(self.num_layers):
            if self.sparse(n):
                moe = self.moe
                experts = moe.top_k if active else moe.num_experts
                shared = 3 * h * moe.shared_intermediate_size + h if moe.shared_intermediate_size else 0
                mlp = moe.num_experts * h + experts * 3 * h * moe.intermediate_size + shared
            else:
                mlp = 3 * h * self.intermediate_size
            total += attn + mlp + norms
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + emb + h

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Parse and check a config.json dict; raises ConfigError naming the offending field."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r:.80} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ConfigError(f"config.json is missing the required field {key!r}")
            _size(cfg, key)
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else kv_heads
        if not _is_int(kv_heads) or kv_heads <= 0 or heads % kv_heads:
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
        if not _is_int(head_dim) or not 0 < head_dim <= MAX_SIZES["head_dim"] or head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even integer up to {MAX_SIZES['head_dim']}, got "
                              f"{head_dim!r:.80}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported (Qwen uses 'silu')")
        if cfg.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported (sliding-window attention)")
        eps = _number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", 0.0, 1.0)
        max_pos = _size(cfg, "max_position_embeddings", 32768)
        for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window"):
            if cfg.get(key) is not None and not isinstance(cfg[key], bool):
                raise ConfigError(f"{key} must be true or false, got {cfg[key]!r:.80}")
        bos = cfg.get("bos_token_id")
        if bos is not None and not (_is_int(bos) and 0 <= bos < cfg["vocab_size"]):
            raise ConfigError(f"bos_token_id must be a token id in [0, {cfg['vocab_size']}), got {bos!r:.80}")
        if model_type == "qwen2":
            bias = cfg.get("attention_bias", True)
            if bias is False:
                raise ConfigError("attention_bias=false contradicts model_type 'qwen2', which always has QKV bias")
        elif model_type == "qwen2_moe":  # transformers' Qwen2MoeConfig names it qkv_bias (o_proj has none)
            bias = cfg.get("qkv_bias", True)
            if not isinstance(bias, bool):
                raise ConfigError(f"qkv_bias must be true or false, got {bias!r:.80}")
        else:
            bias = bool(cfg.get("attention_bias", False))
        eos_ids = token_ids(cfg.get("eos_token_id"), "eos_token_id", cfg["vocab_size"])
        quantization = parse_quantization(cfg)
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
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            dtype=parse_dtype(cfg),
            moe=parse_moe(cfg) if model_type in MOE_MODEL_TYPES else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            quantization=quantization,
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        """Read `path/config.json`; a missing or unparsable file raises ConfigError."""
        file = Path(path) / "config.json"
        if not file.exists():
            raise ConfigError(f"{file} not found")
        return cls.from_dict(read_json_object(contained(path, file.name)))


def parse_moe(cfg: dict[str, Any]) -> MoeConfig:
    """The experts of a qwen2_moe / qwen3_moe config.json, with transformers' defaults for the fields it may omit."""
    qwen2 = cfg["model_type"] == "qwen2_moe"
    # transformers 5 writes qwen3_moe's count as num_local_experts (its attribute_map), released checkpoints num_experts
    spellings = {k: cfg[k] for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if len(set(map(repr, spellings.values()))) > 1:
        raise ConfigError(f"num_experts and num_local_experts disagree: {spellings}")
    experts = _size({"num_experts": next(iter(spellings.values()), 60 if qwen2 else 128)}, "num_experts")
    top_k = _size(cfg, "num_experts_per_tok", 4 if qwen2 else 8)
    if top_k > experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    width = _size(cfg, "moe_intermediate_size", 1408 if qwen2 else 768)
    shared = _size(cfg, "shared_expert_intermediate_size", 5632) if qwen2 else 0
    if not qwen2 and cfg.get("shared_expert_intermediate_size"):
        raise ConfigError("shared_expert_intermediate_size is not part of qwen3_moe (it has no shared expert)")
    norm = cfg.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ConfigError(f"norm_topk_prob must be true or false, got {norm!r:.80}")
    step = _size(cfg, "decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    layers = cfg["num_hidden_layers"]
    if not isinstance(only, list) or not all(_is_int(n) and 0 <= n < layers for n in only):
        raise ConfigError(f"mlp_only_layers must be a list of layer indices in [0, {layers}), got {only!r:.80}")
    for key in ("output_router_logits",):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise ConfigError(f"{key} must be true or false, got {cfg[key]!r:.80}")
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=width, norm_topk_prob=norm,
                     shared_intermediate_size=shared, sparse_step=step, mlp_only_layers=tuple(sorted(set(only))))


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
    if not _is_int(group) or (group <= 0 and group != -1) or group > MAX_SIZES["intermediate_size"]:
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
    for name, value in (("rope_theta", theta_old), ("rope_parameters.rope_theta", theta_new)):
        if value is not None:
            _number(value, name, 0.0)
    if theta_old is not None and theta_new is not None and float(theta_old) != float(theta_new):
        raise ConfigError(f"rope_theta={theta_old} contradicts rope_parameters.rope_theta={theta_new}")
    theta = theta_new if theta_new is not None else theta_old
    if theta is None:
        theta = 10000.0
    merged = {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}
    for key in set(scaling) & set(params):
        if scaling[key] != params[key]:
            raise ConfigError(f"rope_scaling.{key}={scaling[key]!r} contradicts rope_parameters.{key}={params[key]!r}")
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_scaling type {rope_type!r:.80} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if rope_type in ("linear", "yarn"):
        factor = merged.get("factor")
        if _number(factor, "rope_scaling.factor", 0.0, 1e6) < 1:
            raise ConfigError(f"rope_scaling.factor must be a number >= 1 for {rope_type!r}, got {factor!r}")
    for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
        if merged.get(key) is not None:
            _number(merged[key], f"rope_scaling.{key}", -1e6, 1e6)  # finite: they scale every frequency
    original = merged.get("original_max_position_embeddings")
    if original is not None and not (_is_int(original) and 0 < original <= MAX_SIZES["max_position_embeddings"]):
        raise ConfigError(f"rope_scaling.original_max_position_embeddings must be a positive integer, got "
                          f"{original!r:.80}")
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
