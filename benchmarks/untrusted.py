"""The adversarial suite at full size, against `pocketjax serve`'s app on 127.0.0.1 (the fast cases are in
tests/test_untrusted.py, tests/test_server_untrusted.py and tests/test_checkpoint_safety.py).

Each case runs while a probe thread polls /health every 20 ms, and reports how long the case took, the probe's worst
latency, the server process's RSS and open file descriptors before and after, and what the attacker got back:
- a request template with nested range loops (10^10 iterations), and one building 2 * 10^8 characters;
- the largest text prompt the server takes (tokenized off the event loop), and one past it;
- stop strings at the limit on one request, and the decode speed another request keeps (ratio to it alone);
- a 39 MB body without the key (refused from its headers); 1,000 half-open connections (closed at the header
  timeout, /health answered after).
Prints a markdown table last and writes JSON (--json); asserts nothing about time.

    python benchmarks/untrusted.py --json out/untrusted.json
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

import pocketjax as pj
from pocketjax.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from pocketjax.serve.http.http_guard import ServerLimits
from pocketjax.serve.http.server import BackgroundServer, create_app

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: benchmarks.common
from benchmarks.common import add_options, machine, markdown_table, write_json  # noqa: E402

KEY = "bench-key"


class Probe:
    """Polls /health every 20 ms on its own thread; `worst` is the longest answer (or failure) since `reset`."""

    def __init__(self, url: str):
        self.url, self.worst, self.failures = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=60) as response:
                    response.read()
            except OSError:
                self.failures += 1
            self.worst = max(self.worst, time.perf_counter() - start)
            time.sleep(0.02)

    def reset(self) -> None:
        self.worst, self.failures = 0.0, 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def case(name: str, probe: Probe, fn) -> dict:
    process = psutil.Process()
    rss, fds = process.memory_info().rss, process.num_fds()
    probe.reset()
    start = time.perf_counter()
    outcome = fn()
    elapsed = time.perf_counter() - start
    time.sleep(0.1)
    return {"case": name, "seconds": round(elapsed, 3), "health_worst_s": round(probe.worst, 3),
            "health_failures": probe.failures, "rss_mb_before": round(rss / 2**20), "rss_mb_after":
            round(process.memory_info().rss / 2**20), "fds_before": fds, "fds_after": process.num_fds(),
            "outcome": outcome}


def run(args: argparse.Namespace) -> dict:
    limits = ServerLimits(header_timeout_s=args.header_timeout)
    llm = pj.LLM(max_batch_size=4, max_seq_len=args.max_seq_len, prefill_chunk=64)
    app = create_app(llm, api_key=KEY, trust_request_chat_template=True, limits=limits)
    records = []
    with llm, BackgroundServer(app, limits=limits) as server:
        chat, completions = server.url + "/v1/chat/completions", server.url + "/v1/completions"
        post(completions, {"prompt": "import os", "max_tokens": 4, "temperature": 0})  # compile outside the cases
        probe = Probe(server.url)

        def template(source: str):
            def fn():
                status, body = post(chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                           "chat_template_kwargs": {"chat_template": source}})
                return f"{status} {body.get('error', {}).get('message', '')[:70]}"
            return fn

        records.append(case("template: 10^10 nested range iterations", probe, template(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")))
        records.append(case("template: 'x' * 2*10^8", probe, template("{{ 'x' * 200000000 }}")))
        chars = limits.prompt_chars(llm.engine.max_seq_len)

        def prompt(n: int):
            def fn():
                status, body = post(completions, {"prompt": ("def f(x):\n    return x\n" * n)[:n], "max_tokens": 1})
                return f"{status} {body.get('error', {}).get('code') or body.get('usage')}"
            return fn

        records.append(case(f"prompt of {chars} characters (the limit)", probe, prompt(chars)))
        records.append(case("prompt of 6 MB", probe, prompt(6_000_000)))

        def decode_rate(stop: list[str]) -> float:
            """Tokens/s of a plain greedy request while a second one, with `stop`, decodes beside it."""
            body = {"prompt": "import os", "max_tokens": args.gen_len, "temperature": 0, "ignore_eos": True}
            answers = []
            beside = threading.Thread(target=lambda: answers.append(post(completions, {**body, "stop": stop or None})))
            beside.start()
            start = time.perf_counter()
            _, out = post(completions, body)
            rate = out["usage"]["completion_tokens"] / (time.perf_counter() - start)
            beside.join()
            status, other = answers[0]
            assert status == 200 and other["usage"]["completion_tokens"] == args.gen_len, (status, other)
            return rate

        each = MAX_STOP_CHARS // MAX_STOP_STRINGS
        stops = [("q%03d" % i + "z" * each)[:each] for i in range(MAX_STOP_STRINGS)]
        decode_rate([])  # compiles this shape
        rates = {"plain": [], "stops": []}
        for _ in range(args.repeats):  # interleaved: the box's load drifts
            rates["plain"].append(decode_rate([]))
            rates["stops"].append(decode_rate(stops))
        base = statistics.median(rates["plain"])

        def with_stops():
            rate = statistics.median(rates["stops"])
            return f"the plain request's decode tok/s {rate:.1f} vs {base:.1f} beside a plain one (ratio {rate / base:.2f})"

        records.append(case(f"{MAX_STOP_STRINGS} stop strings of {each} chars beside a plain request", probe,
                            with_stops))

        def big_body_without_key():
            with socket.create_connection((server.host, server.port), timeout=30) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 39000000\r\n\r\n")
                status = sock.recv(64).split(b"\r\n")[0].decode()  # answered from the headers alone
                try:
                    for _ in range(39):
                        sock.sendall(b"x" * (1 << 20))
                    sent = "the server kept reading"
                except OSError:
                    sent = "the server closed the connection instead of reading the body"
                return f"{status}; {sent}"

        records.append(case("39 MB body without the key", probe, big_body_without_key))

        def half_open():
            socks = []
            for _ in range(args.half_open):
                sock = socket.create_connection((server.host, server.port), timeout=30)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                socks.append(sock)
            time.sleep(args.header_timeout + 2)
            closed = sum(s.recv(1) == b"" for s in socks)
            for s in socks:
                s.close()
            with urllib.request.urlopen(server.url + "/health", timeout=30) as response:
                return f"{closed}/{len(socks)} closed by the server; /health {response.status}"

        records.append(case(f"{args.half_open} half-open connections", probe, half_open))
        probe.close()
    result = {"machine": machine("loadavg", "cores"), "records": records}
    write_json(args.json, result)
    print(markdown_table(["case", "s", "/health worst s", "RSS MB", "fds", "outcome"], (
        [r["case"], r["seconds"], r["health_worst_s"], f"{r['rss_mb_before']}->{r['rss_mb_after']}",
         f"{r['fds_before']}->{r['fds_after']}", r["outcome"]] for r in records)))
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, json=None, max_seq_len=2048, gen_len=32, repeats=3, half_open=1000, header_timeout=3.0)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
