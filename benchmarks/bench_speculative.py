"""Speculative decoding with prompt-lookup drafts: acceptance rate and decode tokens/s with and without, per
concurrency, on a copy-heavy and a free-generation workload, on the embedded code model and Qwen3-0.6B's shapes.
Prints a markdown table last; `--json` writes every record.

    python benchmarks/bench_speculative.py --json out/spec.json                 # both models, 1/4/8 requests
    python benchmarks/bench_speculative.py --models pocket-coder --concurrency 1 --gen-len 16   # a smoke run

Workloads, built from the standard library's held-out files (every 50th, which pocket-coder never trained on),
tokenized with pocket-coder's tokenizer (its ids are valid in Qwen3's vocabulary too):
  copy: continue a file where the file itself repeats earlier spans. For each held-out file, the window of
        COPY_TOKENS tokens (at a multiple of 32, after COPY_CONTEXT tokens of the file) whose true continuation
        the drafter would predict best (`lookup_tokens_per_step` on the file's own tokens, not on any model's
        output); the files ranked by that score. The prompt is the COPY_CONTEXT tokens before the window.
  edit: a function of ~160 tokens, two blank lines and its first line again; greedy decoding then tends to rewrite
        the function (an editing request), though pocket-coder copies it loosely.
  free: 120 tokens from the middle of a file; the continuation is new code.
Each cycle runs every prompt of the workload (--prompts, default the largest concurrency) through a `Scheduler`
(pipelined, as served), c at a time: each group is stepped until its prompts are prefilled, then its remaining steps
are timed; decode tok/s = tokens generated in them / their time, over all groups (so 1 request is the mean over
the prompts, not one prompt's luck). Greedy, ignore_eos, gen_len tokens
each, so both sides do the same work; `identical` says the speculative tokens equal the plain ones. One untimed
cycle each compiles the shapes; the figure is the best of --repeats timed cycles, plain and speculative interleaved
(the box is shared: best, not median). The speculative engine keeps its measured step times (`StepClock`) from one
cycle to the next, as a server does.
Qwen3-0.6B has random weights: its drafts are accepted only where its greedy output loops.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table, model_folder,  # noqa: E402
                               parse_ints, write_json)
from pocketjax.engine import engine as engine_module  # noqa: E402
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.engine.plan import decode_plans, verify_plans  # noqa: E402
from pocketjax.engine.request import BatchedRequest  # noqa: E402
from pocketjax.engine.request import RequestStatus  # noqa: E402
from pocketjax.engine.sampling_params import SamplingParams  # noqa: E402
from pocketjax.engine.speculative import NgramIndex  # noqa: E402
from pocketjax.model.decoder import load_model  # noqa: E402
from pocketjax.serve.llm import DEFAULT_MODEL  # noqa: E402
from pocketjax.serve.scheduler import Scheduler  # noqa: E402
from pocketjax.serve.tokenizer import Tokenizer  # noqa: E402
from pocketjax.training.bpe import split_holdout, stdlib_files  # noqa: E402

HOLDOUT_EVERY = 50  # pocket-coder's recipe (train.py): every 50th stdlib file was held out


def held_out_sources() -> list[str]:
    texts = []
    for path in stdlib_files():
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return split_holdout(texts, every=HOLDOUT_EVERY)[1]


def functions(source: str) -> list[str]:
    """Top-level or method `def` blocks of a file, as text (a block ends at the next line as indented or less)."""
    lines, blocks = source.splitlines(), []
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if not stripped.startswith("def "):
            continue
        indent = len(line) - len(stripped)
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        blocks.append("\n".join(l[indent:] for l in lines[i:end]).rstrip())
    return blocks


COPY_CONTEXT, COPY_TOKENS = 256, 64  # the copy workload's prompt length, and the continuation it is chosen by


def lookup_tokens_per_step(context: list[int], continuation: list[int], k: int = 4) -> float:
    """Tokens per step a verify-every-step decode would make if its output were `continuation`: the drafter's
    proposals (`NgramIndex`, prompt_lookup 2-4) checked against it, as the verify step does."""
    tokens, index, done, steps = list(context), NgramIndex(2, 4), 0, 0
    while done < len(continuation):
        draft = index.propose(tokens, k)
        accepted = 0
        while accepted < len(draft) and done + accepted < len(continuation) and \
                draft[accepted] == continuation[done + accepted]:
            accepted += 1
        made = min(accepted + 1, len(continuation) - done)
        tokens += continuation[done: done + made]
        done, steps = done + made, steps + 1
    return len(continuation) / steps


def workloads(tokenizer: Tokenizer, n: int) -> dict[str, list[list[int]]]:
    """n prompts of each workload (module docstring): copy, edit (the first fitting function of each held-out file,
    then its second, and so on, where the files have too few), free (the middle of each file long enough)."""
    blocks, free, windows = [], [], []
    for source in held_out_sources():
        blocks.append([b for b in functions(source) if 120 <= len(tokenizer.encode(b)) <= 200])
        ids = tokenizer.encode(source)
        if len(free) < n and len(ids) >= 400:
            free.append(ids[200:320])
        scored = [(lookup_tokens_per_step(ids[at - COPY_CONTEXT: at], ids[at: at + COPY_TOKENS]), at)
                  for at in range(COPY_CONTEXT, len(ids) - COPY_TOKENS + 1, 32)]
        if scored:
            score, at = max(scored)
            windows.append((-score, len(windows), ids[at - COPY_CONTEXT: at]))
    ordered = [b[i] for i in range(max(map(len, blocks), default=0)) for b in blocks if i < len(b)]
    edit = [tokenizer.encode(b + "\n\n\n" + b.splitlines()[0] + "\n") for b in ordered[:n]]
    copy = [prompt for *_, prompt in sorted(windows)[:n]]
    return {"copy": copy, "edit": edit, "free": free}


def in_vocab(prompts: list[list[int]], vocab_size: int) -> list[list[int]]:
    """The prompts with each id folded into a smaller model's vocabulary (a preset such as qwen3-micro has 512 ids):
    id -> id % vocab_size keeps which tokens repeat, and so what the n-gram drafter finds."""
    return [[t % vocab_size for t in p] for p in prompts]


def cycle(engine: Engine, prompts: list[list[int]], gen_len: int, concurrency: int) -> dict:
    """Every prompt through a scheduler, `concurrency` at a time (the next group once the last one finished): decode
    seconds and tokens after each group's prefill, the tokens, the steps, the verify steps, acceptance."""
    spec = engine.speculator
    accepted, proposed = (spec.total_accepted, spec.total_proposed) if spec else (0, 0)
    verifies = [0]
    dispatch = engine.verify_dispatch

    def counted(*args, **kwargs):
        verifies[0] += 1
        return dispatch(*args, **kwargs)

    engine.verify_dispatch = counted  # (an instance attribute: the scheduler calls it, nothing else changes)
    sp = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    seconds, made, steps, tokens = 0.0, 0, 0, []
    try:
        for at in range(0, len(prompts), concurrency):
            group = prompts[at: at + concurrency]
            sched = Scheduler(engine, prefill_token_budget=sum(map(len, group)))
            handles = [sched.submit(p, sp) for p in group]
            while any(h.request.status is not RequestStatus.DECODING and not h.done() for h in handles):
                sched.step()
            before, start = sum(len(h.request.generated_tokens) for h in handles), time.perf_counter()
            while sched.has_work():
                sched.step()
                steps += 1
            seconds += time.perf_counter() - start
            tokens += [h.result().token_ids for h in handles]
            made += sum(len(t) for t in tokens[-len(group):]) - before
    finally:
        del engine.verify_dispatch
    out = dict(seconds=seconds, tokens=made, tok_s=made / seconds, steps=steps, verifies=verifies[0],
               token_ids=tokens)
    if spec:
        out.update(accepted=spec.total_accepted - accepted, proposed=spec.total_proposed - proposed)
    return out


def compare(plain: Engine, spec: Engine, prompts: list[list[int]], gen_len: int, concurrency: int, repeats: int
            ) -> tuple[dict, dict]:
    """The best timed cycle of each engine, their cycles interleaved (plain, speculative, plain, ...) so a change in
    the neighbours' load hits both; one untimed cycle each first compiles every shape it meets."""
    for engine in (plain, spec):
        cycle(engine, prompts, gen_len, concurrency)
    runs = [[cycle(engine, prompts, gen_len, concurrency) for engine in (plain, spec)] for _ in range(repeats)]
    return tuple(max((r[i] for r in runs), key=lambda r: r["tok_s"]) for i in (0, 1))


def run_benchmark(models: list[str], concurrency: list[int], gen_len: int, repeats: int, k: int,
                  cache_dir: str, num_prompts: int | None = None) -> dict:
    tokenizer = Tokenizer.from_folder(DEFAULT_MODEL)
    prompt_sets = workloads(tokenizer, max(num_prompts or 0, *concurrency))
    info = machine("cpu", "cores", "jax", "device", loadavg_start=os.getloadavg())
    records = []
    spec_config = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2)
    for name in models:
        folder = DEFAULT_MODEL if name == "pocket-coder" else model_folder(name, cache_dir)
        model = load_model(folder)
        longest = max(len(p) for ps in prompt_sets.values() for p in ps) + gen_len
        sizes = dict(max_batch_size=max(concurrency), max_seq_len=1 << (longest - 1).bit_length(),
                     prefill_chunk=256, compile_cache_dir="off")
        plain, spec = Engine(model, **sizes), Engine(model, **sizes, speculative=spec_config)
        for workload, prompts in prompt_sets.items():
            prompts = in_vocab(prompts, model.config.vocab_size)
            for c in concurrency:
                base, fast = compare(plain, spec, prompts, gen_len, c, repeats)
                record = dict(model=name, workload=workload, concurrency=c, gen_len=gen_len,
                              plain_tok_s=round(base["tok_s"], 2), speculative_tok_s=round(fast["tok_s"], 2),
                              speedup=round(fast["tok_s"] / base["tok_s"], 3),
                              acceptance_rate=round(fast["accepted"] / fast["proposed"], 3) if fast["proposed"] else 0,
                              tokens_per_step=round(fast["tokens"] / fast["steps"] / c, 2),
                              plain_tokens_per_step=round(base["tokens"] / base["steps"] / c, 2),
                              prompts=len(prompts),
                              steps=fast["steps"], verify_steps=fast["verifies"],
                              step_ms=round(1e3 * fast["seconds"] / fast["steps"], 2),
                              plain_step_ms=round(1e3 * base["seconds"] / base["steps"], 2),
                              identical=fast["token_ids"] == base["token_ids"])
                records.append(record)
                print(json.dumps(record), flush=True)
    info["loadavg_end"] = os.getloadavg()
    return dict(machine=info, settings=dict(models=models, concurrency=concurrency, gen_len=gen_len,
                                               repeats=repeats, prompts=len(prompt_sets["free"]),
                                               speculative=spec_config), records=records)


def median_ms(fn, iters: int) -> float:
    """The median wall milliseconds of `iters` calls of fn (which blocks on what it times), after one untimed call."""
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return float(np.median(times))


def profile_rows(engine: Engine, prompts: list[list[int]], iters: int) -> dict:
    """Where a verify step's time goes against a plain decode step, over len(prompts) requests: the device time of
    each jitted step (`block_until_ready`), the host time of drafting, planning, dispatch and collect, and the
    device->host transfers (leaves read) per step. Drafts are k copies of a fixed token: the full compiled width."""
    sp = SamplingParams(max_tokens=10 * iters + 64, temperature=0.0, ignore_eos=True)
    reqs = [BatchedRequest(f"p{i}", list(p), sp) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.allocate_slot(r)
    try:
        engine.batch_prefill(reqs)
        engine.batch_decode_step(reqs)
        rules, k = engine.rules, engine.speculator.k
        cached = lambda slot: len(engine.slots.tokens[slot])  # noqa: E731
        reach = lambda r: cached(r.slot_id)  # noqa: E731
        drafts = [[7] * k for _ in reqs]
        device = engine.device
        _, dplan, splan = decode_plans(rules, reqs, reach)
        _, vplan, vsplan = verify_plans(rules, reqs, drafts, cached)
        held = {}
        before = jax.tree.map(jnp.copy, device.state)  # the steps timed alone advance it: restored after

        def plain_forward():
            held["logits"] = device.run("decode", dplan)[0].block_until_ready()

        def plain_sample():
            device.run("sample_next", held["logits"], splan).tokens.block_until_ready()

        def verify_forward():
            held["vlogits"] = device.run("verify", vplan).block_until_ready()

        def verify_sample():
            device.run("sample_verify", held["vlogits"], vsplan)[1].block_until_ready()

        record = dict(rows=vplan.rows, requests=len(reqs))
        for name, fn in (("plain_forward_ms", plain_forward), ("plain_sample_ms", plain_sample),
                         ("verify_forward_ms", verify_forward), ("verify_sample_ms", verify_sample)):
            record[name] = round(median_ms(fn, iters), 3)
        device.state = before
        record["draft_ms"] = round(median_ms(lambda: engine.draft(reqs), iters), 3)
        record["plan_plain_ms"] = round(median_ms(lambda: decode_plans(rules, reqs, reach), iters), 3)
        record["plan_verify_ms"] = round(median_ms(lambda: verify_plans(rules, reqs, drafts, cached), iters), 3)
        reads = []
        real = engine_module.to_host

        def counting(tree):
            reads.append(len(jax.tree.leaves(tree)))
            return real(tree)

        engine_module.to_host = counting
        try:
            dispatch, collect, plain = [], [], []
            for _ in range(iters):
                start = time.perf_counter()
                pending = engine.verify_dispatch(reqs, drafts)
                mid = time.perf_counter()
                engine.verify_collect(pending)
                end = time.perf_counter()
                dispatch.append(1e3 * (mid - start))
                collect.append(1e3 * (end - mid))
            record["verify_reads"] = reads[-1]
            for _ in range(iters):
                start = time.perf_counter()
                engine.batch_decode_step(reqs)
                plain.append(1e3 * (time.perf_counter() - start))
            record["plain_reads"] = reads[-1]
        finally:
            engine_module.to_host = real
        record.update(verify_dispatch_ms=round(float(np.median(dispatch)), 3),
                      verify_dispatch_collect_ms=round(float(np.median(collect)), 3),
                      verify_call_ms=round(float(np.median(np.add(dispatch, collect))), 3),
                      plain_call_ms=round(float(np.median(plain)), 3))
        return record
    finally:
        for r in reqs:
            engine.free_slot(r.request_id)


def run_profile(models: list[str], concurrency: list[int], k: int, iters: int, cache_dir: str) -> dict:
    """`profile_rows` per model and request count, on the copy prompts."""
    tokenizer = Tokenizer.from_folder(DEFAULT_MODEL)
    prompts = workloads(tokenizer, max(concurrency))["copy"]
    spec_config = dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2)
    records = []
    for name in models:
        folder = DEFAULT_MODEL if name == "pocket-coder" else model_folder(name, cache_dir)
        model = load_model(folder)
        longest = max(map(len, prompts)) + 10 * iters + 64
        engine = Engine(model, max_batch_size=max(concurrency), max_seq_len=1 << (longest - 1).bit_length(),
                        prefill_chunk=256, compile_cache_dir="off", speculative=spec_config)
        for c in concurrency:
            record = dict(model=name, k=k, **profile_rows(engine, in_vocab(prompts[:c], model.config.vocab_size),
                                                          iters))
            records.append(record)
            print(json.dumps(record), flush=True)
    return dict(settings=dict(models=models, concurrency=concurrency, k=k, iters=iters, loadavg=os.getloadavg()),
                records=records)


PROFILE_COLUMNS = ("plain_forward_ms", "plain_sample_ms", "verify_forward_ms", "verify_sample_ms", "draft_ms",
                   "plan_plain_ms", "plan_verify_ms", "plain_call_ms", "verify_call_ms", "verify_dispatch_ms",
                   "plain_reads", "verify_reads")


def profile_table(result: dict) -> str:
    columns = [c.removesuffix("_ms").replace("_", " ") + (" ms" if c.endswith("_ms") else "") for c in PROFILE_COLUMNS]
    return markdown_table(["model", "k", "rows", *columns], (
        [r["model"], r["k"], r["rows"], *(r[c] for c in PROFILE_COLUMNS)] for r in result["records"]))


def table(result: dict) -> str:
    return markdown_table(["model", "workload", "requests", "plain tok/s", "speculative tok/s", "speedup", "acceptance",
                           "tokens/step (per request)", "identical"], (
        [r["model"], r["workload"], r["concurrency"], r["plain_tok_s"], r["speculative_tok_s"], f"{r['speedup']}x",
         f"{r['acceptance_rate']:.0%}", r["tokens_per_step"], r["identical"]] for r in result["records"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="pocket-coder,qwen3-0.6b", help="pocket-coder and/or presets.py names")
    add_options(p, concurrency="1,4,8", gen_len=96, repeats=3)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompts", type=int, default=None, help="prompts per workload (default: the largest concurrency)")
    add_options(p, cache_dir=DEFAULT_CACHE_DIR, json=None)
    p.add_argument("--profile", action="store_true", help="time each part of a verify step against a plain one")
    p.add_argument("--iters", type=int, default=10, help="--profile: timed calls per part (median)")
    args = p.parse_args(argv)
    if args.profile:
        result = run_profile(args.models.split(","), parse_ints(args.concurrency), args.k, args.iters, args.cache_dir)
        write_json(args.json, result, indent=1)
        print(profile_table(result))
        return 0
    result = run_benchmark(args.models.split(","), parse_ints(args.concurrency), args.gen_len, args.repeats, args.k,
                           args.cache_dir, args.prompts)
    write_json(args.json, result, indent=1)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
