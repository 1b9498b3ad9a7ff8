"""Which formulation of a decode-step matmul XLA:CPU runs well: evidence for the engine's weight layout and flags.

A decode step is a handful of [B, K] x [K, N] products per layer with B = active requests (1..8) and weights far
larger than activations, so it should be memory bound: time ~ weight bytes / bandwidth, nearly flat in B. XLA:CPU's
default dot emitter is not (the issue measured [8,1024]x[1024,3072] at ~4x the batch-1 time). Each XLA flag set runs
in its own subprocess (flags are read once per process); within one, every formulation is timed as the minimum of
many runs, interleaved, so a noisy shared machine biases them all alike.

    python benchmarks/xla_cpu_matmul.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

FLAG_SETS = {
    "default": "",
    "xnn_dot": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=dot",
    "onednn": "--xla_cpu_use_onednn=true",
    "single_thread": "--xla_cpu_multi_thread_eigen=false",
}
SHAPES = {"qwen3-0.6b mlp up": (1024, 3072), "qwen3-0.6b mlp down": (3072, 1024), "qwen3-0.6b q": (1024, 2048)}
BATCHES = (1, 2, 4, 8)


def child(reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    formulations = {
        "x@W[in,out]": (lambda x, w: x @ w, False),
        "(W[out,in]@x.T).T": (lambda x, w: (w @ x.T).T, True),
        "einsum bk,nk": (lambda x, w: jnp.einsum("bk,nk->bn", x, w), True),
    }
    rng = np.random.default_rng(0)
    results = {}
    for shape_name, (k, n) in SHAPES.items():
        w_in_out = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
        w_out_in = jnp.asarray(np.ascontiguousarray(np.asarray(w_in_out).T))
        for b in BATCHES:
            x = jnp.asarray(rng.standard_normal((b, k), dtype=np.float32))
            fns = {name: (jax.jit(f), w_out_in if t else w_in_out) for name, (f, t) in formulations.items()}
            best = {name: float("inf") for name in fns}
            for name, (f, w) in fns.items():
                jax.block_until_ready(f(x, w))
            for _ in range(reps):
                for name, (f, w) in fns.items():
                    t = time.perf_counter()
                    jax.block_until_ready(f(x, w))
                    best[name] = min(best[name], time.perf_counter() - t)
            for name, seconds in best.items():
                results[f"{shape_name}|{b}|{name}"] = seconds
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.reps)))
        return
    runs = {}
    for flag_name, flags in FLAG_SETS.items():
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps)], env=env,
                             capture_output=True, text=True, check=True)
        runs[flag_name] = json.loads(out.stdout.strip().splitlines()[-1])
    records = []
    for flag_name, results in runs.items():
        for key, seconds in results.items():
            shape, b, form = key.split("|")
            k, n = SHAPES[shape]
            records.append({"flags": flag_name, "shape": shape, "batch": int(b), "formulation": form,
                            "ms": seconds * 1e3, "weight_GB_s": k * n * 4 / seconds / 1e9,
                            "GFLOP_s": 2 * int(b) * k * n / seconds / 1e9})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"flag_sets": FLAG_SETS, "records": records}, f, indent=1)
    print("| flags | shape | formulation | " + " | ".join(f"B={b} ms" for b in BATCHES) + " | B=8/B=1 |")
    print("|---|---|---|" + "---|" * (len(BATCHES) + 1))
    rows: dict[tuple, dict[int, float]] = {}
    for r in records:
        rows.setdefault((r["flags"], r["shape"], r["formulation"]), {})[r["batch"]] = r["ms"]
    for (flags, shape, form), by_b in rows.items():
        cells = " | ".join(f"{by_b[b]:.2f}" for b in BATCHES)
        print(f"| {flags} | {shape} | {form} | {cells} | {by_b[8] / by_b[1]:.1f}x |")


if __name__ == "__main__":
    main()
