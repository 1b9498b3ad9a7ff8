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

`--peer-server vllm` (with `--vllm-python`, vLLM's own venv: benchmarks/README.md): vLLM's OpenAI server
(benchmarks/peers/vllm_server.py) on the same folder, dtype and slot count, on 127.0.0.1, as a fourth system under
the same stream and clients, interleaved with the others; it is stopped (SIGSTOP) outside its own passes so its idle
scheduler takes no core from ours, and its CPU per token is its process tree's. A "vllm / http[...]" row sets it
against `pocketjax serve`.

    .venv/bin/python benchmarks/bench_serve.py [--quick] [--json out/bench_serve.json] [--rate 6] [--requests 24]
    .venv/bin/python benchmarks/bench_serve.py --quick --peer-server vllm --vllm-python ~/vllm-venv/bin/python
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

import numpy as np  # noqa: E402

import pocketjax as pj  # noqa: E402
from benchmarks.common import machine, versions, write_json  # noqa: E402
from benchmarks.peers.vllm_server import VllmServer  # noqa: E402
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


def run(llm: pj.LLM, items: list[Item], repeats: int, stacks: list[str],
        peer: VllmServer | None = None) -> list[dict]:
    """Unmeasured passes of every system, then `repeats` measured ones each, interleaved; every pass's record.
    `peer`: vLLM's server, resumed for its own passes only; its CPU is its process tree's."""
    records = []
    llm.scheduler.start()
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's threads or jax state
    with contextlib.ExitStack() as stack:
        clients = stack.enter_context(ProcessPoolExecutor(1, mp_context=spawn))
        systems = {"scheduler": lambda: (asyncio.run(stream(llm.scheduler, items)), 0, 0.0)}
        cpu_clock = {}  # system -> the CPU seconds its server has used (default: this process's)
        for name in stacks:
            server = stack.enter_context(BackgroundServer(create_app(llm), **STACKS[name]))
            systems[f"http[{name}]"] = lambda url=server.url: clients.submit(http_pass, url, items).result()
        if peer is not None:
            systems["vllm"] = lambda: peer_pass(peer, clients, items)
            cpu_clock["vllm"] = peer.cpu_seconds
        for go in systems.values():
            go()  # any shape the warm-up missed compiles here
        compiled = llm.engine.compiled_count()
        for k in range(repeats):
            for name, go in systems.items():
                clock = cpu_clock.get(name, time.process_time)  # ours: engine, scheduler, HTTP server, readers
                cpu = clock()
                traces, failed, client_cpu = go()
                tokens = max(1, sum(len(t.token_times) for t in traces))
                records.append(summarize(name, traces, {
                    "pass": k, "http_errors": failed,
                    "server_cpu_ms_per_token": round(1e3 * (clock() - cpu) / tokens, 3),
                    "client_cpu_ms_per_token": round(1e3 * client_cpu / tokens, 3)}))
        recompiled = llm.engine.compiled_count() - compiled
    for record in records:
        record["recompiled"] = recompiled
    return records


def peer_pass(peer: VllmServer, clients: ProcessPoolExecutor, items: list[Item]) -> tuple[list[Trace], int, float]:
    """One pass of the stream against vLLM's server, running only for it."""
    peer.resume()
    try:
        traces, failed, client_cpu = clients.submit(http_pass, peer.url, items).result()
    finally:
        peer.pause()
    if not traces:
        raise RuntimeError(f"vLLM's server answered none of {len(items)} requests (log: {peer.log})")
    return traces, failed, client_cpu


def compare(label: str, h: dict, s: dict) -> dict:
    """Record `h` against `s`: the throughput ratio, the latency and CPU differences in ms."""
    return {"system": label, "output_tok_s": round(h["output_tok_s"] / s["output_tok_s"], 3),
            **{k: round(h[k] - s[k], 3) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                                  "server_cpu_ms_per_token", "client_cpu_ms_per_token")}}


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
    parser.add_argument("--peer-server", default="", choices=["", "vllm"],
                        help="also serve the same stream from vLLM's OpenAI server (its own venv: --vllm-python) on "
                             "127.0.0.1, same model, dtype and slots")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the interpreter of vLLM's venv (benchmarks/README.md); default: this one")
    parser.add_argument("--http", default=",".join(available_stacks()),
                        help="uvicorn HTTP stacks to compare: h11 (asyncio) and/or httptools (uvloop); default every "
                             "installed one")
    args = parser.parse_args()
    stacks = [name for name in args.http.split(",") if name]
    load_start = os.getloadavg()
    config, prompts, outputs, n, rate = stream_settings(args)
    peer_info = {}
    with pj.LLM(args.model, config, warmup=True) as llm, contextlib.ExitStack() as stack:  # compiled first
        items = workload(n, rate, prompts, outputs, llm.model.config.vocab_size, args.seed)
        peer = None
        if args.peer_server == "vllm":  # started after our warm-up, stopped whenever it is not measured
            dtype = np.dtype(llm.model.dtype).name
            peer = stack.enter_context(VllmServer(args.vllm_python, args.model, dtype, config.max_seq_len,
                                                  args.slots, args.seed))
            peer_info = {"startup_s": round(peer.startup_s, 1), "dtype": dtype, "command": peer.cmd}
        records = run(llm, items, args.repeats, stacks, peer)
    systems = ["scheduler"] + [f"http[{name}]" for name in stacks] + (["vllm"] if peer_info else [])
    best = {system: median_pass(records, system) for system in systems}
    s = best["scheduler"]
    overhead = [compare(f"{system} / scheduler", h, s) for system, h in best.items()
                if system not in ("scheduler", "vllm")]
    if "vllm" in best:  # vLLM's server beside ours, through the same clients
        ours = f"http[{stacks[-1]}]" if stacks else "scheduler"
        overhead.append(compare(f"vllm / {ours}", best["vllm"], best[ours]))
    info = machine("platform", "python", "jax", "device", "cpus", model=args.model, rate=rate, requests=n,
                   slots=args.slots, repeats=args.repeats, seed=args.seed, loadavg_start=load_start,
                   loadavg_end=os.getloadavg(), stacks={name: STACKS[name] for name in stacks},
                   versions=versions("uvicorn", "httptools", "uvloop"), peer_server=peer_info or None)
    write_json(args.json, {"machine": info, "records": records, "median": best, "overhead": overhead})
    for r in records:
        print(json.dumps(r))
    print("(overhead rows: throughput ratio, latency differences in ms)")
    print(table([*best.values(), *overhead], COLUMNS))


if __name__ == "__main__":
    main()
