"""bench_engine.py's peers (transformers, llama.cpp, vLLM), each run in a process of its own, so that a peer's crash
(llama-cpp-python's AMX repack segfaults in some VMs), hang or memory costs only its own rows, and a peer can run
under an interpreter of its own (vLLM's CPU build pins its own torch):

    python -m benchmarks.peers.<name>_peer --json-in SPEC.json --json-out OUT.json

SPEC: {"checkpoint": HF folder, "dtype": the checkpoint's dtype, "kind": what the peer runs (a dtype, or a GGUF
encoding for llama.cpp), "concurrency": [1, 2, ...], "prompt_len", "gen_len", "repeats", "threads", "seed"}.
OUT: {"records": [...]} in bench_engine's record format, rewritten after every concurrency (a crash keeps the rows
before it). `benchmarks.peers.launch` starts them and turns a failure into a "skipped" row.

This package imports the standard library and numpy only: vLLM's venv has neither jax nor pocketjax.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

Emit = Callable[[list], None]


class Skip(Exception):
    """The peer cannot run here (a package missing, no GGUF): its message becomes the row's "skipped" reason."""


class Prompts:
    """Random prompts whose first token differs across the whole run, so no prefix cache ever hits."""

    def __init__(self, vocab: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.count = 0

    def make(self, n: int, length: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            tokens = self.rng.integers(2, self.vocab, size=length).tolist()
            tokens[0] = 2 + self.count % (self.vocab - 2)
            self.count += 1
            out.append(tokens)
        return out


def vocab_size(checkpoint: str | Path) -> int:
    """The checkpoint's vocabulary (its config.json): prompts are token ids, no tokenizer needed."""
    return int(json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"])


class PeakRss:
    """The peak resident memory of this process and its children (vLLM's engine core is one): their RSS summed every
    0.1 s on a thread, never below this process's own high-water mark (VmHWM; not ru_maxrss, which keeps the
    launching process's peak across exec)."""

    def __init__(self, interval: float = 0.1):
        self.peak = 0
        self.interval = interval
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def _own_peak() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    @staticmethod
    def _tree_bytes() -> int:
        try:
            import psutil
        except ImportError:
            return 0
        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:  # a child that just ended
                pass
        return total

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._tree_bytes())
            time.sleep(self.interval)

    def mb(self) -> float:
        return round(max(self.peak, self._tree_bytes(), self._own_peak()) / 2**20, 1)


RSS: PeakRss | None = None


def record(system: str, spec: SimpleNamespace, c: int, prefills: list[float], decodes: list[float],
           **extra) -> dict:
    """One concurrency's record, as bench_engine writes pocketjax's: medians over the timed runs; decode over the
    gen_len - 1 tokens after the first (which the prefill makes)."""
    n_steps = spec.gen_len - 1
    rec = {"system": system, "dtype": spec.dtype, "concurrency": c,
           "prefill_tok_s": c * spec.prompt_len / float(np.median(prefills)),
           "decode_tok_s": c * n_steps / float(np.median(decodes)),
           "decode_step_ms": 1e3 * float(np.median(decodes)) / n_steps,
           "prefill_s_runs": prefills, "decode_s_runs": decodes,
           "peak_rss_mb": RSS.mb() if RSS else None, **extra}
    print(f"{system} {spec.kind} c={c}: prefill {rec['prefill_tok_s']:.1f} tok/s, decode {rec['decode_tok_s']:.2f} "
          f"tok/s ({rec['decode_step_ms']:.1f} ms/step, peak RSS {rec['peak_rss_mb']} MB)", flush=True)
    return rec


def main(run: Callable[[SimpleNamespace, Emit], None], system: str, argv: list[str] | None = None,
         hard_exit: bool = False) -> None:
    """A peer module's entry point: read the spec, run `run(spec, emit)` (emit(records) after each concurrency
    writes everything so far), and write the output; a Skip writes a "skipped" row and exits 0. `hard_exit` ends
    the process without its exit hooks once the records are written (vLLM's shutdown can hang)."""
    global RSS
    p = argparse.ArgumentParser(description=f"bench_engine's {system} peer, in its own process")
    p.add_argument("--json-in", required=True, help="the spec (see benchmarks/peers/__init__.py)")
    p.add_argument("--json-out", required=True, help="where the records go")
    args = p.parse_args(argv)
    spec = SimpleNamespace(**json.loads(Path(args.json_in).read_text()))
    spec.kind = getattr(spec, "kind", None) or spec.dtype
    records: list[dict] = []

    def emit(rows: list) -> None:
        records.extend(rows)
        Path(args.json_out).write_text(json.dumps({"records": records}, indent=1, default=str))

    RSS = PeakRss()
    emit([])
    code = 0
    try:
        run(spec, emit)
    except Skip as e:
        print(f"{system} {spec.kind}: skipped: {e}", flush=True)
        emit([{"system": system, "dtype": spec.kind, "skipped": str(e)}])
    except Exception:
        if not hard_exit:
            raise
        traceback.print_exc()  # its last line becomes the launcher's "skipped" reason
        code = 1
    if hard_exit:  # its children (vLLM's engine core and worker) first: nothing would end them after os._exit
        _kill_children()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill_children() -> None:
    try:
        import psutil
    except ImportError:
        return
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
