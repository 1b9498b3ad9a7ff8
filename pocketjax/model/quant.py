"""int8 / int4 weight quantization: the QuantizedWeight pytree, quantizing at load, the integer and dequantizing
products.
(AWQ / GPTQ int4 checkpoints are read into the same QuantizedWeight by prequantized.py.)

Schemes (every weight is [out, in], HF's layout, as all linears here):
- "int8": symmetric per output channel. values int8 in [-127, 127], scale = absmax / 127, float32 [out, 1].
- "int4": asymmetric, group-wise along the input dim (group GROUP_SIZE, see `group_size_for`). values 0..15 packed
  two per byte within each group: byte j of a group's half-size run holds the group's column j (low nibble) and
  column j + group/2 (high nibble), so unpacking concatenates two whole runs (`unpack_int4`) instead of interleaving
  nibbles, which XLA:CPU did at half the speed (Qwen3-0.6B int4 decode, 1 row: 68 vs 139 ms per step). zero int8
  [out, groups], scale float32 [out, groups], w = (values - zero) * scale, fitted per group by `fit_int4` (a search
  over grids and a least-squares scale, as llama.cpp's k-quants: never worse than the group's range on 16 levels).
  Asymmetric because: the 16 levels cover the group's actual range (a symmetric grid spends levels on the side the
  group does not reach); and AWQ and GPTQ checkpoints (asymmetric, or symmetric = zero 8) are exactly this form, so
  one representation and one dequantization path serve our own int4 and every pre-quantized checkpoint.
- Scales are float32: exact for fp16 checkpoint scales, and the fitted error is the error of the scale stored.
- Tiled int4 (`tile_rows`): for the native CPU kernel, a single-device CPU load stores int4 linears' values in tiles
  of TILE_ROWS rows, [in / 32][TILE_ROWS][16 bytes] per tile (a tile's 32-column chunk is one 64-byte line), so the
  kernel reads one sequential stream per tile instead of TILE_ROWS short ones (Qwen3-0.6B int4 decode step 1.05 /
  1.04 / 1.10 / 1.00x faster at 1 / 2 / 4 / 8 requests, `benchmarks/bench_tiles.py`). Same shapes, same sums and
  bits; everything else reads the row-major values (`untiled`).
- Embedding and lm_head stay in the model dtype. "int8+head" / "int4+head" quantize them too (same bits),
  "int4+head8" in int8 (int4 linears: llama.cpp's Q4_0 / Q4_K_M keep the output matrix at 6 bits for the same reason:
  a 4-bit head costs more perplexity than every linear together, an 8-bit one nothing measurable); a tied table
  [vocab, hidden] is one QuantizedWeight that serves both the token gather (`embed`, rows) and the output projection
  (vocab is its out axis).

Matmul (`layers.linear`): in a single-device CPU program with the native kernels built, int8 and int4 weights go to
`cpu_kernels.quantized_matmul` (csrc/skinny_matmul.cc), batch-invariant, reading 8 or 5.25 bits per weight: int8
dequantized in registers exactly as `dequantize` does and summed as the float32 kernel (bitwise x @ dequantize(w).T
in pocketjax's float form, full precision activations); int4 an integer product against activations rounded to 16
bits per row (the two digits' precision below; dequantizing nibbles made that kernel compute bound). Elsewhere (a
mesh, no compiler):
per-channel int8 on CPU is an integer dot (`int8_product`, the weight the dot's row-major
left operand: 15-20x faster than what follows, 2-2.5x faster than float32) with each activation row written as two
int8 digits (`activation_digits`: x ~= s (hi + lo / 254), s = max|row| / 127), stacked into one dot over 2 x rows.
Why two digits: real Qwen checkpoints carry a few hidden channels 30-1000x larger than the rest at every token; with
one digit per row (W8A8, as first landed) such a channel sets every value's step. Measured (a [64, 1024] x
[1024, 512] product, two channels scaled, RMS error / the weight-only product's error): one digit per row 1.4x / 7.0x /
6.7x at x1 / x30 / x300; blocks of 32 (llama.cpp's q8_0) 1.2x / 1.7x / 1.7x; blocks of 128 1.3x / 2.9x / 2.9x; two
digits 1.000x / 1.001x / 1.000x. Blocks need a batched dot per block, 2-4x slower on XLA:CPU (`benchmarks/
xla_cpu_matmul.py --suites int8_activations`); two digits cost nothing at 1 row (the second digit replaces the
padding row the fast library needs) and the dot over 2 x rows beyond. Smoothing (SmoothQuant) needs activation
statistics from calibration data; LLM.int8()'s outlier split needs data-dependent shapes. Everything else: `x @ dequantize(w, x.dtype).T`, the dequantization in float32 inside the jitted step.
Measured on XLA:CPU (jax 0.10.2, [1..16, 1024] @ [1024, 3072]): no formulation fuses the dequantization into the dot.
Every variant, and even a plain bfloat16 dot (which XLA:CPU computes in float32), materializes one transient float32
operand per matmul;
dequantize-then-matmul was the fastest of x @ (q * s), (x @ q) * s and grouped einsums with per-group scales (batched
per-group dots ran 2-6x slower at decode sizes, and XLA:CPU rejects bf16 x bf16 -> f32 batched dots). The transient
lives for one matmul only, once `after` ties each dequantization to its input (without it XLA hoisted all of them to
the start of the step: the embedded model's forward held 12.0 MB of temporaries instead of 1.3 MB; float: 0.5 MB).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from .numerics import opaque

# mode -> (bits of the linears, bits of the embedding / lm_head or None: kept in the model dtype)
MODES = {"int8": (8, None), "int4": (4, None), "int8+head": (8, 8), "int4+head": (4, 4), "int4+head8": (4, 8)}
GROUP_SIZE = 32  # llama.cpp's block. Measured on the embedded model (bench_quant.py), with `fit_int4`: int4 +0.42%
# perplexity at 32, +0.64% at 64, +0.99% at 128 (Q4_K_M +0.55%, Q4_0 +1.11%); 5.25 bits per weight (Q4_0: 4.5)
MIN_GROUP_SIZE = 32
LINEAR_NAMES = frozenset({"q", "k", "v", "o", "gate", "up", "down"})
HEAD_NAMES = frozenset({"embed", "lm_head"})
# A mixture-of-experts layer's linears (model/moe.py): quantized as the dense ones (the router and the shared expert's
# gate stay float); the experts are stacked [num_experts, out, in], each expert quantized on its own
EXPERT_NAMES = frozenset({"expert_gate", "expert_up", "expert_down"})
MOE_LINEAR_NAMES = EXPERT_NAMES | {"shared_gate", "shared_up", "shared_down"}
LEAVES = ("values", "scale", "zero", "perm")
TILE_ROWS = 4  # int4 rows per tile (csrc/skinny_matmul.cc kTileRows)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [out, in] weight, laid out as the float weight it replaces: every leaf keeps the out axis first,
    so the float weight's column/row sharding applies leaf by leaf, and products read it as `w @ x.T` does.

    values: int8 [out, in] (8 bits) | uint8 [out, in/2] (4 bits, two input columns per byte: `pack_int4`)
    scale:  float32 [out, groups];  zero: int8 [out, groups] | None (symmetric);  w = (values - zero) * scale
    perm:   int32 [in] | None: the columns are stored in this input order (GPTQ desc_act), so x is gathered first.
    tiled:  int4 values stored in tiles of TILE_ROWS rows (`tile_rows`; the native kernel's layout), same shape.
    """

    values: Any
    scale: Any
    zero: Any = None
    perm: Any = None
    bits: int = field(default=8, metadata={"static": True})
    tiled: bool = field(default=False, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """[out, in], after a leading [layers] axis when stacked (the scan layout)."""
        *lead, out, cols = self.values.shape
        return (*lead, out, cols * 8 // self.bits)

    @property
    def group_size(self) -> int:
        return self.shape[-1] // self.scale.shape[-1]

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def nbytes(self) -> int:
        return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self))


def parse_mode(quantize: str | None) -> tuple[int, int | None] | None:
    """(linear bits, embedding/lm_head bits or None) for a `quantize=` value; None for None; ConfigError otherwise."""
    if quantize is None:
        return None
    if quantize not in MODES:
        raise ConfigError(f"quantize={quantize!r} is not supported (supported: None, {', '.join(MODES)})")
    return MODES[quantize]


def bits_for(mode: tuple[int, int | None] | None, name: str) -> int | None:
    """The bits a `parse_mode` mode quantizes the weight called `name` to; None: it stays a float weight."""
    if mode is None:
        return None
    return mode[0] if name in LINEAR_NAMES | MOE_LINEAR_NAMES else mode[1] if name in HEAD_NAMES else None


def group_size_for(in_features: int, group: int = GROUP_SIZE) -> int:
    """The int4 group along the input dim: `group` when it divides in_features; else the largest even divisor of
    in_features below it (packing pairs a group's two halves), if that is at least MIN_GROUP_SIZE; else one group
    spanning the whole dim (always the case when in_features < MIN_GROUP_SIZE). Smaller groups would spend more on
    scales than they save in error."""
    if in_features % group == 0:
        return group
    divisor = max(d for d in range(2, min(group, in_features) + 1, 2) if in_features % d == 0) \
        if in_features % 2 == 0 else 0
    return divisor if divisor >= MIN_GROUP_SIZE else in_features


# ---- packing -----------------------------------------------------------------------------------------------------
def pack_int4(q, groups: int):
    """uint8 [out, in/2] from integer values 0..15 [out, in] in `groups` equal groups along in: in each group, byte j
    holds column j in the low nibble and column j + group/2 in the high one."""
    q = np.asarray(q, np.uint8)
    size = q.shape[-1] // groups
    if q.shape[-1] % groups or size % 2:
        raise ConfigError(f"int4 packing needs even groups along the input dim, got {q.shape[-1]} in {groups}")
    g = q.reshape(*q.shape[:-1], groups, size)
    return (g[..., :size // 2] | (g[..., size // 2:] << 4)).reshape(*q.shape[:-1], -1)


def unpack_int4(packed, groups: int):
    """uint8 [out, in] values 0..15 from pack_int4's bytes; numpy or jax (traced) alike."""
    xp = np if isinstance(packed, np.ndarray) else jnp
    g = packed.reshape(*packed.shape[:-1], groups, -1)
    return xp.concatenate([g & 15, g >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def tileable(w: QuantizedWeight) -> bool:
    """Whether `tile_rows` applies: int4, a 2-D [out, in / 2] weight (not a scan's stacked layers), out a multiple of
    TILE_ROWS, in a multiple of 32 (the kernel's chunk)."""
    return (w.bits == 4 and not w.tiled and np.ndim(w.values) == 2 and w.values.shape[0] % TILE_ROWS == 0
            and w.values.shape[1] % 16 == 0)


def _retile(values, tiled: bool):
    """values [out, in / 2] <-> tiles [out / TILE_ROWS, in / 32, TILE_ROWS, 16] (numpy or jax, same shape out)."""
    out, cols = values.shape
    split = (out // TILE_ROWS, cols // 16, TILE_ROWS, 16) if tiled else (out // TILE_ROWS, TILE_ROWS, cols // 16, 16)
    return values.reshape(split).transpose(0, 2, 1, 3).reshape(out, cols)


def tile_rows(w: QuantizedWeight) -> QuantizedWeight:
    """w with its int4 values in tiles (`tileable`; see the module docstring), on the host: done once at load."""
    if not tileable(w):
        raise ConfigError(f"tile_rows: an untiled 2-D int4 weight with out % {TILE_ROWS} == 0 and in % 32 == 0, got "
                          f"{w.bits}-bit {np.shape(w.values)}{' (tiled)' if w.tiled else ''}")
    return replace(w, values=np.ascontiguousarray(_retile(np.asarray(w.values), False)), tiled=True)


def untiled(w: QuantizedWeight) -> QuantizedWeight:
    """w with row-major values (traceable): what every reader but the native kernel takes."""
    return replace(w, values=_retile(w.values, True), tiled=False) if w.tiled else w


def untiled_params(params: Any) -> Any:
    """params with every tiled weight read back row-major, on device (new arrays); the same tree where none is tiled.
    For programs in XLA's forms, which would otherwise untile each weight in every step."""
    def is_weight(w: Any) -> bool:
        return isinstance(w, QuantizedWeight)
    if not any(w.tiled for w in jax.tree.leaves(params, is_leaf=is_weight) if is_weight(w)):
        return params
    return jax.jit(lambda p: jax.tree.map(lambda w: untiled(w) if is_weight(w) else w, p, is_leaf=is_weight))(params)


# ---- quantize / dequantize ---------------------------------------------------------------------------------------
def quantize(w, bits: int, group_size: int | None = None) -> QuantizedWeight:
    """Quantize a host [out, in] weight (computed in float32): int8 per channel, or int4 group-wise asymmetric."""
    w = np.asarray(w, np.float32)
    if bits == 8:
        scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
        scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
        values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        return QuantizedWeight(values=values, scale=scale, bits=8)
    if bits != 4:
        raise ConfigError(f"bits={bits} is not supported (supported: 8, 4)")
    size = group_size or group_size_for(w.shape[1])
    if w.shape[1] % size:
        raise ConfigError(f"group_size={size} does not divide the input dim {w.shape[1]}")
    parts = [fit_int4(w[i:i + FIT_ROWS].reshape(-1, w.shape[1] // size, size)) for i in range(0, w.shape[0], FIT_ROWS)]
    q, scale, zero = (np.concatenate(p) for p in zip(*parts))
    return QuantizedWeight(values=pack_int4(q.reshape(w.shape), scale.shape[-1]), scale=scale, zero=zero, bits=4)


FIT_ROWS = 2048  # output rows fitted at once (bounds the host memory of quantizing a large weight)
STRETCH = tuple(np.linspace(-1.0, 1.0, 21))  # extra levels over a group's range tried by `fit_int4`


def fit_int4(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(levels uint8 0..15, scale float32, zero int8) per group of `groups` [..., size], w ~= (levels - zero) * scale,
    with the least squared error among candidate grids: the range [min(w, 0), max(w, 0)] on 15 steps (the first form:
    exact for a constant group, never clipping), and the group's own range [min, max] on 15 + d steps for d in
    STRETCH (llama.cpp's search for its k-quants, make_qkx2_quants: a slightly wider or narrower grid often rounds
    the bulk of the group better at the cost of its extremes); each grid's scale then refitted by least squares
    for its levels. Every group's error is at most the first form's. The zero is any int8 (a group need not hold 0)."""
    groups = groups.astype(np.float32)
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    grids = [(np.minimum(lo, 0), np.maximum(hi, 0), 15.0)] + [(lo, hi, 15.0 + d) for d in STRETCH]
    best = None
    for low, high, steps in grids:
        scale = np.where(high > low, (high - low) / np.float32(steps), np.float32(1)).astype(np.float32)
        zero = np.clip(np.rint(-low / scale), -128, 127)
        levels = np.clip(np.rint(groups / scale[..., None]) + zero[..., None], 0, 15)
        d = levels - zero[..., None]
        dd = np.einsum("...i,...i->...", d, d, dtype=np.float64)
        wd = np.einsum("...i,...i->...", groups, d, dtype=np.float64)
        fitted = np.where((dd > 0) & (wd > 0), wd / np.where(dd > 0, dd, 1), scale).astype(np.float32)
        err = np.square(groups - d * fitted[..., None]).sum(axis=-1)
        if best is None:
            best = [levels, fitted, zero, err]
            continue
        take = err < best[3]
        best = [np.where(take[..., None], levels, best[0]), np.where(take, fitted, best[1]),
                np.where(take, zero, best[2]), np.where(take, err, best[3])]
    levels, scale, zero, _ = best
    return levels.astype(np.uint8), scale.astype(np.float32), zero.astype(np.int8)


def leaf_shapes(out_features: int, in_features: int, bits: int, group_size: int | None = None, perm: bool = False
                ) -> dict[str, tuple[tuple[int, ...], int]]:
    """{leaf: (shape, bytes per element)} of `quantize`'s result for an [out, in] weight, without building it; int4
    with `group_size` (default `group_size_for`) and a GPTQ desc_act `perm` describes what prequantized.read_linear
    places."""
    if bits == 8:
        return {"values": ((out_features, in_features), 1), "scale": ((out_features, 1), 4)}
    groups = in_features // (group_size or group_size_for(in_features))
    shapes = {"values": ((out_features, in_features // 2), 1), "scale": ((out_features, groups), 4),
              "zero": ((out_features, groups), 1)}
    return shapes | ({"perm": ((in_features,), 4)} if perm else {})


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The [out, in] weight (values - zero) * scale, computed in float32 and cast to dtype (columns in stored order).
    int4 is unpacked straight into [out, groups, group] (each group's two runs side by side), which XLA:CPU fuses
    into a 1.8x faster step than unpacking to [out, in] first (Qwen3-0.6B int4 decode, 1 row: 68 vs 122 ms)."""
    w = untiled(w)
    groups = w.scale.shape[-1]
    values = jnp.asarray(w.values)
    if w.bits == 4:
        runs = values.reshape(*values.shape[:-1], groups, -1)
        q = jnp.concatenate([runs & 15, runs >> 4], axis=-1).astype(jnp.float32)
    else:
        q = values.astype(jnp.float32).reshape(*values.shape[:-1], groups, -1)
    if w.zero is not None:
        q = q - jnp.asarray(w.zero).astype(jnp.float32)[..., None]
    q = q * jnp.asarray(w.scale, jnp.float32)[..., None]
    return q.reshape(*q.shape[:-2], -1).astype(dtype)


def dequantize_params(params: Any, dtype=jnp.float32) -> Any:
    """`params` with every QuantizedWeight replaced by its float dequantization: the model of the rounded weights
    alone, the reference a quantized product's error is measured against (tests/test_quant.py, bench_quant.py).
    Weights stored in a permuted column order (GPTQ desc_act) are put back in the input order."""
    def leaf(w: Any) -> Any:
        if not isinstance(w, QuantizedWeight):
            return w
        dense = dequantize(w, dtype)
        if w.perm is None:
            return dense
        return jnp.zeros_like(dense).at[..., jnp.asarray(w.perm)].set(dense)  # stored column j is input perm[j]

    return jax.tree.map(leaf, params, is_leaf=lambda w: isinstance(w, QuantizedWeight))


def has_integer_product(w: QuantizedWeight) -> bool:
    """Whether `int8_product` computes x @ w.T: per-channel symmetric int8, on CPU (where XLA has the fast s8 dot)."""
    return w.bits == 8 and w.zero is None and w.scale.shape[-1] == 1 and jax.default_backend() == "cpu"


def matmul(x: jax.Array, w: QuantizedWeight, product: Callable | None = None,
           kernel: Callable | None = None) -> jax.Array:
    """x @ W.T for a quantized W [out, in], in x's dtype: `kernel(x [rows, in], w)` where given (the caller's native
    kernel, dequantizing in registers), else `int8_product` where it applies (integer sums: exact in any order), else
    dequantize-then-matmul (see the module docstring for why) with `product(x, w)` (the caller's float product form;
    default XLA's einsum)."""
    if w.perm is not None:  # the columns are stored in GPTQ's desc_act order
        x = jnp.take(x, w.perm, axis=-1)
    if kernel is not None:
        return kernel(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    w = untiled(w)
    if has_integer_product(w):
        return int8_product(x, w)
    dense = dequantize(after(w, x), x.dtype)
    if product is not None:
        return product(x, dense)
    return jnp.einsum("...k,nk->...n", x, dense)  # no transposed copy of the weight


SKINNY_ROWS = 64  # up to this many rows (decode batches) products run as w @ x.T on CPU (here and layers.linear)


LOW_DIGIT = 254  # the second activation digit's step is the first's / 254: the residual (at most half a step) fits int8


def activation_digits(flat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(digits int8 [2 * rows, K], step float32 [rows, 1]) with flat ~= step * (hi + lo / LOW_DIGIT), hi = digits[:rows],
    lo = digits[rows:]: each row's value in two int8 digits, the second quantizing what the first leaves (at most
    half a step). The one place that decides how int8 products see activations; see the module docstring."""
    absmax = jnp.max(jnp.abs(flat), axis=-1, keepdims=True)
    step = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    hi = jnp.round(flat / step)
    # hi * step kept a product of its own: an FMA contraction of flat - hi * step happened in some programs and not
    # others (`numerics.opaque`), and the second digit's bits followed (issue 43)
    lo = jnp.clip(jnp.round((flat - opaque(hi * step)) * (LOW_DIGIT / step)), -127, 127)
    return jnp.concatenate([hi, lo]).astype(jnp.int8), step


def int8_product(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x @ W.T for a per-output-channel int8 W [out, in], as XLA:CPU's fast integer dot: each row of x as two int8
    digits (`activation_digits`), stacked as 2 x rows rows of one s8 x s8 -> s32 dot, the digits' partial products
    then summed in float32 with both scales. At most half a step of the second digit, absmax / 64516 of a row, is lost
    to activations: 15-bit activations, so an outlier channel no longer sets the step of every other value (it did
    with one int8 digit per row, W8A8; see the module docstring for the numbers). Up to SKINNY_ROWS rows the dot is
    W @ xq.T with the weight as its row-major left operand, materialized then transposed (the barrier keeps XLA from
    folding the transpose back), as `layers.linear` does for float weights; the stacked digits give the fast library
    the >= 2 rows it needs (exactly 1 row fell off it), so a batch-1 product reads the weight once, as before.

    Measured per product, 16 distinct weights per call (2-core AMD EPYC, jax 0.10.2, `benchmarks/xla_cpu_matmul.py
    --suites int8,float`), 1 / 8 rows: down ([1024, 3072]) 0.11 / 0.14 ms as W @ xq.T, 0.40 / 0.44 ms as
    xq @ W[in, out]; gate ([3072, 1024]) 0.11 / 0.15 vs 0.15 / 0.21; float32 takes 0.29-0.30 / 0.38-0.42 ms
    (`--suites int8_activations` times the two digits against one digit, blocks of 32 and the weight-only product).
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).astype(jnp.float32)
    rows = flat.shape[0]
    digits, step = activation_digits(flat)
    contract = (((1,), (1,)), ((), ()))
    if rows <= SKINNY_ROWS:
        acc = jax.lax.optimization_barrier(
            jax.lax.dot_general(w.values, digits, contract, preferred_element_type=jnp.int32)).T
    else:
        acc = jax.lax.dot_general(digits, w.values, contract, preferred_element_type=jnp.int32)
    # No FMA contraction of the products into the sums here or in the caller's residual add (`opaque`, issue 43)
    acc = acc.astype(jnp.float32)
    y = opaque((acc[:rows] + opaque(acc[rows:] * (1.0 / LOW_DIGIT))) * step * w.scale[:, 0])
    return y.astype(x.dtype).reshape(*shape[:-1], w.values.shape[0])


def after(w: QuantizedWeight, x: jax.Array) -> QuantizedWeight:
    """w, its values made data-dependent on x, so that its dequantization cannot run before x exists.

    Every layer's dequantization depends on params only, and XLA:CPU schedules them all ahead of the first matmul:
    the whole model in float32 at once. An optimization_barrier does not help (XLA:CPU expands it away before
    scheduling). Each stored row is tied to the matching element of x's first row: a select that fuses into the
    dequantization, that XLA cannot fold (isnan), and that stays local under tensor parallelism (x and the rows are
    split alike; tying to any single element of x made XLA all-gather x before o and down: measured at TP2).
    """
    nan = jnp.isnan(x.reshape(-1, x.shape[-1])[0])  # False unless x holds a NaN, which poisons the output anyway
    if w.bits == 4:  # a byte holds columns j and j + group/2 of its group (pack_int4)
        nan = nan.reshape(w.scale.shape[-1], 2, -1).any(axis=1).reshape(-1)
    return replace(w, values=jnp.where(nan[None, :], jnp.zeros_like(w.values), w.values))


def embed(table, tokens: jax.Array, dtype) -> jax.Array:
    """Embedding rows [..., hidden] for tokens; of a quantized table [vocab, hidden] only the used rows are
    dequantized."""
    if not isinstance(table, QuantizedWeight):
        if table.dtype.itemsize == 2:  # XLA:CPU has no 16-bit float gather: it would convert the whole table to
            bits = jax.lax.bitcast_convert_type(table, jnp.uint16)  # float32 first (3x per bf16 0.6B decode step)
            return jax.lax.bitcast_convert_type(bits[tokens], table.dtype)
        return table[tokens]
    table, ids = untiled(table), tokens.reshape(-1)
    rows = QuantizedWeight(values=jnp.take(table.values, ids, axis=0), scale=jnp.take(table.scale, ids, axis=0),
                           zero=None if table.zero is None else jnp.take(table.zero, ids, axis=0), bits=table.bits)
    return dequantize(rows, dtype).reshape(tokens.shape + (table.shape[-1],))


# ---- quantizing at load ------------------------------------------------------------------------------------------
# A placer path starting with QUANTIZED is a QuantizedWeight leaf, laid out [out, ...] as its float weight.
QUANTIZED = "quantized"
Placer = Callable[[tuple, np.ndarray], Any]


def quantizing_placer(place: Placer, quantize: str | None, dtype, tile: bool = False) -> Placer:
    """Wrap a checkpoint Placer: linear weights (and with "+head" / "+head8" the embedding / lm_head) are quantized on
    the host (`bits_for`), other arrays are cast to `dtype`, and QuantizedWeights (quantized here or read from an
    AWQ/GPTQ checkpoint) are placed leaf by leaf.

    `place(path, leaf)` receives each of values/scale/zero/perm under (QUANTIZED,) + the weight's own path, so a
    sharding placer gives it the weight's spec (every leaf keeps out first), and replicates a leaf that spec does not
    divide (a 1-D perm; a scale with fewer groups than devices). With `tile` (a single-device CPU load with the native
    kernel), int4 linears are stored in tiles (`tile_rows`).
    """
    mode = parse_mode(quantize)

    def placer(path: tuple, array) -> Any:
        bits = bits_for(mode, path[-1])
        if bits is not None:
            array = quantize_host(array, bits)  # float weights arrive [out, in] (HF's layout), and stay so
        if not isinstance(array, QuantizedWeight):
            return place(path, np.asarray(array, dtype))
        if tile and path[-1] in LINEAR_NAMES and tileable(array):
            array = tile_rows(array)
        path = (QUANTIZED,) + path
        leaves = {leaf: place(path, getattr(array, leaf)) for leaf in LEAVES if getattr(array, leaf) is not None}
        return QuantizedWeight(**leaves, bits=array.bits, tiled=array.tiled)

    return placer


def quantize_host(array: np.ndarray, bits: int) -> QuantizedWeight:
    """`quantize` with the int4 group chosen for this weight's input dim; stacked experts [E, out, in] expert by
    expert, their leaves stacked [E, ...] (each expert's bits those of the expert quantized alone)."""
    if np.ndim(array) == 3:
        parts = [quantize_host(w, bits) for w in array]
        leaves = {leaf: np.stack([getattr(w, leaf) for w in parts]) for leaf in ("values", "scale", "zero")
                  if getattr(parts[0], leaf) is not None}
        return QuantizedWeight(**leaves, bits=bits)
    return quantize(array, bits, group_size_for(array.shape[-1]) if bits == 4 else None)
