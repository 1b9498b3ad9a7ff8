"""What structured outputs (SamplingParams.structured) cost: host ms per decode step for the token masks, device ms
of the masked sampler next to the plain one, and decode tokens/s with 0, 1 or all rows constrained, at each
concurrency. Prints a markdown table last; `--json` writes every record.

    python benchmarks/bench_structured.py --model embedded --concurrency 1,8
    python benchmarks/bench_structured.py --model qwen3-0.6b --tokenizer tests/fixtures/.../tokenizer.json

Per model, concurrency c and variant: c requests with random prompts of --prompt-len tokens go through a pipelined
`Scheduler` (what `LLM` and the server run); once every request has its first token, the scheduler's steps until
--steps more tokens each are timed (decode tok/s = tokens generated / that time). Constrained rows follow a JSON
schema whose string array a random model keeps filling (`SCHEMA`); every request ignores EOS, so all run the same
number of steps. Mask ms per step: the time in `Constrainer.masks` (llguidance's `fill_next_token_bitmask_par`
plus the tokenizer limit), over the timed steps. Sampler ms: `sample_step` alone over c rows of logits, with and
without an all-ones mask, each call synced (median of 20). Variants take turns for --repeats rounds.

The Qwen3-0.6B preset has random weights; its tokenizer is --tokenizer (a tokenizer.json: the real Qwen3 one has
151,669 tokens under the model's 151,936), or else the embedded model's 4,096-token tokenizer under the 151,936-id
mask (a smaller trie than Qwen's: masks then cost less than they would; the JSON says which).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table, model_folder,  # noqa: E402
                               parse_ints, write_json)
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.engine.plan import Signature  # noqa: E402
from pocketjax.engine.runner import empty_plan  # noqa: E402
from pocketjax.engine.sampling_params import SamplingParams  # noqa: E402
from pocketjax.engine.structured import Structured, all_allowed  # noqa: E402
from pocketjax.model.decoder import load_model  # noqa: E402
from pocketjax.serve.llm import DEFAULT_MODEL  # noqa: E402
from pocketjax.serve.scheduler import Scheduler  # noqa: E402
from pocketjax.serve.tokenizer import Tokenizer  # noqa: E402

VARIANTS = ("none", "one", "all")  # rows constrained
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "notes": {"type": "array", "items": {
    "type": "string"}}}, "required": ["title", "notes"]}


def load(args: SimpleNamespace) -> tuple:
    """(model, tokenizer, what the tokenizer is) for --model."""
    folder = DEFAULT_MODEL if args.model == "embedded" else model_folder(args.model, args.cache_dir, args.dtype)
    model = load_model(folder, dtype=args.dtype)
    if args.tokenizer:
        from tokenizers import Tokenizer as Backend
        return model, Tokenizer(Backend.from_file(args.tokenizer)), args.tokenizer
    if (Path(folder) / "tokenizer.json").exists():
        return model, Tokenizer.from_folder(folder), str(folder)
    return model, Tokenizer.from_folder(DEFAULT_MODEL), f"{DEFAULT_MODEL} (4,096 tokens, padded to the model's vocab)"


def time_variant(engine: Engine, variant: str, c: int, prompt_len: int, steps: int, round_: int) -> dict:
    """One timed run of c requests, `variant` saying how many rows are constrained."""
    rng = np.random.default_rng(round_)
    plain = SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=round_, ignore_eos=True)
    constrained = SamplingParams(max_tokens=steps + 1, temperature=1.0, seed=round_, ignore_eos=True,
                                 structured=Structured(json_schema=SCHEMA))
    n = {"none": 0, "one": 1, "all": c}[variant]
    sched = Scheduler(engine, max_waiting=c, prefill_token_budget=c * prompt_len)  # every prompt in one call
    vocab = engine.model.config.vocab_size
    handles = [sched.submit(rng.integers(0, min(vocab, 4000), prompt_len).tolist(), constrained if i < n else plain)
               for i in range(c)]
    masks, spent = engine.constrainer.masks, []

    def timed_masks(rows):
        start = time.perf_counter()
        try:
            return masks(rows)
        finally:
            spent.append(time.perf_counter() - start)

    engine.constrainer.masks = timed_masks
    try:
        while any(not h.request.generated_tokens for h in handles):
            sched.step()
        before, spent[:] = sum(len(h.request.generated_tokens) for h in handles), []
        start, decode_steps = time.perf_counter(), 0
        while sched.has_work():
            sched.step()
            decode_steps += 1
        elapsed = time.perf_counter() - start
    finally:
        del engine.constrainer.masks
    tokens = sum(len(h.result().token_ids) for h in handles) - before
    stopped = sum(h.result().finish_reason == "stop" for h in handles)
    return dict(tok_s=tokens / elapsed, step_ms=1e3 * elapsed / max(decode_steps, 1),
                mask_ms_per_step=1e3 * sum(spent) / max(decode_steps, 1), tokens=tokens, ended_by_grammar=stopped)


def sampler_ms(engine: Engine, c: int, masked: bool, calls: int = 20) -> float:
    """Median device ms of the decode sampler over c rows of logits (synced), with an all-ones mask or without."""
    rows = engine.rules.rows(c)
    plan = empty_plan(engine.rules, Signature("sample_next_masked" if masked else "sample_next", rows))
    if masked:  # every token allowed: the cost of the mask itself, never of a smaller candidate set
        assert (plan.allowed == all_allowed(rows, engine.rules.vocab_size)).all()
    logits = jax.random.normal(jax.random.key(0), (rows, engine.model.config.vocab_size))
    times = []
    for _ in range(calls + 1):
        start = time.perf_counter()
        out = engine.device.run("sample_next", logits, plan)
        jax.block_until_ready(out.tokens)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def run_model(args: SimpleNamespace, concurrency: list[int]) -> list[dict]:
    model, tokenizer, tokenizer_from = load(args)
    engine = Engine(model, tokenizer=tokenizer, max_batch_size=max(concurrency),
                    max_seq_len=args.prompt_len + args.steps + 8, prefill_chunk=args.prompt_len,
                    compile_cache_dir="off")
    start = time.perf_counter()
    engine.constrainer.compile(Structured(json_schema=SCHEMA))  # builds llguidance's tokenizer too
    setup_s = time.perf_counter() - start
    runs: dict[tuple[int, str], list[dict]] = {}
    for c in concurrency:
        variants = VARIANTS if c > 1 else ("none", "all")  # one row: "one" is "all"
        for variant in variants:  # untimed: compiles every program the variant runs
            time_variant(engine, variant, c, args.prompt_len, 2, 99)
        for round_ in range(args.repeats):
            for variant in variants:
                runs.setdefault((c, variant), []).append(
                    time_variant(engine, variant, c, args.prompt_len, args.steps, round_))
    records = []
    for (c, variant), results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in ("tok_s", "step_ms", "mask_ms_per_step")}
        records.append(dict(model=args.model, vocab=model.config.vocab_size, tokenizer=tokenizer_from,
                            tokenizer_vocab=tokenizer.vocab_size, dtype=args.dtype, concurrency=c,
                            constrained=variant, **med, runs=results, llguidance_setup_s=setup_s,
                            sampler_ms=sampler_ms(engine, c, False), masked_sampler_ms=sampler_ms(engine, c, True)))
    return records


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded", help="embedded, an HF folder or a preset of benchmarks/presets.py; "
                   "comma-separated for several")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json for a preset (default: the embedded one's)")
    add_options(p, dtype="float32", concurrency="1,8", prompt_len=16, steps=16, repeats=2, cache_dir=DEFAULT_CACHE_DIR,
                json=None)
    args = p.parse_args(argv)
    concurrency = parse_ints(args.concurrency)
    records = []
    for name in args.model.split(","):
        records += run_model(SimpleNamespace(**{**vars(args), "model": name,
                                                "tokenizer": args.tokenizer if name != "embedded" else None}),
                             concurrency)
    result = {"machine": machine("backend", "devices", "loadavg"), "records": records}
    write_json(args.json, result)
    base = {(r["model"], r["concurrency"]): r["tok_s"] for r in records if r["constrained"] == "none"}
    print(markdown_table(["model", "vocab", "c", "rows constrained", "decode tok/s", "x none", "step ms",
                          "mask ms/step (host)", "sampler ms", "masked sampler ms"], (
        [r["model"], f"{r['vocab']:,}", r["concurrency"], r["constrained"], f"{r['tok_s']:.1f}",
         f"{r['tok_s'] / base[r['model'], r['concurrency']]:.2f}", f"{r['step_ms']:.1f}",
         f"{r['mask_ms_per_step']:.2f}", f"{r['sampler_ms']:.2f}", f"{r['masked_sampler_ms']:.2f}"] for r in records)))
    return result


if __name__ == "__main__":
    main()
