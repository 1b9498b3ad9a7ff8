"""Block-size presets per GPU target, and whether a device can run the Pallas or the jax-triton kernels at all.

Targets (a string: "sm75", "sm80", "sm86", "sm90", "cpu"):
  sm75  Turing (T4, RTX 20xx): 64 KiB shared memory, tensor cores for float16 only (no bfloat16
        matmul). Its presets are the Triton kernels' (Pallas never runs there, see below).
  sm80  A100 / Orin: 163 KiB shared memory per block.
  sm86  RTX 30xx / Ada (8.9) / consumer Blackwell (12.x): ~99 KiB shared memory per block.
  sm90  H100 / H200 / datacenter Blackwell (10.x): 227 KiB shared memory per block.
  cpu   interpret mode (tests, CPU benchmarks): fewer, bigger blocks mean fewer interpreter steps.

Head dims 64/80/96/128: Triton needs every tensor dimension to be a power of two, so the kernels pad
D to the next power of two (80 and 96 run as 128 with the extra columns masked at load time and never
copied: the cache BlockSpec is simply wider than the array). Presets are therefore keyed by the padded
head dim; `block_sizes` shrinks block_k (then num_stages) until the software-pipelined K/V tiles fit the
target's shared memory, which is what float32 inputs need.

What runs where (dispatch: `pocketjax.model.layers.resolve_impl`; evidence: docs/kernels.md "What runs where"):
  * cc >= 8.0: the Pallas kernels (Pallas's Triton lowering through XLA).
  * cc < 8.0 (sm75): XLA rejects Pallas's Triton custom call there ("Triton support is only enabled for Ampere
    GPUs (compute capability 8.0) and up", jax#26799), but official Triton compiles `tl.dot` for sm75 (FMA
    instructions instead of mma) and jax-triton launches its output without that XLA check. So the Triton
    kernels (`triton_decode`, `triton_prefill`, launched by `triton_launch`) run there when jax-triton is
    installed (`jax_triton_unsupported`), in float16 / float32 / int8 caches; no bfloat16 (Turing has no bf16
    arithmetic) and no float8.
  * Elsewhere (CPU, ROCm, sm75 without jax-triton): XLA attention.
The sm75 presets below are the Triton kernels' (the only kernels that run there), chosen from the registers and
spills ptxas reports for the compiled binaries (tests/test_triton_kernels.py reads them for every preset).
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # the Triton backend is deprecated since JAX 0.11 and may disappear; interpret mode works without it
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

# Largest dynamic shared memory one block may use, bytes (CUDA occupancy tables).
SMEM_BYTES = {"sm75": 64 * 1024, "sm80": 163 * 1024, "sm86": 99 * 1024, "sm90": 227 * 1024,
              "cpu": 1 << 30}

# Decode is bandwidth-bound: one program streams K/V of one (slot, kv head[, split]); keys per step
# = block_k, software-pipelined num_stages deep. Values: (block_k, num_warps, num_stages).
_DECODE = {
    "sm90": {64: (128, 4, 3), 128: (128, 4, 3)},
    "sm80": {64: (128, 4, 3), 128: (128, 4, 2)},
    "sm86": {64: (128, 4, 2), 128: (64, 4, 2)},
    # Triton on sm75, float16 K/V (ptxas 12.x, Triton 3.9): block_k 64 spills (255 registers + 400 B of spill
    # stores at D=128), 32 takes 205 registers / 24 KiB shared and no spill, 16 takes 125 (2x the occupancy,
    # 2x the loop trips: to be timed on a T4). float32 at 64 needs 72 KiB shared, over the 64 KiB limit.
    "sm75": {64: (32, 4, 1), 128: (32, 4, 1)},
    "cpu": {64: (128, 4, 1), 128: (128, 4, 1)},
}
# Prefill is compute-bound: block_m query rows (tokens x padded GQA group) against block_k keys.
# Values: (block_m, block_k, num_warps, num_stages); the Triton flash-attention tutorial's A100/H100
# settings, halved where shared memory is smaller.
_PREFILL = {
    "sm90": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)},
    "sm80": {64: (128, 64, 4, 3), 128: (128, 64, 8, 2)},
    "sm86": {64: (64, 64, 4, 2), 128: (64, 32, 4, 2)},
    # Triton on sm75, float16, 4 warps: rows x keys 32 x 32 spills at D=128 (752 B), 32 x 16 takes 227 registers;
    # at D=64 32 x 32 takes 218 registers, no spill.
    "sm75": {64: (32, 32, 4, 1), 128: (32, 16, 4, 1)},
    "cpu": {64: (64, 64, 4, 1), 128: (64, 64, 4, 1)},
}


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1): the size Triton needs for a tensor dimension."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def padded_head_dim(head_dim: int) -> int:
    """Head dim the kernels compute with: next power of two, at least 16 (the GPU dot's minimum K)."""
    return max(16, next_pow2(head_dim))


def _default_device(device):
    return jax.devices()[0] if device is None else device


def compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for CPU, ROCm or when the runtime does not say."""
    cc = getattr(device, "compute_capability", None)
    if getattr(device, "platform", None) != "gpu" or not cc:
        return None
    try:
        major, minor = str(cc).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def target(device: Any = None) -> str:
    """The preset family for a device (a jax.Device, a target string, or None for the default)."""
    if isinstance(device, str):
        if device not in SMEM_BYTES:
            raise ValueError(f"unknown target {device!r}; known: {sorted(SMEM_BYTES)}")
        return device
    device = _default_device(device)
    cc = compute_capability(device)
    if cc is None:
        return "cpu"
    if cc >= (9, 0) and cc < (12, 0):
        return "sm90"
    if cc in ((8, 0), (8, 7)):
        return "sm80"
    if cc >= (8, 0):
        return "sm86"
    return "sm75"


def num_cores(device: Any = None) -> int:
    """Streaming multiprocessors of a GPU (0 for CPU or unknown): sizes the split-K grid."""
    if isinstance(device, str):
        return {"sm90": 132, "sm80": 108, "sm86": 84, "sm75": 40}.get(device, 0)
    device = _default_device(device)
    if compute_capability(device) is None:
        return 0
    return int(getattr(device, "core_count", 0) or 0)


def _smem(kind: str, cfg: dict, head_dim: int, itemsize: int) -> int:
    """Bytes of shared memory the pipelined K and V tiles (plus the Q tile for prefill) take."""
    kv = cfg["num_stages"] * 2 * cfg["block_k"] * head_dim * itemsize
    return kv + (cfg["block_m"] * head_dim * itemsize if kind == "prefill" else 0)


def block_sizes(kind: str, head_dim: int, dtype, device: Any = None) -> dict:
    """Block sizes and launch parameters for a kernel kind ("decode" | "prefill") on a device.

    Returns decode: {block_k, num_warps, num_stages, target}; prefill: {block_m, block_k, num_warps,
    num_stages, target}. block_m counts query rows (tokens x padded GQA group), the prefill wrapper
    turns it into block_q tokens.
    """
    if kind not in ("decode", "prefill"):
        raise ValueError(f"kind must be 'decode' or 'prefill', got {kind!r}")
    tgt = target(device)
    dp = padded_head_dim(head_dim)
    row = min(128, max(64, dp))  # presets exist for padded 64 and 128; 256 scales down below
    if kind == "decode":
        block_k, warps, stages = _DECODE[tgt][row]
        cfg = dict(block_k=block_k, num_warps=warps, num_stages=stages)
    else:
        block_m, block_k, warps, stages = _PREFILL[tgt][row]
        cfg = dict(block_m=block_m, block_k=block_k, num_warps=warps, num_stages=stages)
    itemsize = jnp.dtype(dtype).itemsize
    while _smem(kind, cfg, dp, itemsize) > SMEM_BYTES[tgt] and cfg["block_k"] > 16:
        cfg["block_k"] //= 2
    while _smem(kind, cfg, dp, itemsize) > SMEM_BYTES[tgt] and cfg["num_stages"] > 1:
        cfg["num_stages"] -= 1
    cfg["target"] = tgt
    return cfg


BLOCKS_PER_SPLIT = 4  # key blocks per decode split: fixed, so a row's reduction tree never depends on the batch
MAX_SPLITS = 64


def split_plan(n_blocks: int, cores: int, num_splits: int | None = None) -> tuple[int, int]:
    """(splits, key blocks per split) of a decode launch over a cache of `n_blocks` key blocks.

    Split j always covers key blocks [j * per, (j + 1) * per): the partition of a row's keys, and so the order of
    its softmax reduction, depends on the key positions only, never on how many rows the step has or how long the
    cache slice is (issue 43: the old count came from the row count, 1 row -> up to 64 splits, 32 rows -> 2, and
    the bits changed with the batch). BLOCKS_PER_SPLIT blocks per split, up to MAX_SPLITS splits (beyond
    MAX_SPLITS * BLOCKS_PER_SPLIT blocks the share grows with the cache: invariant per cache length only); one
    split where there are no GPU cores (interpret mode). An explicit `num_splits` shares the cache's blocks evenly.
    """
    if num_splits:
        splits = max(1, min(num_splits, n_blocks))
        return splits, pl.cdiv(n_blocks, splits)
    if cores <= 0:
        return 1, n_blocks
    per = max(BLOCKS_PER_SPLIT, pl.cdiv(n_blocks, MAX_SPLITS))
    return pl.cdiv(n_blocks, per), per


def compiler_params(num_warps: int, num_stages: int):
    """Triton launch parameters, or None where this JAX has no Pallas Triton backend."""
    if plgpu is None:
        return None
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def triton_unsupported(device: Any = None, kv_dtype: str | None = None) -> str | None:
    """Why the Pallas Triton kernels cannot run on `device` over a `kv_dtype` cache; None when they can.

    They need a CUDA GPU of compute capability >= 8.0 (sm75: see the module docstring), >= 8.9 for a float8
    cache (Triton's e4m3 conversions need Ada/Hopper), and a JAX that still ships the Triton backend.
    """
    device = _default_device(device)
    cc = compute_capability(device)
    if cc is None:
        return f"{getattr(device, 'platform', 'cpu')} device without a CUDA compute capability"
    if cc < (8, 0):
        return (f"compute capability {cc[0]}.{cc[1]} < 8.0: Pallas Triton kernels are not supported there "
                "(jax#26799)")
    if kv_dtype is not None and kv_dtype.startswith("float8") and cc < (8, 9):
        return (f"compute capability {cc[0]}.{cc[1]} < 8.9: Triton has no float8 e4m3 conversion there "
                "(float8 KV cache)")
    if plgpu is None:
        return "this JAX has no Pallas Triton backend"
    return None


def jax_triton_unsupported(device: Any = None, kv_dtype: str | None = None) -> str | None:
    """Why the Triton kernels launched by jax-triton (`triton_launch`) cannot run on `device` over a `kv_dtype`
    cache; None when they can. They need a CUDA GPU, jax-triton importable (a CUDA jaxlib + `pip install
    jax-triton`), and below cc 8.0 a float16 / float32 / int8 cache (Turing has no bfloat16 arithmetic); float8
    needs 8.9 as for Pallas. kv_dtype None (the model's dtype) is trusted."""
    device = _default_device(device)
    cc = compute_capability(device)
    if cc is None:
        return f"{getattr(device, 'platform', 'cpu')} device without a CUDA compute capability"
    if kv_dtype is not None and kv_dtype.startswith("float8") and cc < (8, 9):
        return f"compute capability {cc[0]}.{cc[1]} < 8.9: Triton has no float8 e4m3 conversion there"
    if kv_dtype == "bfloat16" and cc < (8, 0):
        return f"compute capability {cc[0]}.{cc[1]} < 8.0 has no bfloat16 arithmetic (use a float16 KV cache)"
    try:
        import jax_triton  # noqa: F401  (lazy: pulls in triton; fails on a JAX without CUDA)
    except ImportError as e:
        return f"jax-triton is not importable ({str(e).splitlines()[0][:120]}); pip install 'pocketjax[cuda12]'"
    return None
