"""Live weight updates (`LLM.update_params`): time per call, compiled programs and device memory over 20 updates.

    python benchmarks/bench_update_params.py [--models embedded,qwen3-0.6b] [--updates 20]
                                             [--dtype bfloat16] [--json OUT]

Per model: an LLM serves one short greedy request twice (compiling its programs, starting the scheduler loop), then
an RL loop's updates: a jitted "training step" makes new weights on the engine's own shardings (untimed), and
`llm.update_params` hands them over (timed: the call returns once the loop's next step boundary swapped them in).
The same request is served after the first two updates and after the last. Reported: the call's median and max
time; compiled programs (`engine.compiled_count()`) before the updates, after the 1st, the 2nd and the last (flat
from the 2nd on: no recompile per update; see "committed" below for the first two); live device bytes (the sum of
`nbytes` over `jax.live_arrays()`) before and after, next to the weights' own bytes (equal before and after: the engine
serves the caller's arrays, and no second copy of the weights stays alive).

"committed": weights loaded onto one device without a mesh are uncommitted JAX arrays, a jitted step's outputs are
committed, and jit keys its programs on that too: the first update from a jitted step adds signatures for committed
params, the next step's for the cache those steps returned (committed too), then none. Loaded committed (a mesh,
a multi-process job) nothing is added.

What a call costs beyond its checks (about 1 ms for the 0.6B preset's 310 leaves) is mostly freeing the old weights'
buffers where the engine held their last reference (measured on a shared 2-core box: 0.6B bf16, 1.5-2 ms a call
while the caller still holds the old params, 20-90 ms when the swap frees them).
Prints a markdown table last; never asserts on time.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: pocketjax + siblings

import pocketjax as pj  # noqa: E402
from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table,  # noqa: E402
                               model_folder, write_json)
from pocketjax.serve.llm import DEFAULT_MODEL  # noqa: E402

PROMPT = [5, 17, 42, 9, 88, 3, 7, 1]
OPTIONS = dict(max_batch_size=1, max_seq_len=64, prefill_chunk=16)  # the fewest programs: compiling is the slow part


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="embedded,qwen3-0.6b", help="'embedded' and/or presets of presets.py")
    p.add_argument("--updates", type=int, default=20)
    add_options(p, dtype="bfloat16", cache_dir=DEFAULT_CACHE_DIR, json=None)
    return p


def training_step(params):
    """A jitted stand-in for an optimizer step: new weights on the engine's shardings (every floating leaf moved), as a
    training step with those out_shardings returns them."""
    def move(x):
        return x * (1 + 0.01 * jnp.sin(997.0 * x)) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.jit(partial(jax.tree.map, move), out_shardings=jax.tree.map(lambda x: x.sharding, params))


def live_bytes() -> int:
    """Bytes of every array alive on the devices now (after collecting garbage, so only what is referenced)."""
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def serve(llm: pj.LLM) -> list[int]:
    return llm.generate(PROMPT, pj.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids


def run(name: str, updates: int, dtype: str, cache_dir: str) -> dict:
    folder = DEFAULT_MODEL if name == "embedded" else model_folder(name, cache_dir, dtype)
    with pj.LLM(folder, **OPTIONS) as llm:
        serve(llm)
        serve(llm)  # the cache that the first request's steps returned has its own signatures
        weights = sum(x.nbytes for x in jax.tree.leaves(llm.model.params))
        compiled, before = [llm.engine.compiled_count()], live_bytes()
        params, seconds = llm.model.params, []
        step = training_step(params)
        for i in range(updates):
            params = jax.block_until_ready(step(params))  # the old weights: only the engine holds them now
            start = time.perf_counter()
            llm.update_params(params)
            seconds.append(time.perf_counter() - start)
            if i < 2:
                serve(llm)
                compiled.append(llm.engine.compiled_count())
        del params
        serve(llm)
        compiled.append(llm.engine.compiled_count())
        return {"model": name, "params": llm.model.config.num_params(), "dtype": str(llm.model.dtype),
                "updates": updates, "update_ms": [1e3 * s for s in seconds],
                "update_ms_median": 1e3 * statistics.median(seconds), "update_ms_max": 1e3 * max(seconds),
                "compiled": dict(zip(("before", "after_1st", "after_2nd", "after_last"), compiled)),
                "weight_bytes": weights, "live_bytes_before": before, "live_bytes_after": live_bytes()}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    records = [run(name, args.updates, args.dtype, args.cache_dir) for name in args.models.split(",")]
    result = {"machine": machine("cpu", "usable_cores", "jax", "devices", "loadavg"), "records": records}
    write_json(args.json, result)
    mib = 2 ** 20
    print(markdown_table(["model", "params", "dtype", "update_params ms (median / max)",
                          "compiled before -> 1st -> 2nd -> last", "weights MiB", "live MiB before -> after"], (
        [r["model"], f"{r['params'] / 1e6:.1f}M", r["dtype"],
         f"{r['update_ms_median']:.2f} / {r['update_ms_max']:.2f}",
         " -> ".join(map(str, r["compiled"].values())), f"{r['weight_bytes'] / mib:.1f}",
         f"{r['live_bytes_before'] / mib:.1f} -> {r['live_bytes_after'] / mib:.1f}"] for r in records)))


if __name__ == "__main__":
    main()
