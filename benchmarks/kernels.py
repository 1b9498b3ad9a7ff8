"""Time the Pallas attention kernels against the XLA reference, JAX's own GQA decode kernel and cuDNN's attention
(`jax.nn.dot_product_attention(implementation="cudnn")`, the baseline a GPU user would compare with; traced only,
not run, off the GPU).

Decode is memory-bound, so it reports the K/V bytes it must read over time as achieved bandwidth,
next to the device's measured copy bandwidth. Prefill is compute-bound, so it reports causal
attention FLOP/s next to a measured large-matmul peak. On CPU, `--quick` runs tiny shapes: the XLA
timings are real, the Pallas ones are interpret mode (a Python-level emulation) and mean nothing
about the kernels' speed. Prints a markdown table last; `--json PATH` writes every row.

    PYTHONPATH=. python benchmarks/kernels.py [--quick | --smoke] [--json out/kernels.json]

`--smoke` (device_check.sh --dry-run) runs one tiny shape per kernel once and fails on any error row: it checks
that the script and every implementation run under this JAX, and times nothing.
"""
from __future__ import annotations

import argparse
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import machine, markdown_table, write_json
from pallas_kernels import decode_attention, prefill_attention, reference, tuning
from pocketjax.model.kv_cache import quantize
from pocketjax.model.layers import resolve_impl


def _time(fn, *args, repeats: int) -> float:
    """Median seconds per call after one compiling call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_bandwidth(n_bytes: int, repeats: int) -> float:
    """Device memory bandwidth, bytes/s, from copying one big array (read + write)."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    return 2 * n_bytes / _time(f, x, repeats=repeats)


def matmul_flops(n: int, dtype, repeats: int) -> float:
    """Dense matmul throughput, FLOP/s, of an n x n x n product in dtype."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / _time(f, a, a, repeats=repeats)


def _normal(key: int, shape, dtype) -> jax.Array:
    """Random data made on the device: host NumPy would take minutes for 32 x 32K-token caches."""
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def _decode_impls(interpret: bool, kv_heads: int, t: int):
    """name -> fn(q, k, v, lengths) for every decode implementation worth timing here."""
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode

    splits = max(1, min(16, t // 64))  # JAX's gqa needs T % k_splits == 0 and >= 16 keys per split

    def jax_gqa(q, k_t, v_t, lengths):
        return jax_decode.gqa(q, k_t, v_t, None, lengths, k_splits=splits, interpret=interpret)

    pallas = functools.partial(decode_attention, interpret=interpret)
    return {"pallas": (jax.jit(pallas), False), "xla": (jax.jit(reference.decode_attention), False),
            "jax_gqa": (jax.jit(jax_gqa), True), "cudnn": (jax.jit(cudnn_decode), True),
            # the same over an int8 cache + float32 per-token, per-head scales (Engine(kv_dtype="int8"))
            "pallas_int8": (jax.jit(lambda q, k, v, n, ks, vs: pallas(q, k, v, n, k_scale=ks, v_scale=vs)), False),
            "xla_int8": (jax.jit(lambda q, k, v, n, ks, vs: reference.decode_attention(q, k, v, n, k_scale=ks,
                                                                                      v_scale=vs)), False)}


def cudnn_decode(q, k_t, v_t, lengths, implementation="cudnn"):
    """cuDNN's fused attention (what a GPU user would compare with) on one query token per sequence: q [S, N, D],
    k/v [S, T, K, D] (its layout, made outside the timed call), the valid keys per sequence in `lengths`."""
    out = jax.nn.dot_product_attention(q[:, None], k_t, v_t, key_value_seq_lengths=lengths,
                                       implementation=implementation)
    return out[:, 0]


def cudnn_prefill(q, k, v, starts, q_lengths, implementation="cudnn"):
    """cuDNN's causal attention over one prompt: q [1, T, N, D], k/v [1, K, T, D] -> its [1, T, K, D] layout (the
    transpose is inside the timed call here: XLA fuses it into the producer in a real model, not in this probe)."""
    k_t, v_t = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return jax.nn.dot_product_attention(q, k_t, v_t, is_causal=True, implementation=implementation)


# GPU-only implementations (no interpreter) -> the same call on JAX's XLA path, traced off the GPU instead: the
# arguments and shapes are checked there (an API change fails the dry run), the row says it did not run
GPU_ONLY = {"cudnn": {"decode": functools.partial(cudnn_decode, implementation="xla"),
                      "prefill": functools.partial(cudnn_prefill, implementation="xla")}}


def gpu_only_row(row: dict, args) -> dict:
    """A GPU-only implementation off the GPU: its XLA twin traced (jax.eval_shape) at these shapes, not run."""
    try:
        jax.eval_shape(GPU_ONLY[row["impl"]][row["kind"]], *args)
        return row | dict(interpret=False, skipped="needs a GPU (traced here, not run)")
    except Exception as e:  # noqa: BLE001 - the row says what broke
        return row | dict(interpret=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def bench_decode(s, t, q_heads, kv_heads, d, dtype, impls, interpret, repeats, peak_bw):
    q = _normal(0, (s, q_heads, d), dtype)
    k = _normal(1, (s, kv_heads, t, d), dtype)
    v = _normal(2, (s, kv_heads, t, d), dtype)
    lengths = jnp.full((s,), t, jnp.int32)
    (kq, ks), (vq, vs) = quantize(k, "int8"), quantize(v, "int8")
    rows = []
    for name, (fn, wants_bthd) in _decode_impls(interpret, kv_heads, t).items():
        if name not in impls:
            continue
        args = (q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)) if wants_bthd else (q, k, v)
        extra = ()
        if name.endswith("_int8"):
            args, extra = (q, kq, vq), (ks, vs)
        kv_bytes = sum(a.size * a.dtype.itemsize for a in args[1:] + extra)
        row = dict(kind="decode", impl=name, slots=s, seq=t, interpret=interpret and not name.startswith("xla"))
        if interpret and name in GPU_ONLY:
            rows.append(gpu_only_row(row, (*args, lengths, *extra)))
            continue
        try:
            sec = _time(fn, *args, lengths, *extra, repeats=repeats)
            row.update(ms=sec * 1e3, gbps=kv_bytes / sec / 1e9, pct_peak=100 * kv_bytes / sec / peak_bw)
        except Exception as e:  # one failing implementation must not hide the others' numbers
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            traceback.print_exc()
        rows.append(row)
    return rows


def bench_prefill(tq, q_heads, kv_heads, d, dtype, impls, interpret, repeats, peak_flops):
    q = _normal(3, (1, tq, q_heads, d), dtype)
    k = _normal(4, (1, kv_heads, tq, d), dtype)
    v = _normal(5, (1, kv_heads, tq, d), dtype)
    starts, q_lengths = jnp.zeros((1,), jnp.int32), jnp.full((1,), tq, jnp.int32)
    flops = 4 * q_heads * d * tq * (tq + 1) / 2  # QK^T and PV over the causal half
    fns = {"pallas": jax.jit(functools.partial(prefill_attention, interpret=interpret)),
           "xla": jax.jit(reference.prefill_attention), "cudnn": jax.jit(cudnn_prefill)}
    rows = []
    for name, fn in fns.items():
        if name not in impls:
            continue
        row = dict(kind="prefill", impl=name, slots=1, seq=tq, interpret=interpret and name != "xla")
        if interpret and name in GPU_ONLY:
            rows.append(gpu_only_row(row, (q, k, v, starts, q_lengths)))
            continue
        try:
            sec = _time(fn, q, k, v, starts, q_lengths, repeats=repeats)
            row.update(ms=sec * 1e3, tflops=flops / sec / 1e12, pct_peak=100 * flops / sec / peak_flops)
        except Exception as e:
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            traceback.print_exc()
        rows.append(row)
    return rows


def markdown(rows, peaks) -> str:
    def cells(r):
        def f(key, fmt):
            return format(r[key], fmt) if key in r else ""
        note = r.get("error") or r.get("skipped") or ("interpret mode: not a kernel timing" if r["interpret"] else "")
        return [r["kind"], r["impl"], r["slots"], r["seq"], f("ms", ".3f"), f("gbps", ".1f"), f("tflops", ".2f"),
                f("pct_peak", ".1f"), note]

    return (f"peak copy bandwidth {peaks['copy_gbps']:.1f} GB/s, peak matmul {peaks['matmul_tflops']:.2f} TFLOP/s "
            f"({peaks['device']})\n\n" + markdown_table(["kind", "impl", "slots", "seq", "ms", "GB/s", "TFLOP/s",
                                                         "% peak", "note"], map(cells, rows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU, smoke runs)")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape per kernel, once; fail on any error")
    parser.add_argument("--json", help="write results to this path")
    parser.add_argument("--impls", default="pallas,xla,jax_gqa,cudnn,pallas_int8,xla_int8")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    interpret = not on_gpu
    quick = args.quick or not on_gpu
    dtype = jnp.dtype(args.dtype)
    impls = set(args.impls.split(","))
    repeats = args.repeats or (3 if quick else 20)
    if args.smoke:
        decode_shapes, prefill_seqs, repeats = [(1, 256)], [64], 1
        q_heads, kv_heads, d = 8, 2, 64
        peaks = dict(copy_gbps=copy_bandwidth(1 << 22, 1) / 1e9, matmul_tflops=matmul_flops(256, jnp.float32, 1) / 1e12)
    elif quick:
        decode_shapes = [(s, t) for s in (1, 8) for t in (256, 1024)]
        prefill_seqs = [256]
        q_heads, kv_heads, d = 8, 2, 64
        peaks = dict(copy_gbps=copy_bandwidth(1 << 26, repeats) / 1e9,
                     matmul_tflops=matmul_flops(1024, jnp.float32, repeats) / 1e12)
    else:
        decode_shapes = [(s, t) for s in (1, 8, 32) for t in (1024, 8192, 32768)]
        prefill_seqs = [2048, 8192]
        q_heads, kv_heads, d = args.q_heads, args.kv_heads, args.head_dim
        peaks = dict(copy_gbps=copy_bandwidth(1 << 31, repeats) / 1e9,
                     matmul_tflops=matmul_flops(8192, dtype, repeats) / 1e12)
    peaks["device"] = f"{device.platform} {device.device_kind}"
    target = tuning.target(device)

    rows = []
    for s, t in decode_shapes:
        rows += bench_decode(s, t, q_heads, kv_heads, d, dtype, impls, interpret, repeats,
                             peaks["copy_gbps"] * 1e9)
    for tq in prefill_seqs:
        rows += bench_prefill(tq, q_heads, kv_heads, d, dtype, impls, interpret,
                              repeats, peaks["matmul_tflops"] * 1e12)

    meta = machine("jax", "python", target=target, heads=[q_heads, kv_heads], head_dim=d, dtype=str(dtype),
                   quick=quick, decode_block=tuning.block_sizes("decode", d, dtype, "cpu" if interpret else device),
                   prefill_block=tuning.block_sizes("prefill", d, dtype, "cpu" if interpret else device),
                   attention_impl=resolve_impl("auto", device=device),
                   triton_unsupported=tuning.triton_unsupported(device), peaks=peaks)
    write_json(args.json, dict(meta=meta, rows=rows), indent=1)
    print(json.dumps(meta, default=str))
    print(markdown(rows, peaks))
    if args.smoke and any("error" in r for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
