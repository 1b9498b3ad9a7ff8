"""LoRA fine-tuning throughput and memory: training tokens/s, the compiled step's memory, the held-out effect.

    python benchmarks/bench_lora.py --models embedded,qwen3-0.6b --steps 20 --json lora.json

Per model: `finetune` (rank 8, alpha 16 on q, v, o, up, down) for --steps steps of --batch-size x --seq-len tokens on
the embedded model's toy "house style" corpus (random ids on a random-weight preset, which has no tokenizer), then
held-out loss before and after. Memory is XLA's own account of the compiled train step (arguments: frozen weights,
adapters, optimizer state, tokens; temporaries: activations kept for the backward pass) plus the process's peak RSS.
Prints a markdown table last; never asserts on time.
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: pocketjax + siblings

import pocketjax as pj
from benchmarks.common import add_options, machine, markdown_table, write_json
from benchmarks.presets import build_preset
from pocketjax.model.lora import LoraConfig
from pocketjax.nnx import Decoder
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.tokenizer import Tokenizer
from pocketjax.training import finetune as ft
from pocketjax.training.evaluation import evaluate

TARGETS = ("q", "v", "o", "up", "down")


def house_style(n: int) -> list[str]:
    """The notebook's toy task: one family of functions in a fixed style."""
    shapes = ["square", "circle", "triangle", "hexagon", "ring", "ellipse", "kite", "rhombus", "trapezoid", "star"]
    return [f"def area_{s}_{i}(size: float) -> float:\n    \"\"\"Area of a {s} of the given size, in square units."
            f"\"\"\"\n    return {i + 1} * size * size\n\n" for i in range(n) for s in shapes]


def step_memory(model: pj.Model, lora: LoraConfig, batch: int, seq_len: int) -> dict:
    """XLA's memory analysis of the compiled LoRA train step (bytes)."""
    view = Decoder(model, lora)
    graphdef, adapters, frozen = nnx.split(view, nnx.LoRAParam, ...)
    step, optimizer = ft.make_step(graphdef, 1.0)
    tokens = jnp.zeros((batch, seq_len + 1), jnp.int32)
    compiled = step.lower(adapters, optimizer.init(adapters), frozen, tokens, jnp.float32(1e-3)).compile()
    m = compiled.memory_analysis()
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    return {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
            "adapter_bytes": int(adapter_bytes)}


def run(name: str, steps: int, batch: int, seq_len: int, workdir: Path) -> dict:
    if name == "embedded":
        model = pj.load_model(DEFAULT_MODEL)
        tok = Tokenizer.from_folder(DEFAULT_MODEL)
        texts = house_style(12)
        train, held = [tok.encode(t) for t in texts[:100]], [tok.encode(t) for t in texts[100:]]
    else:
        model = pj.load_model(build_preset(name, workdir / name))
        rng = np.random.default_rng(0)
        phrases = [list(rng.integers(2, model.config.vocab_size, 24)) for _ in range(12)]
        train, held = [p * 4 for p in phrases[:10]], [p * 4 for p in phrases[10:]]
    lora = LoraConfig(rank=8, alpha=16.0, targets=TARGETS)
    t0 = time.perf_counter()
    view, history = ft.finetune(model, train, lora, steps=steps, lr=1e-2, warmup=2, batch_size=batch,
                                seq_len=seq_len, log_every=max(steps // 4, 1), log=None)
    wall = time.perf_counter() - t0
    held_rows = ft.token_windows(model, held, seq_len)
    eval_batch = min(2, len(held_rows))
    before = evaluate(model.params, model.config, held_rows, eval_batch)
    after = evaluate(view.functional(), model.config, held_rows, eval_batch)
    timed = history[1:] or history  # the first record holds the fewest steps (step 1, compiling, is not timed)
    return {"model": name, "params": model.config.num_params(), "rank": lora.rank, "targets": list(TARGETS),
            "batch": batch, "seq_len": seq_len, "steps": steps, "wall_s": round(wall, 1),
            "train_tok_s": float(np.mean([h["tok_s"] for h in timed])), "held_out_loss_before": before,
            "held_out_loss_after": after, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            **step_memory(model, lora, batch, seq_len)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="embedded,qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    add_options(parser, batch_size=4, seq_len=64, json=None)
    args = parser.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            records.append(run(name, args.steps, args.batch_size, args.seq_len, Path(tmp)))
    result = {"machine": machine("cpu", "jax", "devices"), "records": records}
    write_json(args.json, result)
    print(markdown_table(["model", "params", "train tok/s", "args MB", "temp MB", "adapters MB", "peak RSS MB",
                          "held-out loss before -> after"], (
        [r["model"], f"{r['params'] / 1e6:.1f}M", f"{r['train_tok_s']:.0f}", f"{r['argument_bytes'] / 2**20:.1f}",
         f"{r['temp_bytes'] / 2**20:.1f}", f"{r['adapter_bytes'] / 2**20:.2f}", f"{r['peak_rss_bytes'] / 2**20:.0f}",
         f"{r['held_out_loss_before']:.3f} -> {r['held_out_loss_after']:.3f}"] for r in records)))


if __name__ == "__main__":
    main()
