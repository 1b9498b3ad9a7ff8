"""Tiled against row-major int4 values (`quant.tile_rows`) in the engine's decode step: one model loaded once per
mode, its int4 linears as loaded (tiled: a single-device CPU load with the native kernels) and read back row-major,
two engines stepped alternately in one process, the same requests, greedy tokens asserted identical.

    python benchmarks/bench_tiles.py [--model qwen3-0.6b] [--quantize int4+head8,int4] [--concurrency 1,2,4,8]
                                     [--rounds 10] [--json OUT] [--quick]

Why tiles: row-major, a block of 4 weight rows is 4 streams of in / 2 bytes (512 B at in = 1024), too short for the
hardware prefetcher; a tile puts the 4 rows' 32-column chunks in one 64-byte line, one sequential stream (see
csrc/skinny_matmul.cc). Each round times `--steps` decode steps of each engine in turn (alternating cancels the
drift of a shared machine); reported: the median step of each and their ratio. Prints a markdown table last; never
asserts on time.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: pocketjax + siblings

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, add_quick, machine, markdown_table,  # noqa: E402
                               model_folder, parse, parse_ints, write_json)
from pocketjax import BatchedRequest, Engine, SamplingParams, load_model  # noqa: E402
from pocketjax.model import quant  # noqa: E402

QUICK = dict(model="qwen3-micro", quantize="int4+head8", concurrency="1,2", rounds=2)


def row_major(model):
    """model with its tiled int4 weights read back row-major (new arrays: the two engines share no values)."""
    return dataclasses.replace(model, params=jax.block_until_ready(quant.untiled_params(model.params)))


def compare(engines: dict[str, Engine], c: int, prompt_len: int, steps: int, rounds: int) -> dict:
    """Median decode step (ms) of each engine over `rounds` alternating rounds of `steps` steps at c requests."""
    sampling = SamplingParams(max_tokens=rounds * steps + 8, temperature=0.0, ignore_eos=True)
    reqs = {name: [BatchedRequest(request_id=f"{name}-{i}", prompt_tokens=[2 + i] + [5] * (prompt_len - 1),
                                  sampling=sampling) for i in range(c)] for name in engines}
    tokens = {name: [] for name in engines}
    times = {name: [] for name in engines}
    try:
        for name, engine in engines.items():
            for r in reqs[name]:
                engine.allocate_slot(r)
            engine.batch_prefill(reqs[name])
            engine.batch_decode_step(reqs[name])  # warm
        for _ in range(rounds):
            for name, engine in engines.items():
                for _ in range(steps):
                    start = time.perf_counter()
                    tokens[name].append(engine.batch_decode_step(reqs[name]))
                    times[name].append(time.perf_counter() - start)
    finally:
        for name, engine in engines.items():
            for r in reqs[name]:
                engine.free_slot(r.request_id)
    if tokens["tiled"] != tokens["row-major"]:
        raise RuntimeError(f"c={c}: tiled and row-major values gave different tokens")
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"concurrency": c, "row_major_ms": ms["row-major"], "tiled_ms": ms["tiled"],
            "speedup": ms["row-major"] / ms["tiled"], "steps_each": rounds * steps}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, model="qwen3-0.6b", quantize="int4+head8", concurrency="1,2,4,8", prompt_len=128,
                steps=4, rounds=10, cache_dir=DEFAULT_CACHE_DIR, json=None)
    args = parse(add_quick(p, QUICK), argv, QUICK)
    cs = parse_ints(args["concurrency"])
    records = []
    for mode in args["quantize"].split(","):
        model = load_model(model_folder(args["model"], args["cache_dir"]), dtype="float32", quantize=mode)
        weights = [w for w in jax.tree.leaves(model.params, is_leaf=lambda w: isinstance(w, quant.QuantizedWeight))
                   if isinstance(w, quant.QuantizedWeight) and w.bits == 4]
        if not weights or not all(w.tiled for w in weights):
            raise SystemExit(f"{args['model']} --quantize {mode}: no tiled int4 weights to compare (the native "
                             "kernels on one CPU device tile int4 linears at load)")
        options = dict(max_batch_size=max(cs), max_seq_len=args["prompt_len"] + args["rounds"] * args["steps"] + 16)
        engines = {"row-major": Engine(row_major(model), **options), "tiled": Engine(model, **options)}
        records += [{"quantize": mode, **compare(engines, c, args["prompt_len"], args["steps"], args["rounds"])}
                    for c in cs]
        del engines, model
    write_json(args["json"], {"settings": args, "machine": machine("cpu", "usable_cores", "jax", "loadavg"),
                              "records": records})
    print(markdown_table(["model", "weights", "conc", "row-major ms/step", "tiled ms/step", "tiled speedup"], (
        [args["model"], r["quantize"], r["concurrency"], f"{r['row_major_ms']:.2f}", f"{r['tiled_ms']:.2f}",
         f"{r['speedup']:.3f}x"] for r in records)))


if __name__ == "__main__":
    main()
