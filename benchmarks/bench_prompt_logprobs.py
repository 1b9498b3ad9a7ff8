"""What prompt log-probabilities cost a prefill: the plain prefill step next to the scored variant (every position's
logprob of the next prompt token, with the top-0 or top-20 alternatives). Prints a markdown table last; `--json`
writes every record.

    python benchmarks/bench_prompt_logprobs.py --model qwen3-tiny --concurrency 1,4 --prompt-len 128 --json out.json
    python benchmarks/bench_prompt_logprobs.py --model qwen3-0.6b --concurrency 1 --prompt-len 256

Per concurrency c: one device call over c rows of --prompt-len tokens (one chunk), timed after one untimed call that
compiles it; medians of --repeats. The engine itself always runs the top-20 variant (one compiled shape per prefill
shape); the top-0 row shows what the top-k costs on its own.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table, model_folder,  # noqa: E402
                               parse_ints, write_json)
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.engine.sampling_params import MAX_LOGPROBS  # noqa: E402
from pocketjax.engine.plan import PrefillPlan  # noqa: E402
from pocketjax.model.decoder import load_model  # noqa: E402

VARIANTS = {"plain": None, "scored top-0": 0, f"scored top-{MAX_LOGPROBS}": MAX_LOGPROBS}


def time_variant(engine: Engine, num_top: int | None, c: int, length: int, repeats: int) -> list[float]:
    """Seconds per call of one prefill variant over c rows of `length` tokens (the first call compiles, untimed)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, engine.model.config.vocab_size, (c, length)).astype(np.int32)
    slots, zeros = np.arange(c, dtype=np.int32), np.zeros(c, np.int32)
    lengths = np.full(c, length, np.int32)
    targets = np.concatenate([tokens[:, 1:], zeros[:, None]], axis=1)
    scored = dict(targets=targets, scored=slots, num_top=num_top) if num_top is not None else {}  # every row
    plan = PrefillPlan(tokens, slots, zeros, lengths, kv_len=engine.rules.kv_len(length), **scored)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        logits, scores, _ = engine.device.run("prefill", plan)
        jax.block_until_ready(logits if scores is None else scores)
        if i:
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict:
    p = add_options(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), model="qwen3-tiny", dtype="float32",
                    concurrency="1,4", prompt_len=128, repeats=3, cache_dir=DEFAULT_CACHE_DIR, json=None)
    args = p.parse_args(argv)
    model = load_model(model_folder(args.model, args.cache_dir, args.dtype), dtype=args.dtype)
    concurrency = parse_ints(args.concurrency)
    engine = Engine(model, max_batch_size=max(concurrency), max_seq_len=2 * args.prompt_len,
                    prefill_chunk=args.prompt_len, compile_cache_dir="off")
    records = []
    for c in concurrency:
        for name, num_top in VARIANTS.items():
            times = time_variant(engine, num_top, c, args.prompt_len, args.repeats)
            records.append(dict(model=args.model, dtype=args.dtype, concurrency=c, prompt_len=args.prompt_len,
                                variant=name, seconds=statistics.median(times), seconds_runs=times))
    result = {"machine": machine("backend", "devices"), "records": records}
    write_json(args.json, result)
    plain = {r["concurrency"]: r["seconds"] for r in records if r["variant"] == "plain"}
    print(markdown_table(["model", "c", "prompt", "variant", "ms", "x plain"], (
        [r["model"], r["concurrency"], r["prompt_len"], r["variant"], f"{1e3 * r['seconds']:.1f}",
         f"{r['seconds'] / plain[r['concurrency']]:.2f}"] for r in records)))
    return result


if __name__ == "__main__":
    main()
