"""LoRA adapters in PEFT's layout: read and write `adapter_config.json` + `adapter_model.safetensors`, apply them
unmerged or merge them into the weights.

Our linear weights are [out, in] like HF's, so PEFT's pair needs no transpose: lora_A [r, in], lora_B [out, r],
delta W = scaling * B @ A with scaling = alpha / r (rslora: alpha / sqrt(r)). Unmerged, a targeted weight becomes a
`LoraWeight(base, Lora)` leaf of the params pytree and `layers.linear` adds the rank-r path to the base product, so
the one functional forward serves training (the base stays frozen and may be quantized) and PEFT's unmerged forward;
`merge` folds the pairs into plain arrays for serving. Both work on either layer layout (a list of per-layer dicts
or one dict of [layers, ...] stacked arrays): the pair's leaves then carry the same leading layer axis.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import CheckpointError, ConfigError
from .checkpoint import SafetensorsFile, layer_tensors, write_safetensors
from .config import ModelConfig
from .quant import QuantizedWeight

# our projection name -> the module path PEFT's target_modules and keys use (under model.layers.N.)
TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
BY_MODULE = {module.rpartition(".")[2]: name for name, module in TARGETS.items()}  # "q_proj" -> "q"
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+_proj)\.lora_([AB])\.weight")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters and their size: PEFT's r, lora_alpha, target_modules and use_rslora."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "v")
    rslora: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ConfigError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if not self.targets or unknown or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"LoRA targets must be distinct names among {', '.join(TARGETS)}, got {self.targets!r}")

    @property
    def scaling(self) -> float:
        return scaling(self.alpha, self.rank, self.rslora)


def scaling(alpha: float, rank: int, rslora: bool) -> float:
    """PEFT's factor on B @ A: alpha / r, or alpha / sqrt(r) with rank-stabilized LoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Lora:
    """One projection's low-rank pair in PEFT's layout: a [r, in], b [out, r] (a leading layer axis when stacked)."""

    a: Any
    b: Any
    scaling: float = field(metadata=dict(static=True))

    def delta(self) -> jax.Array:
        """scaling * b @ a in float32, [out, in] (batched over a leading layer axis)."""
        return self.scaling * (jnp.asarray(self.b, jnp.float32) @ jnp.asarray(self.a, jnp.float32))

    def apply(self, x: jax.Array, product: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
        """scaling * x @ a.T @ b.T in the adapter's dtype, cast to x's: the rank-r path, never forming [out, in].

        `product(x, w)` is x @ w.T for a weight [out, in]: `layers.product`, the base weights' form, so the adapter
        keeps their batch invariance (XLA's einsums chose their algorithm by the row count: a request's logprobs
        changed with its batch, issue 67)."""
        low = product(x.astype(self.a.dtype), self.a)
        return (self.scaling * product(low, self.b)).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraWeight:
    """A base weight [out, in] (or a QuantizedWeight) with its adapter unmerged; `layers.linear` computes both."""

    base: Any
    lora: Lora


@dataclass(frozen=True)
class Adapter:
    """A whole adapter: its config and, per layer, our projection name -> its `Lora` pair (host or device arrays)."""

    config: LoraConfig
    layers: tuple[dict[str, Lora], ...]


def is_lora_weight(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def attach(params: dict, adapter: Adapter) -> dict:
    """params with every adapted weight replaced by a `LoraWeight` (unmerged); the base arrays are not copied.

    On stacked layers (the scan layout) each projection's pairs are stacked over layers, so every layer must carry
    the same targets and ranks (a ConfigError otherwise).
    """
    layers = params["layers"]
    if len(adapter.layers) != num_layers(layers):
        raise ConfigError(f"the adapter has {len(adapter.layers)} layers, the model {num_layers(layers)}")
    if isinstance(layers, dict):  # stacked: one LoraWeight per name with [layers, ...] leaves
        names = set(adapter.layers[0])
        if any(set(p) != names for p in adapter.layers):
            raise ConfigError("stacked layers need the same LoRA targets in every layer; load with scan_layers=False")
        try:
            pairs = {n: jax.tree.map(lambda *xs: jnp.stack(xs), *[p[n] for p in adapter.layers]) for n in names}
        except ValueError as e:
            raise ConfigError(f"stacked layers need the same LoRA rank and alpha in every layer: {e}") from e
        return {**params, "layers": {**layers, **{n: LoraWeight(layers[n], pairs[n]) for n in names}}}
    new = [{**p, **{n: LoraWeight(p[n], pair) for n, pair in pairs.items()}} for p, pairs in zip(layers, adapter.layers)]
    return {**params, "layers": new}


def num_layers(layers: list | dict) -> int:
    return len(layers) if isinstance(layers, (list, tuple)) else len(jax.tree.leaves(layers)[0])


def merge(params: dict) -> dict:
    """params with every `LoraWeight` folded into a plain weight base + scaling * b @ a, in the base's dtype."""
    def fold(w):
        if not isinstance(w, LoraWeight):
            return w
        if isinstance(w.base, QuantizedWeight):
            raise ConfigError("cannot merge a LoRA adapter into a quantized weight: keep it unmerged, or merge into "
                              "float weights and quantize afterwards (load_model(path, lora=..., quantize=...))")
        return (w.base.astype(jnp.float32) + w.lora.delta()).astype(w.base.dtype)

    return jax.tree.map(fold, params, is_leaf=is_lora_weight)


def detach(params: dict, config: LoraConfig) -> Adapter:
    """The adapter held by params' `LoraWeight` leaves (the inverse of `attach`), per layer."""
    layers = params["layers"]
    if isinstance(layers, dict):
        n = num_layers(layers)
        per_layer = [{k: jax.tree.map(lambda x, i=i: x[i], w.lora) for k, w in layers.items() if is_lora_weight(w)}
                     for i in range(n)]
    else:
        per_layer = [{k: w.lora for k, w in p.items() if is_lora_weight(w)} for p in layers]
    return Adapter(config, tuple(per_layer))


# ---------------------------------------------------------------------------------------------------------------
# PEFT files


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json, checked for what pocketjax can apply (plain LoRA on linear projections)."""
    file = folder / CONFIG_FILE
    try:
        cfg = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{file} not found: not a PEFT adapter folder") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"peft_type={cfg.get('peft_type')!r} is not supported (supported: LORA)")
    unsupported = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False}
    for key, plain in unsupported.items():
        if cfg.get(key, plain) not in (plain, None):
            raise ConfigError(f"{CONFIG_FILE}: {key}={cfg[key]!r} is not supported (only {key}={plain!r})")
    if cfg.get("modules_to_save"):
        raise ConfigError(f"{CONFIG_FILE}: modules_to_save={cfg['modules_to_save']!r} is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise ConfigError(f"{CONFIG_FILE}: {key} must be a positive number, got {cfg.get(key)!r}")
    return cfg


def read_adapter(folder: str | Path, config: ModelConfig) -> Adapter:
    """A PEFT LoRA adapter folder (as `PeftModel.save_pretrained` writes it) as an `Adapter` of host float32 arrays.

    Every tensor is checked against the model's shapes (CheckpointError names the first that does not fit);
    rank_pattern / alpha_pattern and use_rslora give each pair its scaling, as PEFT computes it.
    """
    folder = Path(folder)
    cfg = read_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.exists():
        raise CheckpointError(f"{weights} not found (pickled adapter_model.bin files are never loaded)")
    file = SafetensorsFile(weights)
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key in file.header:
        m = KEY.fullmatch(key)
        if m is None or m.group(2).rpartition(".")[2] not in BY_MODULE:
            raise CheckpointError(f"{weights.name}: tensor {key!r} is not a LoRA pair of a linear projection")
        found.setdefault((int(m.group(1)), BY_MODULE[m.group(2).rpartition(".")[2]]), {})[m.group(3)] = key
    per_layer: list[dict[str, Lora]] = [{} for _ in range(config.num_layers)]
    for (layer, name), keys in sorted(found.items()):
        if layer >= config.num_layers or set(keys) != {"A", "B"}:
            raise CheckpointError(f"{weights.name}: layer {layer} {TARGETS[name]} has lora_{'/'.join(sorted(keys))} "
                                  f"(model has {config.num_layers} layers; both lora_A and lora_B are needed)")
        shapes = layer_tensors(config, layer)
        if name not in shapes:  # a mixture-of-experts layer has experts, not the dense MLP's projections
            raise CheckpointError(f"{weights.name}: layer {layer} has no {TARGETS[name]} (its MLP is sparse: experts)")
        a, b = (np.asarray(file.tensor(keys[k]), np.float32) for k in "AB")
        (out, inp), rank = shapes[name][1], a.shape[0]
        if a.shape != (rank, inp) or b.shape != (out, rank):
            raise CheckpointError(f"{weights.name}: layer {layer} {TARGETS[name]}: lora_A {a.shape}, lora_B {b.shape} "
                                  f"do not fit a weight [{out}, {inp}]")
        module = f"model.layers.{layer}.{TARGETS[name]}"
        alpha = pattern_value(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        per_layer[layer][name] = Lora(a, b, scaling(alpha, rank, bool(cfg.get("use_rslora"))))
    if not found:
        raise CheckpointError(f"{weights} holds no LoRA tensors")
    targets = tuple(n for n in TARGETS if any(n in p for p in per_layer))
    lora = LoraConfig(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), targets=targets,
                      rslora=bool(cfg.get("use_rslora")))
    return Adapter(lora, tuple(per_layer))


def write_adapter(folder: str | Path, adapter: Adapter, base_model: str | None = None) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (float32) that `PeftModel.from_pretrained` opens."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = adapter.config
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": c.rank,
        "lora_alpha": c.alpha, "use_rslora": c.rslora, "target_modules": [TARGETS[t].rpartition(".")[2]
                                                                           for t in c.targets],
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "use_dora": False, "rank_pattern": {},
        "alpha_pattern": {},
    }
    tensors = {}
    for i, pairs in enumerate(adapter.layers):
        for name, pair in pairs.items():
            if not math.isclose(pair.scaling, c.scaling):
                raise ConfigError(f"layer {i} {name}: scaling {pair.scaling} differs from the config's {c.scaling}")
            prefix = f"base_model.model.model.layers.{i}.{TARGETS[name]}"
            tensors[f"{prefix}.lora_A.weight"] = np.asarray(pair.a, np.float32)
            tensors[f"{prefix}.lora_B.weight"] = np.asarray(pair.b, np.float32)
    write_safetensors(folder / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


# Placer: (param path, host array) -> device array, as in checkpoint.load_params.
Placer = Callable[[tuple, Any], Any]


def merging_placer(place: Placer, adapter: Adapter) -> Placer:
    """A placer that adds each adapted weight's delta to the host array before `place` quantizes or shards it:
    load_model(lora=) merges as it reads, with no second device copy of the weights."""
    def merged(path: tuple, array: Any) -> Any:
        pair = adapter.layers[path[1]].get(path[2]) if path[0] == "layers" else None
        if pair is not None:
            if not isinstance(array, np.ndarray):
                raise ConfigError("a LoRA adapter cannot be merged into a pre-quantized (AWQ/GPTQ) checkpoint")
            array = (array.astype(np.float32) + np.asarray(pair.delta())).astype(array.dtype)
        return place(path, array)

    return merged
