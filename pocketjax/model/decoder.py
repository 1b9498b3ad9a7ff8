"""The functional Qwen decoder: one layer function, threaded through three entry points.

- `forward_logits`: a full causal forward without cache (scoring, perplexity, training, hidden states, hooks).
- `prefill_forward`: a chunk of prompt tokens per row, written into the slotted cache after a cached prefix.
- `decode_forward`: one token per active slot.

Two layouts of the layers, chosen at load (`load_model(scan_layers=)`), one loop (`layer_stack`): a Python list of
per-layer dicts, unrolled at trace time, or one dict of [layers, ...] stacked arrays run by `lax.scan`, which XLA
compiles once whatever the depth (the KV cache is then stacked too, and carried through the scan).
`resolve_scan_layers` says which `"auto"` picks, and the comment above it the measurements behind it.
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
from jax.sharding import NamedSharding

from . import cpu_kernels, layers, moe

from . import quant
from .checkpoint import load_params
from .config import DTYPES, ModelConfig
from .hub import resolve_checkpoint
from ..errors import ConfigError, RequestError
from .memory import check_fits, plan_memory
from .kv_cache import QMAX, KVCache, check_kv_dtype, default_kv_dtype, dequantize, quantize
from .numerics import fixed_logsumexp, fixed_sum
from .lora import merging_placer, read_adapter
from .sharding import make_mesh, mesh_tp, sharded_placer, stacked_spec

Params = dict[str, Any]
# attend(layer index, q [B,T,Hq,D], k, v [B,T,Hkv,D], state) -> (out [B,T,Hq,D], state)
Attend = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

# The scan's cost on XLA:CPU: every iteration copies its layer's weights (and the KV cache slice attention reads) out
# of the stacked arrays before the dot, because XLA:CPU cannot feed a dot from a dynamic slice; a fori_loop compiles to
# the same copy, and `unroll=` keeps a copy per unrolled layer without being faster, so SCAN_UNROLL stays 1. The cache
# update stays in place. So on CPU the scan trades step time for compile time: compile time flat in depth, each decode
# step 2-3x slower (benchmarks/compile_time.py measures both; docs/scan-layers.md). "auto" therefore unrolls below
# AUTO_SCAN_MIN_LAYERS (every Qwen up to 8B: 24-36 layers) and scans from there (14B: 48, 32B: 64, 72B: 80), where an
# unrolled warm-up grows to many minutes. GPU and TPU are not measured yet; the same rule applies there.
SCAN_UNROLL = 1
AUTO_SCAN_MIN_LAYERS = 48


def resolve_scan_layers(scan_layers: bool | str, config: ModelConfig) -> bool:
    """Whether a model is loaded stacked for `lax.scan`: True / False as given; "auto": from AUTO_SCAN_MIN_LAYERS
    layers on (the measurements above it)."""
    if scan_layers == "auto":  # a stack needs every layer alike: dense layers among sparse ones stay unrolled
        return config.num_layers >= AUTO_SCAN_MIN_LAYERS and not config.mixed_layers
    if not isinstance(scan_layers, bool):
        raise ConfigError(f"scan_layers must be 'auto', True or False, got {scan_layers!r}")
    if scan_layers and config.mixed_layers:
        raise ConfigError("scan_layers=True needs every layer alike, but this model mixes dense layers "
                          "(mlp_only_layers / decoder_sparse_step) with sparse ones: load it with scan_layers=False")
    return scan_layers


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

    @property
    def scan_layers(self) -> bool:
        """True when the layers are stacked and run by one `lax.scan` (the engine then stacks its KV cache)."""
        return is_stacked(self.params)


def is_stacked(params: Params) -> bool:
    """True when the layers are one dict of [layers, ...] arrays (the scan layout), False for a list of dicts."""
    return isinstance(params["layers"], dict)


def stack_layers(per_layer: list[dict]) -> dict:
    """One dict of [layers, ...] arrays (QuantizedWeights leaf by leaf) from per-layer dicts, name by name: each
    name's per-layer arrays are released once stacked, so the device holds at most one name's weights twice.
    A sharded array keeps its spec behind a replicated layer axis (`sharding.stacked_spec`)."""
    def stack(*arrays):
        out = jnp.stack(arrays)
        sharding = getattr(arrays[0], "sharding", None)
        if isinstance(sharding, NamedSharding):
            out = jax.device_put(out, NamedSharding(sharding.mesh, stacked_spec(sharding.spec)))
        return out

    stacked = {}
    for name in list(per_layer[0]):
        stacked[name] = jax.tree.map(stack, *[p.pop(name) for p in per_layer])
    return stacked


# A hook(layer, hidden [B, T, H]) -> hidden, applied to the residual stream after each layer.
Hook = Callable[[Any, jax.Array], jax.Array]


def layer_stack(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array, attend: Attend,
                state: Any, hook: Hook | None = None, keep_hidden: bool = False, steer: jax.Array | None = None
                ) -> tuple[jax.Array, Any, jax.Array | None]:
    """Embedding and every decoder layer: (residual stream after the last layer [B, T, H], the attend state,
    with `keep_hidden` the stream after the embedding and after every layer [layers + 1, B, T, H], else None).

    `hook(layer, x)` rewrites the residual stream after each layer (what the next layer and the hidden states see);
    `layer` is a Python int in the unrolled layout and a traced int32 scalar under scan (compare it with
    `jnp.where(layer == n, ...)`, not `if`). `steer` [B, layers, H] (steering vectors as data: one program whatever
    their values) is added to row b's stream after layer i, after the hook; a zero row is a no-op. Stacked layers
    run as one `lax.scan` carrying (x, state): the attend state (the KV cache) is updated in place inside it, and
    `attend` receives the traced layer index.
    """
    x = quant.embed(params["embed"], tokens, params["final_norm"].dtype)
    cos, sin = layers.rope_tables(config, positions, x.dtype)
    b, t, _ = x.shape
    eps = config.rms_norm_eps

    def layer(i, p, x, state, add=None):
        q, k, v = layers.qkv_projection(p, config, layers.rms_norm(x, p["input_norm"], eps), cos, sin)
        out, state = attend(i, q, k, v, state)
        x = x + layers.linear(out.reshape(b, t, -1), p["o"], p.get("o_bias"), name="o")
        x = x + mlp(p, config, layers.rms_norm(x, p["post_norm"], eps))
        x = x if hook is None else hook(i, x)
        return x if add is None else x + add[:, None, :].astype(x.dtype), state

    first = x
    if is_stacked(params):
        def body(carry, xs):
            x, state = layer(*xs[:2], *carry, *xs[2:])
            return (x, state), x if keep_hidden else None

        xs = (jnp.arange(config.num_layers), params["layers"])
        xs += () if steer is None else (jnp.swapaxes(steer, 0, 1),)  # [layers, B, H]: layer i's vectors
        (x, state), after = jax.lax.scan(body, (x, state), xs, unroll=SCAN_UNROLL)
    else:
        after = []
        for i, p in enumerate(params["layers"]):
            x, state = layer(i, p, x, state, None if steer is None else steer[:, i])
            after.append(x)
        after = jnp.stack(after) if keep_hidden else None
    hidden = jnp.concatenate([first[None], after]) if keep_hidden else None
    return x, state, hidden


def mlp(p: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """A layer's MLP: the experts where its params hold a router (a sparse layer: `config.sparse`, as loaded), else
    the dense SwiGLU. Decided by the params' keys at trace time, so a scanned stack (all its layers alike) too."""
    return moe.sparse_mlp(p, config.moe, x) if "router" in p else layers.swiglu(p, x)


def run_layers(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
               attend: Attend, state: Any, hook: Hook | None = None, steer: jax.Array | None = None,
               keep: bool = False) -> tuple[jax.Array, Any, jax.Array | None]:
    """Embedding and every decoder layer; returns the final-normed hidden states [B, T, H], the attend state and,
    with `keep`, the residual stream after the embedding and every layer [layers + 1, B, T, H] (else None)."""
    x, state, stream = layer_stack(params, config, tokens, positions, attend, state, hook, keep, steer)
    return layers.rms_norm(x, params["final_norm"], config.rms_norm_eps), state, stream


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """Float32 logits; a tied model reuses the embedding table [vocab, hidden] as its output projection."""
    return layers.linear(hidden, params.get("lm_head", params["embed"]), name="lm_head").astype(jnp.float32)


@partial(jax.jit, static_argnames=("config", "kv_dtype", "hook", "keep_hidden", "impl"))
def forward_logits(params: Params, config: ModelConfig, tokens: jax.Array, kv_dtype: str | None = None,
                   hook: Hook | None = None, keep_hidden: bool = False, impl: str = "xla"):
    """float32 logits [B, T, vocab] of a full causal forward over tokens [B, T], no cache; with `keep_hidden`,
    (logits, hidden [layers + 1, B, T, H]) as `layer_stack` gives them.

    kv_dtype: K and V as a cache of that dtype stores them: "int8" / "float8_e4m3fn" rounded as a quantized cache
    does, a float dtype cast to it (a bf16 model's float32 cache on CPU attends in float32); None: the model's dtype.
    `hook` is static: each distinct function object compiles once. `impl` "cpu": the engine's native CPU kernels
    (products and attention, a quantized K/V read as the cache stores it), so the logits are the engine's bit for
    bit (`logits`, `logprobs`, `loss`); "xla": XLA's forms (no native kernels; the training/ evaluation's default).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    zeros, full = jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32)

    def attend(i, q, k, v, state):
        heads_first = (0, 2, 1, 3)
        if kv_dtype in QMAX and impl == "cpu":  # values and scales as the engine's cache holds them
            (kq, ks), (vq, vs) = quantize(k, kv_dtype), quantize(v, kv_dtype)
            kv = (kq.transpose(heads_first), vq.transpose(heads_first), ks.transpose(0, 2, 1), vs.transpose(0, 2, 1))
            return layers.prefill_attention(impl, q, kv, zeros, full), state
        if kv_dtype in QMAX:
            k, v = (dequantize(*quantize(x, kv_dtype), x.dtype) for x in (k, v))
        elif kv_dtype is not None:  # as `write_tokens` stores them in a float cache of another dtype
            k, v = k.astype(kv_dtype), v.astype(kv_dtype)
        return layers.prefill_attention(impl, q, (k.transpose(heads_first), v.transpose(heads_first)), zeros,
                                        full), state

    with layers.native_forms(impl == "cpu"):
        x, _, hidden = layer_stack(params, config, tokens, positions, attend, None, hook, keep_hidden)
        out = lm_head(params, layers.rms_norm(x, params["final_norm"], config.rms_norm_eps))
    return (out, hidden) if keep_hidden else out


def prefill_forward(params: Params, config: ModelConfig, impl: str, kv_len: int, cache: KVCache,
                    tokens: jax.Array, slots: jax.Array, starts: jax.Array, lengths: jax.Array,
                    return_hidden: bool = False, hook: Hook | None = None, steer: jax.Array | None = None,
                    capture: bool = False) -> tuple:
    """Write a chunk tokens [B, T] (row b: `lengths[b]` valid tokens at `starts[b]`..) into cache rows `slots`.

    Returns the updated cache and the logits [B, vocab] of each row's last valid token. Attention reads cache
    positions < kv_len (a bucket covering every row's starts + lengths). Padding rows have lengths 0.
    `return_hidden` (static) also returns the final-normed hidden states [B, T, H] of every position, for prompt
    log-probabilities; a flag rather than always, so the plain step never writes them out.
    `hook`: as in `layer_stack`, over the whole chunk (the engine's per-row selection: `steps.row_hooks`).
    `capture` (static) also returns, last, the residual stream at each row's last valid token after the embedding
    and every layer [B, layers + 1, H] (`pj.logits(return_hidden=True)`'s entries at that position).
    """
    b, t = tokens.shape
    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = starts[:, None] + offsets
    write_at = jnp.where(offsets < lengths[:, None], positions, cache.max_seq_len)

    read_len = None if impl == "cpu" else kv_len  # the native kernel reads each row's keys in place, to its position

    def attend(i, q, k, v, cache):
        cache = cache.write(i, slots, write_at, k, v)
        out = layers.prefill_attention(impl, q, cache.layer(i, read_len), starts, lengths, slots=slots,
                                       kv_len=kv_len)
        return out, cache

    with layers.native_forms(impl == "cpu"):
        hidden, cache, stream = run_layers(params, config, tokens, positions, attend, cache, hook, steer, capture)
        at = jnp.maximum(lengths - 1, 0)
        logits = lm_head(params, hidden[jnp.arange(b), at])
    new_lengths = cache.lengths.at[jnp.where(lengths > 0, slots, cache.num_slots)].set(starts + lengths, mode="drop")
    out = (replace(cache, lengths=new_lengths), logits) + ((hidden,) if return_hidden else ())
    return out + (jnp.swapaxes(stream[:, jnp.arange(b), at], 0, 1),) if capture else out


def decode_forward(params: Params, config: ModelConfig, impl: str, kv_len: int, cache: KVCache,
                   tokens: jax.Array, slots: jax.Array, positions: jax.Array, active: jax.Array,
                   dense: bool = False, hook: Hook | None = None, steer: jax.Array | None = None,
                   capture: bool = False) -> tuple:
    """One new token per row: tokens [B] at `positions` in cache rows `slots`; returns (cache, logits [B, vocab]),
    with `capture` also the residual stream after the embedding and every layer [B, layers + 1, H].

    Inactive rows (padding) write nothing and attend to nothing. `dense` promises row i is slot i for every slot,
    so attention reads the cache rows in place instead of gathering them. `hook`: as in `layer_stack`.
    """
    write_at = jnp.where(active, positions, cache.max_seq_len)[:, None]
    lengths = jnp.where(active, positions + 1, 0)

    read_len = None if impl == "cpu" else kv_len  # the native kernel reads each row's keys in place, to its position

    def attend(i, q, k, v, cache):
        cache = cache.write(i, slots, write_at, k, v)
        out = layers.decode_attention(impl, q[:, 0], cache.layer(i, read_len), lengths,
                                      slots=None if dense else slots, kv_len=kv_len)
        return out[:, None], cache

    with layers.native_forms(impl == "cpu"):
        hidden, cache, stream = run_layers(params, config, tokens[:, None], positions[:, None], attend, cache, hook,
                                           steer, capture)
        logits = lm_head(params, hidden[:, 0])
    new_lengths = cache.lengths.at[jnp.where(active, slots, cache.num_slots)].set(lengths, mode="drop")
    out = replace(cache, lengths=new_lengths), logits
    return out + (jnp.swapaxes(stream[:, :, 0], 0, 1),) if capture else out


def default_dtype(config: ModelConfig) -> str:
    """The checkpoint's dtype, except on CPU: float16 computes in float32 (XLA:CPU has no fast float16 product, 8-15x
    slower than float32 in every form measured), and bfloat16 stays bfloat16 where the native kernels are built (they
    stream a bf16 weight at the memory's bandwidth: half float32's bytes) and computes in float32 where they are not
    (XLA:CPU's bf16 forms ran at 0.14-0.82x float32 on three CPUs). A rule of the backend, the checkpoint and the
    build, never a timer: the same call gives the same numerics on a loaded or an idle machine (issue 43 replaced a
    per-process timing probe). Both are logged; `load_model(dtype=...)` forces either."""
    if jax.default_backend() != "cpu" or config.dtype not in ("float16", "bfloat16"):
        return config.dtype
    if config.dtype == "float16":
        layers.log.info("pocketjax: float16 checkpoint computed in float32 on CPU (no fast float16 product on "
                        "XLA:CPU; dtype='float16' forces it)")
        return "float32"
    if layers.cpu_kernels.available():
        layers.log.info("pocketjax: bfloat16 checkpoint computed in bfloat16 on CPU (the native kernels)")
        return "bfloat16"
    layers.log.info("pocketjax: bfloat16 checkpoint computed in float32 on CPU: the native kernels are not built "
                    "and XLA:CPU's bf16 products are slow (dtype='bfloat16' forces it)")
    return "float32"


def load_model(path: str | Path, dtype: str | None = None, tp: int = 1, quantize: str | None = None,
               mesh: Any = None, *, revision: str | None = None, local_files_only: bool = False,
               scan_layers: bool | str = "auto", lora: str | Path | None = None) -> Model:
    """Load a Hugging Face Qwen2/2.5/3 checkpoint, cast to `dtype` (default: `default_dtype`).

    `path` is a checkpoint folder or a Hub repo id ("Qwen/Qwen3-0.6B", at `revision`), downloaded into the hub
    cache unless `local_files_only` or HF_HUB_OFFLINE=1; `Model.path` is then the local snapshot folder.
    Tensors are read one at a time from memory-mapped safetensors and placed on device straight away, so host
    memory peaks near one copy of the weights. `tp` > 1 (or a `mesh`) shards them as they are read.
    `scan_layers`: stack the layers for one `lax.scan` (True), keep them a list for the unrolled loop (False), or
    let `resolve_scan_layers` pick ("auto"); `Model.scan_layers` records which.
    `lora`: a PEFT LoRA adapter folder, merged into each weight as it is read (before quantizing and sharding).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp!r}")
    folder = resolve_checkpoint(path, revision, local_files_only)
    config = ModelConfig.from_folder(folder)
    scan = resolve_scan_layers(scan_layers, config)
    adapter = None if lora is None else read_adapter(lora, config)  # checked before any weight is read
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
        # int4 linears in the native kernel's tiles where it will serve them: one CPU device, the kernels built
        tile = mesh is None and not scan and jax.default_backend() == "cpu" and cpu_kernels.available()
        place = quant.quantizing_placer(place, quantize, np.dtype(jnp.dtype(dtype)), tile)
    if adapter is not None:
        place = merging_placer(place, adapter)
    plan = plan_memory(config, tp=mesh_tp(mesh) if mesh is not None else 1, dtype=dtype, quantize=quantize)
    check_fits(f"loading {path}", plan.weights, list(mesh.devices.flat) if mesh is not None
               else jax.devices()[:1], "quantize='int8' or 'int4', dtype='bfloat16', or tp=2")
    read_dtype = jnp.float32 if quantize is not None else dtype
    params = load_params(folder, config, np.dtype(jnp.dtype(read_dtype)), place)
    if scan:
        params["layers"] = stack_layers(params["layers"])
    return Model(config=config, params=params, mesh=mesh, path=str(folder))


def logits(model: Model, tokens, kv_dtype: str | None = None, *, return_hidden: bool = False,
           hook: Hook | None = None):
    """float32 logits [B, T, vocab] for int tokens [B, T] (or [T]): a full causal forward without cache, in the
    engine's forms (`logits_impl`), so on the CPU default they are the engine's logits bit for bit.

    kv_dtype: attend over K/V as a cache of that dtype holds them ("int8", "float8_e4m3fn" rounded; a float dtype
    cast); None: the cache a default Engine keeps for this model (`default_kv_dtype`: float32 for a 16-bit model on
    CPU). Pass `engine.kv_dtype` to score in the form an engine samples with.
    return_hidden: return (logits, hidden) with hidden [layers + 1, B, T, hidden_size] in the model's dtype: the
    embedding output, then the residual stream after every layer (after `hook`). Entries 0..layers-1 equal
    transformers' `output_hidden_states`; the last is before the final norm, where transformers' last entry is
    after it (its logits are lm_head(final_norm(hidden[-1]))).
    hook: a pure `fn(layer, hidden [B, T, H]) -> hidden` applied to the residual stream after each layer; `layer`
    is a Python int for unrolled layers and a traced int32 scalar under scan (`Model.scan_layers`), so select
    with `jnp.where(layer == n, ...)`. It is a static argument: pass the same function object to reuse the compiled
    forward; arrays it closes over are baked in as constants (or traced, under an outer jit).

    Composes with jax.jit, vmap and grad (of a loss on the logits), and takes sharded inputs. Checked always: the
    shape and the integer dtype (RequestError). Checked only when the tokens are concrete (eagerly, not under
    tracing, where values are unknown): that every id lies in [0, vocab); a traced out-of-range id is clamped by
    the embedding gather, as in any jnp indexing.
    """
    tokens = jnp.asarray(tokens)
    tokens = checked_tokens(tokens[None] if tokens.ndim == 1 else tokens, model.config.vocab_size)
    if hook is not None and not callable(hook):
        raise RequestError(f"hook must be a function (layer, hidden) -> hidden, got {type(hook).__name__}")
    return forward_logits(model.params, model.config, tokens, cache_form(model.dtype, kv_dtype), hook,
                          bool(return_hidden), logits_impl(model.mesh))


def logprobs(model: Model, tokens, kv_dtype: str | None = None) -> jax.Array:
    """float32 [B, T - 1] for int tokens [B, T] (T >= 2): entry t is log p(token t + 1 | tokens <= t), the
    engine's raw logprobs (`logprobs_mode="raw_logprobs"`, the default) of those tokens, bit for bit on the CPU
    default when `kv_dtype` is the engine's (`engine.kv_dtype`; None: a default Engine's, as in `logits`).

    What an RL trainer computes its ratios with: the sampler's numbers, not a second forward's. Differentiable in
    the params (`jax.grad` of a loss on them, with `dataclasses.replace(model, params=params)`); checked as `logits`.
    """
    tokens = checked_tokens(tokens, model.config.vocab_size, min_length=2)
    return next_token_logprobs(model.params, model.config, tokens, cache_form(model.dtype, kv_dtype),
                               logits_impl(model.mesh))


def checked_tokens(tokens, vocab: int, min_length: int = 1) -> jax.Array:
    """int32 token ids [B, T], T >= min_length; RequestError for another dtype or shape, and, when the ids are
    concrete (not traced: their values are unknown then), for an id outside [0, vocab)."""
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise RequestError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if tokens.ndim != 2 or tokens.shape[1] < min_length:
        raise RequestError(f"tokens must be a non-empty [B, T] integer array with T >= {min_length}, got shape "
                           f"{tokens.shape}")
    tokens = tokens.astype(jnp.int32)
    if not isinstance(tokens, jax.core.Tracer):
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab:
            raise RequestError(f"token ids must lie in [0, {vocab}), got range [{low}, {high}]")
    return tokens


def cache_form(dtype, kv_dtype: str | None) -> str | None:
    """`forward_logits`' static kv_dtype for a model of `dtype`: `kv_dtype`, or a default Engine's cache dtype
    (`default_kv_dtype`), as None where that is the model's own dtype (one compiled program for both spellings)."""
    check_kv_dtype(kv_dtype)
    form = kv_dtype or default_kv_dtype(dtype)
    return None if form == jnp.dtype(dtype).name else form


def logits_impl(mesh: Any = None) -> str:
    """The forms `logits` (and the NNX view) run: the engine's native CPU kernels ("cpu") on one CPU device where they
    are built, so the logits are the engine's bit for bit; XLA's forms ("xla") elsewhere."""
    native = jax.default_backend() == "cpu" and mesh is None and layers.cpu_kernels.available()
    return "cpu" if native else "xla"


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """float32 log_softmax of logits [..., V] at integer targets [...], in the sampler's numerics
    (`engine.sampling.token_logprobs`: the logsumexp a `fixed_logsumexp`), so a row's bits are the engine's."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - fixed_logsumexp(logits)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean float32 cross-entropy of logits [..., V] against integer targets [...]: minus the mean of
    `token_logprobs`, summed in a fixed order (`fixed_sum`), so the loss is a function of the sampler's numbers."""
    picked = token_logprobs(logits, targets)
    return -fixed_sum(picked.reshape(-1)) / picked.size


def loss(model_or_params: Model | Params, tokens: jax.Array, config: ModelConfig | None = None,
         kv_dtype: str | None = None) -> jax.Array:
    """Mean next-token cross-entropy (float32 scalar) of int tokens [B, T]: position t predicts token t + 1. The
    same forms and numerics as `logprobs` (the engine's), so it is minus the fixed-order mean of the engine's raw
    logprobs of those tokens; kv_dtype as in `logits`.

    Differentiable in the params: `jax.grad(loss)(params, tokens, config)`. Takes a `pj.Model` or a params
    pytree with its `config`.
    """
    if isinstance(model_or_params, Model):
        model = replace(model_or_params, config=config or model_or_params.config)
    elif config is None:
        raise ConfigError("loss(params, tokens) needs config=ModelConfig(...) when given a params pytree")
    else:
        model = Model(config, model_or_params)
    tokens = checked_tokens(tokens, model.config.vocab_size, min_length=2)
    return next_token_loss(model.params, model.config, tokens, cache_form(model.dtype, kv_dtype),
                           logits_impl(model.mesh))


@partial(jax.jit, static_argnames=("config", "kv_dtype", "impl"))
def next_token_logprobs(params: Params, config: ModelConfig, tokens: jax.Array, kv_dtype: str | None = None,
                        impl: str = "xla") -> jax.Array:
    """`logprobs` without the checks, jitted: float32 [B, T - 1]. The forward runs over tokens[:, :-1] only (the
    last token predicts nothing scored), which is causal, so each position's bits are unchanged."""
    return token_logprobs(forward_logits(params, config, tokens[:, :-1], kv_dtype, impl=impl), tokens[:, 1:])


@partial(jax.jit, static_argnames=("config", "kv_dtype", "impl"))
def next_token_loss(params: Params, config: ModelConfig, tokens: jax.Array, kv_dtype: str | None = None,
                    impl: str = "xla") -> jax.Array:
    """`loss` without the checks, jitted: one compiled program per shape whether called eagerly or under grad."""
    return cross_entropy(forward_logits(params, config, tokens[:, :-1], kv_dtype, impl=impl), tokens[:, 1:])
