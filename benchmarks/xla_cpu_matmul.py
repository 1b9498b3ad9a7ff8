"""Which formulation of a decode-step product XLA:CPU runs well: the evidence behind `layers.linear`,
`quant.int8_product`, the int4 packing, `layers.bfloat16_product` and the XLA attention path.

A decode step is a handful of [B, K] x [K, N] products per layer with B = active requests (1..8) and weights far
larger than activations, so it should be memory bound: time ~ weight bytes / bandwidth, nearly flat in B. Each call
here multiplies one activation by 16 distinct weights (or attends over 28 layers' caches), summed, so the weights come
from memory as in a decode step, not from cache. Each suite x XLA flag set runs in its own subprocess (flags are read
once per process); within one, every formulation is timed as the minimum of many interleaved runs, so a noisy
shared machine biases them all alike.

Suites:
- float: float32 weights, HF's [out, in] layout as `w @ x.T` (barrier, then transposed: what `linear` does up to
  SKINNY_ROWS rows), as `x @ w.T`, and a pre-transposed [in, out] copy as `x @ W`; fused q/k/v and gate/up beside
  the separate products (a candidate lever: measured, not adopted).
- int8: s8 x s8 -> s32 products (activations quantized per row, 1 row padded to 2) with the weight [out, in] as the
  left operand (`int8_product`), [out, in] on the right, and [in, out] on the right (the layout before).
- int4: group-wise int4 [out, in/2] dequantized in the step, packed as pairs (j, j + group/2) per group (what
  `pack_int4` stores) or as interleaved neighbours (2c, 2c + 1), then x @ w.T; and the integer form (per-group
  s8 dots).
- bf16: bfloat16 weights [out, in] beside the float32 product `linear` runs: bf16 x bf16 -> f32 as x @ w.T with
  1 row padded to 2 (`layers.bfloat16_product`), unpadded, padded to 8, the transposed w @ x.T, the weight upcast to
  f32 inside the step, a multiply-reduce fusion (no library dot), pocketjax's own kernel (`cpu_kernels.skinny_matmul`,
  one row per code path this CPU has) and `layers.bfloat16_product` (the form `linear` picks: the kernel up to
  `layers.KERNEL_ROWS` rows with batch_invariant=False; every row count by default). Which is fastest, and whether any
  beats float32, depends on the CPU (a bf16 checkpoint loads as bf16 where the kernels are built: a rule, no probe).
- quantized: pocketjax's native kernels at decode rows: the float32 weight (`cpu_kernels.skinny_matmul`) beside int8
  (per channel, symmetric) and int4 (groups of quant.GROUP_SIZE, fitted) dequantized in registers
  (`cpu_kernels.quantized_matmul`): GB/s of the bytes each reads, and G weights/s (what bounds a kernel that is
  compute bound).
- attention: decode QK^T over an f32 cache [slots, kv_heads, T, D] as q @ K^T (einsum), as K @ q^T (the cache as the
  row-major left operand, barrier, transposed: what the XLA path does on CPU), and P @ V.

    python benchmarks/xla_cpu_matmul.py [--suites float,int8,int4,quantized,bf16,attention] [--flags default,...]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the children import pocketjax from this checkout

FLAG_SETS = {
    "default": "",
    "no_ynn": "--xla_cpu_experimental_ynn_fusion_type=",
    "xnn_dot": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_experimental_xnn_fusion_type=dot",
    "onednn": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true",
}
SHAPES = {"gate/up [3072, 1024]": (3072, 1024), "down [1024, 3072]": (1024, 3072), "q [2048, 1024]": (2048, 1024)}
FUSED = {"q+k+v": (2048, 1024, 1024), "gate+up": (3072, 3072)}
BATCHES = (1, 2, 4, 8)
WEIGHTS = 16  # distinct weights per timed call
GROUP = 128


def best_of(fns: dict, args: dict, reps: int) -> dict[str, float]:
    """Seconds per call: the minimum over `reps` interleaved rounds, after one compiling call each."""
    import jax

    for name, fn in fns.items():
        jax.block_until_ready(fn(*args[name]))
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def summed(product):
    """A jitted sum of `product(x, *w)` over a list of weight tuples: one call reads every weight once."""
    import jax

    return jax.jit(lambda x, ws: sum(product(x, *w).sum() for w in ws))


def suite_float(rng, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    barrier = jax.lax.optimization_barrier
    forms = {"w @ x.T (barrier, transposed)": lambda x, w: barrier(w @ x.T).T, "x @ w.T": lambda x, w: x @ w.T}
    out = []
    for shape_name, (n, k) in SHAPES.items():
        ws = [(jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)),) for _ in range(WEIGHTS)]
        ws_t = [(jnp.asarray(np.ascontiguousarray(np.asarray(w).T)),) for (w,) in ws]
        fns = {name: summed(f) for name, f in forms.items()} | {"x @ W[in, out]": summed(lambda x, w: x @ w)}
        for b in BATCHES:
            x = jnp.asarray(rng.standard_normal((b, k), dtype=np.float32))
            args = {name: (x, ws_t if name == "x @ W[in, out]" else ws) for name in fns}
            for name, s in best_of(fns, args, reps).items():
                out.append({"suite": "float", "shape": shape_name, "batch": b, "form": name, "ms": 1e3 * s / WEIGHTS,
                            "GB_s": n * k * 4 * WEIGHTS / s / 1e9})
        del ws, ws_t
    for fused_name, sizes in FUSED.items():
        k = 1024
        parts = [[jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)) for n in sizes] for _ in range(WEIGHTS)]
        whole = [(jnp.concatenate(p),) for p in parts]
        product = forms["w @ x.T (barrier, transposed)"]
        fns = {"separate": summed(lambda x, *ws: sum(product(x, w).sum() for w in ws)), "fused": summed(product)}
        for b in BATCHES:
            x = jnp.asarray(rng.standard_normal((b, k), dtype=np.float32))
            for name, s in best_of(fns, {"separate": (x, parts), "fused": (x, whole)}, reps).items():
                out.append({"suite": "float", "shape": fused_name, "batch": b, "form": name,
                            "ms": 1e3 * s / WEIGHTS, "GB_s": sum(sizes) * k * 4 * WEIGHTS / s / 1e9})
    return out


def suite_int8(rng, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    barrier = jax.lax.optimization_barrier
    s32 = dict(preferred_element_type=jnp.int32)

    def pad(x):
        return jnp.pad(x, ((0, 1), (0, 0))) if x.shape[0] == 1 else x

    nk, kn = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))
    forms = {  # name: (product, weight stored [in, out])
        "W[out, in] @ xq.T (barrier, transposed)": (
            lambda x, w: barrier(jax.lax.dot_general(w, pad(x), nk, **s32)).T[:x.shape[0]], False),
        "xq @ W[out, in].T": (lambda x, w: jax.lax.dot_general(pad(x), w, nk, **s32)[:x.shape[0]], False),
        "xq @ W[in, out]": (lambda x, w: jax.lax.dot_general(pad(x), w, kn, **s32)[:x.shape[0]], True),
    }
    out = []
    for shape_name, (n, k) in SHAPES.items():
        ws = [(jnp.asarray(rng.integers(-127, 128, (n, k), dtype=np.int8)),) for _ in range(WEIGHTS)]
        ws_t = [(jnp.asarray(np.ascontiguousarray(np.asarray(w).T)),) for (w,) in ws]
        fns = {name: summed(f) for name, (f, _) in forms.items()}
        for b in BATCHES:
            x = jnp.asarray(rng.integers(-127, 128, (b, k), dtype=np.int8))
            args = {name: (x, ws_t if t else ws) for name, (_, t) in forms.items()}
            for name, s in best_of(fns, args, reps).items():
                out.append({"suite": "int8", "shape": shape_name, "batch": b, "form": name, "ms": 1e3 * s / WEIGHTS,
                            "GB_s": n * k * WEIGHTS / s / 1e9})
    return out


def suite_int4(rng, reps: int) -> list[dict]:
    import jax.numpy as jnp
    import numpy as np

    n, k = SHAPES["gate/up [3072, 1024]"]
    groups = k // GROUP

    def scaled(q, zero, scale):
        q = q.astype(jnp.float32).reshape(n, groups, GROUP)
        return ((q - zero[..., None].astype(jnp.float32)) * scale[..., None]).reshape(n, k)

    def tied(x, p):  # as quant.after: the dequantization waits for x (else XLA hoists all 16 ahead of the dots)
        return jnp.where(jnp.isnan(x[0, :1]), jnp.zeros_like(p), p)

    def half_pairs(x, p, zero, scale):  # pack_int4: byte j of a group holds columns j and j + GROUP/2
        g = tied(x, p).reshape(n, groups, GROUP // 2)
        return jnp.einsum("bk,nk->bn", x, scaled(jnp.concatenate([g & 15, g >> 4], -1), zero, scale))

    def neighbours(x, p, zero, scale):  # byte c holds columns 2c and 2c + 1
        p = tied(x, p)
        return jnp.einsum("bk,nk->bn", x, scaled(jnp.stack([p & 15, p >> 4], -1).reshape(n, k), zero, scale))

    def integer(x, p, zero, scale):  # per-group s8 dots (x quantized per row), zero and scales applied after
        rows = x.shape[0]
        x = jnp.pad(x, ((0, max(0, 2 - rows)), (0, 0)))  # 1 row falls off the fast integer dot
        sx = jnp.maximum(jnp.max(jnp.abs(x), -1, keepdims=True), 1e-30) / 127
        xg = jnp.round(x / sx).astype(jnp.int8).reshape(x.shape[0], groups, GROUP)
        g = tied(x, p).reshape(n, groups, GROUP // 2)
        w = jnp.concatenate([g & 15, g >> 4], -1).astype(jnp.int8)  # [n, groups, GROUP]
        acc = jnp.einsum("ngk,bgk->bng", w, xg, preferred_element_type=jnp.int32).astype(jnp.float32)
        acc = acc - zero[None].astype(jnp.float32) * xg.astype(jnp.float32).sum(-1)[:, None, :]
        return (jnp.einsum("bng,ng->bn", acc, scale) * sx)[:rows]

    ws = [(jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)),
           jnp.asarray(rng.integers(0, 16, (n, groups), dtype=np.int8)),
           jnp.asarray(rng.random((n, groups), dtype=np.float32))) for _ in range(WEIGHTS)]
    wf = [(jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)),) for _ in range(WEIGHTS)]
    fns = {"packed pairs (j, j + group/2), dequantized": summed(half_pairs),
           "packed neighbours (2c, 2c + 1), dequantized": summed(neighbours),
           "per-group s8 dots": summed(integer), "float32 x @ w.T": summed(lambda x, w: x @ w.T)}
    out = []
    for b in BATCHES:
        x = jnp.asarray(rng.standard_normal((b, k), dtype=np.float32))
        args = {name: (x, wf if name.startswith("float32") else ws) for name in fns}
        for name, s in best_of(fns, args, reps).items():
            out.append({"suite": "int4", "shape": "gate/up [3072, 1024]", "batch": b, "form": name,
                        "ms": 1e3 * s / WEIGHTS, "GB_s": n * k * (4 if name.startswith("float32") else 0.5)
                        * WEIGHTS / s / 1e9})
    return out


def suite_quantized(rng, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pocketjax.model import cpu_kernels, quant

    if not cpu_kernels.available():
        print("quantized: skipped, the native kernels are not built (see the log)", file=sys.stderr)
        return []
    n, k = SHAPES["gate/up [3072, 1024]"]
    floats = [rng.standard_normal((n, k), dtype=np.float32) for _ in range(WEIGHTS)]
    weights = {"float32": [(jnp.asarray(w),) for w in floats],
               "int8": [(jax.tree.map(jnp.asarray, quant.quantize(w, 8)),) for w in floats],
               "int4": [(jax.tree.map(jnp.asarray, quant.quantize(w, 4)),) for w in floats]}
    fns = {"float32": summed(cpu_kernels.skinny_matmul), "int8": summed(cpu_kernels.quantized_matmul),
           "int4": summed(cpu_kernels.quantized_matmul)}
    out = []
    for b in BATCHES:
        x = jnp.asarray(rng.standard_normal((b, k), dtype=np.float32))
        for name, s in best_of(fns, {name: (x, weights[name]) for name in fns}, reps).items():
            nbytes = weights[name][0][0].nbytes  # bytes read: values (+ scales and zeros)
            out.append({"suite": "quantized", "shape": "gate/up [3072, 1024]", "batch": b, "form": name,
                        "ms": 1e3 * s / WEIGHTS, "GB_s": nbytes * WEIGHTS / s / 1e9,
                        "G_weights_s": n * k * WEIGHTS / s / 1e9})
    return out


def suite_attention(rng, reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    layers, heads, group, d, t = 28, 8, 2, 128, 256
    barrier = jax.lax.optimization_barrier
    batch_dims = ((0, 1), (0, 1))
    forms = {
        "q @ K^T (einsum)": lambda q, k: jnp.einsum("skgd,sktd->skgt", q, k),
        "K @ q^T (barrier, transposed)": lambda q, k: jnp.swapaxes(
            barrier(jax.lax.dot_general(k, q, (((3,), (3,)), batch_dims))), 2, 3),
        "P @ V": lambda p, v: jax.lax.dot_general(p, v, (((3,), (2,)), batch_dims)),
    }
    out = []
    for slots in (1, 8):
        caches = [(jnp.asarray(rng.standard_normal((slots, heads, t, d), dtype=np.float32)),) for _ in range(layers)]
        q = jnp.asarray(rng.standard_normal((slots, heads, group, d), dtype=np.float32))
        p = jnp.asarray(rng.standard_normal((slots, heads, group, t), dtype=np.float32))
        fns = {name: jax.jit(lambda a, cs, f=f: sum(f(a, c).sum() for (c,) in cs)) for name, f in forms.items()}
        args = {name: (p if name == "P @ V" else q, caches) for name in fns}
        for name, s in best_of(fns, args, reps).items():
            out.append({"suite": "attention", "shape": f"{slots} slots x {heads} kv heads x {t} x {d}, {layers} layers",
                        "batch": slots, "form": name, "ms": 1e3 * s,
                        "GB_s": slots * heads * t * d * 4 * layers / s / 1e9})
    return out


def suite_bf16(rng, reps: int) -> list[dict]:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pocketjax.model import cpu_kernels, layers

    barrier = jax.lax.optimization_barrier
    f32 = dict(preferred_element_type=jnp.float32)
    nk = (((1,), (1,)), ((), ()))

    def padded(x, rows):
        return jnp.pad(x, ((0, max(0, rows - x.shape[0])), (0, 0)))

    forms = {  # name: (product of x [B, K] bf16 and w [N, K], the weight dtype)
        "float32 w @ x.T (barrier, transposed)": (lambda x, w: barrier(w @ x.T.astype(jnp.float32)).T, "float32"),
        "x @ w.T -> f32, 1 row padded to 2": (
            lambda x, w: jax.lax.dot_general(padded(x, 2), w, nk, **f32)[:x.shape[0]], "bfloat16"),
        "x @ w.T -> f32": (lambda x, w: jax.lax.dot_general(x, w, nk, **f32), "bfloat16"),
        "x @ w.T -> f32, padded to 8": (
            lambda x, w: jax.lax.dot_general(padded(x, 8), w, nk, **f32)[:x.shape[0]], "bfloat16"),
        "w @ x.T -> f32 (barrier, transposed)": (
            lambda x, w: barrier(jax.lax.dot_general(w, x, nk, **f32)).T, "bfloat16"),
        "w upcast to f32, then w @ x.T": (
            lambda x, w: barrier(w.astype(jnp.float32) @ x.T.astype(jnp.float32)).T, "bfloat16"),
        "multiply-reduce in f32 (one fusion)": (
            lambda x, w: (w.astype(jnp.float32)[None] * x.astype(jnp.float32)[:, None]).sum(-1), "bfloat16"),
        "layers.bfloat16_product (what linear runs)": (layers.bfloat16_product, "bfloat16"),
    }
    if cpu_kernels.available():  # pocketjax's kernel in each code path this CPU has
        for isa in sorted({cpu_kernels.resolved_isa_name(jnp.bfloat16, jnp.bfloat16, i) for i in cpu_kernels.ISAS},
                          key=list(cpu_kernels.ISAS).index):
            forms[f"pocketjax kernel ({isa})"] = (functools.partial(cpu_kernels.skinny_matmul, isa=isa), "bfloat16")
    out = []
    for shape_name, (n, k) in SHAPES.items():
        wf = [(jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)),) for _ in range(WEIGHTS)]
        ws = {"float32": wf, "bfloat16": [(w.astype(jnp.bfloat16),) for (w,) in wf]}
        fns = {name: summed(f) for name, (f, _) in forms.items()}
        for b in BATCHES:
            x = jnp.asarray(rng.standard_normal((b, k), dtype=np.float32)).astype(jnp.bfloat16)
            args = {name: (x, ws[dt]) for name, (_, dt) in forms.items()}
            for name, s in best_of(fns, args, reps).items():
                nbytes = 4 if forms[name][1] == "float32" else 2
                out.append({"suite": "bf16", "shape": shape_name, "batch": b, "form": name, "ms": 1e3 * s / WEIGHTS,
                            "GB_s": n * k * nbytes * WEIGHTS / s / 1e9})
        del wf, ws
    return out


def suite_int8_activations(rng, reps: int) -> list[dict]:
    """How the int8 product quantizes its activations, end to end from float x (quantize, dot, scales): one scale
    per row (W8A8, one outlier channel sets every value's step), two int8 digits per value (x = s q1 + s/254 q2,
    the rows doubled in one dot: 15-bit activations), one scale per block of 32 (llama.cpp's q8_0: a batched dot per
    block, the weight stored [blocks, out, 32]), and the weight-only product (dequantize, float32 dot)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    barrier = jax.lax.optimization_barrier
    nk = (((1,), (1,)), ((), ()))
    block = 32

    def quantized(x, s):
        return jnp.round(x / s).astype(jnp.int8)

    def skinny(w, xq):  # W @ xq.T (barrier, transposed), as int8_product
        return barrier(jax.lax.dot_general(w, xq, nk, preferred_element_type=jnp.int32)).T

    def per_row(x, w, ws):
        s = jnp.max(jnp.abs(x), -1, keepdims=True) / 127
        xq = quantized(x, s)
        xq = jnp.pad(xq, ((0, 1), (0, 0))) if x.shape[0] == 1 else xq
        return skinny(w, xq)[:x.shape[0]] * s * ws[:, 0]

    def two_digits(x, w, ws):
        s = jnp.max(jnp.abs(x), -1, keepdims=True) / 127
        hi = jnp.round(x / s)
        lo = jnp.clip(jnp.round((x - hi * s) * (254 / s)), -127, 127)
        acc = skinny(w, jnp.concatenate([hi, lo]).astype(jnp.int8)).astype(jnp.float32)
        rows = x.shape[0]
        return (acc[:rows] + acc[rows:] * (1 / 254)) * s * ws[:, 0]

    def per_block(x, wb, ws):  # wb [blocks, out, 32]
        rows = x.shape[0]
        xb = jnp.pad(x, ((0, max(0, 2 - rows)), (0, 0))).reshape(max(rows, 2), -1, block).transpose(1, 0, 2)
        s = jnp.maximum(jnp.max(jnp.abs(xb), -1, keepdims=True), 1e-30) / 127  # [blocks, rows, 1]
        acc = jax.lax.dot_general(wb, quantized(xb, s), (((2,), (2,)), ((0,), (0,))),
                                  preferred_element_type=jnp.int32)  # [blocks, out, rows]
        return jnp.einsum("gnr,gr->rn", acc.astype(jnp.float32), s[..., 0])[:rows] * ws[:, 0]

    def weight_only(x, w, ws):
        deq = (jnp.where(jnp.isnan(x[0]), 0, w).astype(jnp.float32) * ws)
        return x @ deq.T

    def float32(x, w):
        rows = x.shape[0]
        return barrier(w @ x.T).T if rows <= 64 else x @ w.T

    out = []
    for shape_name, (n, k) in SHAPES.items():
        if shape_name.startswith("q "):
            continue
        for b in BATCHES + (16, 64, 512):
            count = WEIGHTS if b <= 64 else 2  # compute-bound at prefill sizes: fewer weights, same per product
            w8 = [jnp.asarray(rng.integers(-127, 128, (n, k), dtype=np.int8)) for _ in range(count)]
            ws = [jnp.asarray(rng.random((n, 1), dtype=np.float32) / 127) for _ in range(count)]
            wb = [jnp.asarray(np.ascontiguousarray(np.asarray(w).reshape(n, k // block, block).transpose(1, 0, 2)))
                  for w in w8]
            wf = [(jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)),) for _ in range(count)]
            fns = {"per-row W8A8": summed(per_row), "two digits (rows x2)": summed(two_digits),
                   "per-block 32 (batched)": summed(per_block), "weight-only (dequantize, f32 dot)":
                   summed(weight_only), "float32": summed(float32)}
            x = jnp.asarray(rng.standard_normal((b, k), dtype=np.float32))
            args = {"per-row W8A8": (x, list(zip(w8, ws))), "two digits (rows x2)": (x, list(zip(w8, ws))),
                    "per-block 32 (batched)": (x, list(zip(wb, ws))),
                    "weight-only (dequantize, f32 dot)": (x, list(zip(w8, ws))), "float32": (x, wf)}
            for name, s in best_of(fns, args, reps if b <= 64 else max(2, reps // 3)).items():
                out.append({"suite": "int8_activations", "shape": shape_name, "batch": b, "form": name,
                            "ms": 1e3 * s / count,
                            "GB_s": n * k * (4 if name == "float32" else 1) * count / s / 1e9})
            del w8, ws, wb, wf
    return out


SUITES = {"float": suite_float, "int8": suite_int8, "int4": suite_int4, "quantized": suite_quantized,
          "attention": suite_attention, "bf16": suite_bf16, "int8_activations": suite_int8_activations}


def child(suite: str, reps: int) -> list[dict]:
    import numpy as np

    return SUITES[suite](np.random.default_rng(0), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", default=",".join(SUITES))
    parser.add_argument("--flags", default="default", help=f"comma-separated XLA flag sets: {', '.join(FLAG_SETS)}")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reps)))
        return
    records = []
    for flag_name in args.flags.split(","):
        for suite in args.suites.split(","):
            env = dict(os.environ, XLA_FLAGS=FLAG_SETS[flag_name], JAX_PLATFORMS="cpu")
            run = subprocess.run([sys.executable, __file__, "--child", suite, "--reps", str(args.reps)], env=env,
                                 capture_output=True, text=True, check=True)
            records += [r | {"flags": flag_name} for r in json.loads(run.stdout.strip().splitlines()[-1])]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"flag_sets": FLAG_SETS, "weights_per_call": WEIGHTS, "records": records}, f, indent=1)
    rows: dict[tuple, dict[int, dict]] = {}
    for r in records:
        rows.setdefault((r["flags"], r["suite"], r["shape"], r["form"]), {})[r["batch"]] = r
    print("| flags | suite | shape | form | ms (GB/s) per batch |")
    print("|---|---|---|---|---|")
    for (flags, suite, shape, form), by_b in rows.items():
        cells = ", ".join(f"B={b}: {r['ms']:.3f} ({r['GB_s']:.1f})" for b, r in sorted(by_b.items()))
        print(f"| {flags} | {suite} | {shape} | {form} | {cells} |")


if __name__ == "__main__":
    main()
