"""Run a peer in its own process and read its rows back. A peer that fails, crashes or runs past its time costs
its own rows only: what it wrote before stays, and a row {"system", "dtype", "skipped": why} (the exit code or
signal, and its last stderr line) says what is missing, in the JSON and in the markdown table.

Imported by bench_engine.py and bench_quant.py; imports nothing heavy.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]  # the repository root: `-m benchmarks.peers.<name>` resolves from it
MODULES = {"transformers": "benchmarks.peers.transformers_peer", "llamacpp": "benchmarks.peers.llamacpp_peer",
           "vllm": "benchmarks.peers.vllm_peer"}


def skipped(system: str, dtype: str | None, why: str) -> dict:
    return {"system": system, "dtype": dtype, "skipped": why}


def _relay(stream: IO[str], to: IO[str], tail: deque | None = None) -> None:
    """Copy a child's stream line by line to ours as it comes (keeping the last lines in `tail`)."""
    for line in stream:
        to.write(line)
        to.flush()
        if tail is not None and line.strip():
            tail.append(line.strip())


def _reason(rc: int | None, timeout: float, tail: deque) -> str:
    if rc is None:
        why = f"timed out after {timeout:g} s"
    elif rc < 0:
        try:
            why = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            why = f"killed by signal {-rc}"
    elif rc == 0:
        why = "exited 0 without writing records"
    else:
        why = f"exit code {rc}"
    last = tail[-1] if tail else ""
    return f"{why}: {last[:300]}" if last else why


def run_peer(python: str, system: str, spec: dict, timeout: float, module: str | None = None) -> list[dict]:
    """Run `python -m <module> --json-in SPEC --json-out OUT` from the repository root (module: MODULES[system]),
    its output relayed to ours; its records, plus a "skipped" row when it did not end well."""
    module = module or MODULES[system]
    dtype = spec.get("kind") or spec.get("dtype")
    with tempfile.TemporaryDirectory(prefix=f"pocketjax-{system}-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [python, "-m", module, "--json-in", str(spec_path), "--json-out", str(out_path)]
        try:  # a session of its own: a timeout ends the peer's whole process group (vLLM's engine core included)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    errors="replace", start_new_session=True)
        except OSError as e:
            return [skipped(system, dtype, f"could not start {python}: {e}")]
        tail: deque = deque(maxlen=20)
        relays = [threading.Thread(target=_relay, args=args, daemon=True)
                  for args in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr, tail))]
        for t in relays:
            t.start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # a timeout, our own Ctrl-C, or children left behind: nothing of the peer outlives this call
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        for t in relays:
            t.join(5)
        try:
            records = json.loads(out_path.read_text())["records"]
        except (OSError, ValueError, KeyError):
            records = []
    if rc == 0 and records:
        return records
    return records + [skipped(system, dtype, _reason(rc, timeout, tail))]
