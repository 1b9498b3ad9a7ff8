"""The decoder's building blocks as pure functions, the product forms, and the attention dispatch
(cpu | xla | pallas | pallas_interpret | triton)."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import reference, tuning

from ..errors import ConfigError
from . import cpu_kernels, quant
from .numerics import fixed_sum, opaque
from .config import ModelConfig, rope_frequencies
from .lora import LoraWeight
from .quant import QuantizedWeight
from .sharding import attention_over_heads, kernel_mesh, mesh_tp, over_weight, weight_spec

log = logging.getLogger("pocketjax")
ATTENTION_IMPLS = ("auto", "cpu", "xla", "pallas", "pallas_interpret", "triton")

# Whether a CPU program being traced uses pocketjax's native kernels (products and attention: batch-invariant) or
# XLA's forms. Read at trace time only; the forward functions set it from their static `impl` ("cpu" = native), so
# a jit cache keyed on `impl` never mixes the two. Outside them (a direct `linear` call) the native forms are used
# wherever they are available.
_NATIVE = contextvars.ContextVar("pocketjax_native_forms", default=True)


@contextlib.contextmanager
def native_forms(on: bool) -> Iterator[None]:
    """Trace the enclosed code with the native CPU kernels (on) or XLA's forms (off)."""
    token = _NATIVE.set(on)
    try:
        yield
    finally:
        _NATIVE.reset(token)


def native(*arrays: jax.Array) -> bool:
    """True where the program being traced takes the native CPU kernels for `arrays`: asked for (`native_forms`),
    on the CPU backend, one device, and the kernels built (`cpu_kernels.available`)."""
    return native_anywhere() and on_one_device(*arrays)


def native_anywhere() -> bool:
    """`native` without the one-device condition: on a "tp" mesh the kernels then run per device on shards
    (`sharding.over_weight`)."""
    return _NATIVE.get() and jax.default_backend() == "cpu" and cpu_kernels.available()


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back before the weight, as transformers' Qwen RMSNorm; the mean of
    squares is a `fixed_sum`, so a row's norm never depends on the rows beside it."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(fixed_sum(xf * xf, keepdims=True) / x.shape[-1] + eps)
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
    return opaque(x * cos[..., None, :]) + opaque(rotated * sin[..., None, :])  # each product rounds (no FMA)


SKINNY_ROWS = quant.SKINNY_ROWS  # up to this many rows (decode batches), XLA:CPU runs the transposed product faster


def linear(x: jax.Array, w: jax.Array | QuantizedWeight | LoraWeight, b: jax.Array | None = None,
           name: str | None = None) -> jax.Array:
    """x @ w.T (+ b) for a weight stored [out, in] (HF's layout), or a QuantizedWeight in the same layout (an integer
    product where native: the native kernel dequantizing int8 / int4 in registers; elsewhere XLA's integer product where
    `quant.has_integer_product`, else dequantized inside the step and multiplied as a float weight).

    Where `native(x, w)` (CPU, one device, the kernels built): every float product, of any row count, is pocketjax's
    kernel (`cpu_kernels.skinny_matmul`), whose per-row result does not depend on the row count: decode, verify and
    prefill compute a position alike, alone or in a batch. On a "tp" mesh a float weight named by `name` (its
    params key: "q", "o", "lm_head", ...) runs the kernel per device on its shard (`sharding.over_weight`); XLA's
    forms otherwise (`xla_product`).
    """
    if isinstance(w, LoraWeight):  # an unmerged LoRA adapter (model/lora.py): base product + its rank-r path
        return linear(x, w.base, b) + opaque(w.lora.apply(x, product))
    if isinstance(w, QuantizedWeight):
        fast = native(x, w.scale)
        kernel = fast and x.dtype in (jnp.float32, jnp.bfloat16) and cpu_kernels.quantized_applies(w)
        y = quant.matmul(x, w, product if fast else None, cpu_kernels.quantized_matmul if kernel else None)
    else:
        y = product(x, w, name)
    return y if b is None else y + b


def product(x: jax.Array, w: jax.Array, name: str | None = None) -> jax.Array:
    """x @ w.T for a float weight [out, in]: the native kernel where `native(x, w)`, per device on a "tp" mesh for a
    named weight (XLA cannot partition the kernel's call; the name says how the weight is split), else XLA's forms."""
    kernel = w.dtype in (jnp.float32, jnp.bfloat16)
    mesh = kernel_mesh(w) if kernel and name is not None else None
    if mesh is not None and native_anywhere():
        return over_weight(native_product, x, w, weight_spec(name, w.shape, mesh_tp(mesh)), mesh)
    if kernel and native(x, w):
        return native_product(x, w)
    if w.dtype == jnp.float16 and native(x, w):
        float16_products_logged()
    return xla_product(x, w)


@functools.cache
def float16_products_logged() -> None:
    """Say once that float16 weights multiply in XLA's forms: the native kernel takes float32 and bfloat16 weights,
    and upcasting a float16 weight at every step would copy it (on CPU, load_model computes a float16 checkpoint in
    float32 unless dtype="float16" is forced)."""
    log.info("pocketjax: float16 weights multiply in XLA's forms (the native product takes float32 / bfloat16): "
             "served, but not bitwise batch-invariant (README \"Guarantees\")")


def native_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T in pocketjax's kernel (`cpu_kernels.skinny_matmul`): a row's bits never depend on the rows beside it."""
    flat = x.reshape(-1, x.shape[-1])
    if w.dtype == jnp.bfloat16:
        flat = flat.astype(jnp.bfloat16)  # as XLA's bf16 product: x rounded to bfloat16, f32 sums
    return cpu_kernels.skinny_matmul(flat, w).astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def xla_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """XLA's fastest forms measured per row count (not batch-invariant: XLA picks the algorithm by shape).

    For a few rows on CPU the product is computed as w @ x.T, materialized (the barrier keeps XLA from folding the
    transpose back into the dot's output layout), then transposed: XLA:CPU's [8, 1024] x [1024, 3072] dot takes
    3-5x the batch-1 time, the tall-skinny form about the same as batch 1 (benchmarks/xla_cpu_matmul.py).
    """
    if w.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return bfloat16_product(x, w)
    rows = math.prod(x.shape[:-1])
    if rows <= SKINNY_ROWS and jax.default_backend() == "cpu":
        flat = x.reshape(rows, x.shape[-1])
        return jax.lax.optimization_barrier(w @ flat.T).T.reshape(*x.shape[:-1], w.shape[0])
    return jnp.einsum("...k,nk->...n", x, w)


def bfloat16_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T for a bfloat16 weight [out, in] on CPU in XLA's forms (the native kernel is `product`'s first
    choice), x rounded to bfloat16 and f32 sums, in the form measured fastest per row count
    (benchmarks/xla_cpu_matmul.py --suites bf16; benchmarks/README.md "bfloat16 on CPU"):

    - 1 row in a single-device program with the kernel built: pocketjax's kernel, which streams the bf16 weight at
      the memory's bandwidth (XLA:CPU's best 1-row bf16 form, padded to 2 rows, reads 10-21 GB/s where float32
      reads 23-35). On a mesh XLA cannot partition the kernel's custom call: sharded programs use the forms below.
    - 2..BF16_SKINNY_ROWS rows: XLA's bf16 dot as w @ x.T with f32 accumulation, materialized (barrier) and
      transposed, as `xla_product` does for float32.
    - 1 row without the kernel: x @ w.T padded to 2 rows; beyond BF16_SKINNY_ROWS (prefill): x @ w.T.
    """
    rows = math.prod(x.shape[:-1])
    flat = x.reshape(rows, x.shape[-1]).astype(jnp.bfloat16)
    nk = (((1,), (1,)), ((), ()))
    if rows <= KERNEL_ROWS and on_one_device(flat, w) and cpu_kernels.available():
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


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    """Qwen's MLP: down(silu(gate(x)) * up(x))."""
    return linear(jax.nn.silu(linear(x, p["gate"], name="gate")) * linear(x, p["up"], name="up"), p["down"],
                  name="down")


def qkv_projection(p: dict, config: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """q [B,T,Hq,D], k and v [B,T,Hkv,D] with bias, QK-norm (Qwen3) and RoPE applied."""
    b, t, _ = x.shape
    d = config.head_dim
    q, k, v = (linear(x, p[n], p.get(f"{n}_bias"), name=n).reshape(b, t, -1, d) for n in "qkv")
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def resolve_impl(requested: str, kv_dtype: str | None = None, device=None, batch_invariant: bool = True) -> str:
    """The attention path that will run for `requested`: "cpu", "xla", "pallas", "pallas_interpret" or "triton";
    logs which and why.

    On the CPU, "auto" (with `batch_invariant`) and "cpu" run pocketjax's native kernels, products included
    (`cpu_kernels`: built here, outside any trace), where they build; XLA's forms otherwise, or with
    batch_invariant=False (faster at some batch sizes, not batch-invariant: README "Guarantees").

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
            wanted = requested == "cpu" or (requested == "auto" and batch_invariant)
            if wanted and cpu_kernels.available():
                impl, reason = "cpu", "CPU: pocketjax's native kernels (batch-invariant products and attention)"
            elif wanted:
                impl, reason = "xla", ("CPU: the native kernels are not available (see above): XLA's forms, not "
                                       "batch-invariant")
            else:
                impl = "xla"
                reason = ("CPU: XLA's forms (batch_invariant=False)" if requested == "auto" else
                          f"{requested} requested on CPU: falling back to XLA attention (use pallas_interpret to run "
                          "the kernels interpreted)")
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


def native_attention(q, kv: tuple[jax.Array, ...], starts, q_lengths, slots) -> jax.Array:
    """The native CPU kernel (`cpu_kernels.attention`) over kv = (k, v[, k_scale, v_scale]), per device on its
    local heads when the cache is sharded: each query row's bits depend on its position, query and keys only."""
    def kernel(q, kv, starts, q_lengths, slots):
        k, v, scales = split_kv(kv)
        k, v = (a.astype(jnp.float32) if a.dtype == jnp.float16 else a for a in (k, v))  # a forced float16 cache
        rows = jnp.arange(q.shape[0], dtype=jnp.int32) if slots is None else slots
        return cpu_kernels.attention(q, k, v, rows, starts, q_lengths, 1.0 / math.sqrt(q.shape[-1]), **scales)
    # the kernel computes in float32 or bfloat16: float16 queries are widened (exactly) to float32, which a float16
    # model's default float32 cache computes in anyway, so float16 keeps the invariant attention (issue 67)
    wide = q.astype(jnp.float32) if q.dtype == jnp.float16 else q
    return attention_over_heads(kernel, wide, kv, starts, q_lengths, slots).astype(q.dtype)


def decode_attention(impl: str, q, kv: tuple[jax.Array, ...], lengths, slots=None, kv_len: int | None = None):
    """One query token per slot over one layer's cache kv = (k, v[, k_scale, v_scale]), k/v [S, Hkv, T, D].

    The XLA path reads only the first `kv_len` positions (a static bucket); the kernels skip blocks by length.
    On a sharded cache the kernels run per device on local heads (shard_map; XLA partitions the XLA path).
    """
    if impl == "cpu":  # the query at position lengths - 1; an inactive row (length 0) is one padding row
        active = (lengths > 0).astype(jnp.int32)
        return native_attention(q[:, None], kv, jnp.maximum(lengths - 1, 0), active, slots)[:, 0]
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
    if impl == "cpu":
        return native_attention(q, kv, starts, q_lengths, slots)
    if impl == "xla":
        k, v, scales = split_kv(tuple(a[:, :, :kv_len] for a in kv))
        return reference.prefill_attention(q, k, v, starts, q_lengths, slots=slots, **scales)
    def kernel(q, kv, starts, q_lengths, slots):
        k, v, scales = split_kv(kv)
        return _kernels(impl).prefill_attention(q, k, v, starts, q_lengths, slots=slots,
                                                interpret=impl == "pallas_interpret", **scales)
    return attention_over_heads(kernel, q, kv, starts, q_lengths, slots)
