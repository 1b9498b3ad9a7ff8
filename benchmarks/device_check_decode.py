"""Host-free decode on a GPU (issue 66): the tables `device_check.sh` prints first, one part per process.

    table   - decode at R rows x decode_steps N through the engine's own loop (`decode_dispatch(after=..., steps=N)`
              then `decode_collect` of the step before, as the scheduler's pipelined policy runs it): ms per token
              step, tok/s, host µs per dispatch, and the step's share of the measured read bandwidth (HBM).
    sampler - at one row, the parent commit's shape (the forward program, then 8a0ce4b's sampler with its
              `lax.cond`s and data-dependent `while`: `benchmarks/peers/sampling_8a0ce4b.py`, two dispatches) beside
              today's `decode_sample` (one dispatch), greedy and top-p; run once per XLA_FLAGS setting (command
              buffers as shipped / off / +CONDITIONAL,+WHILE: flags are read when the backend starts).
              `--markers` brackets each timed loop on stderr for `thunks`.
    thunks  - count the conditional / while thunk log lines per step between the markers of a `sampler --markers`
              run made under TF_CPP_VMODULE=conditional_thunk=3,while_thunk=3.
    seed    - the seed's workload on one device: a Qwen2.5-32B-shaped model (random weights made on the device, no
              checkpoint file; int8 linears where bf16 does not fit), prompt P, gen G, 1 / 2 / 4 / 8 requests beside
              the seed's TP2 baseline.

Weights are random (`random_model`: drawn on the device tensor by tensor), so nothing here reads a checkpoint. Both
loops of `sampler` feed the same scratch plan every step (`plan.decode_plans` for rows in slots 0..n-1, positions
advanced by the sampler on the device) and read each step's tokens one step behind, so what differs between them is
the programs and their dispatches only. Each part prints its rows as they end and rewrites its JSON after each, so a
run cut short by its cap keeps what it measured.
    python benchmarks/device_check_decode.py table --preset qwen3-0.6b --dtype bfloat16 --rows 1,8,64 --steps 1,8
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import roofline
from benchmarks.common import parse_ints
from benchmarks.peers import sampling_8a0ce4b as old_sampling
from benchmarks.presets import preset_config
from pocketjax.engine.engine import Engine
from pocketjax.engine.plan import decode_plans
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.model.checkpoint import nest, param_tensors
from pocketjax.model.config import ModelConfig
from pocketjax.model.decoder import Model, resolve_scan_layers, stack_layers
from pocketjax.model.quant import LINEAR_NAMES, QuantizedWeight

# The seed's own run (TP2 on two SM75 GPUs, Qwen2.5-32B, prompt 8,192, gen 128) and its targets: throughput at
# 2 / 4 / 8 requests over 1 request's.
SEED_BASELINE = {"prefill_tok_s": 1434.0, "decode_tok_s": 30.9}
SEED_TARGETS = {2: 1.8, 4: 3.0, 8: 4.0}
SAMPLINGS = {"greedy": SamplingParams(temperature=0.0, ignore_eos=True),
             "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=0, ignore_eos=True)}
MARK = "@@device_check_decode"  # stderr markers around a timed loop (`thunks` counts the log lines between them)


# ---- weights ---------------------------------------------------------------------------------------------------

def random_model(preset: str, dtype: str, int8: bool = False, seed: int = 0, scan: bool | str = "auto") -> Model:
    """A preset's model with random weights drawn on the device one tensor at a time (never a host copy or a file):
    norms one, biases zero, matrices normal with std 1/sqrt(in). `int8`: every linear an int8 QuantizedWeight
    (uniform values, per-row scale giving the same std), the embedding and head in `dtype`. `scan`: stack the layers
    for one `lax.scan` (`resolve_scan_layers`: "auto" stacks 48 layers and more, as `load_model` does)."""
    config = ModelConfig.from_dict(preset_config(preset, dtype))
    key, float_dtype = jax.random.key(seed), jnp.dtype(dtype)

    @partial(jax.jit, static_argnums=(1,))
    def normal(k: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return (jax.random.normal(k, shape, jnp.float32) / np.float32(math.sqrt(shape[-1]))).astype(float_dtype)

    @partial(jax.jit, static_argnums=(1,))
    def quantized(k: jax.Array, shape: tuple[int, ...]) -> QuantizedWeight:
        values = jax.random.randint(k, shape, -127, 128, jnp.int32).astype(jnp.int8)
        scale = np.float32(math.sqrt(3.0) / (127 * math.sqrt(shape[1])))  # uniform[-127, 127] has std 127/sqrt(3)
        return QuantizedWeight(values=values, scale=jnp.full((shape[0], 1), scale, jnp.float32), bits=8)

    def make(i: int, path: tuple, name: str, shape: tuple[int, ...]) -> Any:
        if name.endswith("norm.weight"):
            return jnp.ones(shape, float_dtype)
        if name.endswith(".bias"):
            return jnp.zeros(shape, float_dtype)
        k = jax.random.fold_in(key, i)
        return quantized(k, shape) if int8 and path[-1] in LINEAR_NAMES else normal(k, shape)

    params = nest(config, ((path, make(i, path, name, shape))
                           for i, (path, name, shape) in enumerate(param_tensors(config))))
    if resolve_scan_layers(scan, config):
        params["layers"] = stack_layers(params["layers"])
    jax.block_until_ready(params)
    return Model(config=config, params=params)


def weight_form(arg: str, preset: str, dtype: str) -> bool:
    """`--weights int8|float|auto`: True for int8 linears; auto: int8 when the float weights (and a fifth more for
    the cache and activations) would not fit the device's memory."""
    if arg != "auto":
        return arg == "int8"
    config = ModelConfig.from_dict(preset_config(preset, dtype))
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return limit is not None and 1.2 * config.num_params() * jnp.dtype(dtype).itemsize > limit


# ---- the engine's decode loop ------------------------------------------------------------------------------------

def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n random prompts of `length` tokens (ids past the first few: no special meaning in a random model)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, vocab, length)] for _ in range(n)]


def engine_run(engine: Engine, tokens: list[list[int]], gen: int, steps: int,
               sampling: SamplingParams = SAMPLINGS["greedy"]) -> dict:
    """Prefill every prompt, then decode each to `gen` tokens as the scheduler's pipelined policy does: dispatch a
    step behind the one in flight, then collect that one. Returns the prefill and decode seconds, the decode tokens
    made, and the host seconds of each dispatch call (packing and enqueueing: the device runs on meanwhile)."""
    sampling = replace(sampling, max_tokens=gen)
    reqs = [BatchedRequest(request_id=f"r{i}", prompt_tokens=p, sampling=sampling) for i, p in enumerate(tokens)]
    for req in reqs:
        engine.allocate_slot(req)
    dispatch: list[float] = []
    try:
        t0 = time.perf_counter()
        engine.batch_prefill(reqs)
        jax.block_until_ready(engine.device.state)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pending = None
        for _ in range(2 * gen + 2):  # a bound: each pass dispatches at least one token per unfinished row
            if all(r.finished for r in reqs):
                break
            t = time.perf_counter()
            step = engine.decode_dispatch(reqs, after=pending, steps=steps)
            dispatch.append(time.perf_counter() - t)
            if pending is not None:
                engine.decode_collect(pending)
            pending = step
        if pending is not None:
            engine.decode_collect(pending)
        decode_s = time.perf_counter() - t0
        made = [len(r.generated_tokens) for r in reqs]
    finally:
        for req in reqs:
            engine.free_slot(req.request_id)
    if made != [gen] * len(reqs):
        raise RuntimeError(f"decode made {made} tokens, not {gen} per request")
    return {"prefill_s": prefill_s, "decode_s": decode_s, "decode_tokens": sum(m - 1 for m in made),
            "dispatches": len(dispatch), "dispatch_us": 1e6 * float(np.median(dispatch)) if dispatch else None}


def peak_read(probe_bytes: int) -> float:
    """The device's read bandwidth (bytes/s): the faster of roofline's two read-only passes."""
    return max(roofline.read_bandwidth(probe_bytes, 3).values())


def table(args: argparse.Namespace) -> list[dict]:
    """Decode ms/step and tok/s at each rows x decode_steps, with the host's µs per dispatch and the HBM share."""
    model = random_model(args.preset, args.dtype)
    config, peak = model.config, peak_read(args.probe_bytes)
    print(f"read bandwidth {peak / 1e9:,.1f} GB/s; {args.preset} {args.dtype}, prompt {args.prompt_len}, "
          f"gen {args.gen_len}, greedy", flush=True)
    print(f"{'rows':>5} {'steps':>5} {'ms/step':>8} {'tok/s':>10} {'µs/dispatch':>11} {'dispatches':>10} "
          f"{'HBM %':>6}", flush=True)
    records = []
    for rows in parse_ints(args.rows):
        engine = Engine(model, max_batch_size=rows, max_seq_len=args.prompt_len + args.gen_len + max(
            parse_ints(args.steps)), decode_steps=max(parse_ints(args.steps)), attention_impl=args.attention)
        tokens = prompts(rows, args.prompt_len, config.vocab_size)
        for steps in parse_ints(args.steps):  # the warm pass compiles; its own prompts (no cached prefix to reuse)
            engine_run(engine, prompts(rows, args.prompt_len, config.vocab_size, seed=1000 + steps), args.gen_len,
                       steps)
            run = engine_run(engine, tokens, args.gen_len, steps)
            step_s = run["decode_s"] / (run["decode_tokens"] / rows)
            context = args.prompt_len + args.gen_len / 2
            moved = roofline.decode_bytes(config, args.dtype, rows, context)
            rec = dict(part="table", preset=args.preset, dtype=args.dtype, rows=rows, decode_steps=steps,
                       ms_per_step=1e3 * step_s, tok_s=run["decode_tokens"] / run["decode_s"],
                       dispatch_us=run["dispatch_us"], dispatches=run["dispatches"], step_bytes=moved,
                       read_bytes_s=peak, hbm_pct=100 * moved / step_s / peak, impl=engine.impl)
            records.append(rec)
            print(f"{rows:>5} {steps:>5} {rec['ms_per_step']:8.3f} {rec['tok_s']:10.1f} {rec['dispatch_us']:11.1f} "
                  f"{run['dispatches']:>10} {rec['hbm_pct']:6.1f}", flush=True)
            write(args.json, records)
        del engine
    return records


# ---- the parent's sampler beside today's -------------------------------------------------------------------------

@partial(jax.jit, donate_argnames=("state",))
def old_sample_next(state: Any, logits: jax.Array, plan: Any) -> tuple[Any, Any]:
    """8a0ce4b's `sample_step` for decode rows, with 8a0ce4b's sampler: its own jitted program, as then."""
    rows = jnp.where(plan.rows_on, plan.slots, state.num_slots)
    steps = state.generated[plan.slots]
    out = old_sampling.sample(logits, plan.sampling, state.prompt_mask[plan.slots], state.output_counts[plan.slots],
                              steps, num_top=plan.num_top, logprobs_mode=plan.logprobs_mode)
    return state.count(rows, out.tokens).advance(rows, out.tokens, state.position[plan.slots] + 1, steps + 1), out


def scratch_plans(engine: Engine, rows: int, position: int, sampling: SamplingParams) -> tuple[Any, Any]:
    """The engine's decode plan and sampler plan for `rows` requests in slots 0..rows-1 at `position`, their slot
    state set as after a prefill (the plans `plan.decode_at` builds, with these sampling parameters)."""
    stand_ins = [BatchedRequest(i, [0], sampling, slot_id=i, seed=0) for i in range(rows)]
    _, plan, sample = decode_plans(engine.rules, stand_ins, lambda r: position)
    slots, ones, zeros = jnp.arange(rows), jnp.ones(rows, jnp.int32), jnp.zeros(rows, jnp.int32)
    engine.device.state = engine.device.state.advance(slots, ones, position + zeros, zeros)
    return plan, sample


def timed_loop(step, n: int, label: str, markers: bool) -> dict:
    """Run `step()` (returns the step's tokens, on device) n times back to back, reading each step's tokens one step
    behind; returns ms per step and the host µs of each call."""
    calls, behind = [], None
    if markers:
        print(f"{MARK} begin {label} steps={n}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        tokens = step()
        calls.append(time.perf_counter() - t)
        if behind is not None:
            np.asarray(behind)
        behind = tokens
    np.asarray(behind)
    seconds = time.perf_counter() - t0
    if markers:
        print(f"{MARK} end {label}", file=sys.stderr, flush=True)
    return {"ms_per_step": 1e3 * seconds / n, "call_us": 1e6 * float(np.median(calls))}


def sampler(args: argparse.Namespace) -> list[dict]:
    """At one row: 8a0ce4b's shape (forward, then its sampler) against `decode_sample`, per sampling setting."""
    model = random_model(args.preset, args.dtype)
    engine = Engine(model, max_batch_size=1, max_seq_len=args.prompt_len + 2 * args.timed_steps + 8,
                    attention_impl=args.attention)
    device = engine.device
    print(f"{args.label}: {args.preset} {args.dtype}, 1 row at position {args.prompt_len}, {args.timed_steps} steps "
          f"(XLA_FLAGS as this process got them)", flush=True)
    print(f"{'sampling':8} {'sampler':9} {'ms/step':>8} {'µs/call':>8} {'dispatches/step':>15}", flush=True)
    records = []
    for name in args.samplings.split(","):
        sampling = SAMPLINGS[name]
        for which in ("8a0ce4b", "today"):
            plan, sample = scratch_plans(engine, 1, args.prompt_len, sampling)
            if which == "today":
                def step(plan=plan, sample=sample):
                    return device.run("decode_sample", plan, sample)[0].tokens
            else:
                def step(plan=plan, sample=sample):
                    logits = device.run("decode", plan)[0]
                    device.state, out = old_sample_next(device.state, logits, sample)
                    return out.tokens
            timed_loop(step, 3, "warm", False)  # compiles
            plan, sample = scratch_plans(engine, 1, args.prompt_len, sampling)
            run = timed_loop(step, args.timed_steps, f"{name}/{which}", args.markers)
            rec = dict(part="sampler", label=args.label, sampling=name, sampler=which,
                       dispatches_per_step=2 if which == "8a0ce4b" else 1, **run)
            records.append(rec)
            print(f"{name:8} {which:9} {run['ms_per_step']:8.3f} {run['call_us']:8.1f} "
                  f"{rec['dispatches_per_step']:>15}", flush=True)
            write(args.json, records)
    return records


THUNK_LINE = {"conditional": re.compile(r"conditional_thunk\.cc"), "while": re.compile(r"while_thunk\.cc")}


def count_thunks(log: str) -> dict[str, dict[str, float]]:
    """Per marked loop of a `sampler --markers` log: conditional and while thunk log lines per step."""
    counts: dict[str, dict[str, float]] = {}
    label, steps, seen = None, 0, {}
    for line in log.splitlines():
        if line.startswith(f"{MARK} begin "):
            label, steps = line.split()[2], int(line.split("steps=")[1])
            seen = {kind: 0 for kind in THUNK_LINE}
        elif line.startswith(f"{MARK} end ") and label is not None:
            counts[label] = {kind: n / steps for kind, n in seen.items()}
            label = None
        elif label is not None:
            for kind, pattern in THUNK_LINE.items():
                seen[kind] += bool(pattern.search(line))
    return counts


def thunks(args: argparse.Namespace) -> dict:
    """Print and save the thunk lines per step of each marked loop in `args.log`."""
    with open(args.log, errors="replace") as f:
        counts = count_thunks(f.read())
    print(f"{'loop':20} {'conditional/step':>16} {'while/step':>10}")
    for label, c in counts.items():
        print(f"{label:20} {c['conditional']:16.1f} {c['while']:10.1f}")
    write(args.json, [dict(part="thunks", loop=k, **v) for k, v in counts.items()])
    if not counts:
        raise SystemExit("no marked loop in the log")
    if not any(c["conditional"] for k, c in counts.items() if k.endswith("/8a0ce4b")):
        # 8a0ce4b's sampler runs a conditional every step (on CPU: 6 lines per greedy step): none logged means the
        # log setting did not reach XLA (or every conditional ran inside a command buffer), not that none ran
        print("no conditional thunk line logged for 8a0ce4b's sampler: the counts above do not tell thunks apart")
    return counts


# ---- the seed's workload -------------------------------------------------------------------------------------------

def seed(args: argparse.Namespace) -> list[dict]:
    """Prefill and decode tok/s at each request count, beside the seed's TP2 numbers and its scaling targets."""
    int8 = weight_form(args.weights, args.preset, args.dtype)
    t0 = time.perf_counter()
    model = random_model(args.preset, args.dtype, int8=int8, scan={"on": True, "off": False}.get(args.scan, "auto"))
    counts = parse_ints(args.requests)
    engine = Engine(model, max_batch_size=max(counts), max_seq_len=args.prompt_len + args.gen_len,
                    prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps, attention_impl=args.attention)
    form = "int8 linears" if int8 else args.dtype
    print(f"{args.preset} ({model.config.num_layers} layers, {form}, random weights made in "
          f"{time.perf_counter() - t0:.1f} s), prompt {args.prompt_len}, gen {args.gen_len}, decode_steps "
          f"{args.decode_steps}; the seed (TP2, two SM75 GPUs): prefill {SEED_BASELINE['prefill_tok_s']:,.0f}, "
          f"decode {SEED_BASELINE['decode_tok_s']} tok/s", flush=True)
    print(f"{'requests':>8} {'prefill tok/s':>13} {'decode tok/s':>12} {'x seed dec':>10} {'gen tok/s':>9} "
          f"{'x c1':>6} {'target':>6} {'warm s':>7}", flush=True)
    records: list[dict] = []
    for c in counts:
        tokens = prompts(c, args.prompt_len, model.config.vocab_size, seed=c)
        t0 = time.perf_counter()
        # compiles: the kernels attend over the whole cache (one program per row count), so one chunk of prompt
        # meets every shape the timed run will; XLA's attention length buckets need the whole prompt. Prompts of
        # their own, so the timed prefill finds no cached prefix.
        warm = prompts(c, args.prompt_len if engine.impl == "xla" else min(args.prompt_len, args.prefill_chunk),
                       model.config.vocab_size, seed=1000 + c)
        engine_run(engine, warm, min(args.gen_len, 2 * args.decode_steps + 2), args.decode_steps)
        warm_s = time.perf_counter() - t0
        run = engine_run(engine, tokens, args.gen_len, args.decode_steps)
        total = c * args.gen_len / (run["prefill_s"] + run["decode_s"])  # requests' generated tokens per second
        first = records[0] if records else None
        rec = dict(part="seed", preset=args.preset, weights=form, requests=c, prompt_len=args.prompt_len,
                   gen_len=args.gen_len, decode_steps=args.decode_steps, warm_s=warm_s,
                   prefill_tok_s=c * args.prompt_len / run["prefill_s"],
                   decode_tok_s=run["decode_tokens"] / run["decode_s"], gen_tok_s=total,
                   gen_x_c1=total / first["gen_tok_s"] if first and first["requests"] == 1 else None,
                   target_x_c1=SEED_TARGETS.get(c))
        rec["decode_x_seed"] = rec["decode_tok_s"] / SEED_BASELINE["decode_tok_s"]
        records.append(rec)
        ratio = "" if rec["gen_x_c1"] is None else f"{rec['gen_x_c1']:.2f}"
        target = "" if rec["target_x_c1"] is None else f"{rec['target_x_c1']:.1f}"
        print(f"{c:>8} {rec['prefill_tok_s']:13,.0f} {rec['decode_tok_s']:12,.1f} {rec['decode_x_seed']:10.2f} "
              f"{total:9,.1f} {ratio:>6} {target:>6} {warm_s:7.1f}", flush=True)
        write(args.json, records)
    return records


# ---- command line ----------------------------------------------------------------------------------------------------

def write(path: str | None, records: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "records": records}, f, indent=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = p.add_subparsers(dest="part", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", default="qwen3-0.6b")
    common.add_argument("--dtype", default="bfloat16")
    common.add_argument("--attention", default="xla")
    common.add_argument("--json")
    t = parts.add_parser("table", parents=[common])
    t.add_argument("--rows", default="1,8,64")
    t.add_argument("--steps", default="1,8")
    t.add_argument("--prompt-len", type=int, default=128)
    t.add_argument("--gen-len", type=int, default=65)
    t.add_argument("--probe-bytes", type=int, default=1 << 30)
    s = parts.add_parser("sampler", parents=[common])
    s.add_argument("--label", default="shipped")
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--timed-steps", type=int, default=64)
    s.add_argument("--markers", action="store_true")
    s.add_argument("--samplings", default=",".join(SAMPLINGS), help=f"of {', '.join(SAMPLINGS)}")
    k = parts.add_parser("thunks", parents=[common])
    k.add_argument("log")
    w = parts.add_parser("seed", parents=[common])
    w.set_defaults(preset="qwen2.5-32b")
    w.add_argument("--weights", default="auto", choices=("auto", "int8", "float"))
    w.add_argument("--requests", default="1,2,4,8")
    w.add_argument("--prompt-len", type=int, default=8192)
    w.add_argument("--gen-len", type=int, default=128)
    w.add_argument("--prefill-chunk", type=int, default=2048)
    w.set_defaults(attention="auto")  # 8,192 positions: a kernel that never holds [heads, chunk, keys] scores
    w.add_argument("--decode-steps", type=int, default=8)
    w.add_argument("--scan", default="auto", choices=("auto", "on", "off"))  # the dry run's 2 layers: on
    return p


def main(argv: list[str] | None = None) -> Any:
    args = build_parser().parse_args(argv)
    return {"table": table, "sampler": sampler, "thunks": thunks, "seed": seed}[args.part](args)


if __name__ == "__main__":
    main()
