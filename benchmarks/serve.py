"""Serve a Poisson stream of requests with the engine + FCFS scheduler, and with transformers' generate batched
naively (static left-padded batches of whatever is pending), on the same random-weight checkpoint.

Reports output throughput, time to first token and inter-token latency (p50/p99) for both, then the share of the
scheduler loop's wall time spent on the host at 8 concurrent requests: everything but the time the loop sat
blocked on device results. Prints a markdown table last; `--json PATH` writes every number. Never asserts on time.

    PYTHONPATH=. python benchmarks/serve.py [--quick] [--json out/serve.json] [--rate 8] [--requests 48]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pocketjax as pj  # noqa: E402
from pocketjax.config import EngineConfig  # noqa: E402
from pocketjax.engine import Engine  # noqa: E402
from pocketjax.sampling import SamplingParams  # noqa: E402
from pocketjax.scheduler import Scheduler  # noqa: E402

# A bigger sibling of the tests' tiny Qwen3 so the device step, not Python, dominates a step (it still runs on CPU).
MODEL = dict(quick=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32, vocab_size=4096),
             full=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, vocab_size=16384))
# (prompt lengths, output lengths, max_seq_len, prefill_chunk, min_prefill_bucket): --quick compiles one attention
# length and one chunk width, because on 2 CPU cores each compiled shape costs seconds.
SHAPES = dict(quick=((4, 48), (4, 24), 128, 32, 32), full=((16, 192), (16, 96), 512, 64, 16))


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
    """A random-weight transformers Qwen3 checkpoint, built by the tests' own builder."""
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


# ---- pocketjax -------------------------------------------------------------------------------------------------
class StepClock:
    """Wraps one engine's and one scheduler's methods (on the instances) to split the loop's time three ways:
    inside scheduler.step, inside the engine's device calls, and blocked on device results."""

    def __init__(self, sched: Scheduler):
        self.step_s = self.engine_s = self.blocked_s = 0.0
        self.steps = 0
        engine = sched.engine
        sched.step = self.timed(sched.step, "step_s")
        engine.batch_prefill = self.timed(engine.batch_prefill, "engine_s")
        engine.batch_decode_step = self.timed(engine.batch_decode_step, "engine_s")
        deliver = engine._deliver

        def blocked_deliver(rows, out, results):
            t0 = time.perf_counter()
            jax.block_until_ready(out)
            self.blocked_s += time.perf_counter() - t0
            return deliver(rows, out, results)

        engine._deliver = blocked_deliver

    def timed(self, fn, attr: str):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - t0)
                self.steps += attr == "step_s"
        return run

    def reset(self) -> None:
        self.step_s = self.engine_s = self.blocked_s = 0.0
        self.steps = 0

    def report(self) -> dict:
        busy = max(self.step_s, 1e-9)
        return {"steps": self.steps, "step_ms": round(1e3 * busy / max(self.steps, 1), 3),
                "scheduler_host_share": round((busy - self.engine_s) / busy, 4),
                "host_share": round((busy - self.blocked_s) / busy, 4)}


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
    """Compile every (rows, chunk width) bucket a stream can hit, stepping by hand."""
    cfg = sched.engine.config
    rows = 1
    while rows <= cfg.max_batch_size:
        width = cfg.min_prefill_bucket
        while width <= cfg.prefill_chunk:
            for i in range(rows):
                sched.submit([i + 1] + [7] * (width - 1), SamplingParams(max_tokens=2, temperature=0.0,
                                                                          ignore_eos=True))
            while sched.step():
                pass
            width *= 2
        rows *= 2


def run_pocketjax(model, items: list[Item], config: EngineConfig, concurrent_tokens: int) -> tuple[dict, dict]:
    """The stream, then `slots` requests decoding together (the host-share figure); compiles before measuring."""
    engine = Engine(model, config=config)
    sched = Scheduler(engine)
    clock = StepClock(sched)
    warm(sched)
    with sched:
        asyncio.run(stream(sched, items))  # a full unmeasured pass: any shape the sweep missed compiles here
        compiled = engine.compiled_count()
        clock.reset()
        traces = asyncio.run(stream(sched, items))
        record = summarize("pocketjax", traces, {**clock.report(), "recompiled": engine.compiled_count() - compiled})
        closed = [Item(0.0, item.prompt, concurrent_tokens) for item in items[:config.max_batch_size]]
        clock.reset()
        traces = asyncio.run(stream(sched, closed))
        concurrent = summarize(f"pocketjax x{config.max_batch_size}", traces, clock.report())
    return record, concurrent


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
def table(records: list[dict]) -> str:
    cols = ["system", "requests", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "host_share", "scheduler_host_share"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in records]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF checkpoint folder (default: a random-weight Qwen3 built here)")
    parser.add_argument("--quick", action="store_true", help="small model and stream: ~2 minutes on 2 CPU cores")
    parser.add_argument("--requests", type=int, help="requests in the stream (default 48, quick 24)")
    parser.add_argument("--rate", type=float, default=None, help="mean arrivals per second (default 8, quick 6)")
    parser.add_argument("--slots", type=int, default=8, help="engine slots = transformers batch = host-share concurrency")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", default="transformers", help="comma list; empty to skip transformers")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    prompts, outputs, max_seq_len, chunk, min_chunk = SHAPES[size]
    config = EngineConfig(max_batch_size=args.slots, max_seq_len=max_seq_len, prefill_chunk=chunk,
                          min_prefill_bucket=min_chunk)
    n = args.requests or (24 if args.quick else 48)
    rate = args.rate if args.rate is not None else (6.0 if args.quick else 8.0)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else build_checkpoint(Path(tmp), size)
        model = pj.load_model(folder)
        items = workload(n, rate, prompts, outputs, model.config.vocab_size, args.seed)
        record, concurrent = run_pocketjax(model, items, config, outputs[1])
        records = [record, concurrent]
        if "transformers" in args.peers.split(","):
            records.append(run_transformers(folder, items, args.slots, args.torch_threads))

    machine = {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
               "device": str(jax.devices()[0]), "model": args.model or f"random qwen3 {MODEL[size]}",
               "rate": rate, "requests": n, "slots": args.slots, "seed": args.seed}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine, "records": records}, indent=2))
    for r in records:
        print(json.dumps(r))
    print(table(records))


if __name__ == "__main__":
    main()
