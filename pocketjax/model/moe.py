"""The sparse MLP of Qwen's mixture-of-experts models (qwen3_moe, qwen2_moe): a router picks `top_k` of
`num_experts` SwiGLU experts per token, and only those run.

- `route`: router logits in float32 (the hidden state and the router weight widened exactly to float32, one
  float32 product, whatever the model's dtype: the router adds no bf16 rounding of its own to a near-tie), softmax
  over the experts, the top k chosen on the float32 logits (softmax is monotone, and the logits carry no ties that
  rounding the probabilities could add), their probabilities renormalized over the k when `norm_topk_prob`, then cast
  to the model's dtype as transformers does. Every sum a `fixed_sum`, so a token's experts and weights depend on its
  own hidden state only (whatever the batch, chunk or program: decode, verify and prefill pick alike).
- `expert_product`: one (row, expert) pair per row of x against that expert's [out, in] weight. On the native CPU
  path each pair is pocketjax's product kernel on one row (`cpu_kernels.expert_matmul`: the experts' weights read
  in place, each weight row once for every pair routed to that expert), so a pair's bits are those of the same row
  alone: batch-invariant, and a decode step reads only the chosen experts. int8 / int4 experts (`quantize=`, each
  expert quantized on its own: quant.py) take the quantized kernel the same way (`expert_quantized_matmul`).
  On a "tp" mesh each expert is split as a dense MLP is (sharding.py: gate / up on their width, down on its input),
  and every device runs the same kernels under shard_map on its half of every expert for every pair, then one psum
  after down adds the two halves (`sharding.over_weight`): batch-invariant inside a TP engine, each device holding
  and reading half the experts' bytes, balanced whatever the routing. (Expert parallelism, experts split by id, emulated with
  the same kernels, measured within noise of it at 1-8 rows on two CPU devices, and loads each device by where the
  router sends the tokens.) Quantized experts are split leaf by leaf; where a device's half of `in` would
  cut an int4 group (a width of one group), that product takes the fallback below. Elsewhere (a GPU, XLA's forms,
  no compiler) the pairs are grouped by expert and multiplied by `jax.lax.ragged_dot_general` (XLA's grouped
  product; quantized experts dequantized whole first). Measured on a 2-core CPU, TP2 decode of a 4-layer qwen3_moe
  with 64 experts of 512 x 1024, 8 active: 5-9 s per step at 1 / 4 / 8 rows with the experts replicated in XLA's
  grouped product, 17-24 / 46-60 / 72-76 ms with the split kernels (one device: 16 / 48 / 97 ms).
- `sparse_mlp`: the k experts' outputs, each scaled by its routing weight, added in rank order (elementwise adds,
  never reassociated), plus qwen2_moe's shared expert behind its sigmoid gate.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import cpu_kernels, layers, quant
from .config import MoeConfig
from .numerics import fixed_sum, opaque
from .quant import QuantizedWeight
from .sharding import kernel_mesh, leaf_specs, mesh_tp, over_weight, weight_spec


def route(router: jax.Array, x: jax.Array, moe: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] in x's dtype, expert ids int32 [N, k]) for tokens x [N, H]; router [num_experts, H]."""
    logits = layers.product(x.astype(jnp.float32), router.astype(jnp.float32), "router")
    top, ids = jax.lax.top_k(logits, moe.top_k)
    shifted = jnp.exp(logits - top[:, :1])  # the largest logit is the first chosen
    chosen = jnp.exp(top - top[:, :1]) / fixed_sum(shifted, keepdims=True)
    if moe.norm_topk_prob:
        chosen = chosen / fixed_sum(chosen, keepdims=True)
    return chosen.astype(x.dtype), ids.astype(jnp.int32)


def expert_product(x: jax.Array, w: jax.Array | QuantizedWeight, ids: jax.Array, name: str | None = None
                   ) -> jax.Array:
    """y [P, out], y[p] = x[p] @ w[ids[p]].T for x [P, in], stacked experts w [E, out, in] (float, or int8 / int4
    expert by expert: quant.py) and ids int32 [P]. On a "tp" mesh `name` (the params key: "expert_up", ...) says
    how w is split (`sharding.weight_spec`), and each device runs the kernel on its shard of every expert."""
    quantized = isinstance(w, QuantizedWeight)
    mesh = kernel_mesh(w.scale if quantized else w) if name is not None else None
    if mesh is not None and layers.native_anywhere():
        tp = mesh_tp(mesh)
        spec = weight_spec(name, w.shape, tp)
        if kernel_takes(x, w) and kernel_takes(x, shard_of(w, spec, tp), whole=w):
            return over_weight(native_expert_product, x, w, spec, mesh, ids)
    elif layers.native(x, w.scale if quantized else w) and kernel_takes(x, w):
        return native_expert_product(x, w, ids)
    return grouped_product(x, quant.dequantize(w, x.dtype) if quantized else w, ids)  # quantized: dequantized whole


def kernel_takes(x: jax.Array, w, whole=None) -> bool:
    """Whether the native expert kernels take x and w (arrays or their shapes); `whole`: w is its shard, which
    must then hold whole quantization groups (or a single group per row: an int8 scale, exact on any columns)."""
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        return False
    if not isinstance(w, QuantizedWeight):
        return w.dtype in (jnp.float32, jnp.bfloat16)
    groups_kept = whole is None or w.group_size == whole.group_size or w.scale.shape[-1] == 1
    return groups_kept and cpu_kernels.expert_quantized_applies(w)


def shard_of(w, spec, tp: int):
    """The shapes (ShapeDtypeStructs) of one device's shard of w placed with `spec` (its leaves as
    `sharding.leaf_specs` split them)."""
    def shard(leaf, leaf_spec):
        split = [dim // tp if axes is not None else dim for dim, axes in
                 zip(leaf.shape, (*leaf_spec, *(None,) * leaf.ndim))]
        return jax.ShapeDtypeStruct(tuple(split), leaf.dtype)
    return jax.tree.map(shard, w, leaf_specs(w, spec, tp), is_leaf=lambda v: isinstance(v, P))


def native_expert_product(x: jax.Array, w: jax.Array | QuantizedWeight, ids: jax.Array) -> jax.Array:
    """`expert_product` in pocketjax's kernels (one device, or one device's shard under shard_map): each pair's bits
    those of its row alone."""
    if isinstance(w, QuantizedWeight):
        return cpu_kernels.expert_quantized_matmul(x, w, ids)
    flat = x.astype(jnp.bfloat16) if w.dtype == jnp.bfloat16 else x  # as layers.native_product rounds x
    return cpu_kernels.expert_matmul(flat, w, ids).astype(x.dtype)


def grouped_product(x: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    """`expert_product` in XLA's forms: the pairs sorted by expert (stably), one `ragged_dot_general` over the groups,
    the rows put back in order. Not batch-invariant (XLA picks its algorithm by shape)."""
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.zeros((w.shape[0],), jnp.int32).at[ids].add(1)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    y = jax.lax.ragged_dot_general(x[order], w.astype(x.dtype), sizes, dims,
                                   preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.zeros_like(y).at[order].set(y)


def sparse_mlp(p: dict, moe: MoeConfig, x: jax.Array) -> jax.Array:
    """The sparse block on normed hidden states x [..., H]: sum over the k chosen experts of weight * SwiGLU expert,
    plus the shared expert scaled by sigmoid(shared_expert_gate(x)) where the model has one (qwen2_moe)."""
    shape, k = x.shape, moe.top_k
    flat = x.reshape(-1, shape[-1])
    weights, ids = route(p["router"], flat, moe)
    pairs, experts = jnp.repeat(flat, k, axis=0), ids.reshape(-1)  # pair n * k + j: token n, its j-th expert
    hidden = (jax.nn.silu(expert_product(pairs, p["expert_gate"], experts, "expert_gate"))
              * expert_product(pairs, p["expert_up"], experts, "expert_up"))
    y = expert_product(hidden, p["expert_down"], experts, "expert_down").reshape(-1, k, shape[-1])
    y = opaque(y * weights[..., None])  # each scaled output rounds on its own before the sum (no FMA)
    out = y[:, 0]
    for j in range(1, k):  # rank order, one elementwise add at a time
        out = out + y[:, j]
    if "shared_gate" in p:
        shared = layers.linear(jax.nn.silu(layers.linear(flat, p["shared_gate"], name="shared_gate"))
                               * layers.linear(flat, p["shared_up"], name="shared_up"), p["shared_down"],
                               name="shared_down")
        gate = jax.nn.sigmoid(layers.linear(flat, p["shared_expert_gate"], name="shared_expert_gate"))
        out = out + opaque(gate * shared)
    return out.reshape(shape)
