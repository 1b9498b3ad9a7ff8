"""Hugging Face checkpoint folder -> params pytree, read lazily from memory-mapped safetensors.

The safetensors format is parsed here (8-byte header length, JSON header, raw little-endian data) rather than
through `safetensors.numpy`, because numpy has no bfloat16 and because owning the parser lets every truncated or
corrupt file fail with a CheckpointError that names it. Nothing is ever unpickled.
"""
from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from . import prequantized
from .config import ModelConfig
from ..errors import CheckpointError
from .files import contained  # noqa: F401 - re-exported: the loader's one containment check

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
FLOAT_DTYPES = frozenset(SAFETENSORS_DTYPES[k] for k in ("F64", "F32", "F16", "BF16"))  # what a weight can be


def check_float(name: str, array: np.ndarray) -> np.ndarray:
    """`array`, or a CheckpointError when it is stored as an integer or bool type: values, not weights (the
    casting load would otherwise turn I32 bit patterns into weights without a word). Packed int4 tensors of a
    prequantized checkpoint are checked by their own rules (prequantized.read_linear)."""
    if array.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name!r} is stored as {DTYPE_NAMES.get(array.dtype, array.dtype)}: a weight "
                              f"must be F32, F16, BF16 or F64")
    return array
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_RANK = 8
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFile:
    """One memory-mapped .safetensors file; `tensor(name)` is a zero-copy, read-only numpy view."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot open {self.path}: {e}") from e
        self.header = self._parse_header()

    def _parse_header(self) -> dict[str, dict[str, Any]]:
        size = len(self._mmap)
        if size < 8:
            raise CheckpointError(f"{self.path} is truncated: {size} bytes, no header")
        (n,) = struct.unpack("<Q", self._mmap[:8])
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{self.path} is truncated or corrupt: header claims {n} bytes, file has {size}")
        try:
            header = json.loads(bytes(self._mmap[8 : 8 + n]))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path} has a corrupt header: {e}") from e
        except RecursionError:
            raise CheckpointError(f"{self.path} has a corrupt header: nested too deeply") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path} has a corrupt header: not a JSON object")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (isinstance(metadata, dict)
                                         and all(isinstance(v, str) for v in metadata.values())):
            raise CheckpointError(f"{self.path}: __metadata__ must map strings to strings")
        self._data_start = 8 + n
        spans = []
        for name, info in header.items():
            if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and _ints(info.get("shape"))
                    and _ints(info.get("data_offsets")) and len(info["data_offsets"]) == 2
                    and len(info["shape"]) <= MAX_RANK and info["dtype"] in SAFETENSORS_DTYPES):
                raise CheckpointError(f"{self.path}: corrupt header entry for tensor {name!r:.200} (dtype, shape "
                                      f"and data_offsets must be a known dtype and lists of non-negative ints)")
            begin, end = info["data_offsets"]
            count = math.prod(info["shape"])  # Python ints: no overflow
            if begin > end or end - begin != count * SAFETENSORS_DTYPES[info["dtype"]].itemsize:
                raise CheckpointError(f"{self.path}: tensor {name!r:.200} has inconsistent offsets for its shape")
            if self._data_start + end > size:
                raise CheckpointError(f"{self.path} is truncated: tensor {name!r:.200} ends past the end of the file")
            spans.append((begin, end, name))
        spans.sort()
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(f"{self.path}: tensors {first!r:.100} and {second!r:.100} overlap in the file")
        return header

    def keys(self) -> list[str]:
        return list(self.header)

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        begin, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        buf = memoryview(self._mmap)[self._data_start + begin : self._data_start + end]
        return np.frombuffer(buf, dtype=dtype).reshape(info["shape"])


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors in the safetensors format (used by tests and the embedded-model trainer)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        header[name] = {
            "dtype": DTYPE_NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.tobytes())


def open_checkpoint(folder: str | Path) -> dict[str, SafetensorsFile]:
    """Map every tensor name of a checkpoint folder (single file or sharded index) to its open file."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = read_index(contained(folder, INDEX_FILE))
        files = {name: SafetensorsFile(contained(folder, name)) for name in sorted(set(weight_map.values()))}
        for name, file in weight_map.items():
            if name not in files[file].header:
                raise CheckpointError(f"tensor {name!r:.200} is listed in {index.name} but missing from {file}")
        return {name: files[file] for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        candidates = sorted(folder.glob("*.safetensors"))
        if not candidates:
            raise CheckpointError(f"no model.safetensors or {INDEX_FILE} in {folder}")
        files = [SafetensorsFile(contained(folder, p.name)) for p in candidates]
    else:
        files = [SafetensorsFile(contained(folder, single.name))]
    return {name: f for f in files for name in f.keys()}


def read_index(index: Path) -> dict[str, str]:
    """A sharded checkpoint's weight_map (tensor name -> shard file name), checked for shape."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{index} is corrupt: {e}") from e
    except RecursionError:
        raise CheckpointError(f"{index} is corrupt: nested too deeply") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} is corrupt: it needs a non-empty 'weight_map' object")
    if not all(isinstance(v, str) and v for v in weight_map.values()):
        raise CheckpointError(f"{index} is corrupt: every weight_map value must be a shard file name")
    return weight_map


def _ints(value: Any) -> bool:
    """A list of non-negative ints (JSON true/false are not ints here)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def layer_tensors(config: ModelConfig, layer: int = 0) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our param name -> (HF tensor suffix, shape), for the tensors layer `layer` of `config` has (every layer of a
    dense model alike; a mixture-of-experts layer holds its experts instead of the dense MLP: `expert_tensors`).

    Linear weights keep HF's [out, in] layout: on XLA:CPU the decode-sized product runs fastest as w @ x.T
    (benchmarks/xla_cpu_matmul.py), and loading needs no transposes.
    """
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    table = {
        "input_norm": ("input_layernorm.weight", (h,)),
        "post_norm": ("post_attention_layernorm.weight", (h,)),
        "q": ("self_attn.q_proj.weight", (q, h)),
        "k": ("self_attn.k_proj.weight", (kv, h)),
        "v": ("self_attn.v_proj.weight", (kv, h)),
        "o": ("self_attn.o_proj.weight", (h, q)),
    }
    if config.attention_bias:
        table |= {"q_bias": ("self_attn.q_proj.bias", (q,)), "k_bias": ("self_attn.k_proj.bias", (kv,)),
                  "v_bias": ("self_attn.v_proj.bias", (kv,))}
        if config.model_type in ("qwen3", "qwen3_moe"):
            table["o_bias"] = ("self_attn.o_proj.bias", (h,))
    if config.qk_norm:
        table |= {"q_norm": ("self_attn.q_norm.weight", (d,)), "k_norm": ("self_attn.k_norm.weight", (d,))}
    if config.sparse(layer):
        return table | expert_tensors(config)
    return table | {"gate": ("mlp.gate_proj.weight", (i, h)), "up": ("mlp.up_proj.weight", (i, h)),
                    "down": ("mlp.down_proj.weight", (h, i))}


# A sparse layer's stacked experts: our name -> HF's per-expert projection (model.layers.N.mlp.experts.E.<proj>).
EXPERT_PROJECTIONS = {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}


def expert_tensors(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A sparse layer's params: the router (mlp.gate), the experts stacked [num_experts, out, in] (stored one tensor
    per expert: `expert_names`), and qwen2_moe's shared expert with its gate."""
    moe, h = config.moe, config.hidden_size
    e, i = moe.num_experts, moe.intermediate_size
    table = {"router": ("mlp.gate.weight", (e, h)),
             "expert_gate": ("mlp.experts.gate_proj.weight", (e, i, h)),
             "expert_up": ("mlp.experts.up_proj.weight", (e, i, h)),
             "expert_down": ("mlp.experts.down_proj.weight", (e, h, i))}
    if moe.shared_intermediate_size:
        s = moe.shared_intermediate_size
        table |= {"shared_gate": ("mlp.shared_expert.gate_proj.weight", (s, h)),
                  "shared_up": ("mlp.shared_expert.up_proj.weight", (s, h)),
                  "shared_down": ("mlp.shared_expert.down_proj.weight", (h, s)),
                  "shared_expert_gate": ("mlp.shared_expert_gate.weight", (1, h))}
    return table


def expert_names(name: str, num_experts: int) -> list[str]:
    """The per-expert HF tensors a stacked expert param is read from: "model.layers.3.mlp.experts.gate_proj.weight"
    -> ["model.layers.3.mlp.experts.0.gate_proj.weight", ...] (the layout every released checkpoint has)."""
    head, _, proj = name.rpartition(".experts.")
    return [f"{head}.experts.{e}.{proj}" for e in range(num_experts)]


def param_tensors(config: ModelConfig) -> Iterator[tuple[tuple, str, tuple[int, ...]]]:
    """(our param path, HF tensor name, shape) for every tensor the config implies, in load order.

    The one walk over the parameters: loading, the memory planner and the trainer (init, save) all use it.
    """
    v, h = config.vocab_size, config.hidden_size
    yield ("embed",), "model.embed_tokens.weight", (v, h)
    for n in range(config.num_layers):
        for ours, (suffix, shape) in layer_tensors(config, n).items():
            yield ("layers", n, ours), f"model.layers.{n}.{suffix}", shape
    yield ("final_norm",), "model.norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield ("lm_head",), "lm_head.weight", (v, h)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the checkpoint must hold (a stacked expert param: one per expert)."""
    shapes = {}
    for path, name, shape in param_tensors(config):
        if path[-1] in EXPERT_PROJECTIONS:
            shapes |= dict.fromkeys(expert_names(name, shape[0]), shape[1:])
        else:
            shapes[name] = shape
    return shapes


def nest(config: ModelConfig, items: Iterable[tuple[tuple, Any]]) -> dict[str, Any]:
    """The params pytree {'embed', 'layers': [per-layer dicts], 'final_norm', 'lm_head'?} from (path, value) pairs."""
    params: dict[str, Any] = {"layers": [{} for _ in range(config.num_layers)]}
    for path, value in items:
        if path[0] == "layers":
            params["layers"][path[1]][path[2]] = value
        else:
            params[path[0]] = value
    return params


# Placer: receives our param path (e.g. ("layers", 3, "q")) and the host array in its final layout and dtype;
# returns the device array. The default is jax.device_put; tensor parallelism passes one that shards.
Placer = Callable[[tuple, np.ndarray], Any]


def quantized_part(name: str, array: np.ndarray) -> np.ndarray:
    """A stored part of an AWQ/GPTQ linear: its scales are floats (qweight, qzeros, g_idx: read_linear's rules)."""
    return check_float(name, array) if name.endswith(".scales") else array


def iter_params(folder: str | Path, config: ModelConfig, dtype: np.dtype) -> Iterator[tuple[tuple, np.ndarray]]:
    """Yield (param path, host array) one tensor at a time, validated against the config."""
    tensors = open_checkpoint(folder)
    shapes = expected_shapes(config)
    stored, quantized = prequantized.stored_shapes(config, shapes, tensors)
    tied_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(set(tensors) - set(stored) - tied_extra)
    if unexpected:
        raise CheckpointError(f"unexpected tensor(s) in checkpoint: {', '.join(unexpected[:5])}")
    missing = sorted(set(stored) - set(tensors))
    if missing:
        raise CheckpointError(f"missing tensor(s) in checkpoint: {', '.join(missing[:5])}")

    def part(n: str) -> np.ndarray:
        return quantized_part(n, tensors[n].tensor(n))

    for path, name, shape in param_tensors(config):
        if path[-1] in EXPERT_PROJECTIONS:  # one [out, in] tensor (or AWQ/GPTQ linear) per expert, stacked as read
            experts = expert_names(name, shape[0])
            if prequantized.quantized_experts(experts, quantized):
                yield path, prequantized.read_experts(config.quantization, experts, *shape[1:], part)
            else:
                yield path, read_experts(tensors, name, shape, dtype)
            continue
        if name in quantized:  # an AWQ/GPTQ QuantizedWeight, read into quant.py's [out, in] layout
            yield path, prequantized.read_linear(config.quantization, name.removesuffix(".weight"), *shape, part)
            continue
        array = check_float(name, tensors[name].tensor(name))
        if tuple(array.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, config implies {shape}")
        yield path, np.ascontiguousarray(array, dtype=dtype)


def read_experts(tensors: dict[str, SafetensorsFile], name: str, shape: tuple[int, ...], dtype: np.dtype
                 ) -> np.ndarray:
    """The [num_experts, out, in] stack of a layer's per-expert tensors (`expert_names`), each checked and cast."""
    out = np.empty(shape, dtype)
    for e, part in enumerate(expert_names(name, shape[0])):
        array = check_float(part, tensors[part].tensor(part))
        if tuple(array.shape) != shape[1:]:
            raise CheckpointError(f"tensor {part!r} has shape {tuple(array.shape)}, config implies {shape[1:]}")
        out[e] = array
    return out


def load_params(folder: str | Path, config: ModelConfig, dtype: np.dtype, place: Placer) -> dict[str, Any]:
    """The params pytree: {'embed', 'layers': [per-layer dicts], 'final_norm', 'lm_head'?}, placed tensor by tensor."""

    def placed() -> Iterator[tuple[tuple, Any]]:
        for path, array in iter_params(folder, config, dtype):
            value = place(path, array)
            del array  # the host copy goes before the next tensor is read
            yield path, value

    return nest(config, placed())
