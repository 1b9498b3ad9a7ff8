"""How good the embedded model is, in the two numbers its users feel: held-out perplexity and code that parses.

Both are measured on stdlib files the training never saw (`bpe.split_holdout`, the same split `train_tiny` uses):

- perplexity: exp of the mean next-token cross-entropy over the held-out files packed into training-length windows,
  exactly as `train_tiny` reports it (so runs compare);
- parse rate: the share of `NUM_HEADERS` held-out function headers (`def name(...):` on one line, dedented) whose
  greedy `MAX_NEW_TOKENS`-token completion, cut at the first blank line, parses with `ast.parse` — the test a
  reader of the README's first command applies by eye.

    python -m pocketjax.training.evaluation --model pocketjax/assets/pocket-coder [--json OUT]
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..model.config import ModelConfig
from ..model.decoder import Params, next_token_loss
from .data import encode_windows

NUM_HEADERS = 50
MAX_NEW_TOKENS = 48
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def function_headers(texts: Sequence[str], n: int = NUM_HEADERS) -> list[str]:
    """`n` one-line `def` headers spread evenly over `texts` (dedented, each ending in a newline); deterministic."""
    found = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body[0].lineno > node.lineno:
                line = lines[node.lineno - 1]
                if line.rstrip().endswith(":") and not node.decorator_list:
                    found.append(textwrap.dedent(line).rstrip() + "\n")
    found = sorted(set(found), key=found.index)  # first occurrence order, no duplicates
    if len(found) < n:
        raise ValueError(f"only {len(found)} function headers in the held-out files, {n} asked")
    return [found[i * len(found) // n] for i in range(n)]


def cut_at_blank_line(completion: str) -> str:
    """The completion up to its first blank line: where a function (or the model's idea of one) ends."""
    match = _BLANK_LINE.search(completion)
    return completion[: match.start() + 1] if match else completion


def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in generated text
        return False
    return True


def parse_rate(llm: Any, headers: Sequence[str], max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
    """Greedy completions of `headers` through `llm` (a pocketjax LLM, batched); the share whose cut text parses."""
    from ..engine.sampling_params import SamplingParams

    outs = llm.generate(list(headers), SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    cases = []
    for header, out in zip(headers, outs):
        body = cut_at_blank_line(out.text)
        cases.append({"header": header, "completion": body, "parses": parses(header + body)})
    return {"parse_rate": sum(c["parses"] for c in cases) / len(cases), "cases": cases}


def evaluate(params: Params, config: ModelConfig, windows: np.ndarray, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy over `windows` [N, T] (full batches only, so one shape compiles)."""
    n = len(windows) - len(windows) % batch_size
    if n == 0:
        raise ValueError(f"{len(windows)} windows cannot fill a batch of {batch_size}")
    values = [next_token_loss(params, config, jnp.asarray(windows[j:j + batch_size]))
              for j in range(0, n, batch_size)]
    return float(jnp.mean(jnp.stack(values)))


def held_out_loss(model_dir: str | Path, holdout_every: int, seq_len: int, batch_size: int = 1) -> float:
    """Mean next-token cross-entropy of the model in `model_dir` over the held-out stdlib files (float32).

    batch_size 1 scores every window (`evaluate` drops a tail that does not fill a batch).
    """
    from ..model.decoder import load_model
    from ..serve.tokenizer import Tokenizer
    from .bpe import PAD_TOKEN, split_holdout, stdlib_corpus

    tokenizer = Tokenizer.from_folder(model_dir)
    _, held = split_holdout(stdlib_corpus(), every=holdout_every)
    windows = encode_windows(tokenizer, held, tokenizer.token_id(PAD_TOKEN), seq_len)
    model = load_model(model_dir, dtype="float32")
    return evaluate(model.params, model.config, windows, batch_size)


def evaluate_model(model_dir: str | Path, holdout_every: int = 50, seq_len: int = 256) -> dict[str, Any]:
    """Held-out loss and perplexity, and the header parse rate with every case, of the model in `model_dir`."""
    from ..serve.llm import LLM
    from .bpe import split_holdout, stdlib_corpus

    loss = held_out_loss(model_dir, holdout_every, seq_len)
    _, held = split_holdout(stdlib_corpus(), every=holdout_every)
    with LLM(str(model_dir), dtype="float32", max_batch_size=NUM_HEADERS) as llm:
        rate = parse_rate(llm, function_headers(held))
    return {"held_out_loss": loss, "held_out_perplexity": math.exp(loss), **rate}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pocketjax.training.evaluation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="a model folder trained by pocketjax.training")
    parser.add_argument("--holdout-every", type=int, default=50, help="the split train_tiny used (its recipe)")
    parser.add_argument("--json", type=Path, default=None, help="write the report, every case included")
    args = parser.parse_args(argv)
    report = evaluate_model(args.model, args.holdout_every)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2), encoding="utf-8")
    for case in report["cases"][:3]:
        print(f"--- {'parses' if case['parses'] else 'does not parse'}\n{case['header']}{case['completion']}")
    print(f"held-out perplexity {report['held_out_perplexity']:.2f} (loss {report['held_out_loss']:.4f}); "
          f"{report['parse_rate']:.0%} of {NUM_HEADERS} held-out function headers complete to code that parses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
