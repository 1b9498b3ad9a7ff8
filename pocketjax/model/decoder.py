"""The functional Qwen decoder: one layer function, threaded through three entry points.

- `forward_logits`: a full causal forward without cache (scoring, perplexity, training).
- `prefill_forward`: a chunk of prompt tokens per row, written into the slotted cache after a cached prefix.
- `decode_forward`: one token per active slot.

Layers are a Python list of per-layer dicts and the loop is unrolled at trace time: on XLA:CPU a `lax.scan` over
stacked weights copies each layer's slice (measured 2.5x slower at batch 1), and the unrolled loop lets every cache
buffer be updated in place.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import layers

from . import quant
from .checkpoint import load_params
from .config import DTYPES, ModelConfig
from .hub import resolve_checkpoint
from ..errors import ConfigError, RequestError
from .memory import check_fits, plan_memory
from .kv_cache import QMAX, KVCache, check_kv_dtype, dequantize, quantize
from .sharding import make_mesh, mesh_tp, sharded_placer

Params = dict[str, Any]
# attend(layer index, q [B,T,Hq,D], k, v [B,T,Hkv,D], state) -> (out [B,T,Hq,D], state)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


@dataclass(frozen=True)
class Model:
    """A loaded model: its config, its params pytree, and the mesh it is placed on (None: one device)."""

    config: ModelConfig
    params: Params
    mesh: Any = None
    path: str | None = None

    @property
    def dtype(self):
        return self.params["final_norm"].dtype  # the embedding may be quantized


def run_layers(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
               attend: Attend, state: Any) -> tuple[jax.Array, Any]:
    """Embedding and every decoder layer; returns the final-normed hidden states [B, T, H] and the attend state."""
    x = quant.embed(params["embed"], tokens, params["final_norm"].dtype)
    cos, sin = layers.rope_tables(config, positions, x.dtype)
    b, t, _ = x.shape
    eps = config.rms_norm_eps
    for i, p in enumerate(params["layers"]):
        q, k, v = layers.qkv_projection(p, config, layers.rms_norm(x, p["input_norm"], eps), cos, sin)
        out, state = attend(i, q, k, v, state)
        x = x + layers.linear(out.reshape(b, t, -1), p["o"], p.get("o_bias"))
        x = x + layers.swiglu(p, layers.rms_norm(x, p["post_norm"], eps))
    return layers.rms_norm(x, params["final_norm"], eps), state


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """Float32 logits; a tied model reuses the embedding table [vocab, hidden] as its output projection."""
    return layers.linear(hidden, params.get("lm_head", params["embed"])).astype(jnp.float32)


@partial(jax.jit, static_argnames=("config", "kv_dtype"))
def forward_logits(params: Params, config: ModelConfig, tokens: jax.Array, kv_dtype: str | None = None) -> jax.Array:
    """float32 logits [B, T, vocab] of a full causal forward over tokens [B, T], no cache.

    kv_dtype "int8" / "float8_e4m3fn" rounds K and V as a quantized cache stores them (scoring its accuracy cost).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    zeros, full = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)

    def attend(i, q, k, v, state):
        if kv_dtype in QMAX:
            k, v = (dequantize(*quantize(x, kv_dtype), x.dtype) for x in (k, v))
        kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        return layers.prefill_attention("xla", q, (kt, vt), zeros, full), state

    hidden, _ = run_layers(params, config, tokens, positions, attend, None)
    return lm_head(params, hidden)


def prefill_forward(params: Params, config: ModelConfig, impl: str, kv_len: int, cache: KVCache,
                    tokens: jax.Array, slots: jax.Array, starts: jax.Array, lengths: jax.Array
                    ) -> tuple[KVCache, jax.Array]:
    """Write a chunk tokens [B, T] (row b: `lengths[b]` valid tokens at `starts[b]`..) into cache rows `slots`.

    Returns the updated cache and the logits [B, vocab] of each row's last valid token. Attention reads cache
    positions < kv_len (a bucket covering every row's starts + lengths). Padding rows have lengths 0.
    """
    b, t = tokens.shape
    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = starts[:, None] + offsets
    write_at = jnp.where(offsets < lengths[:, None], positions, cache.max_seq_len)

    def attend(i, q, k, v, cache):
        cache = cache.write(i, slots, write_at, k, v)
        out = layers.prefill_attention(impl, q, cache.layer(i), starts, lengths, slots=slots, kv_len=kv_len)
        return out, cache

    hidden, cache = run_layers(params, config, tokens, positions, attend, cache)
    last = hidden[jnp.arange(b), jnp.maximum(lengths - 1, 0)]
    new_lengths = cache.lengths.at[jnp.where(lengths > 0, slots, cache.num_slots)].set(starts + lengths, mode="drop")
    return replace(cache, lengths=new_lengths), lm_head(params, last)


def decode_forward(params: Params, config: ModelConfig, impl: str, kv_len: int, cache: KVCache,
                   tokens: jax.Array, slots: jax.Array, positions: jax.Array, active: jax.Array,
                   dense: bool = False) -> tuple[KVCache, jax.Array]:
    """One new token per row: tokens [B] at `positions` in cache rows `slots`; returns (cache, logits [B, vocab]).

    Inactive rows (padding) write nothing and attend to nothing. `dense` promises row i is slot i for every slot,
    so attention reads the cache rows in place instead of gathering them.
    """
    write_at = jnp.where(active, positions, cache.max_seq_len)[:, None]
    lengths = jnp.where(active, positions + 1, 0)

    def attend(i, q, k, v, cache):
        cache = cache.write(i, slots, write_at, k, v)
        out = layers.decode_attention(impl, q[:, 0], cache.layer(i), lengths, slots=None if dense else slots,
                                      kv_len=kv_len)
        return out[:, None], cache

    hidden, cache = run_layers(params, config, tokens[:, None], positions[:, None], attend, cache)
    new_lengths = cache.lengths.at[jnp.where(active, slots, cache.num_slots)].set(lengths, mode="drop")
    return replace(cache, lengths=new_lengths), lm_head(params, hidden[:, 0])


def default_dtype(config: ModelConfig) -> str:
    """The checkpoint's dtype, except float16 on CPU, which computes in float32 (and says so): XLA:CPU has a fast
    bfloat16 product (`layers.bfloat16_product`) but none for float16, 8-15x slower than float32 in every form
    measured. `load_model(dtype="float16")` still forces it."""
    if config.dtype == "float16" and jax.default_backend() == "cpu":
        layers.log.info("pocketjax: float16 checkpoint computed in float32 on CPU (no fast float16 product on "
                        "XLA:CPU; dtype='float16' forces it)")
        return "float32"
    return config.dtype


def load_model(path: str | Path, dtype: str | None = None, tp: int = 1, quantize: str | None = None,
               mesh: Any = None, *, revision: str | None = None, local_files_only: bool = False) -> Model:
    """Load a Hugging Face Qwen2/2.5/3 checkpoint, cast to `dtype` (default: `default_dtype`).

    `path` is a checkpoint folder or a Hub repo id ("Qwen/Qwen3-0.6B", at `revision`), downloaded into the hub
    cache unless `local_files_only` or HF_HUB_OFFLINE=1; `Model.path` is then the local snapshot folder.
    Tensors are read one at a time from memory-mapped safetensors and placed on device straight away, so host
    memory peaks near one copy of the weights. `tp` > 1 (or a `mesh`) shards them as they are read.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    folder = resolve_checkpoint(path, revision, local_files_only)
    config = ModelConfig.from_folder(folder)
    dtype = dtype or default_dtype(config)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    stored = config.quantization
    if quant.parse_mode(quantize) is not None and stored is not None:
        raise ConfigError(f"quantize={quantize!r}: the checkpoint is already {stored.method} int{stored.bits}")
    if tp != 1 or mesh is not None:
        mesh = mesh if mesh is not None else make_mesh(tp)
        if tp != 1 and tp != mesh_tp(mesh):
            raise ConfigError(f"tp={tp} contradicts the mesh's 'tp' axis of size {mesh_tp(mesh)}")
        place = sharded_placer(mesh, config)
    else:
        def place(_, array):
            return jax.device_put(array)
    if quantize is not None or stored is not None:  # quantize from float32, cast the rest to dtype
        place = quant.quantizing_placer(place, quantize, np.dtype(jnp.dtype(dtype)))
    if stored is None:  # (a pre-quantized checkpoint is not planned yet: its float plan would overstate it)
        plan = plan_memory(config, tp=mesh_tp(mesh) if mesh is not None else 1, dtype=dtype, quantize=quantize)
        check_fits(f"loading {path}", plan.weights, list(mesh.devices.flat) if mesh is not None
                   else jax.devices()[:1], "quantize='int8' or 'int4', dtype='bfloat16', or tp=2")
    read_dtype = jnp.float32 if quantize is not None else dtype
    params = load_params(folder, config, np.dtype(jnp.dtype(read_dtype)), place)
    return Model(config=config, params=params, mesh=mesh, path=str(folder))


def logits(model: Model, tokens, kv_dtype: str | None = None) -> jax.Array:
    """float32 logits [B, T, vocab] for int tokens [B, T] (or [T]): a full causal forward without cache.

    kv_dtype: score with K/V rounded as a cache of that dtype stores them ("int8", "float8_e4m3fn").

    Composes with jax.jit, vmap and grad (of a loss on the logits), and takes sharded inputs. Checked always: the
    shape and the integer dtype (RequestError). Checked only when the tokens are concrete (eagerly, not under
    tracing, where values are unknown): that every id lies in [0, vocab); a traced out-of-range id is clamped by
    the embedding gather, as in any jnp indexing.
    """
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise RequestError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    tokens = tokens.astype(jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise RequestError(f"tokens must be a non-empty [B, T] integer array, got shape {tokens.shape}")
    vocab = model.config.vocab_size
    if not isinstance(tokens, jax.core.Tracer):
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab:
            raise RequestError(f"token ids must lie in [0, {vocab}), got range [{low}, {high}]")
    check_kv_dtype(kv_dtype)
    return forward_logits(model.params, model.config, tokens, kv_dtype)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean float32 cross-entropy of logits [..., V] against integer targets [...]."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def loss(model_or_params: Model | Params, tokens: jax.Array, config: ModelConfig | None = None) -> jax.Array:
    """Mean next-token cross-entropy (float32 scalar) of int tokens [B, T]: position t predicts token t + 1.

    Differentiable in the params: `jax.grad(loss)(params, tokens, config)`. Takes a `pj.Model` or a params
    pytree with its `config`.
    """
    if isinstance(model_or_params, Model):
        params, config = model_or_params.params, config or model_or_params.config
    else:
        params = model_or_params
    if config is None:
        raise ConfigError("loss(params, tokens) needs config=ModelConfig(...) when given a params pytree")
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise RequestError(f"tokens must be an integer array [B, T] with T >= 2, got shape {tokens.shape}")
    return next_token_loss(params, config, tokens)


@partial(jax.jit, static_argnames="config")
def next_token_loss(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """`loss` without the checks, jitted: one compiled program per shape whether called eagerly or under grad."""
    return cross_entropy(forward_logits(params, config, tokens[:, :-1]), tokens[:, 1:])
