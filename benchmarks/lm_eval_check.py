"""lm-evaluation-harness against `pocketjax serve` vs the harness's own transformers backend, on one small local task.

The task (written to a temporary folder, nothing downloaded) has the three request kinds a harness sends: multiple
choice (loglikelihood of each choice, and is_greedy), rolling log-likelihood of whole snippets (perplexity), and
greedy generation until a stop string. The harness runs it twice on the same checkpoint: `hf` (transformers, float32,
CPU) and `local-completions` (this server over HTTP, `num_concurrent` requests in flight, its tokenizer auto-detected
through /tokenizer_info + /tokenize). Prints each metric of both and the per-request differences (max |loglikelihood
difference|, is_greedy and generation mismatches) as a table last; `--json PATH` writes every number with the
versions it ran with. Skips (exit 0) when lm_eval is not installed: `pip install "lm-eval[api]"`.

    .venv/bin/python benchmarks/lm_eval_check.py [--concurrent 4] [--json out/lm_eval_check.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine, markdown_table, versions, write_json  # noqa: E402

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\ndef main():\n    print(sys.argv)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "with open(path) as f:\n    lines = f.readlines()\n# 你好 ü\n",
]
CHOICES = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " a * b"], 0),
    ("import numpy as", [" np", " pd", " os"], 0),
    ("for i in range(10):\n   ", [" print(i)", " return", " import"], 0),
    ("def is_even(n):\n    return n %", [" 2 == 0", " 3 == 1", " 5"], 0),
    ("class Point:\n    def __init__(self, x, y):\n        self.x =", [" x", " y", " 0"], 0),
    ("# comment 😀\nx =", [" 1", " None", " []"], 0),
]
PROMPTS = [("def square(x):\n", "    return x * x"), ("import os\n", "import sys"), ("class A:\n", "    pass"),
           ("def main():\n", "    print"), ("x = [1, 2, 3]\n", "print(x)"), ("if __name__ ==", " \"__main__\":")]


def write_task(folder: Path) -> list[str]:
    """Three lm-eval task YAMLs over local JSONL files; their names."""
    docs = {"pj_mc": [{"context": c, "choices": ch, "label": y} for c, ch, y in CHOICES],
            "pj_ppl": [{"text": t} for t in SNIPPETS],
            "pj_gen": [{"prompt": p, "target": t} for p, t in PROMPTS]}
    for name, rows in docs.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    specs = {
        "pj_mc": "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
                 "doc_to_target: label\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n",
        "pj_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: '{{text}}'\ndoc_to_target: '{{text}}'\n"
                  "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
        "pj_gen": "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
                  "target_delimiter: ''\ngeneration_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 16\n"
                  "  do_sample: false\n  temperature: 0.0\nmetric_list:\n  - metric: exact_match\n",
    }
    for name, spec in specs.items():
        path = folder / f"{name}.jsonl"
        (folder / f"{name}.yaml").write_text(f"task: {name}\n" + common.format(path=path) + spec)
    return list(specs)


def run_harness(model: str, model_args: str, tasks: list[str], folder: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, batch_size=1, device="cpu",
                                   task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def per_request(results: dict) -> dict[tuple[str, int, int], object]:
    """(task, doc id, request index) -> the harness's filtered response (loglikelihood pair, float, or text)."""
    out = {}
    for task, samples in results["samples"].items():
        for sample in samples:
            for i, resp in enumerate(sample["resps"]):
                out[task, sample["doc_id"], i] = resp[0]
    return out


def compare(ref: dict, served: dict) -> dict:
    """Max |loglikelihood difference| and counts of is_greedy / generation mismatches over matching requests."""
    diff, greedy, text, n = 0.0, 0, 0, 0
    for key, want in ref.items():
        got, n = served[key], n + 1
        if isinstance(want, (list, tuple)):  # (loglikelihood, is_greedy)
            diff = max(diff, abs(float(want[0]) - float(got[0])))
            greedy += bool(want[1]) != bool(got[1])
        elif isinstance(want, str):
            text += want != got
        else:  # rolling loglikelihood
            diff = max(diff, abs(float(want) - float(got)))
    return {"requests": n, "max_abs_loglikelihood_diff": diff, "is_greedy_mismatches": greedy,
            "generation_mismatches": text}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, default=4, help="requests the harness keeps in flight")
    parser.add_argument("--max-length", type=int, default=256, help="context of both backends (rolling windows)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("lm_eval is not installed (pip install 'lm-eval[api]'): skipped")
        return 0
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import pocketjax as pj
    from pocketjax.serve.llm import DEFAULT_MODEL
    from pocketjax.serve.http.server import BackgroundServer, create_app

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tasks = write_task(folder)
        ref = run_harness("hf", f"pretrained={DEFAULT_MODEL},dtype=float32,max_length={args.max_length}", tasks,
                          folder)
        app = None
        with pj.LLM(max_batch_size=8, max_seq_len=args.max_length) as llm, \
                BackgroundServer(app := create_app(llm)) as server:
            served = run_harness("local-completions",
                                 f"base_url={server.url}/v1/completions,model=pocket-coder,"
                                 f"num_concurrent={args.concurrent},max_length={args.max_length},max_retries=1",
                                 tasks, folder)
    # the server's own count of what the harness asked it: tokenizer probes and calls, completions, failures
    registry = app.state.metrics.registry
    calls = {f"{method} {path} {status}": registry.get_sample_value(
        "http_requests_total", {"method": method, "handler": path, "status": status})
        for method, path, status in (("GET", "/tokenizer_info", "200"), ("POST", "/tokenize", "200"),
                                     ("POST", "/v1/completions", "200"), ("POST", "/v1/completions", "400"))}
    rows = []
    for task in tasks:
        for metric, value in ref["results"][task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                rows.append((task, metric.split(",")[0], value, served["results"][task][metric]))
    diffs = compare(per_request(ref), per_request(served))
    installed = versions("lm_eval", "transformers", "torch", "jax")
    write_json(args.json, {
        "machine": machine("platform", "python", "cpus", loadavg_start=load, loadavg_end=os.getloadavg(),
                           concurrent=args.concurrent, max_length=args.max_length, versions=installed),
        "metrics": [dict(zip(("task", "metric", "hf", "pocketjax"), r)) for r in rows],
        "per_request": diffs, "server_calls": calls})
    print(json.dumps({"versions": installed, "per_request": diffs, "server_calls": calls}))
    print(markdown_table(["task", "metric", "hf (transformers)", "pocketjax serve"],
                         ([task, metric, f"{a:.6g}", f"{b:.6g}"] for task, metric, a, b in rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
