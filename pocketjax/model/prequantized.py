"""Reading pre-quantized int4 checkpoints (AWQ GEMM, GPTQ) into QuantizedWeights, as config.quantization declares.

AWQ GEMM:  qweight int32 [in, out/8], nibbles in AWQ_ORDER along out; qzeros int32 [in/g, out/8], same order;
           scales fp16 [in/g, out]; w = (q - z) * s.
GPTQ:      qweight int32 [in/8, out], nibble j of word r = input row 8r + j; qzeros int32 [groups, out/8], nibble j
           = column 8c + j; scales [groups, out]; g_idx int32 [in] = the group of each input row (desc_act:
           a permutation, else i // g). checkpoint_format "gptq" (v1, what auto-gptq and GPTQModel save by
           default) stores zero - 1, so zero = nibble + 1 (zero 0 is unrepresentable there); "gptq_v2" stores the
           zero itself. sym=True is zero 8 (v1 nibble 7), read like any other zero.

Both are exactly quant.py's int4 form (asymmetric, group-wise), stored [in, out]: `read_linear` transposes them to
quant.py's [out, in] on the host, so they share its dequantizing matmul.

Mixture-of-experts checkpoints (qwen3_moe, qwen2_moe; e.g. Qwen/Qwen3-30B-A3B-GPTQ-Int4) store every expert as its
own linear, model.layers.N.mlp.experts.E.gate_proj.{qweight,qzeros,scales(,g_idx)}, and the shared expert as dense
linears. `read_experts` reads a layer's experts of one projection into one QuantizedWeight stacked [E, ...], the
layout quant.py's expert-by-expert quantization gives, so the native expert kernel (`cpu_kernels.
expert_quantized_matmul`) runs them. What one stacked weight cannot hold is a ConfigError: experts of one stack with
different group sizes or some left float (one stack has one group size and one storage), a GPTQ desc_act expert
whose g_idx permutes its input rows (the expert product gathers no per-expert input order), and a quantized router or
shared-expert gate (routing reads a float weight in float32; released AWQ/GPTQ MoE checkpoints keep both float).
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from .config import ModelConfig, QuantizationConfig
from ..errors import CheckpointError, ConfigError
from .quant import QuantizedWeight, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8


def pack_nibbles(q, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """int32 words holding 8 4-bit values each along `axis` (0: GPTQ qweight; 1: qzeros and AWQ), nibble i at bit 4i.

    Without `order`, nibble i holds element 8w + i; with AWQ's order it holds element 8w + order[i].
    """
    q = np.moveaxis(np.asarray(q, np.uint32), axis, -1)
    if q.shape[-1] % 8:
        raise ConfigError(f"packing 8 nibbles per int32 needs a multiple of 8 along axis {axis}, got {q.shape[-1]}")
    q = q.reshape(q.shape[:-1] + (q.shape[-1] // 8, 8))
    if order is not None:
        q = q[..., list(order)]
    words = np.bitwise_or.reduce(q << (4 * np.arange(8, dtype=np.uint32)), axis=-1)
    return np.moveaxis(words.view(np.int32), -1, axis)


def unpack_nibbles(words: np.ndarray, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """uint8 values 0..15, the inverse of `pack_nibbles` (8 per int32 along `axis`)."""
    w = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)
    q = ((w[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).astype(np.uint8)
    if order is not None:
        q = q[..., list(np.argsort(order))]
    return np.moveaxis(q.reshape(w.shape[:-1] + (w.shape[-1] * 8,)), -1, axis)


def tensor_shapes(qc: QuantizationConfig, prefix: str, out_features: int, in_features: int
                  ) -> dict[str, tuple[int, ...]]:
    """The quantized tensors stored for one linear `prefix` (HF name without .weight) and their shapes."""
    groups = in_features // qc.group_for(in_features)
    if qc.method == "awq":
        return {prefix + ".qweight": (in_features, out_features // 8),
                prefix + ".qzeros": (groups, out_features // 8), prefix + ".scales": (groups, out_features)}
    return {prefix + ".qweight": (in_features // 8, out_features), prefix + ".qzeros": (groups, out_features // 8),
            prefix + ".scales": (groups, out_features), prefix + ".g_idx": (in_features,)}


# A sparse layer's routing weights: read as float [out, in] weights by moe.route / sparse_mlp, never quantized here
FLOAT_ONLY = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")


def stored_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]], available: Collection[str]
                  ) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(the tensors the checkpoint must hold, the names of the linear weights stored quantized).

    In an AWQ/GPTQ checkpoint a linear `X.weight` is stored as X.qweight/qzeros/scales(/g_idx) wherever X.qweight is
    present; a linear left in float (modules_to_not_convert, lm_head) keeps its X.weight. Each expert of a MoE layer
    is such a linear (`shapes` names them one by one). A quantized router or shared-expert gate is a ConfigError.
    """
    qc = config.quantization
    if qc is None:
        return shapes, set()
    stored: dict[str, tuple[int, ...]] = {}
    quantized: set[str] = set()
    for name, shape in shapes.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(FLOAT_ONLY) and prefix + ".qweight" in available:
            raise ConfigError(f"{prefix} is stored {qc.method}-quantized: pocketjax routes with a float router and "
                              f"shared-expert gate (read in float32; a rounded router changes which experts a token "
                              f"picks). Released {qc.method} MoE checkpoints keep them float (modules_to_not_convert)")
        if len(shape) == 2 and prefix + ".qweight" in available and name != "model.embed_tokens.weight":
            stored |= tensor_shapes(qc, prefix, *shape)
            quantized.add(name)
        else:
            stored[name] = shape
    return stored, quantized


def read_linear(qc: QuantizationConfig, prefix: str, out_features: int, in_features: int,
                tensor: Callable[[str], np.ndarray]) -> QuantizedWeight:
    """The QuantizedWeight of linear `prefix`; `tensor(name)` returns a stored tensor (shape checked here)."""
    t = {}
    for name, shape in tensor_shapes(qc, prefix, out_features, in_features).items():
        array = tensor(name)
        if tuple(array.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(array.shape)}, {qc.method} int4 with "
                                  f"group_size {qc.group_size} implies {shape}")
        if name.endswith((".qweight", ".qzeros")) and array.dtype != np.int32:
            raise CheckpointError(f"tensor {name!r} is {array.dtype}, packed int4 must be int32")
        if name.endswith(".g_idx") and array.dtype.kind not in "iu":
            raise CheckpointError(f"tensor {name!r} is {array.dtype}, a group index must be an integer type")
        t[name.rsplit(".", 1)[1]] = array
    order = AWQ_ORDER if qc.method == "awq" else None
    q = unpack_nibbles(t["qweight"], axis=1 if qc.method == "awq" else 0, order=order)
    zero = unpack_nibbles(t["qzeros"], axis=1, order=order).astype(np.int8) + np.int8(qc.zero_offset)
    scale = np.asarray(t["scales"], np.float32)
    perm = None
    group = qc.group_for(in_features)
    if "g_idx" in t:
        g_idx = np.asarray(t["g_idx"], np.int64)
        if not np.array_equal(g_idx, np.arange(in_features) // group):
            perm = np.argsort(g_idx, kind="stable")
            if not np.array_equal(g_idx[perm], np.arange(in_features) // group):
                raise CheckpointError(f"{prefix}.g_idx does not assign exactly {group} input rows to each group")
            q = q[perm]
    return QuantizedWeight(values=pack_int4(q.T, scale.shape[0]), scale=np.ascontiguousarray(scale.T),
                           zero=np.ascontiguousarray(zero.T),
                           perm=None if perm is None else perm.astype(np.int32), bits=4)


def quantized_experts(names: list[str], quantized: Collection[str]) -> bool:
    """Whether a stack of expert weights (`names`, one per expert) is stored quantized: all or none, else ConfigError
    (one stacked weight is either a QuantizedWeight or a float array)."""
    stored = [name in quantized for name in names]
    if any(stored) and not all(stored):
        floats = [name for name, q in zip(names, stored) if not q]
        raise ConfigError(f"{len(floats)} of {len(names)} experts are stored float ({floats[0]}, ...) and the rest "
                          f"quantized: pocketjax stacks a layer's experts of one projection into one weight, of one "
                          f"storage")
    return all(stored)


def read_experts(qc: QuantizationConfig, names: list[str], out_features: int, in_features: int,
                 tensor: Callable[[str], np.ndarray]) -> QuantizedWeight:
    """One QuantizedWeight stacked [E, ...] from the experts' linears `names` (HF names ending .weight, one per
    expert, each read by `read_linear`): the layout quant.quantize_host gives stacked experts, what the native expert
    kernel reads. Experts with different group sizes, or a desc_act permutation, are ConfigErrors (see the module
    docstring)."""
    groups = {tuple(tensor(name.removesuffix(".weight") + ".scales").shape) for name in names}
    if len(groups) > 1:
        stack = names[0].removesuffix(".weight").replace(".experts.0.", ".experts.*.")
        raise ConfigError(f"the experts {stack} have scales of shapes {sorted(groups)}: "
                          f"mixed group sizes (e.g. GPTQModel's per-module `dynamic`) cannot stack into one weight "
                          f"with one group size")
    parts = [read_linear(qc, name.removesuffix(".weight"), out_features, in_features, tensor) for name in names]
    permuted = [name for name, part in zip(names, parts) if part.perm is not None]
    if permuted:
        raise ConfigError(f"{permuted[0].removesuffix('.weight')}.g_idx permutes its input rows (GPTQ desc_act=true): "
                          f"each expert would need its own input order, which the stacked expert product does not "
                          f"gather; load a desc_act=false checkpoint")
    leaves = {leaf: np.stack([getattr(part, leaf) for part in parts]) for leaf in ("values", "scale", "zero")}
    return QuantizedWeight(**leaves, bits=4)
