"""What narrower weights can gain a 1-row decode product on this CPU: a model's weights read as stored, float32 and
bfloat16 copies of the same shapes, with no arithmetic (the ceiling of any product over those bytes in that order),
beside the native kernel's 1-row AVX2 form on the same bytes (`csrc/weight_read.cc`; built here with the compiler
`cpu_kernels` uses).

Why: a bf16 step moves half a float32 step's bytes, yet on a CPU without native bf16 arithmetic the products run
~1.3x, not 2x, faster. This separates what the memory system gives (read bf16 vs read float32) from what the kernel's
widening costs (kernel vs read, per dtype). Every weight of one decode step, in step order (per layer q, k, v, o,
gate, up, down, then the lm_head), each split between two threads, as a step reads them. x86 with AVX2 + FMA only.

    python benchmarks/weight_read.py [--model qwen3-0.6b] [--repeats 15] [--json out/weight_read.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_engine import cpu_features  # noqa: E402
from benchmarks.common import add_options, add_quick, machine, markdown_table, parse, write_json  # noqa: E402
from benchmarks.presets import PRESETS  # noqa: E402
from pocketjax.model import cpu_kernels  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "csrc" / "weight_read.cc"
QUICK = dict(model="qwen3-micro", repeats=3)


def step_shapes(preset: dict) -> list[tuple[int, int]]:
    """(out, in) of every weight a decode step reads, in its order; the lm_head is the embedding when tied."""
    h, i, d = preset["hidden_size"], preset["intermediate_size"], preset.get("head_dim", 0) or (
        preset["hidden_size"] // preset["num_attention_heads"])
    q, kv = preset["num_attention_heads"] * d, preset["num_key_value_heads"] * d
    layer = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    return layer * preset["num_hidden_layers"] + [(preset["vocab_size"], h)]


def build(directory: Path) -> Path:
    """The probe compiled into `directory` (x86-64 only: it is AVX2 code, as the kernel's path it times)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise SystemExit(f"weight_read: an x86-64 probe (AVX2 + FMA); this machine is {platform.machine()}")
    compiler = cpu_kernels.find_compiler()
    if compiler is None:
        raise SystemExit("weight_read: no C++ compiler (POCKETJAX_CXX, CXX, c++, g++ or clang++)")
    binary = directory / "weight_read"
    subprocess.run([compiler, "-O3", "-std=c++17", "-pthread", str(SOURCE), "-o", str(binary)], check=True,
                   timeout=300)
    return binary


def run_benchmark(model: str, repeats: int) -> dict:
    shapes = step_shapes(PRESETS[model])
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([str(build(Path(tmp))), str(repeats), *(f"{n},{k}" for n, k in shapes)],
                              capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"weight_read failed: {done.stderr.strip()}")
    records = [json.loads(line) for line in done.stdout.splitlines()]
    for r in records:
        r["GB_s"] = round(r["GB"] / r["median_ms"] * 1e3, 2)
    ms = {(r["form"], r["dtype"]): r["median_ms"] for r in records}
    ratios = {"read float32 / read bfloat16 (the most bf16 can gain)": ms["read", "float32"] / ms["read", "bfloat16"],
              "kernel float32 / kernel bfloat16 (what it gains)": ms["kernel", "float32"] / ms["kernel", "bfloat16"],
              "kernel bfloat16 / read bfloat16 (what widening costs)":
                  ms["kernel", "bfloat16"] / ms["read", "bfloat16"],
              "kernel float32 / read float32": ms["kernel", "float32"] / ms["read", "float32"]}
    info = machine("cpu", "cores", "loadavg", **cpu_features())
    return dict(machine=info, settings=dict(model=model, repeats=repeats, weights=len(shapes)), records=records,
                ratios={k: round(v, 3) for k, v in ratios.items()})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, model="qwen3-0.6b", repeats=15, json=None)
    args = parse(add_quick(p, QUICK), argv, QUICK)
    if args["model"] not in PRESETS:
        raise SystemExit(f"--model must be a preset of benchmarks/presets.py: {sorted(PRESETS)}")
    result = run_benchmark(args["model"], args["repeats"])
    write_json(args["json"], result)
    print(markdown_table(("form", "weights", "median ms / step", "min ms", "GB", "GB/s (median)"),
                         [(r["form"], r["dtype"], r["median_ms"], r["min_ms"], r["GB"], r["GB_s"])
                          for r in result["records"]]))
    print(markdown_table(("ratio", "value"), result["ratios"].items()))


if __name__ == "__main__":
    main()
