"""The decoder's building blocks as pure functions, and the attention dispatch (xla | pallas | pallas_interpret)."""
from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import reference, tuning

from ..errors import ConfigError
from . import cpu_kernels, quant
from .config import ModelConfig, rope_frequencies
from .lora import LoraWeight
from .quant import QuantizedWeight
from .sharding import attention_over_heads

log = logging.getLogger("pocketjax")
ATTENTION_IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "triton")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back before the weight, exactly as transformers' Qwen RMSNorm."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_tables(config: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [..., head_dim] for integer positions, HF convention (halves duplicated, scaled by attn factor)."""
    inv_freq, attention_factor = rope_frequencies(config)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * attention_factor).astype(dtype), (jnp.sin(emb) * attention_factor).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [..., T, heads, D] with cos/sin [..., T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


SKINNY_ROWS = quant.SKINNY_ROWS  # up to this many rows (decode batches), XLA:CPU runs the transposed product faster


def linear(x: jax.Array, w: jax.Array | QuantizedWeight | LoraWeight, b: jax.Array | None = None) -> jax.Array:
    """x @ w.T (+ b) for a weight stored [out, in] (HF's layout), or a QuantizedWeight in the same layout (an integer
    product where `quant.has_integer_product`, else dequantized inside the step and multiplied as a float weight).

    For a few rows on CPU the product is computed as w @ x.T, materialized (the barrier keeps XLA from folding the
    transpose back into the dot's output layout), then transposed: XLA:CPU's [8, 1024] x [1024, 3072] dot takes
    3-5x the batch-1 time, the tall-skinny form about the same as batch 1 (benchmarks/xla_cpu_matmul.py).
    """
    if isinstance(w, LoraWeight):  # an unmerged LoRA adapter (model/lora.py): base product + its rank-r path
        return linear(x, w.base, b) + w.lora.apply(x)
    if isinstance(w, QuantizedWeight):
        y = quant.matmul(x, w)
    elif w.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        y = bfloat16_product(x, w)
    else:
        rows = math.prod(x.shape[:-1])
        if rows <= SKINNY_ROWS and jax.default_backend() == "cpu":
            flat = x.reshape(rows, x.shape[-1])
            y = jax.lax.optimization_barrier(w @ flat.T).T.reshape(*x.shape[:-1], w.shape[0])
        else:
            y = jnp.einsum("...k,nk->...n", x, w)
    return y if b is None else y + b


def bfloat16_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T for a bfloat16 weight [out, in] on CPU, x rounded to bfloat16 and f32 sums, in the form measured
    fastest per row count (benchmarks/xla_cpu_matmul.py --suites bf16; benchmarks/README.md "bfloat16 on CPU"):

    - 1 row in a single-device program: pocketjax's own kernel (`cpu_kernels.skinny_matmul`, compiled at first use),
      which streams the bf16 weight at the memory's bandwidth. XLA:CPU has no 1-row bf16 form that does (its best,
      padded to 2 rows, reads 10-21 GB/s where float32 reads 23-35; unpadded, transposed or upcast forms take 6-10x
      longer), so a bf16 decode step, half float32's bytes, was no faster than float32 (issue 36). On a mesh XLA
      cannot partition the kernel's custom call (it would gather the weight): sharded programs use the forms below.
    - 2..BF16_SKINNY_ROWS rows: XLA's bf16 dot as w @ x.T with f32 accumulation, materialized (barrier) and
      transposed, as `linear` does for float32: 20-32 GB/s, ahead of the kernel's FMAs there (compute bound on a
      slow core) and of x @ w.T.
    - 1 row without the kernel (no compiler, POCKETJAX_CPU_KERNELS=off, a mesh): x @ w.T padded to 2 rows; beyond
      BF16_SKINNY_ROWS (prefill): x @ w.T.

    Whether bf16 beats float32 still depends on the CPU, so `default_dtype` loads bfloat16 checkpoints as bfloat16
    only where `bfloat16_probe` measured this function no slower than float32's product.
    """
    rows = math.prod(x.shape[:-1])
    flat = x.reshape(rows, x.shape[-1]).astype(jnp.bfloat16)
    nk = (((1,), (1,)), ((), ()))
    if rows <= KERNEL_ROWS and on_one_device(flat, w) and cpu_kernels.skinny_matmul_available():
        y = cpu_kernels.skinny_matmul(flat, w)
    elif 2 <= rows <= BF16_SKINNY_ROWS:
        y = jax.lax.optimization_barrier(jax.lax.dot_general(w, flat, nk, preferred_element_type=jnp.float32)).T
    else:
        padded = jnp.pad(flat, ((0, 1), (0, 0))) if rows == 1 else flat
        y = jax.lax.dot_general(padded, w, nk, preferred_element_type=jnp.float32)[:rows]
    return y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])


KERNEL_ROWS = 1  # bf16 products of this many rows run in pocketjax's kernel (it reads the weight once for up to 8
# rows, but at 2-8 rows XLA's transposed bf16 dot measured faster on a 2-core Sapphire Rapids)
BF16_SKINNY_ROWS = 8  # up to this many rows the transposed bf16 dot (measured at 2, 4, 8)


def on_one_device(*arrays: jax.Array) -> bool:
    """True when the program placing `arrays` is not partitioned: none is on a mesh of several devices, and no
    `jax.set_mesh` context names one. Decided at trace time (a static choice of product form)."""
    meshes = [jax.typeof(a).sharding.mesh for a in arrays] + [jax.sharding.get_abstract_mesh()]
    return all(m.empty or m.size == 1 for m in meshes)


@dataclass(frozen=True)
class Bfloat16Probe:
    """`linear`'s milliseconds per decode-shaped product with bfloat16 and with float32 weights, per row count."""

    bfloat16_ms: dict[int, float]
    float32_ms: dict[int, float]

    @property
    def fast(self) -> bool:
        """True where bfloat16 weights multiplied no slower than float32 at every row count probed."""
        return all(self.bfloat16_ms[r] <= self.float32_ms[r] for r in self.float32_ms)


PROBE_SHAPE, PROBE_WEIGHTS, PROBE_ROWS, PROBE_ROUNDS = (2048, 1024), 8, (1, 4), 5


@functools.cache
def bfloat16_probe() -> Bfloat16Probe:
    """This process's measurement of `linear` on bfloat16 vs float32 weights (once, ~1-3 s): PROBE_WEIGHTS distinct
    weights per call (34 MB in bf16, past a 32 MB L3, so they come from memory as in a decode step), at 1 row and a
    small batch, the minimum of PROBE_ROUNDS interleaved calls (a shared machine's load hits both alike).

    A measurement, not CPU flags: which library path a bf16 dot takes (and how fast) depends on the CPU, the XLA
    build and its flags; the ISA flags alone predict it wrong (an AVX512_BF16 Zen 4 decoded at 0.82x float32 at
    1 request, issue 36).
    """
    keys = jax.random.split(jax.random.key(0), PROBE_WEIGHTS)
    f32 = [jax.random.normal(k, PROBE_SHAPE, jnp.float32) for k in keys]
    weights = {"bfloat16": [w.astype(jnp.bfloat16) for w in f32], "float32": f32}
    product = jax.jit(lambda x, ws: sum(linear(x, w).astype(jnp.float32).sum() for w in ws))
    best: dict[str, dict[int, float]] = {name: {} for name in weights}
    for rows in PROBE_ROWS:
        args = {name: (jnp.ones((rows, PROBE_SHAPE[1]), name), ws) for name, ws in weights.items()}
        for name in weights:
            jax.block_until_ready(product(*args[name]))  # compile
        for _ in range(PROBE_ROUNDS):
            for name in weights:
                t0 = time.perf_counter()
                jax.block_until_ready(product(*args[name]))
                ms = 1e3 * (time.perf_counter() - t0) / PROBE_WEIGHTS
                best[name][rows] = min(best[name].get(rows, math.inf), ms)
    return Bfloat16Probe(bfloat16_ms=best["bfloat16"], float32_ms=best["float32"])


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    """Qwen's MLP: down(silu(gate(x)) * up(x))."""
    return linear(jax.nn.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])


def qkv_projection(p: dict, config: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """q [B,T,Hq,D], k and v [B,T,Hkv,D] with bias, QK-norm (Qwen3) and RoPE applied."""
    b, t, _ = x.shape
    d = config.head_dim
    q = linear(x, p["q"], p.get("q_bias")).reshape(b, t, -1, d)
    k = linear(x, p["k"], p.get("k_bias")).reshape(b, t, -1, d)
    v = linear(x, p["v"], p.get("v_bias")).reshape(b, t, -1, d)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def resolve_impl(requested: str, kv_dtype: str | None = None, device=None) -> str:
    """The attention path that will run for `requested`: "xla", "pallas", "pallas_interpret" or "triton"; logs which
    and why.

    requested: one of ATTENTION_IMPLS. "auto" runs the Pallas kernels where they compile for `device` (default: the
    first) and a `kv_dtype` cache (`tuning.triton_unsupported`: cc >= 8.0), below 8.0 the Triton kernels launched
    through jax-triton when it is installed (`tuning.jax_triton_unsupported`), XLA attention elsewhere, so an engine
    config never crashes on an older GPU. "pallas" / "triton" force one kernel family where it can run (XLA
    otherwise); "pallas_interpret" runs the Pallas kernels interpreted (slow; for tests).
    """
    if requested not in ATTENTION_IMPLS:
        raise ConfigError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {requested!r}")
    if requested == "xla":
        impl, reason = "xla", "XLA attention requested"
    elif requested == "pallas_interpret":
        impl, reason = "pallas_interpret", "Pallas kernels in interpret mode requested (slow; for tests)"
    else:
        device = jax.devices()[0] if device is None else device
        unsupported = tuning.triton_unsupported(device, kv_dtype)
        if getattr(device, "platform", "cpu") == "cpu":
            impl = "xla"
            reason = ("CPU: XLA attention (Pallas GPU kernels would only run interpreted)" if requested == "auto" else
                      f"{requested} requested on CPU: falling back to XLA attention (use pallas_interpret to run the "
                      "kernels interpreted)")
        elif requested == "triton" or (requested == "auto" and unsupported
                                       and tuning.compute_capability(device) < (8, 0)):
            impl, reason = _triton_or_xla(device, kv_dtype, requested, unsupported)
        elif unsupported:
            impl, reason = "xla", f"{unsupported}, using XLA attention"
        else:
            major, minor = tuning.compute_capability(device)
            how = "auto" if requested == "auto" else "requested"
            impl, reason = "pallas", f"compute capability {major}.{minor}: Pallas Triton kernels ({how})"
    log.info("pocketjax attention: %s (%s)", impl, reason)
    return impl


def _triton_or_xla(device, kv_dtype: str | None, requested: str, pallas_unsupported: str | None) -> tuple[str, str]:
    """("triton", why) where jax-triton can launch the Triton kernels on `device`, else ("xla", why)."""
    unsupported = tuning.jax_triton_unsupported(device, kv_dtype)
    if unsupported:
        return "xla", f"{unsupported}, using XLA attention"
    major, minor = tuning.compute_capability(device)
    if requested == "triton":
        return "triton", f"compute capability {major}.{minor}: Triton kernels through jax-triton (requested)"
    return "triton", f"{pallas_unsupported}; Triton kernels compiled by official Triton, launched through jax-triton"


def _kernels(impl: str):
    """The module holding decode_attention / prefill_attention of a kernel path (the Triton one imports triton)."""
    if impl == "triton":
        from pallas_kernels import triton_launch
        return triton_launch
    return pallas_kernels


def split_kv(kv: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, dict]:
    """(k, v) or (k, v, k_scale, v_scale) -> k, v and the scale keywords of the kernels and references."""
    k, v, *scales = kv
    return k, v, dict(zip(("k_scale", "v_scale"), scales))


def decode_attention(impl: str, q, kv: tuple[jax.Array, ...], lengths, slots=None, kv_len: int | None = None):
    """One query token per slot over one layer's cache kv = (k, v[, k_scale, v_scale]), k/v [S, Hkv, T, D].

    The XLA path reads only the first `kv_len` positions (a static bucket); the kernels skip blocks by length.
    On a sharded cache the kernels run per device on local heads (shard_map; XLA partitions the XLA path).
    """
    if impl == "xla":
        k, v, scales = split_kv(tuple(a[:, :, :kv_len] for a in kv))
        return reference.decode_attention(q, k, v, lengths, slots=slots, **scales)
    def kernel(q, kv, lengths, slots):
        k, v, scales = split_kv(kv)
        return _kernels(impl).decode_attention(q, k, v, lengths, slots=slots, interpret=impl == "pallas_interpret",
                                               **scales)
    return attention_over_heads(kernel, q, kv, lengths, slots)


def prefill_attention(impl: str, q, kv: tuple[jax.Array, ...], starts, q_lengths, slots=None,
                      kv_len: int | None = None):
    """A chunk of new tokens per row after a cached prefix, causal, through the chosen implementation."""
    if impl == "xla":
        k, v, scales = split_kv(tuple(a[:, :, :kv_len] for a in kv))
        return reference.prefill_attention(q, k, v, starts, q_lengths, slots=slots, **scales)
    def kernel(q, kv, starts, q_lengths, slots):
        k, v, scales = split_kv(kv)
        return _kernels(impl).prefill_attention(q, k, v, starts, q_lengths, slots=slots,
                                                interpret=impl == "pallas_interpret", **scales)
    return attention_over_heads(kernel, q, kv, starts, q_lengths, slots)
