"""Engine throughput: warm prefill and decode tokens/s per concurrency, next to transformers (and llama.cpp), with
each figure set against this machine's measured roofline. Prints a markdown table last; `--json` writes every record.

    python benchmarks/bench_engine.py --model qwen3-0.6b --dtype float32 --concurrency 1,2,4,8 \
        --prompt-len 128 --gen-len 64 --json out/bench.json --peers transformers --plot out/bench.png
    python benchmarks/bench_engine.py --quick          # tiny preset, short lengths: about a minute on 2 cores

Per concurrency c: c requests with distinct random prompts of --prompt-len tokens are prefilled in one
`batch_prefill` (prefill tok/s = c * prompt_len / its time), then decoded for gen_len - 1 `batch_decode_step`s
(decode tok/s = c * (gen_len - 1) / their time; the first generated token comes from the prefill). One untimed cycle
compiles every shape first; the figures are medians over --repeats timed cycles. Two checks for issue 3 ride on the
concurrency-1 record: the engine's per-token latency over a minimal jitted single-sequence greedy loop, and the
decode step time with max_seq_len doubled at equal active length (flat when the cache is donated, not copied).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: pocketjax + siblings
# PyTorch's OpenMP workers spin while they wait; on a shared 2-core box they fight every other process for the cores
# and transformers' small decode matmuls slow down ~10x (measured on qwen3-tiny: 91 -> 11 ms/token). Passive
# waiting makes the peer's figures depend less on the neighbours. Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import roofline  # noqa: E402
from benchmarks.common import DEFAULT_CACHE_DIR, machine, model_folder, parse_ints, write_json  # noqa: E402
from benchmarks.peers import Prompts, launch  # noqa: E402 - Prompts: the peers' processes make theirs alike
from benchmarks.presets import GGUF_TYPES, PRESETS  # noqa: E402
from pocketjax.model.config import ModelConfig  # noqa: E402
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.engine.request import BatchedRequest  # noqa: E402
from pocketjax.engine.plan import bucket, decode_at  # noqa: E402
from pocketjax.model.kv_cache import init_cache  # noqa: E402
from pocketjax.model import cpu_kernels  # noqa: E402
from pocketjax.model.layers import ATTENTION_IMPLS  # noqa: E402
from pocketjax.model.decoder import decode_forward, lm_head, load_model, prefill_forward  # noqa: E402
from pocketjax.engine.sampling_params import SamplingParams  # noqa: E402

PEERS = ("transformers", "llamacpp", "vllm")  # each runs in its own process: benchmarks/peers/
CHECK_GEN_LEN = 25  # tokens per request in the issue-3 checks: medians over ~100 steps per figure are plenty
QUICK = dict(model="qwen3-tiny", concurrency="1,4", prompt_len=32, gen_len=16, repeats=3)


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """The command line; with `suppress_defaults`, parsing returns only the options actually given."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                argument_default=argparse.SUPPRESS if suppress_defaults else None)
    default = (lambda v: argparse.SUPPRESS) if suppress_defaults else (lambda v: v)  # noqa: E731
    p.add_argument("--model", default=default("qwen3-0.6b"), help=f"HF folder or a preset: {', '.join(PRESETS)}")
    p.add_argument("--dtype", default=default("float32"), choices=["float32", "bfloat16", "float16"],
                   help="the checkpoint's dtype (presets are built in it); peers run in it")
    p.add_argument("--quantize", default=default(""),
                   help="comma-separated weight quantizations pocketjax runs, each its own rows ('none' or a "
                        "quant.MODES name: int8, int4, int8+head, int4+head, int4+head8; empty: none)")
    p.add_argument("--load-dtypes", default=default(""),
                   help="comma-separated dtypes pocketjax loads the same checkpoint in, each its own rows "
                        "('default': load_model's default for it; empty: --dtype)")
    p.add_argument("--concurrency", default=default("1,2,4,8"), help="comma-separated numbers of concurrent requests")
    p.add_argument("--prompt-len", type=int, default=default(128))
    p.add_argument("--gen-len", type=int, default=default(64), help="tokens generated per request (first by prefill)")
    p.add_argument("--repeats", type=int, default=default(3), help="timed cycles per concurrency; medians reported")
    p.add_argument("--max-seq-len", type=int, default=default(0), help="engine max_seq_len (0: next power of two "
                   ">= prompt + gen, at least 128)")
    p.add_argument("--prefill-chunk", type=int, default=default(512))
    p.add_argument("--attention", default=default("auto"), choices=list(ATTENTION_IMPLS))
    p.add_argument("--forms", default=default("invariant"),
                   help="comma-separated: invariant (the default engine: native CPU kernels, batch-invariant), xla "
                        "(batch_invariant=False: XLA's forms, system 'pocketjax-xla-forms'); both: the cost table")
    p.add_argument("--peers", default=default("transformers"),
                   help="comma-separated: transformers, llamacpp, vllm ('' for none); each in its own process")
    p.add_argument("--vllm-python", default=default(sys.executable),
                   help="the interpreter of vLLM's own venv (benchmarks/README.md); default: this one")
    p.add_argument("--peer-timeout", type=float, default=default(1800.0),
                   help="seconds one peer process may run before it is ended (its row then says so)")
    p.add_argument("--gguf", default=default(None),
                   help="GGUF file for the llama.cpp peer's --dtype rows (default: <model>/model-<dtype>.gguf)")
    p.add_argument("--gguf-types", default=default(""),
                   help="comma-separated encodings the llama.cpp peer runs, each its own rows, converted once to "
                        "<model>/model-<type>.gguf (float32, float16, bfloat16, q8_0, q4_0, q4_k_m; empty: --dtype, "
                        "plus q8_0 when --quantize has an int8 mode, q4_0 and q4_k_m when it has an int4 one)")
    p.add_argument("--threads", type=int, default=default(0), help="peer threads (0: the CPUs this process may use)")
    p.add_argument("--cache-dir", default=default(DEFAULT_CACHE_DIR), help="where presets are built")
    p.add_argument("--json", default=default(None), help="write {machine, records} here")
    p.add_argument("--plot", default=default(None), help="write decode/prefill tok/s vs concurrency here (png)")
    p.add_argument("--no-checks", dest="checks", action="store_false", default=default(True),
                   help="skip the issue-3 checks (minimal loop, doubled max_seq_len) and the time breakdown")
    p.add_argument("--breakdown", action="store_true", default=default(False),
                   help="the time breakdown (forward / lm_head / sampler / host per step) even with --no-checks")
    p.add_argument("--quick", action="store_true", default=default(False),
                   help=f"smoke run: {QUICK} for whatever is not given")
    return p


def resolve_args(args: argparse.Namespace | dict | None = None, **kwargs) -> SimpleNamespace:
    """Defaults, overridden by `args` and kwargs; --quick fills what was not given.

    A dict or kwargs counts as given in full; for a Namespace (every option present), the values that differ from
    the defaults count as given.
    """
    out = vars(build_parser().parse_args([]))
    if isinstance(args, argparse.Namespace):
        given = {k: v for k, v in vars(args).items() if v != out.get(k)}
    else:
        given = dict(args or {})
    given.update(kwargs)
    if given.get("quick"):
        out.update(QUICK)
    out.update(given)
    out["concurrency"] = parse_ints(out["concurrency"])
    out["peers"] = parse_names(out["peers"])
    out["forms"] = parse_names(out["forms"]) or ["invariant"]
    if set(out["forms"]) - {"invariant", "xla"}:
        raise SystemExit(f"--forms: invariant and/or xla, got {out['forms']}")
    out["load_dtypes"] = parse_names(out["load_dtypes"]) or [out["dtype"]]
    out["quantize"] = [None if q == "none" else q for q in parse_names(out["quantize"])] or [None]
    out["gguf_types"] = parse_names(out["gguf_types"]) or (
        [out["dtype"]] + (["q8_0"] if any(q and q.startswith("int8") for q in out["quantize"]) else [])
        + (["q4_0", "q4_k_m"] if any(q and q.startswith("int4") for q in out["quantize"]) else []))
    if set(out["gguf_types"]) - set(GGUF_TYPES):
        raise SystemExit(f"--gguf-types: from {', '.join(GGUF_TYPES)}, got {out['gguf_types']}")
    unknown = [p for p in out["peers"] if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s) {unknown}: choose from {', '.join(PEERS)}")
    if out["prompt_len"] < 1 or out["gen_len"] < 2 or out["repeats"] < 1 or min(out["concurrency"]) < 1:
        raise SystemExit("need prompt_len >= 1, gen_len >= 2, repeats >= 1 and concurrency >= 1")
    if not out["max_seq_len"]:
        out["max_seq_len"] = bucket(out["prompt_len"] + out["gen_len"], 128, 1 << 30)
    return SimpleNamespace(**out)


def parse_names(value) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value or [])


ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile", "neon", "asimd", "bf16", "sve")


def cpu_features() -> dict:
    """The CPU's vendor / family / model and the ISA flags a product's library path depends on (from /proc/cpuinfo),
    and the code paths pocketjax's native kernels run here (None where they are not built)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    kernels = None
    if jax.default_backend() == "cpu" and cpu_kernels.available():
        kernels = {"float32_weight": cpu_kernels.resolved_isa_name(jnp.float32, jnp.float32),
                   "bfloat16_weight": cpu_kernels.resolved_isa_name(jnp.bfloat16, jnp.bfloat16)}
    return {"cpu_vendor": fields.get("vendor_id"), "cpu_family": fields.get("cpu family"),
            "cpu_model": fields.get("model"), "isa_flags": [f for f in ISA_FLAGS if f in flags],
            "cpu_kernels": kernels}


def machine_info(args: SimpleNamespace, peaks: roofline.Peaks) -> dict:
    info = machine("cpu", "cores", "usable_cores", "platform", "python", "jax", "devices", **cpu_features(),
                   jax_backend=jax.default_backend(), numpy=np.__version__, loadavg_start=list(os.getloadavg()),
                   peaks=asdict(peaks), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                   settings={k: v for k, v in vars(args).items() if k not in ("json", "plot")})
    for name in ("torch", "transformers", "llama_cpp"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing or broken peer only loses its version line
            info[name] = None
    return info


# ---- pocketjax ------------------------------------------------------------------------------------------------------

def engine_cycle(engine: Engine, prompts: list[list[int]], gen_len: int) -> tuple[float, list[float]]:
    """Prefill then decode every prompt to gen_len tokens: (prefill seconds, seconds of each decode step)."""
    sampling = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    reqs = [BatchedRequest(request_id=f"r{i}", prompt_tokens=p, sampling=sampling) for i, p in enumerate(prompts)]
    for req in reqs:
        engine.allocate_slot(req)
    try:
        t0 = time.perf_counter()
        engine.batch_prefill(reqs)
        prefill_s = time.perf_counter() - t0
        steps = []
        for _ in range(gen_len - 1):
            t0 = time.perf_counter()
            engine.batch_decode_step(reqs)
            steps.append(time.perf_counter() - t0)
    finally:
        for req in reqs:
            engine.free_slot(req.request_id)
    return prefill_s, steps


@partial(jax.jit, static_argnames=("config", "impl", "kv_len"), donate_argnames=("cache",))
def minimal_prefill(params, cache, tokens, *, config: ModelConfig, impl: str, kv_len: int):
    """Batch-1 prefill of tokens [1, T] into slot 0; (cache, greedy first token)."""
    zero, length = jnp.zeros((1,), jnp.int32), jnp.full((1,), tokens.shape[1], jnp.int32)
    cache, logits = prefill_forward(params, config, impl, kv_len, cache, tokens, zero, zero, length)
    return cache, jnp.argmax(logits[0]).astype(jnp.int32)


@partial(jax.jit, static_argnames=("config", "impl", "kv_len"), donate_argnames=("cache",))
def minimal_decode(params, cache, token, position, *, config: ModelConfig, impl: str, kv_len: int):
    """One greedy batch-1 step with the argmax in the jitted call: (cache, next token)."""
    cache, logits = decode_forward(params, config, impl, kv_len, cache, token[None], jnp.zeros((1,), jnp.int32),
                                   position[None], jnp.ones((1,), bool), dense=True)
    return cache, jnp.argmax(logits[0]).astype(jnp.int32)


def minimal_cycle(model, engine: Engine, prompt: list[int], gen_len: int, sync: bool) -> tuple[list[int], list[float]]:
    """The baseline loop: one slot, no host bookkeeping. Returns (tokens, seconds of each of the gen_len - 1 steps).

    With `sync`, each token is fetched to the host as it is made (as any streaming loop must, to check stops);
    without, steps are dispatched back to back, only the last is waited for, and the mean step is returned.
    Attention reads the engine's kv bucket, but the one-slot cache is twice the engine's max_seq_len: with one slot
    and a bucket equal to the whole cache, XLA:CPU copies every layer's cache several times per step (seen in the
    compiled HLO), which would make the baseline slow for a reason that is not the engine's.
    """
    c = model.config
    s = engine.max_seq_len
    cache = init_cache(c.num_layers, 1, c.num_kv_heads, 2 * s, c.head_dim, model.dtype)
    kv = lambda n: bucket(n, engine.config.min_kv_bucket, s)  # noqa: E731 - the engine's kv bucket rule
    cache, token = minimal_prefill(model.params, cache, jnp.asarray([prompt], jnp.int32), config=c,
                                   impl=engine.impl, kv_len=kv(len(prompt)))
    tokens, steps = [token], []
    start = t0 = time.perf_counter()
    for pos in range(len(prompt), len(prompt) + gen_len - 1):
        cache, token = minimal_decode(model.params, cache, token, jnp.int32(pos), config=c, impl=engine.impl,
                                      kv_len=kv(pos + 1))
        if sync:
            tokens.append(int(token))
            steps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        else:
            tokens.append(token)
    jax.block_until_ready(token)
    if not sync:
        steps = [(time.perf_counter() - start) / (gen_len - 1)] * (gen_len - 1)
    return [int(t) for t in tokens], steps


def engine_tokens(engine: Engine, prompt: list[int], gen_len: int) -> tuple[list[int], list[float]]:
    """One request through the engine: (its generated tokens, seconds of each decode step)."""
    sampling = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    req = BatchedRequest(request_id="check", prompt_tokens=prompt, sampling=sampling)
    engine.allocate_slot(req)
    try:
        engine.batch_prefill([req])
        steps = []
        for _ in range(gen_len - 1):
            t0 = time.perf_counter()
            engine.batch_decode_step([req])
            steps.append(time.perf_counter() - t0)
    finally:
        engine.free_slot(req.request_id)
    return req.generated_tokens, steps


def overhead_checks(model, engine: Engine, prompts: Prompts, args: SimpleNamespace) -> dict:
    """(a) engine c=1 vs the minimal loop, per-token latency; (b) engine c=1 step time with max_seq_len doubled.

    The runs are interleaved per repeat so that load from other processes hits them alike, and each figure is the
    median over every step of every repeat (robust to the bursts of a shared machine).
    """
    doubled = Engine(model, max_batch_size=engine.num_slots, max_seq_len=2 * engine.max_seq_len,
                     prefill_chunk=args.prefill_chunk, attention_impl=args.attention)
    runs = {"engine": [], "minimal": [], "minimal_async": [], "doubled": []}
    match = []
    gen = min(args.gen_len, CHECK_GEN_LEN)
    for r in range(args.repeats + 1):  # the first round compiles
        prompt = prompts.make(1, args.prompt_len)[0]
        theirs, engine_steps = engine_tokens(engine, prompt, gen)
        mine, minimal_steps = minimal_cycle(model, engine, prompt, gen, sync=True)
        _, async_steps = minimal_cycle(model, engine, prompt, gen, sync=False)
        _, doubled_steps = engine_tokens(doubled, prompts.make(1, args.prompt_len)[0], gen)
        if r == 0:
            continue
        match.append(mine == theirs)
        for key, steps in zip(runs, (engine_steps, minimal_steps, async_steps, doubled_steps)):
            runs[key].extend(steps)
    del doubled
    med = {k: float(np.median(v)) for k, v in runs.items()}
    return {
        "engine_c1_ms_per_token": 1e3 * med["engine"],
        "minimal_loop_ms_per_token": 1e3 * med["minimal"],
        "minimal_loop_async_ms_per_token": 1e3 * med["minimal_async"],
        "batched_vs_minimal_ratio": med["engine"] / med["minimal"],
        "minimal_loop_tokens_match": all(match),
        "max_seq_len": engine.max_seq_len,
        "doubled_max_seq_len_step_ms": 1e3 * med["doubled"],
        "doubled_max_seq_len_ratio": med["doubled"] / med["engine"],
    }


def step_breakdown(model, engine: Engine, prompts: Prompts, c: int, args: SimpleNamespace) -> dict:
    """Where one decode step's time goes at concurrency c: the forward (of which lm_head), the sampler, the host.

    Interleaves, step by step, a real engine decode step over c requests with the engine's own jitted forward and
    sampler called alone on a scratch engine's cache (the plan the engine builds for c rows at this context, so
    they run the engine's compiled executables) and `lm_head` alone on [rows, hidden].
    host = engine step - forward - sampler: bookkeeping, packing, transfers.
    """
    cfg = model.config
    scratch = Engine(model, engine.config)  # same rules, cache dtype and layout as the engine's
    plan, sample = decode_at(scratch.rules, [args.prompt_len] * c)
    slots = jnp.arange(c)  # rows 0..c-1 continue at prompt_len, as the engine's requests do after their prefill
    ones, zeros = jnp.ones(c, jnp.int32), jnp.zeros(c, jnp.int32)
    device, state = scratch.device, {}
    device.state = device.state.advance(slots, ones, args.prompt_len + zeros, zeros)
    hidden = jnp.ones((plan.rows, cfg.hidden_size), model.dtype)
    head = jax.jit(lm_head)

    def forward():
        state["logits"] = device.run("decode", plan)[0].block_until_ready()

    def sampler():
        np.asarray(device.run("sample_next", state["logits"], sample).tokens)

    def head_only():
        head(model.params, hidden).block_until_ready()

    sp = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    reqs = [BatchedRequest(request_id=f"b{i}", prompt_tokens=p, sampling=sp)
            for i, p in enumerate(prompts.make(c, args.prompt_len))]
    for req in reqs:
        engine.allocate_slot(req)
    times = {"step": [], "forward": [], "sampler": [], "lm_head": []}
    try:
        engine.batch_prefill(reqs)
        forward(), sampler(), head_only()  # compiles lm_head alone; the others are the engine's executables
        for _ in range(min(args.gen_len - 1, 4 * args.repeats + 3)):
            for key, fn in (("step", lambda: engine.batch_decode_step(reqs)), ("forward", forward),
                            ("sampler", sampler), ("lm_head", head_only)):
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
    finally:
        for req in reqs:
            engine.free_slot(req.request_id)
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    return {"breakdown_step_ms": ms["step"], "forward_ms": ms["forward"], "lm_head_ms": ms["lm_head"],
            "layers_ms": ms["forward"] - ms["lm_head"], "sampler_ms": ms["sampler"],
            "host_ms": ms["step"] - ms["forward"] - ms["sampler"]}


def bench_pocketjax(folder: Path, args: SimpleNamespace, load_dtype: str, quantize: str | None = None,
                    forms: str = "invariant") -> tuple[list[dict], ModelConfig]:
    model = load_model(str(folder), dtype=None if load_dtype == "default" else load_dtype, quantize=quantize)
    dtype = jnp.dtype(model.dtype).name
    engine = Engine(model, max_batch_size=max(args.concurrency), max_seq_len=args.max_seq_len,
                    prefill_chunk=args.prefill_chunk, attention_impl=args.attention,
                    batch_invariant=forms == "invariant")
    system = "pocketjax" if forms == "invariant" else "pocketjax-xla-forms"
    prompts = Prompts(model.config.vocab_size)
    records = []
    for c in args.concurrency:
        t0 = time.perf_counter()
        engine_cycle(engine, prompts.make(c, args.prompt_len), args.gen_len)  # compiles this c's shapes
        warmup_s = time.perf_counter() - t0
        prefills, decodes, steps = [], [], []
        for _ in range(args.repeats):
            prefill_s, step_s = engine_cycle(engine, prompts.make(c, args.prompt_len), args.gen_len)
            prefills.append(prefill_s)
            decodes.append(sum(step_s))
            steps.extend(step_s)
        n_steps = args.gen_len - 1
        rec = {"system": system, "dtype": dtype, "concurrency": c, "load_dtype": load_dtype, "quantize": quantize,
               "prefill_tok_s": c * args.prompt_len / float(np.median(prefills)),
               "decode_tok_s": c * n_steps / float(np.median(decodes)),
               "decode_step_ms": 1e3 * float(np.median(decodes)) / n_steps,
               "decode_step_ms_median": 1e3 * float(np.median(steps)),
               "decode_step_ms_p10_p90": [1e3 * float(np.percentile(steps, q)) for q in (10, 90)],
               "prefill_s_runs": prefills, "decode_s_runs": decodes, "warmup_s": warmup_s,
               "engine_slots": engine.num_slots, "attention_impl": engine.impl}
        if args.checks or getattr(args, "breakdown", False):
            rec.update(step_breakdown(model, engine, prompts, c, args))
        records.append(rec)
        print(f"{system} c={c}: prefill {rec['prefill_tok_s']:.1f} tok/s, decode {rec['decode_tok_s']:.2f} tok/s "
              f"({rec['decode_step_ms']:.1f} ms/step; warm-up {warmup_s:.1f} s)", flush=True)
    if args.checks and forms == "invariant":
        checks = overhead_checks(model, engine, prompts, args)
        c1 = next((r for r in records if r["concurrency"] == 1), None)
        if c1 is None:
            records.append(c1 := {"system": "pocketjax", "dtype": dtype, "concurrency": 1, "load_dtype": load_dtype,
                                  "quantize": quantize})
        c1.update(checks)
        print(f"pocketjax checks: batched/minimal per-token {checks['batched_vs_minimal_ratio']:.3f} "
              f"(target <= 1.05), 2x max_seq_len step ratio {checks['doubled_max_seq_len_ratio']:.3f} "
              f"(target < 1.10)", flush=True)
    config = model.config
    del engine, model
    gc.collect()
    return records, config


# ---- peers ----------------------------------------------------------------------------------------------------------

PEER_SEEDS = {"transformers": 1, "llamacpp": 2, "vllm": 3}  # prompts of their own, never pocketjax's


def peer_specs(name: str, folder: Path, args: SimpleNamespace) -> list[dict]:
    """One spec per peer process (benchmarks/peers/__init__.py): llama.cpp once per --gguf-types encoding, so that
    one encoding's crash costs its rows alone; transformers and vLLM in --dtype."""
    common = {"checkpoint": str(folder), "dtype": args.dtype, "concurrency": list(args.concurrency),
              "prompt_len": args.prompt_len, "gen_len": args.gen_len, "repeats": args.repeats,
              "threads": args.threads or len(os.sched_getaffinity(0)), "seed": PEER_SEEDS[name]}
    if name == "llamacpp":
        return [common | {"kind": kind, "gguf": args.gguf} for kind in args.gguf_types]
    return [common | {"kind": args.dtype}]


def bench_peer(name: str, folder: Path, args: SimpleNamespace) -> list[dict]:
    """A peer's rows, each of its runs in its own process (vLLM under --vllm-python); a run that fails, crashes or
    outlives --peer-timeout leaves a "skipped" row saying why (benchmarks/peers/launch.py)."""
    python = args.vllm_python if name == "vllm" else sys.executable
    return [row for spec in peer_specs(name, folder, args)
            for row in launch.run_peer(python, name, spec, args.peer_timeout)]


# ---- roofline, output -----------------------------------------------------------------------------------------------

def variant(rec: dict) -> tuple:
    """What a record measured, concurrency aside: its system, dtype and weight quantization."""
    return rec["system"], rec["dtype"], rec.get("quantize")


def add_roofline(records: list[dict], config: ModelConfig, args: SimpleNamespace, peaks: roofline.Peaks) -> None:
    """Each record's decode as % of the bandwidth bound (and of the tighter roofline), prefill as % of matmul peak.

    Decode context is the mean active length over the timed steps: prompt_len + gen_len / 2.
    """
    by_c = {r["concurrency"]: r for r in records  # pocketjax in the checkpoint's dtype, beside the peers
            if r["system"] == "pocketjax" and r["dtype"] == args.dtype and not r.get("quantize") and "decode_tok_s" in r}
    context = args.prompt_len + args.gen_len / 2
    for rec in records:
        if "decode_tok_s" not in rec:
            continue
        c = rec["concurrency"]
        bound = roofline.decode_bound_tok_s(config, rec["dtype"], c, context, peaks)
        flops_per_prefill = roofline.prefill_flops(config, c, args.prompt_len)
        prefill_s = c * args.prompt_len / rec["prefill_tok_s"]
        same_system_c1 = next((r for r in records if variant(r) == variant(rec) and r["concurrency"] == 1
                               and "decode_tok_s" in r), None)
        rec.update({
            "decode_ratio_vs_c1": rec["decode_tok_s"] / same_system_c1["decode_tok_s"] if same_system_c1 else None,
            "prefill_ratio_vs_c1": rec["prefill_tok_s"] / same_system_c1["prefill_tok_s"] if same_system_c1 else None,
            "decode_bytes_per_step": bound["step_bytes"],
            "achieved_decode_gb_s": bound["step_bytes"] * rec["decode_tok_s"] / c / 1e9,
            "bandwidth_bound_tok_s": bound["bandwidth_bound_tok_s"],
            "roofline_tok_s": bound["roofline_tok_s"],
            "pct_bandwidth_roofline": 100 * rec["decode_tok_s"] / bound["bandwidth_bound_tok_s"],
            "pct_roofline": 100 * rec["decode_tok_s"] / bound["roofline_tok_s"],
            "prefill_flops": flops_per_prefill,
            "achieved_prefill_gflop_s": flops_per_prefill / prefill_s / 1e9,
            "pct_matmul_peak": 100 * flops_per_prefill / prefill_s / peaks.matmul_flop_s,
        })
        if rec.get("phase_read_bytes_s"):
            rec["pct_phase_bandwidth"] = 100 * rec["achieved_decode_gb_s"] * 1e9 / rec["phase_read_bytes_s"]
        if rec.get("quantize"):  # the roofline counts float weights: no bandwidth share for quantized ones
            for key in ("decode_bytes_per_step", "achieved_decode_gb_s", "bandwidth_bound_tok_s", "roofline_tok_s",
                        "pct_bandwidth_roofline", "pct_roofline", "pct_phase_bandwidth"):
                rec[key] = None
        if rec["system"] != "pocketjax" and c in by_c:
            rec["pocketjax_decode_speedup"] = by_c[c]["decode_tok_s"] / rec["decode_tok_s"]
            if rec.get("phase_read_bytes_s") and by_c[c].get("phase_read_bytes_s"):  # as if both had one bandwidth
                rec["pocketjax_decode_speedup_equal_bandwidth"] = (
                    rec["pocketjax_decode_speedup"] * rec["phase_read_bytes_s"] / by_c[c]["phase_read_bytes_s"])


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(records: list[dict]) -> str:
    head = ("| system | dtype | conc | prefill tok/s | decode tok/s | decode x c1 | ms/step | fwd / lm_head / "
            "sampler / host ms | % BW roofline | % BW of own probe | % matmul peak (prefill) |")
    lines = [head, "|" + "---|" * 4 + "---:|" * 7]
    for r in records:
        if "skipped" in r:  # a peer that could not run: why, in place of its numbers
            why = str(r["skipped"]).replace("|", "/")
            lines.append(f"| {r['system']} | {r.get('dtype') or '-'} | - | skipped: {why} |" + " |" * 7)
            continue
        if "decode_tok_s" not in r:
            continue
        split = ("-" if "forward_ms" not in r else
                 f"{r['forward_ms']:.1f} / {r['lm_head_ms']:.1f} / {r['sampler_ms']:.1f} / {r['host_ms']:.1f}")
        dtype = r["dtype"] + (f" {r['quantize']}" if r.get("quantize") else "")
        lines.append(f"| {r['system']} | {dtype} | {r['concurrency']} | {fmt(r['prefill_tok_s'], '.1f')} | "
                     f"{fmt(r['decode_tok_s'], '.2f')} | {fmt(r.get('decode_ratio_vs_c1'), '.2f')} | "
                     f"{fmt(r.get('decode_step_ms'), '.1f')} | {split} | "
                     f"{fmt(r.get('pct_bandwidth_roofline'), '.1f')} | {fmt(r.get('pct_phase_bandwidth'), '.1f')} | "
                     f"{fmt(r.get('pct_matmul_peak'), '.1f')} |")
    return "\n".join(lines)


def summary_lines(result: dict) -> list[str]:
    m, p = result["machine"], result["machine"]["peaks"]
    out = [f"machine: {m['cpu']}, {m['usable_cores']} usable cores, jax {m['jax']} ({m['jax_backend']}), "
           f"torch {m['torch']}, loadavg {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}",
           f"cpu: {m.get('cpu_vendor')} family {m.get('cpu_family')} model {m.get('cpu_model')}, ISA "
           f"{' '.join(m.get('isa_flags') or []) or '?'}; native kernels {m.get('cpu_kernels')}",
           f"peaks: read bandwidth {p['bandwidth_bytes_s'] / 1e9:.2f} GB/s (start "
           f"{m['peaks_start']['bandwidth_bytes_s'] / 1e9:.2f}, end {m['peaks_end']['bandwidth_bytes_s'] / 1e9:.2f}: "
           f"spread {100 * m['bandwidth_spread']:.1f}%; copy {p['copy_bytes_s'] / 1e9:.2f}), matmul "
           f"{p['matmul_flop_s'] / 1e9:.1f} GFLOP/s ({p['matmul_dtype']}, n={p['matmul_n']})"]
    c1 = next((r for r in result["records"] if r["system"] == "pocketjax" and r["concurrency"] == 1), None)
    if c1 and c1.get("decode_bytes_per_step"):  # (None for quantized weights)
        out.append(f"batch-1 decode reads {c1['decode_bytes_per_step'] / 1e6:.1f} MB/step -> bound "
                   f"{c1['bandwidth_bound_tok_s']:.1f} tok/s; pocketjax reaches {c1['pct_bandwidth_roofline']:.1f}% "
                   f"({c1['achieved_decode_gb_s']:.2f} GB/s)")
    if c1 and "batched_vs_minimal_ratio" in c1:
        out.append(f"issue 3 (a): engine c=1 {c1['engine_c1_ms_per_token']:.2f} ms/token vs minimal loop "
                   f"{c1['minimal_loop_ms_per_token']:.2f} (async {c1['minimal_loop_async_ms_per_token']:.2f}) -> "
                   f"ratio {c1['batched_vs_minimal_ratio']:.3f} (target <= 1.05); same tokens: "
                   f"{c1['minimal_loop_tokens_match']}")
        out.append(f"issue 3 (b): step at max_seq_len {c1['max_seq_len']} -> {2 * c1['max_seq_len']}: "
                   f"{c1['engine_c1_ms_per_token']:.2f} -> {c1['doubled_max_seq_len_step_ms']:.2f} ms, ratio "
                   f"{c1['doubled_max_seq_len_ratio']:.3f} (target < 1.10)")
    return out


def plot(records: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in dict.fromkeys(r["system"] for r in records):
        rows = sorted((r for r in records if r["system"] == system and "decode_tok_s" in r),
                      key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        axes[0].plot(xs, [r["decode_tok_s"] for r in rows], marker="o", label=system)
        axes[1].plot(xs, [r["prefill_tok_s"] for r in rows], marker="o", label=system)
    for ax, what in zip(axes, ("decode", "prefill")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(f"{what} tokens/s")
        ax.set_title(f"{what}: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: dict, config: ModelConfig, args: SimpleNamespace, peaks: roofline.Peaks) -> None:
    """Fill the roofline fields and the end load; write the JSON if asked."""
    add_roofline(result["records"], config, args, peaks)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    write_json(args.json, result)


def run_benchmark(args: argparse.Namespace | dict | None = None, **kwargs) -> dict:
    """Run the whole benchmark; returns {"machine": {...}, "records": [...]} (also written to --json if given)."""
    args = resolve_args(args, **kwargs)
    folder = model_folder(args.model, args.cache_dir, args.dtype)
    print(f"bench: {args.model} ({folder}) {args.dtype}, concurrency {args.concurrency}, prompt {args.prompt_len}, "
          f"gen {args.gen_len}, {args.repeats} repeats, max_seq_len {args.max_seq_len}", flush=True)
    t0 = time.perf_counter()
    measure = partial(roofline.measure_peaks, args.dtype, probe_bytes=(256 << 20) if args.quick else (1 << 30),
                      matmul_n=1024 if args.quick else 2048)
    peaks = measure()
    machine = machine_info(args, peaks)
    phases = machine["phase_s"] = {"peaks": time.perf_counter() - t0}
    result = {"machine": machine, "records": []}
    records = result["records"]

    def probed(rows: list[dict], read_bytes_s: float) -> list[dict]:
        """Each record with the read bandwidth measured just before its system ran: on a shared box it drifts by
        10-15% within one run, so systems compare fairly only against their own probe."""
        return [r | {"phase_read_bytes_s": read_bytes_s} for r in rows]

    probe_bytes = (256 << 20) if args.quick else (1 << 30)
    for load_dtype in args.load_dtypes:
        for quantize in args.quantize:
            for forms in args.forms:
                t0 = time.perf_counter()
                bandwidth = max(roofline.read_bandwidth(probe_bytes, 4).values())
                rows, config = bench_pocketjax(folder, args, load_dtype, quantize, forms)
                records += probed(rows, bandwidth)
                phases[f"pocketjax-{load_dtype}-{quantize or 'float'}-{forms}"] = time.perf_counter() - t0
                save(result, config, args, peaks)  # after each system: a long run that is stopped keeps its rows
    for name in args.peers:
        t0 = time.perf_counter()
        bandwidth = max(roofline.read_bandwidth(probe_bytes, 4).values())
        records += probed(bench_peer(name, folder, args), bandwidth)
        phases[name] = time.perf_counter() - t0
        save(result, config, args, peaks)
    t0 = time.perf_counter()
    end_peaks = measure()  # again at the end: the best of the two counts (neighbours only ever lower a peak)
    machine["peaks_start"], machine["peaks_end"] = asdict(peaks), asdict(end_peaks)
    machine["bandwidth_spread"] = roofline.spread(peaks, end_peaks)
    peaks = roofline.best_of(peaks, end_peaks)
    machine["peaks"] = asdict(peaks)
    phases["peaks"] += time.perf_counter() - t0
    save(result, config, args, peaks)
    if args.plot:
        plot(records, args.plot, f"{args.model} {args.dtype}, prompt {args.prompt_len}, gen {args.gen_len}")
    print("\n".join(summary_lines(result)))
    print()
    print(markdown_table(records), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:  # `pocketjax bench -- --quick`: the CLI passes its separator through
        argv = argv[1:]
    return run_benchmark(vars(build_parser(suppress_defaults=True).parse_args(argv)))


if __name__ == "__main__":
    main()
