"""Tensor parallelism: the device mesh, where every parameter and cache shard lives, and shard_map for the kernels.

Megatron-style layout on a mesh axis "tp", optionally with a "dp" axis of replicas that each serve their own slots:

- q/k/v/gate/up are column-parallel (output features split, i.e. whole heads per device) with their biases;
  o/down are row-parallel (input features split). Each layer then needs exactly two all-reduces of the
  [tokens, hidden] activations (after o and after down), which XLA inserts; every other op is local.
- KV heads are split over "tp" when tp divides num_kv_heads. When kv_heads < tp (and divides it, e.g. the 2 kv
  heads of Qwen2.5-1.5B at tp=4) the k/v weights and the KV cache are replicated and each device attends with the
  kv head its query heads share. That costs memory and redundant k/v projections; the alternative, a cache of tp
  duplicated kv heads, changes the cache's shape for every caller and is left out.
- Embedding and lm_head are vocab-parallel: in a Qwen checkpoint they are the largest tensors (151936 x hidden,
  ~25% of Qwen3-0.6B), so replicating them would leave little of TP's memory saving. The lookup becomes a masked
  local gather plus one all-reduce of [tokens, hidden]; lm_head produces vocab-sharded logits and the sampler's
  jit runs partitioned on them. A vocab that tp does not divide (the test configs' 257, 301) is replicated rather
  than padded: padding would change the logits' shape for every caller. Real Qwen vocabularies (151936, 152064)
  divide by 2, 4 and 8.
- The same rule for the MLP width: an intermediate_size that tp does not divide is replicated (every Qwen size
  divides by 8). Heads are the exception: tp must divide num_attention_heads, or loading raises ConfigError.
- Mixture of experts (moe.py): each expert is a column/row-parallel MLP like the dense one, its stack [E, out, in]
  split on the expert width (expert_gate / expert_up on out, expert_down on in, never on E), so every device holds
  half of every expert and runs every routed pair on half the width, and one all-reduce follows down; a
  moe_intermediate_size that tp does not divide is replicated. qwen2_moe's shared expert is split as the dense
  MLP by its own width. The router and the shared expert's gate are replicated (each device computes the same float32
  logits: routing never depends on the layout).
- Norms, and o's bias (added after the all-reduce), are replicated.
- "dp": params are replicated over it, the cache's slot axis is split over it. A decode step over every slot
  (the engine's dense path: row i is slot i) then runs each replica on its own slots with only small index
  all-gathers. Prefill and partial decode batches gather cache rows by slot id, which XLA answers with an
  all-reduce of those rows across replicas: correct, but a dp-aware scheduler that keeps each replica's requests
  on its own slots is what makes dp pay.

Plain `jax.jit` runs the model: committed, sharded inputs make XLA's SPMD partitioner insert the collectives.
Only the kernels, which XLA cannot partition, run per device inside `shard_map`: attention on local heads
(`attention_over_heads`, called by layers' dispatch), and pocketjax's CPU products (experts included) on each
device's shard of a weight (`over_weight`). The mesh is read from the cache's type (`jax.typeof(x)
.sharding.mesh` names the mesh of a sharded jit argument even with automatic axes), or else from a
`jax.set_mesh` context, so neither the model nor the engine passes it. shard_map is manual over "tp" only: a "dp"
axis stays with XLA, which cannot split a GPU kernel call, so the kernels see every slot when dp > 1.

Beyond one host: `jax.distributed.initialize()` in every process, then the same code: `jax.devices()` spans the
hosts, `make_mesh(tp=jax.local_device_count(), dp=jax.process_count())` keeps each TP group (and its all-reduces)
on one host's fast links, and `make_array_from_callback` asks each process only for its local shards; `to_host`
reads a step's output on every process even when its rows are split across them (serve/distributed.py,
tests/test_multihost.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import ModelConfig
from ..errors import ConfigError
from .kv_cache import QMAX, KVCache, init_cache
from .quant import QUANTIZED

TP, DP = "tp", "dp"
COLUMN_HEADS = ("q", "q_bias")  # always split: tp divides num_heads
COLUMN_KV = ("k", "v", "k_bias", "v_bias")  # split when tp divides num_kv_heads, else replicated
COLUMN_MLP = ("gate", "up")
COLUMN_SHARED = ("shared_gate", "shared_up")  # qwen2_moe's shared expert: a dense MLP of its own width
COLUMN_EXPERTS = ("expert_gate", "expert_up")  # stacked experts [E, out, in]: split on out (the expert width)
EXPERTS = COLUMN_EXPERTS + ("expert_down",)
ROW = {"o": "heads", "down": "mlp", "shared_down": "shared", "expert_down": "experts"}


def make_mesh(tp: int, devices: Sequence[Any] | None = None, *, dp: int | None = None) -> Mesh:
    """A 1-D ("tp",) mesh over the first tp devices; with `dp`, a 2-D ("dp", "tp") mesh of dp replicas of tp devices.

    Devices are ordered by (process, id), so under `jax.distributed` (where jax.devices() spans every host) a
    ("dp", "tp") mesh with tp = jax.local_device_count() keeps each tensor-parallel group, and its all-reduces,
    inside one host, and dp spans the hosts.
    """
    if not isinstance(tp, int) or tp < 1 or (dp is not None and (not isinstance(dp, int) or dp < 1)):
        raise ConfigError(f"tp and dp must be positive integers, got tp={tp!r}, dp={dp!r}")
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    needed = tp * (dp or 1)
    if needed > len(devices):
        shape = f"tp={tp}" if dp is None else f"dp={dp} x tp={tp}"
        raise ConfigError(f"{shape} needs {needed} devices, but only {len(devices)} are available "
                          f"({devices[0].platform} x{len(devices)})")
    if dp is None:
        return Mesh(np.array(devices[:tp]), (TP,))
    return Mesh(np.array(devices[:needed]).reshape(dp, tp), (DP, TP))


def mesh_tp(mesh) -> int:
    """The tensor-parallel degree of a mesh (1 when it has no "tp" axis)."""
    return dict(mesh.shape).get(TP, 1)


def check_tp(config: ModelConfig, tp: int) -> None:
    """Raise ConfigError, naming the numbers, when the model's heads cannot be split over tp devices."""
    if config.num_heads % tp:
        raise ConfigError(f"tp={tp} does not divide num_attention_heads={config.num_heads}")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"tp={tp} and num_key_value_heads={kv}: tp must divide the kv heads, or the kv heads "
                          f"must divide tp (then they are replicated)")


def param_spec(path: tuple, config: ModelConfig, tp: int) -> P:
    """Where a parameter's shards live on the "tp" axis: linears are [out, in] (HF's layout); a path that starts
    with QUANTIZED is a QuantizedWeight leaf, laid out [out, ...] as its weight, and gets the weight's spec."""
    if path and path[0] == QUANTIZED:
        return param_spec(path[1:], config, tp)
    name = path[-1]
    if tp == 1:
        return P()
    moe = config.moe
    split = {"heads": True, "kv": config.num_kv_heads % tp == 0, "mlp": config.intermediate_size % tp == 0,
             "vocab": config.vocab_size % tp == 0,
             "experts": moe is not None and moe.intermediate_size % tp == 0,
             "shared": moe is not None and moe.shared_intermediate_size % tp == 0}
    lead = (None,) if name in EXPERTS else ()  # the expert axis is never split: every device runs every pair
    if (name in COLUMN_HEADS or (name in COLUMN_KV and split["kv"]) or (name in COLUMN_MLP and split["mlp"])
            or (name in COLUMN_SHARED and split["shared"]) or (name in COLUMN_EXPERTS and split["experts"])):
        return P(*lead, TP, None) if not name.endswith("_bias") else P(TP)
    if name in ROW and split[ROW[name]]:
        return P(*lead, None, TP)
    if name in ("embed", "lm_head") and split["vocab"]:
        return P(TP, None)  # [vocab, hidden]
    return P()


def array_spec(path: tuple, shape: tuple[int, ...], config: ModelConfig, tp: int) -> P:
    """The spec an array of `shape` at param `path` is placed with: param_spec where it splits the array evenly over
    tp, else replicated. Only quantized leaves can fall back: a row-parallel scale [out, groups] may have fewer groups
    than devices (int8: one), an int4 values leaf has half its weight's columns, a perm [in] is 1-D."""
    return fitted(param_spec(path, config, tp), shape, tp)


def fitted(spec: P, shape: tuple[int, ...], tp: int) -> P:
    """`spec` where it splits an array of `shape` evenly over tp, else replicated (P())."""
    if len(spec) > len(shape) or any(dim % tp for dim, axes in zip(shape, spec) if axes is not None):
        return P()
    return spec


def sharded_placer(mesh: Mesh, config: ModelConfig) -> Callable[[tuple, np.ndarray], jax.Array]:
    """A checkpoint Placer that puts each host tensor straight into its shards: each device gets only its slice.

    `make_array_from_callback` asks for one index per addressable device and copies only that slice, so host
    memory stays near one tensor; under jax.distributed each process materializes only its local shards.
    """
    tp = mesh_tp(mesh)
    check_tp(config, tp)

    def place(path: tuple, array: np.ndarray) -> jax.Array:
        sharding = NamedSharding(mesh, array_spec(path, array.shape, config, tp))
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    return place


def cache_spec(kv_heads: int, mesh) -> P:
    """[slots, kv_heads, T, D]: slots over "dp" (each replica serves its own), kv heads over "tp" when it divides."""
    slots = DP if DP in mesh.axis_names else None
    heads = TP if kv_heads % mesh_tp(mesh) == 0 and mesh_tp(mesh) > 1 else None
    return P(slots, heads)


def cache_shardings(mesh: Mesh, num_layers: int, slots: int, kv_heads: int, quantized: bool = False,
                    stacked: bool = False) -> KVCache:
    """A KVCache of NamedShardings: k/v (and their scales) per `cache_spec` (after a replicated layer axis when
    `stacked`), lengths along the slot axis."""
    if DP in mesh.axis_names and slots % mesh.shape[DP]:
        raise ConfigError(f"{slots} slots cannot be split over dp={mesh.shape[DP]} replicas")
    spec = cache_spec(kv_heads, mesh)
    # a prefix spec: also fits the [S, kv_heads, T] scales
    layer = NamedSharding(mesh, stacked_spec(spec) if stacked else spec)
    lengths = NamedSharding(mesh, P(DP) if DP in mesh.axis_names else P())
    arrays = layer if stacked else (layer,) * num_layers
    scales = arrays if quantized else ()
    return KVCache(k=arrays, v=arrays, lengths=lengths, k_scale=scales, v_scale=scales)


def stacked_spec(spec: P) -> P:
    """The spec of a [layers, ...] stack of arrays placed with `spec`: the layer axis is never split."""
    return P(None, *spec)


def init_sharded_cache(mesh: Mesh, num_layers: int, slots: int, kv_heads: int, max_seq_len: int, head_dim: int,
                       dtype, stacked: bool = False) -> KVCache:
    """A zeroed cache created directly in its shards: unlike device_put(init_cache(...), cache_shardings(...)), no
    device ever holds the whole cache (which may not fit on one device: that is why it is sharded)."""
    shardings = cache_shardings(mesh, num_layers, slots, kv_heads, jnp.dtype(dtype).name in QMAX, stacked)
    create = jax.jit(init_cache, static_argnums=range(7), out_shardings=shardings)
    return create(num_layers, slots, kv_heads, max_seq_len, head_dim, jnp.dtype(dtype), stacked)


def to_host(tree: Any) -> Any:
    """numpy copies of a pytree of device arrays, the same on every process.

    Under jax.distributed a leaf split across processes (the sampler's rows, split over "dp" when dp spans hosts)
    holds only its local rows here, so it is first replicated by one jitted all-gather of the whole tree; leaves
    that are replicated or local (every single-process case) are read as they are.
    """
    leaves = jax.tree.leaves(tree)
    split = [x for x in leaves if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated)]
    if split:
        tree = replicate(tree, NamedSharding(split[0].sharding.mesh, P()))
    return jax.device_get(tree)


@partial(jax.jit, static_argnames=("sharding",))
def replicate(tree: Any, sharding: NamedSharding) -> Any:
    """`tree` with every leaf replicated on `sharding`'s mesh (an all-gather of the split ones)."""
    return jax.lax.with_sharding_constraint(tree, sharding)


def kernel_mesh(cache: jax.Array):
    """The (abstract) mesh a per-device kernel must run over: the one `cache` is placed on, or the context mesh.

    None when there is nothing to split (one device, or a mesh without a "tp" axis larger than 1).
    """
    mesh = jax.typeof(cache).sharding.mesh
    if mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh_tp(mesh) == 1 else mesh


def weight_spec(name: str, shape: tuple[int, ...], tp: int) -> P:
    """How a product runs a float weight [out, in] (stacked experts: [E, out, in]) named `name` per device:
    `param_spec`'s layout read from the name and the shape (a product has no config): column-parallel names split
    `out`, row-parallel ones `in`, where tp divides it, else replicated. A k / v weight whose kv heads are replicated
    (tp does not divide them) but whose `out` divides is run split: XLA slices the replicated weight, the same
    values."""
    out, inp = shape[-2:]
    lead = (None,) * (len(shape) - 2)
    if name in COLUMN_HEADS + COLUMN_KV + COLUMN_MLP + COLUMN_SHARED + COLUMN_EXPERTS + ("embed", "lm_head"):
        return P(*lead, TP, None) if out % tp == 0 else P()
    if name in ROW:
        return P(*lead, None, TP) if inp % tp == 0 else P()
    return P()


def leaf_specs(w: Any, spec: P, tp: int) -> Any:
    """The spec of each leaf of a weight placed with `spec`: the array's own, or for a QuantizedWeight [.., out, ...]
    each leaf's where it divides (`fitted`, as the placer split them), else replicated (an int8 scale [.., out, 1]
    of a row-parallel weight: per output row, so the whole scale serves each device's columns)."""
    return jax.tree.map(lambda leaf: fitted(spec, leaf.shape, tp), w)


def over_weight(product: Callable, x: jax.Array, w: Any, spec: P, mesh, *rows: jax.Array) -> jax.Array:
    """product(x, w, *rows) for w [..., out, in] placed with `spec` (`weight_spec`), run per device under shard_map
    on "tp". `w` may be a QuantizedWeight (leaves as `leaf_specs`); `rows` (the experts' ids) are replicated.

    Why: XLA cannot partition pocketjax's product kernels (custom calls), and its own partitioned dots choose their
    summation order by shape, so TP2 was not batch-invariant. Column-parallel (out split): each device computes
    whole rows of sums, one device's bits. Row-parallel (in split): each device sums its half of `in`, then one psum
    adds the devices' partials, the same additions at every row count. Replicated: every device computes it all.
    """
    spec = P(*spec, *(None,) * (len(w.shape) - len(spec)))
    column, row = spec[-2] == TP, spec[-1] == TP
    lead = [None] * (x.ndim - 1)

    def local(x, w, *rows):
        y = product(x, w, *rows)
        return jax.lax.psum(y, TP) if row else y

    in_specs = (P(*lead, TP if row else None), leaf_specs(w, spec, mesh_tp(mesh))) + (P(),) * len(rows)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(*lead, TP if column else None),
                         axis_names={TP}, check_vma=False)(x, w, *rows)


def attention_over_heads(kernel: Callable, q: jax.Array, kv: tuple[jax.Array, ...], *rows) -> jax.Array:
    """kernel(q, kv, *rows) run per device on its own query heads, under shard_map when sharded.

    q [..., q_heads, D] is split on heads over "tp"; the cache arrays kv (k, v [S, kv_heads, T, D] and, when
    quantized, their scales [S, kv_heads, T]) on kv heads when tp divides them, else they are replicated and each
    device attends with the one kv head its query heads share (when kv_heads > 1, by placing its queries in that
    head's group of a zero query tensor: kv_heads x the work of one head, none of the cache copied). Row arrays
    (lengths, starts, slots; None allowed) are replicated.
    Only "tp" is manual: a "dp" axis stays automatic, so XLA keeps the slot axis wherever it lives.
    """
    mesh = kernel_mesh(kv[0])
    if mesh is None:
        return kernel(q, kv, *rows)
    tp, kv_heads, axis = mesh_tp(mesh), kv[0].shape[1], q.ndim - 2
    heads = P(*([None] * axis), TP)
    replicated_kv = kv_heads % tp != 0

    def local(q, kv, *rows):
        if not replicated_kv or kv_heads == 1:
            return kernel(q, kv, *rows)
        group = q.shape[axis]  # this device's query heads, all in kv head `h`
        h = jax.lax.axis_index(TP) * kv_heads // tp
        full = jnp.zeros(q.shape[:axis] + (kv_heads * group,) + q.shape[axis + 1:], q.dtype)
        out = kernel(jax.lax.dynamic_update_slice_in_dim(full, q, h * group, axis), kv, *rows)
        return jax.lax.dynamic_slice_in_dim(out, h * group, group, axis)

    cache = P() if replicated_kv else P(None, TP)
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, cache) + (P(),) * len(rows), out_specs=heads,
                         axis_names={TP}, check_vma=False)(q, kv, *rows)
