"""The long fuzz of the published API (tests/test_openapi.py is its bounded CI cut): schemathesis driven by
/openapi.json against `pocketjax serve`'s app on the embedded model, every check but positive_data_acceptance,
every phase (coverage's positive and negative cases, random cases, stateful), once without and once with an API key.
Prints, last, a table per run: cases, failures, and per POST route the answers by status and the share that reached
generation; `--json` writes it all. For a release: about 15 minutes on 2 cores with the defaults.

    pip install -e .[dev]
    python benchmarks/fuzz_api.py --json fuzz.json                      # the release run
    python benchmarks/fuzz_api.py --max-examples 20 --runs open         # a quick look
    python benchmarks/fuzz_api.py --mode positive --phases fuzzing      # the document's admitted requests only

The share reaching generation is the fuzzer's requests answered 200 on /v1/chat/completions and /v1/messages (the
server's own http_requests_total): what the document admits, the server serves. Exit status 1 when the fuzzer found
a failure (the run's report is kept with --report-dir).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.common import machine, markdown_table, write_json  # noqa: E402

KEY = "fuzz-key"
GENERATION = ("/v1/chat/completions", "/v1/messages")


def http_answers(metrics) -> dict[tuple[str, str, str], int]:
    """(method, route, status) -> answers, from the server's http_requests_total."""
    out = {}
    for metric in metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "http_requests_total":
                out[sample.labels["method"], sample.labels["handler"], sample.labels["status"]] = int(sample.value)
    return out


def fuzz(llm, api_key: str | None, args: argparse.Namespace, folder: Path) -> dict:
    """One schemathesis run against a fresh app over `llm`: its report, the answers by route and status."""
    from pocketjax.serve.http.http_guard import ServerLimits
    from pocketjax.serve.http.server import BackgroundServer, create_app

    app = create_app(llm, api_key=api_key, limits=ServerLimits(max_choices=args.max_choices))
    name = "api_key" if api_key else "open"
    report = folder / f"{name}.json"
    config = folder / "schemathesis.toml"
    config.write_text("")
    started = time.perf_counter()
    with BackgroundServer(app) as server:
        command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color", "run",
                   f"{server.url}/openapi.json", "--checks", "all", "--exclude-checks", "positive_data_acceptance",
                   "--phases", args.phases, "--mode", args.mode, "--max-examples", str(args.max_examples),
                   "--seed", str(args.seed), "--workers", "1", "--generation-database", "none",
                   "--request-timeout", "300", "--max-response-time", "300",  # compiling a program: seconds
                   "--report", "json", "--report-json-path", str(report)]
        if api_key:
            command += ["--header", f"Authorization: Bearer {api_key}"]
        run = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    (folder / f"{name}.txt").write_text(run.stdout + run.stderr)
    result = json.loads(report.read_text())
    answers = http_answers(app.state.metrics)
    routes: dict[str, dict[str, int]] = {}
    for (method, route, status), n in sorted(answers.items()):
        if method == "POST":
            routes.setdefault(route, {})[status] = n
    reached = sum(routes.get(r, {}).get("200", 0) for r in GENERATION)
    asked = sum(sum(routes.get(r, {}).values()) for r in GENERATION)
    return {"run": name, "seconds": round(seconds, 1), "exit_code": run.returncode,
            "cases": result["test_cases"]["generated"], "failures": result["failures"], "errors": result["errors"],
            "routes": routes, "generation_share": reached / asked if asked else None,
            "reached_generation": reached, "generation_requests": asked}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="open,api_key", help="open, api_key or both")
    p.add_argument("--phases", default="coverage,fuzzing,stateful")
    p.add_argument("--mode", default="all", choices=("all", "positive", "negative"))
    p.add_argument("--max-examples", type=int, default=400, help="per operation, in the random phases")
    p.add_argument("--seed", type=int, default=69)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--max-choices", type=int, default=4, help="--max-choices of the server (n x prompts)")
    p.add_argument("--report-dir", default=None, help="keep schemathesis' reports and output here")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import pocketjax as pj

    folder = Path(args.report_dir or tempfile.mkdtemp(prefix="pocketjax-fuzz-"))
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    with pj.LLM(max_batch_size=4, max_seq_len=args.max_seq_len, prefill_chunk=32) as llm:
        for run in args.runs.split(","):
            results.append(fuzz(llm, KEY if run == "api_key" else None, args, folder))
    write_json(args.json, {"machine": machine("cpu", "cores"), "options": vars(args), "runs": results})
    for result in results:
        print(f"\n{result['run']}: {result['cases']} cases in {result['seconds']} s, "
              f"{len(result['failures'])} failures, {len(result['errors'])} errors; "
              f"{result['reached_generation']} of {result['generation_requests']} chat and Anthropic requests "
              f"reached generation ({(result['generation_share'] or 0):.0%}); reports in {folder}")
        statuses = sorted({s for r in result["routes"].values() for s in r})
        rows = [(route, *(counts.get(s, 0) for s in statuses),
                 f"{counts.get('200', 0) / sum(counts.values()):.0%}") for route, counts in result["routes"].items()]
        print(markdown_table(("POST route", *statuses, "200 share"), rows))
    return 1 if any(r["exit_code"] or r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
