"""The native CPU kernel's register blocks over adjacent weight rows against row streams (`streams`, the default;
csrc/skinny_matmul.cc `Blocks`): every product of one decode step of a model's shapes (per layer q, k, v, o, gate, up,
down, then the lm_head; distinct weights, so they come from memory as in a step), in one jitted program per order,
the two run alternately in one process, their outputs asserted bitwise equal.

    python benchmarks/bench_streams.py [--model qwen3-0.6b] [--weights float32,bfloat16,int8,int4]
                                       [--rows 1,2,4,8] [--repeats 10] [--json OUT] [--quick]
    python benchmarks/bench_streams.py --engine [--quantize none,int8+head] [--concurrency 1,4] [--pairs 3]

`--engine`: the engine's decode step instead (greedy, prompt 128), each order in its own fresh process (a process
whose kernel products default to `streams=False` is the adjacent one), the two alternated `--pairs` times; reports
the median of each process's median step. Fresh processes because the order is a trace-time choice that jax.jit's
cache does not key: two engines in one process with programs of the same shapes would share them.

Why: adjacent rows of an [out, in] weight are a block's NB streams one row long (in = 1024: 4 KiB float32, 1 KiB
int8), which the hardware prefetcher starts over at every block; as NB runs of rows, a block reads NB long
sequential streams. int4 here is row-major (a single-device CPU load tiles int4, and a tile is one stream already:
bench_tiles.py). Weights are random (a product's time does not depend on the values); x is the weights' float dtype.
Reports the median over `--repeats` alternating rounds; prints a markdown table last; never asserts on time.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: pocketjax + siblings

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, add_quick, machine, markdown_table,  # noqa: E402
                               model_folder, parse, parse_ints, write_json)
from benchmarks.presets import PRESETS  # noqa: E402
from pocketjax import BatchedRequest, Engine, SamplingParams, load_model  # noqa: E402
from pocketjax.model import cpu_kernels, quant  # noqa: E402

QUICK = dict(model="qwen3-tiny", weights="float32,int8", rows="1,2", repeats=2, quantize="int8+head", concurrency="2",
             pairs=1, steps=4)
WEIGHTS = ("float32", "bfloat16", "int8", "int4")


def step_shapes(config: dict) -> list[tuple[int, int]]:
    """[out, in] of every product of one decode step: per layer q, k, v, o, gate, up, down, then the lm_head."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def random_weight(rng: np.random.Generator, out: int, cols: int, form: str):
    """A random [out, cols] weight in `form`: a float array, or a QuantizedWeight of quant.py's layout (int8 per
    channel, int4 in groups of quant.GROUP_SIZE, row-major)."""
    if form in ("float32", "bfloat16"):
        return jnp.asarray(rng.standard_normal((out, cols), np.float32), form)
    bits = 8 if form == "int8" else 4
    leaves = {}
    for name, (shape, _) in quant.leaf_shapes(out, cols, bits).items():
        if name == "scale":
            leaves[name] = rng.random(shape, np.float32) * np.float32(0.01)
        elif name == "zero":
            leaves[name] = rng.integers(0, 16, shape, np.int8)
        elif bits == 4:  # values: two int4 per byte
            leaves[name] = rng.integers(0, 256, shape, np.uint8)
        else:
            leaves[name] = rng.integers(-127, 128, shape, np.int8)
    leaves = {name: jnp.asarray(leaf) for name, leaf in leaves.items()}
    return quant.QuantizedWeight(bits=bits, **leaves)


def step_cases(model: str, weights: str, rows: str) -> Iterator[tuple[str, list, int, jax.Array]]:
    """(form, the step's weights, rows, x) for each weight form and row count asked, made as they are iterated: one
    decode step's weights, random and distinct, and x as wide as the widest input, in the form's float dtype.
    SystemExit here, before any is made, for a model without preset shapes, an unknown form or no native kernels."""
    if model not in PRESETS:
        raise SystemExit(f"--model: one of {sorted(PRESETS)} (the shapes are a preset's)")
    forms = weights.split(",")
    if not set(forms) <= set(WEIGHTS):
        raise SystemExit(f"--weights: a comma-separated subset of {WEIGHTS}, got {weights!r}")
    if not cpu_kernels.available():
        raise SystemExit("the native CPU kernels are not available in this process (see the log)")
    return step_inputs(step_shapes(PRESETS[model]), forms, parse_ints(rows))


def step_inputs(shapes: list[tuple[int, int]], forms: list[str], rows: list[int]) -> Iterator[tuple]:
    """`step_cases`' inputs, one weight form's step in memory at a time."""
    widest = max(cols for _, cols in shapes)
    rng = np.random.default_rng(0)
    for form in forms:
        step = [random_weight(rng, out, cols, form) for out, cols in shapes]
        for count in rows:
            x = jnp.asarray(rng.standard_normal((count, widest), np.float32),
                            "bfloat16" if form == "bfloat16" else "float32")
            yield form, step, count, x


def step_products(weights: list, streams: bool):
    """One jitted program: every weight's product with x (its row of outputs kept), rows in `streams` order."""
    def run(x, ws):
        out = []
        for w in ws:
            xi = x[:, :w.shape[1]]  # x is as wide as the widest input
            if isinstance(w, quant.QuantizedWeight):
                out.append(cpu_kernels.quantized_matmul(xi, w, streams=streams))
            else:
                out.append(cpu_kernels.skinny_matmul(xi, w, streams=streams))
        return out
    return jax.jit(run)


def compare(weights: list, x: jax.Array, repeats: int) -> dict:
    """Median ms of the step's products in each order over `repeats` alternating rounds; bits asserted equal."""
    programs = {"adjacent": step_products(weights, False), "streams": step_products(weights, True)}
    outs = {name: jax.block_until_ready(p(x, weights)) for name, p in programs.items()}  # compiles, warms
    if not all(np.array_equal(a, b) for a, b in zip(outs["adjacent"], outs["streams"])):
        raise RuntimeError("adjacent rows and row streams gave different bits")
    times = {name: [] for name in programs}
    for _ in range(repeats):
        for name, p in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(p(x, weights))
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"adjacent_ms": ms["adjacent"], "streams_ms": ms["streams"], "speedup": ms["adjacent"] / ms["streams"]}


def engine_step_ms(folder: str, quantize: str, c: int, steps: int, streams: bool) -> float:
    """Median decode step (ms) of a fresh engine at c requests, its kernels' rows in `streams` order (run in a process
    of its own: the adjacent order is this process's products with `streams=False` bound)."""
    if not streams:
        cpu_kernels.skinny_matmul = functools.partial(cpu_kernels.skinny_matmul, streams=False)
        cpu_kernels.quantized_matmul = functools.partial(cpu_kernels.quantized_matmul, streams=False)
    model = load_model(folder, dtype="float32", quantize=None if quantize == "none" else quantize)
    engine = Engine(model, max_batch_size=c, max_seq_len=128 + steps + 16)
    sampling = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    reqs = [BatchedRequest(request_id=str(i), prompt_tokens=[2 + i] + [5] * 127, sampling=sampling) for i in range(c)]
    for r in reqs:
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    engine.batch_decode_step(reqs)  # warm
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.batch_decode_step(reqs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def compare_engines(args: dict) -> list[dict]:
    """Per quantize mode and concurrency: each order's fresh process alternated `pairs` times."""
    folder = str(model_folder(args["model"], args["cache_dir"]))
    records = []
    for mode in args["quantize"].split(","):
        for c in parse_ints(args["concurrency"]):
            ms = {"adjacent": [], "streams": []}
            for _ in range(args["pairs"]):
                for order in ms:
                    out = subprocess.run([sys.executable, __file__, "--engine-worker", json.dumps(
                        [folder, mode, c, args["steps"], order == "streams"])], capture_output=True, text=True)
                    if out.returncode:
                        raise RuntimeError(f"{order} engine process failed:\n{out.stderr[-2000:]}")
                    ms[order].append(float(out.stdout.strip().splitlines()[-1]))
            a, b = (statistics.median(ms[o]) for o in ms)
            records.append({"quantize": mode, "concurrency": c, "adjacent_ms": a, "streams_ms": b, "speedup": a / b,
                            "runs": ms})
    return records


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--engine-worker"]:
        print(engine_step_ms(*json.loads(argv[1])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, model="qwen3-0.6b", weights=",".join(WEIGHTS), rows="1,2,4,8", repeats=10, quantize="none,int8+head",
                concurrency="1,4", pairs=3, steps=40, cache_dir=DEFAULT_CACHE_DIR, json=None)
    p.add_argument("--engine", action="store_true", help="time the engine's decode step, one process per order")
    args = parse(add_quick(p, QUICK), argv, QUICK)
    if args["engine"]:
        records = compare_engines(args)
        write_json(args["json"], {"settings": args, "machine": machine("cpu", "usable_cores", "jax", "loadavg"),
                                  "records": records})
        print(markdown_table(["model", "weights", "conc", "adjacent ms/step", "streams ms/step", "streams speedup"], (
            [args["model"], r["quantize"], r["concurrency"], f"{r['adjacent_ms']:.2f}", f"{r['streams_ms']:.2f}",
             f"{r['speedup']:.3f}x"] for r in records)))
        return
    records = [{"weights": form, "rows": rows, "products": len(weights),
                "weight_mib": sum(w.nbytes for w in weights) / 2**20, **compare(weights, x, args["repeats"])}
               for form, weights, rows, x in step_cases(args["model"], args["weights"], args["rows"])]
    write_json(args["json"], {"settings": args, "machine": machine("cpu", "usable_cores", "jax", "loadavg"),
                              "records": records})
    print(markdown_table(["model", "weights", "rows", "MiB read", "adjacent ms", "streams ms", "streams speedup"], (
        [args["model"], r["weights"], r["rows"], f"{r['weight_mib']:.0f}", f"{r['adjacent_ms']:.2f}",
         f"{r['streams_ms']:.2f}", f"{r['speedup']:.3f}x"] for r in records)))


if __name__ == "__main__":
    main()
