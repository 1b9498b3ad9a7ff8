"""Layer loop: compile seconds per decode shape at 16, 32 and 64 layers, unrolled vs `lax.scan`, and warm decode
ms/step of each layout on Qwen3-0.6B shapes at concurrency 1 and 8. Prints a markdown table last.

    python benchmarks/compile_time.py [--layers 16,32,64] [--concurrency 1,8] [--model qwen3-0.6b|PATH]
                                      [--steps 16] [--json out/compile_time.json] [--no-decode]

Compile rows: Qwen3-0.6B's layer shapes at each depth, float32, the engine's decode step (`steps.decode_step`) for
8 slots x 256 positions, lowered and compiled from abstract shapes (no weights are allocated): trace+lower seconds
and XLA compile seconds, wall clock and this process's CPU seconds (XLA compiles mostly on one thread, so CPU seconds
move less with the machine's load). The persistent compile cache is not used. Decode rows: the model loaded both ways
(`load_model(scan_layers=False | True)`), one Engine per concurrency c (c slots, max_seq_len 256), c prompts of
`--prompt-len` tokens prefilled, then the median over `--repeats` runs of `--steps` `batch_decode_step` calls.
Timings on a shared machine are indicative.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table, model_folder,  # noqa: E402
                               parse_ints, usable_cores, write_json)
from benchmarks.presets import preset_config  # noqa: E402
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.engine.request import BatchedRequest  # noqa: E402
from pocketjax.engine.sampling_params import SamplingParams  # noqa: E402
from pocketjax.engine.plan import Signature, StepRules  # noqa: E402
from pocketjax.engine.runner import empty_plan  # noqa: E402
from pocketjax.engine.steps import SlotState, decode_step  # noqa: E402
from pocketjax.model.checkpoint import nest, param_tensors  # noqa: E402
from pocketjax.model.config import ModelConfig  # noqa: E402
from pocketjax.model.decoder import load_model, resolve_scan_layers  # noqa: E402
from pocketjax.model.kv_cache import init_cache  # noqa: E402

SLOTS, SEQ = 8, 256  # the compiled decode shape: every slot (the engine's dense path), attention over 256 positions


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="16,32,64", help="depths whose decode step is compiled")
    add_options(p, concurrency="1,8", model="qwen3-0.6b", dtype="float32", prompt_len=32, steps=16, repeats=3)
    p.add_argument("--no-decode", dest="decode", action="store_false", help="only the compile rows")
    return add_options(p, cache_dir=DEFAULT_CACHE_DIR, json=None)


def abstract_params(config: ModelConfig, scan: bool) -> dict:
    """The params pytree of `config` as ShapeDtypeStructs (float32), stacked for scan: nothing is allocated."""
    params = nest(config, ((path, jax.ShapeDtypeStruct(shape, jnp.float32))
                           for path, _, shape in param_tensors(config)))
    if scan:
        per_layer = params["layers"]
        params["layers"] = {name: jax.ShapeDtypeStruct((len(per_layer),) + per_layer[0][name].shape, jnp.float32)
                            for name in per_layer[0]}
    return params


def compile_seconds(layers: int, scan: bool) -> dict:
    """Trace+lower and compile seconds of one decode step over SLOTS x SEQ at Qwen3-0.6B's shapes, `layers` deep."""
    config = ModelConfig.from_dict({**preset_config("qwen3-0.6b"), "num_hidden_layers": layers})
    c = config
    cache = jax.eval_shape(lambda: init_cache(layers, SLOTS, c.num_kv_heads, SEQ, c.head_dim, jnp.float32, scan))
    state = jax.eval_shape(lambda: SlotState.zeros(SLOTS, c.vocab_size))
    rules = StepRules(SLOTS, SEQ, SEQ, 16, SEQ, "xla", c.vocab_size)  # an engine of SLOTS slots x SEQ
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = decode_step.lower(abstract_params(config, scan), cache, state,
                                empty_plan(rules, Signature("decode", SLOTS, kv_len=SEQ)), config=config, impl="xla")
    t1, c1 = time.perf_counter(), time.process_time()
    lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    return {"kind": "compile", "layers": layers, "scan": scan, "lower_s": t1 - t0, "compile_s": t2 - t1,
            "lower_cpu_s": c1 - c0, "compile_cpu_s": c2 - c1}


def decode_ms(model, concurrency: int, args) -> float:
    """Median ms per batch_decode_step over `args.repeats` runs of `args.steps` steps at `concurrency` requests."""
    engine = Engine(model, max_batch_size=concurrency, max_seq_len=SEQ, compile_cache_dir="off")
    rng = np.random.default_rng(0)
    sampling = SamplingParams(max_tokens=SEQ, temperature=0.0, ignore_eos=True)
    reqs = [BatchedRequest(i, rng.integers(0, model.config.vocab_size, args.prompt_len).tolist(), sampling)
            for i in range(concurrency)]
    for r in reqs:
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    engine.batch_decode_step(reqs)  # compiles
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.batch_decode_step(reqs)
        runs.append((time.perf_counter() - t0) / args.steps * 1e3)
    tokens = [r.generated_tokens for r in reqs]
    for r in reqs:
        engine.free_slot(r.request_id)
    return float(np.median(runs)), runs, tokens


def table(records: list[dict]) -> str:
    compiles = {(r["layers"], r["scan"]): r for r in records if r["kind"] == "compile"}
    lower = lambda r: f"{r['lower_s']:.2f}" if r else "-"  # noqa: E731
    comp = lambda r: f"{r['compile_s']:.2f} ({r['compile_cpu_s']:.2f})" if r else "-"  # noqa: E731
    rows = []
    for layers in sorted({k[0] for k in compiles}):
        u, s = compiles.get((layers, False)), compiles.get((layers, True))
        rows.append([layers, lower(u), comp(u), lower(s), comp(s)])
    text = markdown_table(["layers", "unrolled lower s", "unrolled compile s (CPU s)", "scan lower s",
                           "scan compile s (CPU s)"], rows)
    decodes = [r for r in records if r["kind"] == "decode"]
    if decodes:
        by = {(r["concurrency"], r["scan"]): r for r in decodes}
        rows = []
        for c in sorted({r["concurrency"] for r in decodes}):
            u, s = by[c, False], by[c, True]
            rows.append([c, f"{u['ms_per_step']:.1f}", f"{s['ms_per_step']:.1f}",
                         f"{s['ms_per_step'] / u['ms_per_step']:.2f}", "scan" if u["auto_scan"] else "unrolled"])
        text += "\n\n" + markdown_table(["concurrency", "unrolled ms/step", "scan ms/step", "scan / unrolled",
                                          "auto picks"], rows)
    return text


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    records = []
    for layers in parse_ints(args.layers):
        for scan in (False, True):
            record = compile_seconds(layers, scan)
            records.append(record)
            print(f"{layers} layers, {'scan' if scan else 'unrolled'}: lower {record['lower_s']:.2f} s, "
                  f"compile {record['compile_s']:.2f} s", flush=True)
    if args.decode:
        folder = model_folder(args.model, args.cache_dir, args.dtype)
        tokens = {}
        for scan in (False, True):
            model = load_model(folder, dtype=args.dtype, scan_layers=scan)
            auto = resolve_scan_layers("auto", model.config)
            for c in parse_ints(args.concurrency):
                ms, runs, tokens[scan, c] = decode_ms(model, c, args)
                records.append({"kind": "decode", "concurrency": c, "scan": scan, "ms_per_step": ms, "runs_ms": runs,
                                "layers": model.config.num_layers, "auto_scan": auto})
                print(f"decode c={c} {'scan' if scan else 'unrolled'}: {ms:.1f} ms/step", flush=True)
            del model
            gc.collect()
        for c in {k[1] for k in tokens}:  # greedy tokens of both layouts agree (a sanity check, not a timing)
            assert tokens[False, c] == tokens[True, c], f"scan and unrolled greedy tokens differ at c={c}"
    out = {"machine": machine("jax", "backend", "cores", "loadavg", cores=usable_cores()), "settings": vars(args),
           "records": records}
    write_json(args.json, out)
    print(table(records))
    return out


if __name__ == "__main__":
    main()
