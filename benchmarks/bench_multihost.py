"""Multi-process serving: scheduler step time with the same mesh in one process and split over two processes
(jax.distributed over 127.0.0.1, gloo CPU collectives), the per-step coordination (process 0's broadcast) timed
apart from the rest, and the bytes each step exchanges. Prints a markdown table last.

    python benchmarks/bench_multihost.py [--model qwen3-tiny|PATH] [--layout tp,dp] [--concurrency 4]
                                         [--prompt-len 32] [--gen-len 32] [--repeats 3] [--json OUT] [--quick]

Per layout: "1 process" runs the 2-device mesh (tp=2 or dp=2) in one process over two XLA host devices; "2
processes" runs the same mesh with one device in each process. Every process drives its Scheduler by hand, step by
step (process 0 submits, the others follow its broadcasts), after one untimed cycle that compiles every shape.
Each run serves the same cycles twice: with the pipelined scheduler (what serving runs: the broadcast at the start
of a step queues behind the decode step still in flight, so its time includes waiting for that step) and
unpipelined (nothing is in flight when the broadcast starts, so its time is the coordination itself, plus any wait
for the slower process). Columns: the median decode step and the part of it in the broadcast, for both; "rest",
the unpipelined step minus its broadcast; the broadcast alone, timed in a loop before serving; coordination
bytes/step, the broadcast buffer plus payload; model collectives, what XLA put in the compiled decode step (count
and result bytes, from its HLO). Both processes share the same two cores here, so the
numbers are indicative: on real hosts the collectives cross a network and the compute does not share cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, add_quick, machine, markdown_table,  # noqa: E402
                               model_folder, parse, write_json)

QUICK = dict(model="qwen3-micro", concurrency=2, prompt_len=16, gen_len=12, repeats=2)
LAYOUTS = {"tp": (2, 1), "dp": (1, 2)}  # layout -> (tp, dp)
IDLE_EXCHANGES = 50
COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                        r"(?:-start)?\(")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, model="qwen3-tiny", dtype="float32")
    p.add_argument("--layout", default="tp,dp", help="comma-separated: tp (tp=2) and/or dp (dp=2)")
    add_options(p, concurrency=4, prompt_len=32, gen_len=32, repeats=3, cache_dir=DEFAULT_CACHE_DIR, json=None)
    add_quick(p, QUICK)
    p.add_argument("--timeout", type=int, default=900, help="seconds before a run's processes are killed")
    # a child process of the run (set by the parent)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    return p


def resolve_args(argv: list[str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(**parse(build_parser(), argv, QUICK))


# ---- a child: one process of a run ------------------------------------------------------------------------------

def decode_collectives(engine, rows: int) -> tuple[int, int]:
    """(count, result bytes) of the collectives XLA put in the compiled decode step for `rows` slots."""
    import numpy as np

    from pocketjax.engine.plan import Signature

    hlo = engine.lower(Signature("decode", rows, kv_len=engine.rules.kv_len(1))).compile().as_text()
    count = size = 0
    for dtype, dims, _ in COLLECTIVE.findall(hlo):
        count += 1
        size += DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return count, size


def child(args: SimpleNamespace) -> dict:
    """Serve `repeats` cycles of `concurrency` requests with the scheduler driven step by step; timings per step."""
    from pocketjax.serve import distributed
    if args.num_processes > 1:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import numpy as np

    import pocketjax as pj
    from benchmarks.bench_engine import Prompts
    from pocketjax.model.sharding import make_mesh
    from pocketjax.serve.scheduler import Scheduler

    tp, dp = LAYOUTS[args.child]
    model = pj.load_model(args.folder, dtype=args.dtype, mesh=make_mesh(tp=tp, dp=dp))
    group = distributed.ProcessGroup.current()
    idle_ms = None
    if group is not None:  # the broadcast alone, before the scheduler uses it
        group.exchange({})
        start = time.perf_counter()
        for _ in range(IDLE_EXCHANGES):
            group.exchange({})
        idle_ms = 1e3 * (time.perf_counter() - start) / IDLE_EXCHANGES
    max_seq_len = max(128, 1 << (args.prompt_len + args.gen_len).bit_length())
    engine = pj.Engine(model, max_batch_size=args.concurrency, max_seq_len=max_seq_len,
                       prefill_chunk=max(16, args.prompt_len), compile_cache_dir="off")
    prompts = Prompts(model.config.vocab_size)
    record = {"layout": args.child, "tp": tp, "dp": dp, "processes": args.num_processes,
              "process_id": args.process_id, "concurrency": args.concurrency, "coord_idle_ms": idle_ms}
    for pipeline in (True, False):  # pipelined: what serving runs; unpipelined: the broadcast waits for nothing
        scheduler = Scheduler(engine, group=group, pipeline=pipeline)
        steps = serve_cycles(scheduler, group, prompts, args)
        step_s, coord_s = np.array([s for s, _, _ in steps]), np.array([c for _, c, _ in steps])
        suffix = "" if pipeline else "_unpipelined"
        record |= {f"step_ms{suffix}": 1e3 * float(np.median(step_s)),
                   f"coord_ms{suffix}": 1e3 * float(np.median(coord_s)),
                   f"rest_ms{suffix}": 1e3 * float(np.median(step_s - coord_s)), f"decode_steps{suffix}": len(steps)}
        record["coord_bytes_per_step"] = (distributed.HEADER_BYTES + float(np.mean([b for _, _, b in steps]))
                                          if group else 0)
    if group is not None:  # process 0's stop is the last broadcast; the others take it in one more step
        if group.leader:
            scheduler.stop()
        else:
            scheduler.step()
    record["model_collectives"], record["model_collective_bytes"] = decode_collectives(engine, args.concurrency)
    return record


def serve_cycles(scheduler, group, prompts, args: SimpleNamespace) -> list[tuple[float, float, int]]:
    """(seconds, of which in the broadcast, payload bytes) of every decode step of `repeats` timed cycles, after one
    that compiles. Process 0 submits each cycle's requests before its first step; every process steps until
    there is no work, which every process sees at the same step."""
    import pocketjax as pj

    sampling = pj.SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    steps = []
    for cycle in range(args.repeats + 1):
        batch = prompts.make(args.concurrency, args.prompt_len)
        handles = [scheduler.submit(p, sampling) for p in batch] if group is None or group.leader else []
        more, first = True, True
        while more:
            before_s, before_b = (group.seconds, group.bytes) if group else (0.0, 0)
            t0 = time.perf_counter()
            more = scheduler.step()
            elapsed = time.perf_counter() - t0
            if cycle and not first:  # the first step of a cycle prefills: only decode steps are compared
                steps.append((elapsed, (group.seconds - before_s) if group else 0.0,
                              (group.bytes - before_b) if group else 0))
            first = False
        assert all(len(h.result().token_ids) == args.gen_len for h in handles)
    return steps


# ---- the parent -----------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: SimpleNamespace, folder: Path, layout: str, processes: int, out: Path) -> list[dict]:
    """Run one layout with `processes` processes (2 devices spread over them); every process's record."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={2 // processes}"}
    coordinator = f"127.0.0.1:{free_port()}"
    common = ["--model", args.model, "--dtype", args.dtype, "--concurrency", str(args.concurrency),
              "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--repeats", str(args.repeats),
              "--child", layout, "--folder", str(folder), "--coordinator", coordinator,
              "--num-processes", str(processes)]
    procs = [subprocess.Popen([sys.executable, __file__, *common, "--process-id", str(i), "--json", f"{out}.{i}"],
                              env=env) for i in range(processes)]
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"layout {layout} with {processes} processes did not finish in {args.timeout} s")
    if any(codes):
        raise SystemExit(f"layout {layout} with {processes} processes failed: exit statuses {codes}")
    return [json.loads(Path(f"{out}.{i}").read_text()) for i in range(processes)]


def table(records: list[dict]) -> str:
    return markdown_table(["mesh", "processes", "step ms (pipelined)", "in broadcast", "step ms (unpipelined)",
                           "in broadcast", "rest", "broadcast alone ms", "coordination bytes/step",
                           "model collectives/decode step (bytes)"], (
        [f"tp={r['tp']} dp={r['dp']}", r["processes"], f"{r['step_ms']:.2f}", f"{r['coord_ms']:.2f}",
         f"{r['step_ms_unpipelined']:.2f}", f"{r['coord_ms_unpipelined']:.2f}", f"{r['rest_ms_unpipelined']:.2f}",
         "-" if r["coord_idle_ms"] is None else f"{r['coord_idle_ms']:.2f}", f"{r['coord_bytes_per_step']:.0f}",
         f"{r['model_collectives']} ({r['model_collective_bytes']})"] for r in records))


def main(argv: list[str] | None = None) -> dict | None:
    args = resolve_args(argv)
    if args.child:
        write_json(args.json, child(args))
        return None
    import tempfile

    folder = model_folder(args.model, args.cache_dir, args.dtype)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in [s.strip() for s in args.layout.split(",") if s.strip()]:
            for processes in (1, 2):
                record = launch(args, folder, layout, processes, Path(tmp) / f"{layout}-{processes}.json")[0]
                records.append(record)  # process 0's view: it owns intake and timing
                print(f"{layout} x{processes} process(es): {record['step_ms']:.2f} ms/step pipelined, "
                      f"{record['step_ms_unpipelined']:.2f} unpipelined of which {record['coord_ms_unpipelined']:.2f} "
                      f"in the broadcast", flush=True)
    result = {"machine": machine("cores", "loadavg"), "settings": {
        k: getattr(args, k) for k in ("model", "dtype", "concurrency", "prompt_len", "gen_len", "repeats")},
        "records": records}
    write_json(args.json, result)
    print(table(records))
    return result


if __name__ == "__main__":
    main()
