"""Serve a Poisson stream of requests with the engine + FCFS scheduler, and with transformers' generate batched
naively (static left-padded batches of whatever is pending), on the same random-weight checkpoint.

Reports output throughput, time to first token and inter-token latency (p50/p99) for both, then the host share of
the scheduler loop at `--slots` (8) concurrent requests, pipelined and not:

    D = seconds per decode step of the engine's jitted forward + sampler alone, chained back to back on device with
        no host read (one block at the end): the step time if the host cost nothing;
    W = wall seconds per step of the background scheduler loop (admission checks, dispatch, the token read, handle
        delivery, streaming to asyncio readers) over the steps where all requests decode together;
    host_share = (W - D) / W, the part of the loop's wall time the device could have been busy but was not: the
        median over runs each paired with a D run just before it; host_share_best uses the fastest W and D instead
        (load from other processes only adds time).

Prints a markdown table last; `--json PATH` writes every number. Never asserts on time.

    PYTHONPATH=. python benchmarks/serve.py [--quick] [--json out/serve.json] [--rate 8] [--requests 48]
    PYTHONPATH=. python benchmarks/serve.py --model qwen3-0.6b --no-stream   # host share alone, Qwen3-0.6B shapes
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pocketjax as pj  # noqa: E402
from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table, model_folder,  # noqa: E402
                               parse_ints, write_json)
from pocketjax.engine.config import EngineConfig  # noqa: E402
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.engine.request import RequestStatus  # noqa: E402
from pocketjax.engine.plan import decode_at  # noqa: E402
from pocketjax.engine.sampling_params import SamplingParams  # noqa: E402
from pocketjax.serve.scheduler import Scheduler  # noqa: E402

# A bigger sibling of the tests' tiny Qwen3 so the device step, not Python, dominates a step (it still runs on CPU).
MODEL = dict(quick=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32, vocab_size=4096),
             full=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, vocab_size=16384))
# (prompt lengths, output lengths, max_seq_len, prefill_chunk, min_prefill_bucket): --quick compiles one attention
# length and one chunk width, because on 2 CPU cores each compiled shape costs seconds.
SHAPES = dict(quick=((4, 48), (4, 24), 128, 32, 32), full=((16, 192), (16, 96), 512, 64, 16))


def stream_settings(args) -> tuple[EngineConfig, tuple, tuple, int, float]:
    """What --quick, --slots, --requests and --rate make of a stream (here and in bench_serve.py): the engine config,
    the prompt and output length ranges, the number of requests and their arrival rate."""
    prompts, outputs, max_seq_len, chunk, min_chunk = SHAPES["quick" if args.quick else "full"]
    config = EngineConfig(max_batch_size=args.slots, max_seq_len=max_seq_len, prefill_chunk=chunk,
                          min_prefill_bucket=min_chunk)
    n = args.requests or (24 if args.quick else 48)
    rate = args.rate if args.rate is not None else (6.0 if args.quick else 8.0)
    return config, prompts, outputs, n, rate


@dataclass
class Item:
    arrival: float  # seconds after the start of the stream
    prompt: list[int]
    max_tokens: int


@dataclass
class Trace:
    """One request as a client saw it: when it was submitted and when each token arrived (perf_counter s)."""

    submitted: float
    token_times: list[float] = field(default_factory=list)


def build_checkpoint(folder: Path, size: str) -> Path:
    """A random-weight Qwen3 checkpoint in transformers' layout, built by the tests' own builder (numpy, no torch)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_hf_checkpoint  # noqa: PLC0415 - after jax: its env defaults no longer apply

    return build_hf_checkpoint(folder, "qwen3_gqa4_headdim", **MODEL[size])


def workload(n: int, rate: float, prompt_range, output_range, vocab: int, seed: int) -> list[Item]:
    """n requests with Poisson arrivals at `rate` per second and uniform random prompt/output lengths."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    return [Item(float(t), [int(x) for x in rng.integers(0, vocab, rng.integers(*prompt_range, endpoint=True))],
                 int(rng.integers(*output_range, endpoint=True))) for t in arrivals]


def summarize(system: str, traces: list[Trace], extra: dict | None = None) -> dict:
    """Throughput over the whole stream, TTFT per request and ITL over every consecutive token pair (ms)."""
    start = min(t.submitted for t in traces)
    end = max(t.token_times[-1] for t in traces)
    tokens = sum(len(t.token_times) for t in traces)
    ttft = [1e3 * (t.token_times[0] - t.submitted) for t in traces]
    itl = [1e3 * d for t in traces for d in np.diff(t.token_times)]
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 2) if xs else None  # noqa: E731
    return {"system": system, "requests": len(traces), "output_tokens": tokens, "wall_s": round(end - start, 3),
            "output_tok_s": round(tokens / (end - start), 1), "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), **(extra or {})}


# ---- pocketjax ----------------------------------------------------------------------------------------------
class LoopClock:
    """Wraps a scheduler's step (on the instance) to time the loop: the wall time between consecutive step ends,
    kept for the steps that began with `n` requests all decoding, and the tokens each such step handed them (n, or
    up to n * decode_steps)."""

    def __init__(self, sched: Scheduler, n: int):
        self.intervals: list[float] = []
        self.tokens: list[int] = []
        self.last: float | None = None
        self._rows = n
        step = sched.step

        def timed() -> bool:
            running = list(sched.running)
            full = len(running) == n and all(h.request.status is RequestStatus.DECODING for h in running)
            before = sum(len(h.request.generated_tokens) for h in running)
            try:
                return step()
            finally:
                now = time.perf_counter()
                if full and self.last is not None:
                    self.intervals.append(now - self.last)
                    self.tokens.append(sum(len(h.request.generated_tokens) for h in running) - before)
                self.last = now

        sched.step = timed

    def step_s(self) -> float:
        """Wall seconds per token of every row (a step's time when each step hands every row one token)."""
        n = len(self.tokens) and sum(self.tokens) / len(self.tokens) / max(1, self._rows)
        return float(np.sum(self.intervals) / (n * len(self.intervals))) if self.intervals and n else float("nan")


def device_step_s(scratch: Engine, positions: list[int], steps: int) -> float:
    """Seconds per decode step when the device never waits on the host: the engine's jitted forward and sampler over
    len(positions) rows, `steps` times back to back, each fed the previous step's tokens on device, one block at the
    end. Rows start at `positions` (where the measured loop's requests are), so attention reads the same lengths.
    `scratch` is an engine of the same configuration whose cache may be overwritten (same compiled executables)."""
    n = len(positions)
    zeros = jnp.zeros(n, jnp.int32)  # rows 0..n-1 continue from `positions`: the slots' state feeds each step
    device = scratch.device
    device.state = device.state.advance(jnp.arange(n), zeros + 1, jnp.asarray(positions, jnp.int32), zeros)

    n_steps = scratch.config.decode_steps  # tokens per dispatch, as the loop runs them with nothing waiting

    def step(k: int):  # the plan the engine builds for these rows, k positions on: one program per dispatch
        plan, sample = decode_at(scratch.rules, [p + k * n_steps for p in positions], n_steps)
        return device.run("decode_sample", plan, sample)[0].tokens

    jax.block_until_ready(step(0)), jax.block_until_ready(step(1))  # warm
    dispatches = max(1, steps // n_steps)
    t0 = time.perf_counter()
    for k in range(2, 2 + dispatches):
        tokens = step(k)
    jax.block_until_ready(tokens)
    return (time.perf_counter() - t0) / (dispatches * n_steps)  # per token of every row


async def stream(sched: Scheduler, items: list[Item]) -> list[Trace]:
    """Submit each item at its arrival time and record when each of its tokens reaches the client."""
    t0 = time.perf_counter()

    async def one(item: Item) -> Trace:
        await asyncio.sleep(max(0.0, t0 + item.arrival - time.perf_counter()))
        trace = Trace(time.perf_counter())
        handle = sched.submit(item.prompt, SamplingParams(max_tokens=item.max_tokens, temperature=0.0,
                                                          ignore_eos=True))
        async for _ in handle:
            trace.token_times.append(time.perf_counter())
        return trace

    return list(await asyncio.gather(*(one(item) for item in items)))


def warm(sched: Scheduler) -> None:
    """Compile every (rows, chunk width) bucket a stream can hit, stepping by hand; three tokens per request, so
    each batch bucket also runs a decode step fed on device."""
    cfg = sched.engine.config
    rows = 1
    while rows <= cfg.max_batch_size:
        width = cfg.min_prefill_bucket
        while width <= cfg.prefill_chunk:
            for i in range(rows):
                sched.submit([i + 1] + [7] * (width - 1), SamplingParams(max_tokens=3, temperature=0.0,
                                                                          ignore_eos=True))
            while sched.step():
                pass
            width *= 2
        rows *= 2


def run_pocketjax(model, items: list[Item], config: EngineConfig, concurrent_tokens: int, with_stream: bool,
                  repeats: int) -> list[dict]:
    """The stream (pipelined loop), then `slots` requests decoding together through the loop, pipelined and not, each
    run paired with a device-only run just before it, so load from other processes hits both alike; `repeats` pairs
    per variant, interleaved. Each record keeps the median W, D and host share over its pairs."""
    engine = Engine(model, config=config)
    steps = f" N={config.decode_steps}" if config.decode_steps > 1 else ""  # decode steps per dispatch
    records = []
    if with_stream:
        warm(Scheduler(engine))
        with Scheduler(engine) as sched:
            asyncio.run(stream(sched, items))  # a full unmeasured pass: any shape the sweep missed compiles here
            compiled = engine.compiled_count()
            traces = asyncio.run(stream(sched, items))
        records.append(summarize(f"pocketjax{steps}", traces, {"recompiled": engine.compiled_count() - compiled}))
    prompts = [item.prompt for item in items[:config.max_batch_size]]
    closed = [Item(0.0, prompt, concurrent_tokens) for prompt in prompts]
    scratch = Engine(model, config=config)
    for pipeline in (True, False):  # compiles what this mix still needs (the steps fed on device, say)
        loop_run(engine, closed, pipeline)
    compiled = engine.compiled_count()
    pairs: dict[bool, list] = {True: [], False: []}
    for _ in range(repeats):
        for pipeline, runs in pairs.items():
            device_s = device_step_s(scratch, [len(p) + 2 for p in prompts], min(concurrent_tokens, 32))
            runs.append((device_s, *loop_run(engine, closed, pipeline)))
    for pipeline, runs in pairs.items():
        shares = [(step_s - device_s) / step_s for device_s, step_s, _, _ in runs]
        _, _, full_steps, traces = sorted(runs, key=lambda run: run[1])[len(runs) // 2]
        name = f"pocketjax{steps} x{len(prompts)} {'pipelined' if pipeline else 'unpipelined'}"
        step_s, device_s = float(np.median([r[1] for r in runs])), float(np.median([r[0] for r in runs]))
        records.append(summarize(name, traces, {
            "decode_tok_s": round(len(prompts) / step_s, 1), "step_ms": round(1e3 * step_s, 3),
            "device_step_ms": round(1e3 * device_s, 3), "host_share": round(float(np.median(shares)), 4),
            "host_share_best": round(1 - min(r[0] for r in runs) / min(r[1] for r in runs), 4),
            "host_share_runs": [round(x, 4) for x in shares], "step_ms_runs": [round(1e3 * r[1], 3) for r in runs],
            "device_step_ms_runs": [round(1e3 * r[0], 3) for r in runs], "full_steps": full_steps,
            "recompiled": engine.compiled_count() - compiled}))
    return records


def loop_run(engine: Engine, closed: list[Item], pipeline: bool) -> tuple[float, int, list[Trace]]:
    """The items at once through a background loop, streamed to asyncio readers: (W = mean wall seconds per step
    while all of them decode together, how many such steps, the client traces)."""
    sched = Scheduler(engine, pipeline=pipeline)
    clock = LoopClock(sched, len(closed))
    with sched:
        traces = asyncio.run(stream(sched, closed))
    return clock.step_s(), len(clock.intervals), traces


# ---- transformers ----------------------------------------------------------------------------------------------
class StepTimes:
    """A generate() streamer that only records when each step's tokens come out (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(folder: Path, items: list[Item], batch: int, threads: int) -> dict:
    """Static batching: take up to `batch` requests that have arrived, left-pad, generate the longest output."""
    import torch
    import transformers

    if threads:  # torch's OpenMP workers spin: on an oversubscribed CPU two of them ran 8x slower than one
        torch.set_num_threads(threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def generate(group: list[Item]) -> list[float]:
        width = max(len(i.prompt) for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, item in enumerate(group):
            ids[row, width - len(item.prompt):] = torch.tensor(item.prompt)
            mask[row, width - len(item.prompt):] = 1
        steps = StepTimes()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(i.max_tokens for i in group), do_sample=False,
                        eos_token_id=None, pad_token_id=0, streamer=steps)
        return steps.times[1:]

    generate(items[:2])  # warm-up
    pending, traces = deque(items), []
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        if pending[0].arrival > now:
            time.sleep(pending[0].arrival - now)
            continue
        group = []
        while pending and pending[0].arrival <= now and len(group) < batch:
            group.append(pending.popleft())
        times = generate(group)
        traces += [Trace(t0 + item.arrival, times[:item.max_tokens]) for item in group]
    return summarize("transformers", traces, {"torch_threads": torch.get_num_threads()})


# ---- main ------------------------------------------------------------------------------------------------------
COLUMNS = ["system", "requests", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "decode_tok_s", "step_ms", "device_step_ms", "host_share", "host_share_best"]


def table(records: list[dict], cols: list[str] = COLUMNS) -> str:
    return markdown_table(cols, ([r.get(c, "") for c in cols] for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF checkpoint folder or a preset of benchmarks/presets.py (built once into "
                                        "--cache-dir); default: a random-weight Qwen3 built here")
    add_options(parser, cache_dir=DEFAULT_CACHE_DIR)
    parser.add_argument("--no-stream", action="store_true", help="skip the Poisson stream (and transformers): only "
                                                                 "the host-share measurement")
    parser.add_argument("--quick", action="store_true", help="small model and stream: ~2 minutes on 2 CPU cores")
    parser.add_argument("--requests", type=int, help="requests in the stream (default 48, quick 24)")
    parser.add_argument("--rate", type=float, default=None, help="mean arrivals per second (default 8, quick 6)")
    parser.add_argument("--slots", type=int, default=8, help="engine slots = transformers batch = host-share concurrency")
    parser.add_argument("--repeats", type=int, help="host-share runs per variant, interleaved (default 3, quick 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-steps", default="1", help="comma list of EngineConfig.decode_steps, each run in turn")
    parser.add_argument("--peers", default="transformers", help="comma list; empty to skip transformers")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    load_start = os.getloadavg()
    size = "quick" if args.quick else "full"
    repeats = args.repeats or (5 if args.quick else 3)
    config, prompts, outputs, n, rate = stream_settings(args)

    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, args.cache_dir) if args.model else build_checkpoint(Path(tmp), size)
        model = pj.load_model(folder)
        items = workload(n, rate, prompts, outputs, model.config.vocab_size, args.seed)
        records = [r for n in parse_ints(args.decode_steps) for r in run_pocketjax(
            model, items, replace(config, decode_steps=n), outputs[1], not args.no_stream, repeats)]
        if "transformers" in args.peers.split(",") and not args.no_stream:
            records.append(run_transformers(folder, items, args.slots, args.torch_threads))

    info = machine("platform", "python", "jax", "device", model=args.model or f"random qwen3 {MODEL[size]}",
                   rate=rate, requests=n, slots=args.slots, seed=args.seed, repeats=repeats,
                   loadavg_start=load_start, loadavg_end=os.getloadavg())
    write_json(args.json, {"machine": info, "records": records})
    for r in records:
        print(json.dumps(r))
    print(table(records))


if __name__ == "__main__":
    main()
