"""Startup: a fresh process's time to its first token with the persistent compile cache off, cold and warm, and
what `warmup()` compiles (shapes, seconds) cold and from the cache. Prints a markdown table last.

    python benchmarks/startup.py [--model qwen3-tiny|qwen3-0.6b|PATH] [--max-seq-len N] [--max-batch-size N]
                                 [--json out/startup.json] [--no-warmup] [--scan-layers auto|on|off]
    python benchmarks/startup.py --serve[="--no-warmup --model PATH ..."] [--json out/serve-startup.json]

`--serve` times what a new user's `pocketjax serve` does instead (issue 67: listen at once, warm up beside): a fresh
server process on an empty compile cache (the embedded model unless its arguments name another), /health polled
every 0.25 s: when it first answers (503 "warming" while it warms up) and when it is ready (200).

Each row is its own Python process (`--child`): import pocketjax, load the model, build the Engine, (warm up,)
prefill one prompt and read its first token. "from launch" is the parent's wall clock from starting the process to
that token; the other columns are the child's own phases. One unrecorded process runs first: on 2 CPU cores the
first one paid ~10 s more (disk, and the OS handing out the KV cache's memory the first time). The cache rows
share one fresh folder: "cold" writes it, "warm" reads it; the warm-up rows do the same with a second folder.
Warm-up runs every shape for real: on CPU that is part of its time (8.5 of ~20 s for Qwen3-0.6B shapes, 2 slots x
256 positions, from a warm cache, on 2 busy cores).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
# Nothing that imports jax or pocketjax at the top: a child process times those imports itself.
from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table, model_folder,  # noqa: E402
                               usable_cores, write_json)

VARIABLE = "POCKETJAX_COMPILE_CACHE_DIR"
RUNS = (  # name, compile cache folder ("cache" or "warmup": a fresh folder shared by the pair), warm up
    ("no cache", "off", False), ("cold cache", "cache", False), ("warm cache", "cache", False),
    ("warm-up, cold cache", "warmup", True), ("warm-up, warm cache", "warmup", True),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, model="qwen3-tiny", dtype="float32")
    p.add_argument("--max-seq-len", type=int, default=2048, help="engine max_seq_len (the engine's default)")
    p.add_argument("--max-batch-size", type=int, default=8, help="engine slots (the engine's default)")
    add_options(p, prompt_len=32)
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the two warm-up rows")
    p.add_argument("--scan-layers", default="auto", choices=["auto", "on", "off"], help="load_model's scan_layers")
    add_options(p, cache_dir=DEFAULT_CACHE_DIR, json=None)
    p.add_argument("--serve", nargs="?", const="", default=None, metavar="ARGS",
                   help="time `pocketjax serve ARGS` to its first /health answer and to ready, on an empty cache")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one measured process: its compile cache
    p.add_argument("--child-warmup", action="store_true", help=argparse.SUPPRESS)
    return p


def child(args: argparse.Namespace) -> dict:
    """One fresh process's phases, in seconds, up to its first token."""
    t0 = time.perf_counter()
    import numpy as np

    import pocketjax as pj
    from pocketjax.engine.request import BatchedRequest

    t1 = time.perf_counter()
    model = pj.load_model(args.model, dtype=args.dtype,
                          scan_layers={"on": True, "off": False}.get(args.scan_layers, args.scan_layers))
    t2 = time.perf_counter()
    engine = pj.Engine(model, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                       compile_cache_dir=args.child)
    t3 = time.perf_counter()
    shapes = engine.warmup(progress=False) if args.child_warmup else 0
    t4 = time.perf_counter()
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_len).tolist()
    req = BatchedRequest(0, prompt, pj.SamplingParams(max_tokens=1, temperature=0.0))
    engine.allocate_slot(req)
    token = engine.batch_prefill([req])[0]
    t5 = time.perf_counter()
    return {"first_token_wall": time.time(), "token": token, "import_s": t1 - t0, "load_s": t2 - t1,
            "engine_s": t3 - t2, "warmup_shapes": shapes, "warmup_s": t4 - t3, "first_token_s": t5 - t4,
            "compiled": engine.compiled_count()}


def measure(args: SimpleNamespace, folder: Path, cache: str, warm_up: bool) -> dict:
    """Run one child process; its phases, its time to first token from launch and the cache folder's size after."""
    cmd = [sys.executable, __file__, "--child", cache, "--model", str(folder), "--dtype", args.dtype,
           "--max-seq-len", str(args.max_seq_len), "--max-batch-size", str(args.max_batch_size),
           "--prompt-len", str(args.prompt_len), "--scan-layers", args.scan_layers] + (
               ["--child-warmup"] if warm_up else [])
    env = {k: v for k, v in os.environ.items() if k != VARIABLE and not k.startswith("JAX_COMPILATION_CACHE")}
    launched = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child failed ({' '.join(cmd)}):\n{done.stderr}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["from_launch_s"] = record.pop("first_token_wall") - launched
    files = [p for p in Path(cache).rglob("*") if p.is_file()] if cache != "off" else []
    record.update(cache_entries=len(files), cache_bytes=sum(p.stat().st_size for p in files))
    return record


def serve_times(serve_args: str, limit_s: float = 600.0) -> dict:
    """A fresh `pocketjax serve` on an empty compile cache: seconds from launch to its first /health answer (and
    that answer's status) and to its first 200."""
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as sock:  # a free port on the loopback
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cache = tempfile.mkdtemp(prefix="pocketjax-serve-cache-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")} | {VARIABLE: cache}
    cmd = [sys.executable, "-m", "pocketjax", "serve", "--host", "127.0.0.1", "--port", str(port),
           *serve_args.split()]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first, status = None, None
    try:
        while status != 200:
            if server.poll() is not None or time.perf_counter() - t0 > limit_s:
                raise SystemExit(f"{' '.join(cmd)} never became ready:\n{server.communicate()[1][-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    status = answer.status
            except urllib.error.HTTPError as e:
                status = e.code
            except OSError:
                status = None
            if status is not None and first is None:
                first = (time.perf_counter() - t0, status)
            time.sleep(0.25)
        return {"run": f"pocketjax serve {serve_args}".strip(), "first_answer_s": first[0], "first_status": first[1],
                "ready_s": time.perf_counter() - t0}
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(cache, ignore_errors=True)


def table(records: list[dict]) -> str:
    return markdown_table(["run", "from launch s", "import s", "load s", "engine s", "warm-up shapes", "warm-up s",
                           "first token s", "cache entries", "cache MiB"], (
        [r["run"], f"{r['from_launch_s']:.2f}", f"{r['import_s']:.2f}", f"{r['load_s']:.2f}", f"{r['engine_s']:.2f}",
         r["warmup_shapes"], f"{r['warmup_s']:.2f}", f"{r['first_token_s']:.2f}", r["cache_entries"],
         f"{r['cache_bytes'] / 2**20:.1f}"] for r in records))


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args)))
        return {}
    if args.serve is not None:
        record = serve_times(args.serve)
        out = {"machine": machine("jax", "backend", "cores", "loadavg", cores=usable_cores()), "records": [record]}
        write_json(args.json, out)
        print(markdown_table(["run", "first /health answer s", "its status", "ready (200) s"], [
            [record["run"], f"{record['first_answer_s']:.1f}", record["first_status"], f"{record['ready_s']:.1f}"]]))
        return out
    folder = model_folder(args.model, args.cache_dir, args.dtype)
    measure(args, folder, "off", False)  # unrecorded: the first process alone pays the disk and the OS's memory
    work = Path(tempfile.mkdtemp(prefix="pocketjax-startup-"))
    t0 = time.perf_counter()
    records = []
    try:
        for name, cache, warm_up in RUNS:
            if warm_up and not args.warmup:
                continue
            record = measure(args, folder, cache if cache == "off" else str(work / cache), warm_up)
            records.append({"run": name, **record})
            print(f"{name}: {record['from_launch_s']:.2f} s to the first token", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"machine": machine("jax", "backend", "cores", "loadavg", cores=usable_cores(),
                              seconds=time.perf_counter() - t0),
           "settings": {k: v for k, v in vars(args).items() if not k.startswith(("json", "child"))}, "records": records}
    write_json(args.json, out)
    print(table(records))
    return out


if __name__ == "__main__":
    main()
