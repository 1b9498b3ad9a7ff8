"""plan_memory: bytes per device of weights, KV cache and activations for a model, before loading anything.

Weights follow the placement load_model makes: each tensor (or quantized leaf) split as `sharding.array_spec` says
(column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding/lm_head when tp divides the vocab),
replicated where that spec does not divide it. Quantized weights count their values, float32 scales and int8 zeros
(see quant.py). The KV cache follows `sharding.cache_spec`: split on kv heads when tp divides them, else
replicated; int8 KV adds one float32 scale per (layer, k|v, slot, kv head, position).

Activations are the peak of one prefill call (the engine's largest step), N = slots x prefill_chunk tokens:
    layer   N * a * (3H + (2 Hq + 2 Hkv) D + 3 I)      residual/normed/attn-out, q/k/v/attn, gate/up/product
            with Hq, Hkv, I the per-device head counts and MLP width, a the dtype's bytes; XLA frees a layer's
            intermediates before the next, so one layer counts. A sparse layer's MLP (mixture of experts) counts
            k (3 I_e + 2H) + 4E / a + 3 I_s per token instead of 3I: its k (token, expert) pairs' inputs, gate / up /
            product and outputs, the float32 router logits, the shared expert; the larger of the two kinds counts
    scores  attention="xla" only: N * Hq * max_seq_len * 4 * 2 (float32 logits and probabilities) plus the gathered
            K/V rows, 2 * slots * Hkv * max_seq_len * D * kv bytes; the Pallas kernels keep scores in VMEM/SRAM
    logits  slots * vocab * 4 (float32 last-token logits) + slots * vocab * 5 (the sampler's penalty state)
    dequant quantized only: the largest linear's in * out * 4 / split: XLA:CPU materializes one float32 dequantized
            operand per matmul (measured; see quant.py), XLA:GPU fuses it (then this is an upper bound); a stack
            of quantized experts counts whole (XLA's grouped fallback dequantizes it; the native kernel reads
            each expert in place, so there this is an upper bound)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import ml_dtypes
import numpy as np

from . import quant
from .checkpoint import param_tensors
from .config import DTYPES, ModelConfig
from .kv_cache import QUANTIZED_KV_DTYPES, check_kv_dtype
from ..errors import CapacityError, ConfigError
from .sharding import array_spec, check_tp

GiB = 1024**3
ATTENTION = ("pallas", "xla")


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device: weights, kv_cache, activations and their total; `details` breaks each down."""

    weights: int
    kv_cache: int
    activations: int
    total: int
    details: dict[str, int] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "activations": self.activations,
                "total": self.total, "details": dict(self.details)}

    def __str__(self) -> str:
        rows = [("weights", self.weights), ("kv_cache", self.kv_cache), ("activations", self.activations),
                ("total", self.total)]
        lines = [f"{name:<30}{gib(n):>14}" for name, n in rows]
        lines += [f"  {name:<28}{gib(n):>14}" for name, n in self.details.items()]
        return "memory per device\n" + "\n".join(lines)


def gib(n: int) -> str:
    return f"{n / GiB:.3f} GiB"


def itemsize(dtype: str) -> int:
    return np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize


def plan_memory(config_or_dict: ModelConfig | dict, tp: int = 1, dtype: str = "float16", quantize: str | None = None,
                kv_dtype: str | None = None, slots: int = 8, max_seq_len: int = 8192, prefill_chunk: int = 512,
                attention: str = "pallas") -> MemoryPlan:
    """The MemoryPlan (bytes per device) of serving a model at tensor parallelism `tp` with `slots` x `max_seq_len`.

    dtype: weights and activations; quantize: None | a quant.MODES name (as load_model);
    a config with an AWQ/GPTQ `quantization` is planned as load_model places it (int4 linears with the checkpoint's
    group, a MoE layer's experts stacked as read, GPTQ desc_act's int32 permutation, the rest in dtype; it takes no
    `quantize`, as load_model).
    kv_dtype: the cache (default: dtype; "int8" adds float32 per-token, per-head scales).
    """
    config = config_or_dict if isinstance(config_or_dict, ModelConfig) else ModelConfig.from_dict(config_or_dict)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    kv_dtype = kv_dtype or dtype
    check_kv_dtype(kv_dtype)
    if attention not in ATTENTION:
        raise ConfigError(f"attention={attention!r} is not supported (supported: {', '.join(ATTENTION)})")
    for name, value in (("tp", tp), ("slots", slots), ("max_seq_len", max_seq_len), ("prefill_chunk", prefill_chunk)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    check_tp(config, tp)
    mode = quant.parse_mode(quantize)
    stored = config.quantization
    if stored is not None and mode is not None:
        raise ConfigError(f"quantize={quantize!r}: the checkpoint is already {stored.method} int{stored.bits}")
    a = itemsize(dtype)

    weights: dict[str, int] = {"linear": 0, "embedding+lm_head": 0, "norms+biases": 0}
    if config.moe is not None:
        weights["experts"] = 0
    largest_linear = 0
    for path, _, shape in param_tensors(config):
        name = path[-1]
        if quant.bits_for(mode, name) is not None:
            # quantized weights keep the float weight's [out, in] layout (see quant.quantizing_placer); stacked
            # experts [E, out, in] are quantized expert by expert, their leaves stacked
            path = (quant.QUANTIZED,) + path
            leaves = [(shape[:-2] + s, size) for s, size in
                      quant.leaf_shapes(*shape[-2:], quant.bits_for(mode, name)).values()]
        elif stored is not None and name in quant.LINEAR_NAMES | quant.MOE_LINEAR_NAMES:
            # prequantized.read_linear's QuantizedWeight; stacked experts (read_experts) [E, ...], never permuted
            path = (quant.QUANTIZED,) + path
            perm = stored.method == "gptq" and stored.desc_act and name not in quant.EXPERT_NAMES
            leaves = [(shape[:-2] + s, size) for s, size in
                      quant.leaf_shapes(*shape[-2:], stored.bits, stored.group_for(shape[-1]), perm=perm).values()]
        else:
            leaves = [(shape, a)]
        nbytes = sum(device_bytes(path, s, size, config, tp) for s, size in leaves)
        group = ("linear" if name in quant.LINEAR_NAMES | quant.MOE_LINEAR_NAMES - quant.EXPERT_NAMES else
                 "experts" if name in quant.EXPERT_NAMES | {"router"} else
                 "embedding+lm_head" if name in quant.HEAD_NAMES else "norms+biases")
        weights[group] += nbytes
        if name in quant.LINEAR_NAMES | quant.MOE_LINEAR_NAMES:  # XLA's fallback dequantizes a whole expert stack
            largest_linear = max(largest_linear, device_bytes(path, shape, 4, config, tp))

    d, h, vocab = config.head_dim, config.hidden_size, config.vocab_size
    kv_local = config.num_kv_heads // tp if config.num_kv_heads % tp == 0 else config.num_kv_heads
    q_local = config.num_heads // tp
    mlp_local = config.intermediate_size // tp if config.intermediate_size % tp == 0 else config.intermediate_size
    mlp_width = 3 * mlp_local if any(not config.sparse(n) for n in range(config.num_layers)) else 0
    if config.moe is not None:  # per token: k pairs' input copies, gate / up / product and outputs, the router's
        moe = config.moe        # logits (float32), the shared expert's gate / up / product
        sparse = moe.top_k * (3 * moe.intermediate_size + 2 * h) + moe.num_experts * 4 // a
        mlp_width = max(mlp_width, sparse + 3 * moe.shared_intermediate_size)
    kv_bytes = itemsize(kv_dtype)
    positions = 2 * config.num_layers * slots * kv_local * max_seq_len
    kv = {"values": positions * d * kv_bytes, "scales": positions * 4 if kv_dtype in QUANTIZED_KV_DTYPES else 0,
          "lengths": slots * 4}

    tokens = slots * prefill_chunk
    act = {"layer": tokens * a * (3 * h + (2 * q_local + 2 * kv_local) * d + mlp_width),
           "scores": (tokens * q_local * max_seq_len * 4 * 2 + 2 * slots * kv_local * max_seq_len * d * kv_bytes
                      if attention == "xla" else 0),
           "logits+sampler": slots * vocab * (4 + 5),
           "dequant": largest_linear if mode is not None or stored is not None else 0}

    details = {f"weights.{k}": v for k, v in weights.items()} | {f"kv_cache.{k}": v for k, v in kv.items()}
    details |= {f"activations.{k}": v for k, v in act.items()}
    w, c, x = sum(weights.values()), sum(kv.values()), sum(act.values())
    return MemoryPlan(weights=w, kv_cache=c, activations=x, total=w + c + x, details=details)


def device_bytes(path: tuple, shape: tuple[int, ...], element_bytes: int, config: ModelConfig, tp: int) -> int:
    """Bytes one device holds of a tensor: split as load_model places it (sharding.array_spec)."""
    total = int(np.prod(shape, dtype=np.int64)) * element_bytes
    return total // tp ** sum(axes is not None for axes in array_spec(path, shape, config, tp))


def per_device_bytes(tree: Any) -> dict[Any, int]:
    """Bytes each device holds for the arrays of a pytree (params, cache): what was placed, beside the plan."""
    total: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            total[shard.device] = total.get(shard.device, 0) + shard.data.nbytes
    return total


def available_bytes(device: Any) -> int | None:
    """Free memory of a device: the accelerator's limit minus what it holds, or the host's available memory for a
    CPU device (Linux MemAvailable); None when the platform does not say."""
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return None
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_fits(what: str, per_device: int, devices: Sequence[Any], advice: str) -> None:
    """CapacityError, before anything is allocated, when `per_device` bytes on each device will not fit in its free
    memory (CPU devices share the host's, so theirs add up); the message carries both numbers and `advice`."""
    devices = [d for d in devices if d.process_index == jax.process_index()]  # a job's other hosts check their own
    on_host = sum(d.platform == "cpu" for d in devices)
    checks = [(per_device * on_host, devices[0])] if on_host else []
    checks += [(per_device, d) for d in devices if d.platform != "cpu"]
    for needed, device in checks:
        free = available_bytes(device)
        if free is not None and needed > free:
            where = "host memory" if device.platform == "cpu" else str(device)
            raise CapacityError(f"{what} needs {gib(needed)} but {where} has {gib(free)} free: {advice}")
