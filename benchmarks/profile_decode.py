"""Where a warm decode step spends its time: the engine's compiled step under `jax.profiler.trace`, per XLA op
(fusion, dot, custom call) summed over the profiled steps, for each dtype the checkpoint is loaded as.

A shared machine makes absolute times drift, so the dtypes are profiled in one process, back to back, and the table
gives each op's share of its own step beside its milliseconds. The op names are XLA's (a `dot` or `*.fusion` with
the HLO's shapes in `--hlo`), so a slow product shows up as one long op per layer.

    python benchmarks/profile_decode.py --model qwen3-0.6b --dtype bfloat16 --load-dtypes bfloat16,float32 \
        --concurrency 1,2 [--steps 8] [--quantize int4+head8] [--json out.json]

Every float product and the attention run pocketjax's native CPU kernels by default (`custom-call` ops here); run once
more with POCKETJAX_CPU_KERNELS=off for the same step in XLA's forms.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, markdown_table, model_folder,  # noqa: E402
                               parse_ints, write_json)
from pocketjax import BatchedRequest, Engine, SamplingParams, load_model  # noqa: E402


def trace_events(log_dir: Path) -> list[dict]:
    """The complete ('X') events of the perfetto trace jax.profiler wrote under log_dir."""
    (path,) = log_dir.rglob("*.trace.json.gz")
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def per_op(events: list[dict], steps: int) -> dict[str, float]:
    """Milliseconds per step of each XLA op, named as the profiler names the compiled step's thunks."""
    ops = defaultdict(float)
    for e in events:
        name = e.get("name", "")
        if e.get("args", {}).get("hlo_op") or e.get("args", {}).get("hlo_module"):
            ops[name] += e["dur"] / 1e3 / steps
    return dict(ops)


def op_kind(name: str) -> str:
    """An op's family: the digits XLA appends to repeated ops are dropped, so the 28 layers' dots sum into one row."""
    return name.rstrip("0123456789").rstrip(".").rstrip("_")


def profile(engine: Engine, c: int, prompt_len: int, steps: int) -> dict:
    """Prefill c prompts, run 3 warm decode steps, then `steps` traced ones; their per-op milliseconds."""
    sampling = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    reqs = [BatchedRequest(request_id=f"p{i}", prompt_tokens=[2 + i] + [5] * (prompt_len - 1), sampling=sampling)
            for i in range(c)]
    for r in reqs:
        engine.allocate_slot(r)
    try:
        engine.batch_prefill(reqs)
        for _ in range(3):
            engine.batch_decode_step(reqs)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            with jax.profiler.trace(tmp, create_perfetto_trace=True):
                for _ in range(steps):
                    engine.batch_decode_step(reqs)
            wall = (time.perf_counter() - t0) / steps
            events = trace_events(Path(tmp))
    finally:
        for r in reqs:
            engine.free_slot(r.request_id)
    ops = per_op(events, steps)
    kinds = defaultdict(float)
    for name, ms in ops.items():
        kinds[op_kind(name)] += ms
    return {"concurrency": c, "step_ms": 1e3 * wall, "ops_ms": ops, "kinds_ms": dict(kinds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, model="qwen3-0.6b", dtype="bfloat16")
    p.add_argument("--load-dtypes", default="bfloat16,float32")
    p.add_argument("--quantize", default="", help="quant.MODES name (int8+head, int4+head8, ...); empty: none")
    add_options(p, concurrency="1,2", prompt_len=128, steps=8)
    p.add_argument("--top", type=int, default=12)
    add_options(p, cache_dir=DEFAULT_CACHE_DIR, json=None)
    args = p.parse_args()
    folder = model_folder(args.model, args.cache_dir, args.dtype)
    cs = parse_ints(args.concurrency)
    records = []
    for dtype in args.load_dtypes.split(","):
        model = load_model(folder, dtype=dtype, quantize=args.quantize or None)
        engine = Engine(model, max_batch_size=max(cs), max_seq_len=256)
        for c in cs:
            records.append({"dtype": dtype, "quantize": args.quantize or None,
                            **profile(engine, c, args.prompt_len, args.steps)})
        del engine, model
    write_json(args.json, {"settings": vars(args), "records": records}, indent=1)
    for r in records:
        total = sum(r["kinds_ms"].values())
        form = f"{r['dtype']} {r['quantize']}" if r["quantize"] else r["dtype"]
        print(f"\n{form} c={r['concurrency']}: step {r['step_ms']:.1f} ms wall, ops {total:.1f} ms")
        print(markdown_table(["op", "ms/step", "share"], (
            [name, f"{ms:.2f}", f"{100 * ms / total:.1f}%"]
            for name, ms in sorted(r["kinds_ms"].items(), key=lambda kv: -kv[1])[:args.top])))


if __name__ == "__main__":
    main()
