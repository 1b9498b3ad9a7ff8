"""The HTTP layer's cost: a Poisson stream of requests through `pocketjax serve`'s app, next to the same stream
submitted to its Scheduler directly.

One LLM (so one engine and one set of compiled steps, all compiled by its warm-up) serves both. "scheduler": each
request is submitted to `llm.scheduler` and its tokens read by an asyncio reader (benchmarks/serve.py's `stream`).
"http[h11]", "http[httptools]": each request is one streaming POST /v1/completions (token-id prompt, greedy,
ignore_eos) on its own connection, to uvicorn on a thread of this process, with its pure-Python h11 parser on
asyncio or with httptools' C parser on uvloop (what uvicorn[standard] installs; `--http` picks); the clients run in a second process (asyncio + httpx2), so their
parsing does not take the server's GIL. A token's time is when the SSE chunk carrying it arrives (chunks carry vLLM's
continuous usage stats, so a chunk of k tokens counts k; perf_counter is the system-wide monotonic clock, so both
processes' times compare). All report output throughput, time to first token and inter-token latency p50/p99
(benchmarks/serve.py's `summarize`); each system runs the stream once unmeasured, then `--repeats` measured passes,
interleaved, and the pass with the median throughput is reported. CPU milliseconds per token, this process (engine,
scheduler, HTTP server) and the client process, say what the HTTP layer costs regardless of the machine's load
(wall-clock numbers on a shared box are indicative). `--rate 0` sends every request at once (saturation). Prints a
markdown table last; `--json PATH` writes every number.

    .venv/bin/python benchmarks/bench_serve.py [--quick] [--json out/bench_serve.json] [--rate 6] [--requests 24]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pocketjax as pj  # noqa: E402
from benchmarks.common import machine, versions, write_json  # noqa: E402
from benchmarks.serve import Item, Trace, stream, stream_settings, summarize, table, workload  # noqa: E402
from pocketjax.serve.llm import DEFAULT_MODEL  # noqa: E402
from pocketjax.serve.http.server import BackgroundServer, create_app  # noqa: E402

COLUMNS = ["system", "requests", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "server_cpu_ms_per_token", "client_cpu_ms_per_token", "http_errors"]


async def http_stream(url: str, items: list[Item]) -> tuple[list[Trace], int]:
    """Each item as its own streaming POST at its arrival time; (client traces, requests that failed)."""
    import httpx2

    t0 = time.perf_counter()
    failed = 0

    async def one(client: httpx2.AsyncClient, item: Item) -> Trace:
        nonlocal failed
        await asyncio.sleep(max(0.0, t0 + item.arrival - time.perf_counter()))
        trace, seen = Trace(time.perf_counter()), 0
        body = {"prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"continuous_usage_stats": True}}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                failed += 1
                return trace
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now, count = time.perf_counter(), json.loads(line[6:])["usage"]["completion_tokens"]
                trace.token_times += [now] * (count - seen)
                seen = count
        return trace

    limits = httpx2.Limits(max_connections=len(items), max_keepalive_connections=len(items))
    async with httpx2.AsyncClient(timeout=600, limits=limits) as client:
        traces = await asyncio.gather(*(one(client, item) for item in items))
    return [t for t in traces if t.token_times], failed


def http_pass(url: str, items: list[Item]) -> tuple[list[Trace], int, float]:
    """One pass of HTTP clients (run in the client process): traces, failures, the client process's CPU seconds."""
    cpu = time.process_time()
    traces, failed = asyncio.run(http_stream(url, items))
    return traces, failed, time.process_time() - cpu


# uvicorn's HTTP stacks: its pure-Python h11 parser on asyncio, and what uvicorn[standard] picks (httptools' C
# parser on uvloop); both run in one process on one LLM, so their difference is the HTTP stack alone
STACKS = {"h11": {"http": "h11", "loop": "asyncio"}, "httptools": {"http": "httptools", "loop": "uvloop"}}


def available_stacks() -> list[str]:
    import importlib.util

    return ["h11"] + (["httptools"] if all(importlib.util.find_spec(m) for m in ("httptools", "uvloop")) else [])


def run(llm: pj.LLM, items: list[Item], repeats: int, stacks: list[str]) -> list[dict]:
    """Unmeasured passes of every system, then `repeats` measured ones each, interleaved; every pass's record."""
    records = []
    llm.scheduler.start()
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads or jax state
    with contextlib.ExitStack() as stack:
        clients = stack.enter_context(ProcessPoolExecutor(1, mp_context=spawn))
        systems = {"scheduler": lambda: (asyncio.run(stream(llm.scheduler, items)), 0, 0.0)}
        for name in stacks:
            server = stack.enter_context(BackgroundServer(create_app(llm), **STACKS[name]))
            systems[f"http[{name}]"] = lambda url=server.url: clients.submit(http_pass, url, items).result()
        for go in systems.values():
            go()  # any shape the warm-up missed compiles here
        compiled = llm.engine.compiled_count()
        for k in range(repeats):
            for name, go in systems.items():
                cpu = time.process_time()  # every thread of this process: engine, scheduler, HTTP server, readers
                traces, failed, client_cpu = go()
                tokens = sum(len(t.token_times) for t in traces)
                records.append(summarize(name, traces, {
                    "pass": k, "http_errors": failed,
                    "server_cpu_ms_per_token": round(1e3 * (time.process_time() - cpu) / tokens, 3),
                    "client_cpu_ms_per_token": round(1e3 * client_cpu / tokens, 3)}))
        recompiled = llm.engine.compiled_count() - compiled
    for record in records:
        record["recompiled"] = recompiled
    return records


def median_pass(records: list[dict], system: str) -> dict:
    runs = sorted((r for r in records if r["system"] == system), key=lambda r: r["output_tok_s"])
    return runs[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint folder with tokenizer.json "
                                                                     "(default: the embedded model)")
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs, one attention length")
    parser.add_argument("--requests", type=int, help="requests per pass (default 48, quick 24)")
    parser.add_argument("--rate", type=float, help="mean arrivals per second; 0: all at once (default 8, quick 6)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="measured passes per system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--http", default=",".join(available_stacks()),
                        help="uvicorn HTTP stacks to compare: h11 (asyncio) and/or httptools (uvloop); default every "
                             "installed one")
    args = parser.parse_args()
    stacks = [name for name in args.http.split(",") if name]
    load_start = os.getloadavg()
    config, prompts, outputs, n, rate = stream_settings(args)
    with pj.LLM(args.model, config, warmup=True) as llm:  # every shape compiled first: none while measuring
        items = workload(n, rate, prompts, outputs, llm.model.config.vocab_size, args.seed)
        records = run(llm, items, args.repeats, stacks)
    systems = ["scheduler"] + [f"http[{name}]" for name in stacks]
    best = {system: median_pass(records, system) for system in systems}
    s = best["scheduler"]
    overhead = [{"system": f"{system} / scheduler", "output_tok_s": round(h["output_tok_s"] / s["output_tok_s"], 3),
                 **{k: round(h[k] - s[k], 3) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                                       "server_cpu_ms_per_token", "client_cpu_ms_per_token")}}
                for system, h in best.items() if system != "scheduler"]
    info = machine("platform", "python", "jax", "device", "cpus", model=args.model, rate=rate, requests=n,
                   slots=args.slots, repeats=args.repeats, seed=args.seed, loadavg_start=load_start,
                   loadavg_end=os.getloadavg(), stacks={name: STACKS[name] for name in stacks},
                   versions=versions("uvicorn", "httptools", "uvloop"))
    write_json(args.json, {"machine": info, "records": records, "median": best, "overhead": overhead})
    for r in records:
        print(json.dumps(r))
    print("(overhead rows: throughput ratio, latency differences in ms)")
    print(table([*best.values(), *overhead], COLUMNS))


if __name__ == "__main__":
    main()
