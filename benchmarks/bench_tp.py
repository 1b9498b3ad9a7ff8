"""Tensor parallelism: prefill and decode tokens/s and per-device memory at tp=1 vs tp=2, and on paper the
all-reduce volume of a 64-layer Qwen at TP2 over PCIe 4.0 x16 vs NVLink. Prints a markdown table last.

    python benchmarks/bench_tp.py [--model qwen3-tiny|qwen3-0.6b|PATH] [--tp 1,2] [--concurrency 1,4]
                                  [--json out/bench_tp.json] [--quick]

On CPU the two "devices" are XLA host devices (set below, before jax is imported) sharing the same cores, so
tp=2 cannot be faster there: it adds the all-reduces and halves each matmul without adding compute. The CPU
numbers show the machinery works and what it costs; the paper model shows what the collectives cost on GPUs.
Each (tp, concurrency) runs one untimed cycle that compiles every shape, then --repeats timed cycles (median).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # no effect on GPU backends

import argparse  # noqa: E402
import gc  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_engine import Prompts, engine_cycle  # noqa: E402
from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, add_quick, machine, markdown_table,  # noqa: E402
                               model_folder, parse, parse_ints, usable_cores, write_json)
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.model.memory import per_device_bytes  # noqa: E402
from pocketjax.engine.plan import Signature  # noqa: E402
from pocketjax.model.decoder import load_model  # noqa: E402
from pocketjax.model.layers import ATTENTION_IMPLS  # noqa: E402

QUICK = dict(model="qwen3-tiny", concurrency="4", prompt_len=32, gen_len=12, repeats=2)
# The paper model: a 64-layer, hidden-5120 Qwen (Qwen2.5-32B's shape) at TP2 in fp16.
PAPER = dict(layers=64, hidden=5120, bytes_per_value=2, tp=2, decode_tokens=(1, 8, 64), prefill_tokens=(512, 2048))
LINKS = {"PCIe 4.0 x16": 25e9, "NVLink": 300e9}  # effective bytes/s per direction, as the issue states


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, model="qwen3-tiny", dtype="float32")
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel degrees")
    add_options(p, concurrency="1,4", prompt_len=128, gen_len=32, repeats=3)
    p.add_argument("--attention", default="auto", choices=list(ATTENTION_IMPLS))
    add_options(p, cache_dir=DEFAULT_CACHE_DIR, json=None)
    return add_quick(p, QUICK, " (< 2 minutes on 2 cores)")


def resolve_args(argv: list[str] | None = None) -> SimpleNamespace:
    """Parsed flags; --quick fills every flag that was left at its default."""
    args = parse(build_parser(), argv, QUICK)
    args["tp"], args["concurrency"] = parse_ints(args["tp"]), parse_ints(args["concurrency"])
    return SimpleNamespace(**args)


def all_reduces(engine: Engine, rows: int) -> int:
    """All-reduces in the compiled decode step for `rows` active slots (XLA inserts them; we count them)."""
    hlo = engine.lower(Signature("decode", rows, kv_len=engine.rules.kv_len(1)))
    ops = re.findall(r"= .+? (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                     hlo.compile().as_text())
    return ops.count("all-reduce")


def bench_tp(folder: Path, tp: int, args: SimpleNamespace) -> list[dict]:
    """One record per concurrency: warm prefill and decode tokens/s, per-device parameter and cache bytes."""
    model = load_model(str(folder), dtype=args.dtype, tp=tp)
    max_seq_len = max(128, 1 << (args.prompt_len + args.gen_len - 1).bit_length())
    engine = Engine(model, max_batch_size=max(args.concurrency), max_seq_len=max_seq_len,
                    prefill_chunk=max(16, args.prompt_len), attention_impl=args.attention)
    params = per_device_bytes(model.params)
    cache = per_device_bytes(engine.cache)
    prompts = Prompts(model.config.vocab_size)
    records = []
    for c in args.concurrency:
        t0 = time.perf_counter()
        for warm in range(1, 4):  # under tp the 2nd cycle still compiles the sampler once more (penalties move
            compiled = engine.compiled_count()  # from one device onto the mesh); stop once nothing new compiles
            engine_cycle(engine, prompts.make(c, args.prompt_len), args.gen_len)
            if engine.compiled_count() == compiled:
                break
        warmup_s = time.perf_counter() - t0
        prefills, decodes = [], []
        for _ in range(args.repeats):
            prefill_s, steps = engine_cycle(engine, prompts.make(c, args.prompt_len), args.gen_len)
            prefills.append(prefill_s)
            decodes.append(sum(steps))
        n_steps = args.gen_len - 1
        rec = {"tp": tp, "concurrency": c, "dtype": args.dtype, "attention_impl": engine.impl,
               "prefill_tok_s": c * args.prompt_len / float(np.median(prefills)),
               "decode_tok_s": c * n_steps / float(np.median(decodes)),
               "decode_step_ms": 1e3 * float(np.median(decodes)) / n_steps,
               "param_bytes_per_device": max(params.values()), "cache_bytes_per_device": max(cache.values()),
               "devices": len(params), "warm_cycles": warm,
               "decode_all_reduces": all_reduces(engine, c) if tp > 1 else 0,
               "prefill_s_runs": prefills, "decode_s_runs": decodes, "warmup_s": warmup_s}
        records.append(rec)
        print(f"tp={tp} c={c}: prefill {rec['prefill_tok_s']:.0f} tok/s, decode {rec['decode_tok_s']:.1f} tok/s "
              f"({rec['decode_step_ms']:.1f} ms/step), params {rec['param_bytes_per_device'] / 2**20:.2f} MiB/device, "
              f"{rec['decode_all_reduces']} all-reduces/decode step (warm-up {warmup_s:.1f} s)", flush=True)
    del engine, model
    gc.collect()
    return records


def paper_model(layers: int, hidden: int, bytes_per_value: int, tp: int, decode_tokens, prefill_tokens) -> list[dict]:
    """All-reduce traffic per step of a Megatron TP layout: 2 all-reduces of [tokens, hidden] per layer.

    A ring all-reduce over tp devices sends 2 (tp - 1) / tp of the message from each device (1x at TP2).
    Time = bytes on the wire / link bandwidth; per-collective latency comes on top (~10 us each over PCIe,
    a few us over NVLink: 128 collectives per step, which dominates decode at small batch).
    """
    rows = []
    for phase, counts in (("decode", decode_tokens), ("prefill", prefill_tokens)):
        for tokens in counts:
            message = tokens * hidden * bytes_per_value
            volume = layers * 2 * message
            wire = volume * 2 * (tp - 1) / tp
            rows.append({"phase": phase, "tokens": tokens, "all_reduces": layers * 2, "message_bytes": message,
                         "volume_bytes": volume, "wire_bytes_per_device": wire,
                         **{f"ms_{name}": 1e3 * wire / bw for name, bw in LINKS.items()}})
    return rows


def table(records: list[dict], paper: list[dict]) -> str:
    measured = markdown_table(["tp", "concurrency", "prefill tok/s", "decode tok/s", "decode ms/step",
                               "params MiB/device", "cache MiB/device", "all-reduces/decode step"], (
        [r["tp"], r["concurrency"], f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}",
         f"{r['decode_step_ms']:.1f}", f"{r['param_bytes_per_device'] / 2**20:.2f}",
         f"{r['cache_bytes_per_device'] / 2**20:.2f}", r["decode_all_reduces"]] for r in records))
    on_paper = markdown_table(["step", "tokens", "all-reduces", "volume MB", "MB sent/device",
                               *(f"ms {n}" for n in LINKS)], (
        [p["phase"], p["tokens"], p["all_reduces"], f"{p['volume_bytes'] / 1e6:.1f}",
         f"{p['wire_bytes_per_device'] / 1e6:.1f}", *(f"{p[f'ms_{n}']:.3f}" for n in LINKS)] for p in paper))
    return (f"{measured}\n\nPaper: {PAPER['layers']}-layer Qwen, hidden {PAPER['hidden']}, fp16, TP{PAPER['tp']}: "
            f"2 all-reduces of [tokens, hidden] per layer (bandwidth term only)\n\n{on_paper}")


def main(argv: list[str] | None = None) -> dict:
    args = resolve_args(argv)
    if max(args.tp) > len(jax.devices()):
        raise SystemExit(f"--tp {max(args.tp)} needs that many devices; this process sees {len(jax.devices())}")
    folder = model_folder(args.model, args.cache_dir, args.dtype)
    t0 = time.perf_counter()
    records = [r for tp in args.tp for r in bench_tp(folder, tp, args)]
    paper = paper_model(**PAPER)
    out = {"machine": machine("jax", "backend", "devices", "cores", "loadavg", cores=usable_cores(),
                              xla_flags=os.environ.get("XLA_FLAGS", ""), seconds=time.perf_counter() - t0,
                              settings={k: v for k, v in vars(args).items() if k != "json"}),
           "records": records, "paper": paper}
    write_json(args.json, out)
    print(table(records, paper))
    return out


if __name__ == "__main__":
    main()
