"""What a per-request intervention or capture costs a decode step: no hook, a steering hook (SamplingParams.hook) on
every row or on one row only (the others then run the same program, their rows selected away), the same steering as
data (SamplingParams.steer, a new vector every round) on every row or one, and activations captured at every layer
(SamplingParams.return_hidden). Then 100 requests with 100 distinct vectors: the compiled programs after the first and
the last (equal: steering is data). Prints a markdown table last; `--json` writes every record.

    python benchmarks/bench_hooks.py --model qwen3-tiny --concurrency 1,8 --json out.json
    python benchmarks/bench_hooks.py --model qwen3-0.6b --concurrency 1,8 --steps 8

Per concurrency c and variant: c requests are prefilled, one untimed decode step compiles the variant's program, then
--steps calls of `Engine.batch_decode_step` (forward, sampler and the host sync) are timed one by one; the variants
take turns for --repeats rounds, so a busy machine's drift reaches them alike. Reported: the median ms per step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table, model_folder,  # noqa: E402
                               parse_ints, write_json)
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.engine.request import BatchedRequest  # noqa: E402
from pocketjax.engine.sampling_params import SamplingParams  # noqa: E402
from pocketjax.model.decoder import load_model  # noqa: E402

VARIANTS = ("no hook", "hook on every row", "hook on one row", "steer on every row", "steer on one row",
            "hidden on every row")  # the last: SamplingParams.return_hidden, every layer (the engine reads them all)


def steering_hook(layer_index: int, vector: np.ndarray):
    """Adds `vector` to the residual stream after one layer: the typical steering-vector intervention."""
    def hook(layer, hidden):
        return hidden + jnp.where(layer == layer_index, 1.0, 0.0).astype(hidden.dtype) * vector.astype(hidden.dtype)
    return hook


def time_variant(engine: Engine, variant: str, hook, c: int, prompt_len: int, steps: int, round_: int) -> list[float]:
    """Seconds per decode step of c greedy requests, `variant` saying which rows carry the hook or steering."""
    rng = np.random.default_rng(round_)
    plain = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    c_model = engine.model.config
    steer = {c_model.num_layers // 2: rng.normal(0, 0.5, c_model.hidden_size).astype(np.float32)}  # new each round
    changed = (replace(plain, hook=hook) if variant.startswith("hook") else replace(plain, steer=steer)
               if variant.startswith("steer") else replace(plain, return_hidden=range(c_model.num_layers + 1)))
    params = [changed if variant.endswith("every row") or (variant.endswith("one row") and i == 0) else plain
              for i in range(c)]
    reqs = [BatchedRequest(f"{variant}-{round_}-{i}", [int(t) for t in rng.integers(0, engine.model.config.vocab_size,
                                                                                   prompt_len)], sp)
            for i, sp in enumerate(params)]
    for r in reqs:
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    engine.batch_decode_step(reqs)  # compiles the variant's program the first time: untimed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.batch_decode_step(reqs)
        times.append(time.perf_counter() - start)
    for r in reqs:
        engine.free_slot(r.request_id)
    return times


def main(argv: list[str] | None = None) -> dict:
    p = add_options(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), model="qwen3-tiny", dtype="float32",
                    concurrency="1,8", prompt_len=32, steps=16, repeats=3, cache_dir=DEFAULT_CACHE_DIR, json=None)
    args = p.parse_args(argv)
    model = load_model(model_folder(args.model, args.cache_dir, args.dtype), dtype=args.dtype)
    concurrency = parse_ints(args.concurrency)
    engine = Engine(model, max_batch_size=max(concurrency), max_seq_len=args.prompt_len + args.steps + 8,
                    prefill_chunk=args.prompt_len, compile_cache_dir="off")
    vector = np.random.default_rng(0).normal(0, 0.5, model.config.hidden_size).astype(np.float32)
    hook = steering_hook(model.config.num_layers // 2, vector)
    runs: dict[tuple[int, str], list[float]] = {}
    for c in concurrency:
        variants = [v for v in VARIANTS if c > 1 or not v.endswith("one row")]  # one row: "one row" is "every row"
        for round_ in range(args.repeats):
            for variant in variants:
                runs.setdefault((c, variant), []).extend(
                    time_variant(engine, variant, hook, c, args.prompt_len, args.steps, round_))
    records = [dict(model=args.model, dtype=args.dtype, concurrency=c, variant=variant,
                    decode_step_ms=1e3 * statistics.median(times), decode_step_ms_runs=[1e3 * t for t in times])
               for (c, variant), times in runs.items()]
    counts = []
    for i in range(100):  # 100 requests, 100 distinct vectors, with an unsteered batch-mate (the first compiles the
        time_variant(engine, "steer on one row", hook, 2, args.prompt_len, 1, 1000 + i)  # shapes of 2 rows)
        counts.append(engine.compiled_count())
    programs = {"compiled_after_1st_vector": counts[0], "compiled_after_100th_vector": counts[-1]}
    print(programs, flush=True)
    result = {"machine": machine("backend", "devices", "loadavg"), "records": records, **programs}
    write_json(args.json, result)
    base = {r["concurrency"]: r["decode_step_ms"] for r in records if r["variant"] == "no hook"}
    print(markdown_table(["model", "c", "variant", "decode ms/step", "x no hook"], (
        [r["model"], r["concurrency"], r["variant"], f"{r['decode_step_ms']:.2f}",
         f"{r['decode_step_ms'] / base[r['concurrency']]:.2f}"] for r in records)))
    return result


if __name__ == "__main__":
    main()
