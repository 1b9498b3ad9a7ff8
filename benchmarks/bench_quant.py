"""Quantization: weight bytes, KV cache bytes, perplexity and decode speed of int8 / int4 weights and int8 / float8
KV caches next to bfloat16 and float32. Prints a markdown table last; `--json` writes every record.

    python benchmarks/bench_quant.py                       # embedded model if present, else the qwen3-tiny preset
    python benchmarks/bench_quant.py --model PATH --json out/quant.json --gen-len 32 --concurrency 1,4

Perplexity: on the embedded model's own held-out split (every 50th stdlib file, through its tokenizer) when the
folder has a tokenizer; for a random-weight preset, on sequences sampled from the float32 model itself (temperature
1), so the float perplexity is the model's own entropy and any increase is what quantization costs. Quantized
variants compute in float32 there, so the figure isolates the quantization error. Decode tok/s: greedy, warm (one
untimed round compiles every shape), variants interleaved round by round over --repeats rounds; the best and the
median round are reported. On a shared CPU box these numbers are noisy: compare within one run only.

GGUF (`--gguf-types`, default float32,q8_0,q4_0,q4_k_m): llama.cpp's perplexity of the same checkpoint written as
GGUF (Q4_0 / Q4_K_M by llama-cpp-python's own quantizer from the float32 GGUF) on the same tokens, each encoding in
its own process (benchmarks/peers/llamacpp_peer.py), beside int4 and int4 with an int8 KV cache; a row says
"skipped" with the reason where llama-cpp-python is missing or the process failed. The float32 GGUF's perplexity
matching ours checks the conversion. Their speed beside pocketjax int4: bench_engine.py --quantize int4 --peers
llamacpp (--gguf-types then defaults to q4_0,q4_k_m beside --dtype).

Outliers (`--outliers 30,300`, the default): the perplexity rows again on copies of the model whose two channels are
planted 30x / 300x larger through every RMSNorm weight and their input columns of q/k/v and gate/up as much smaller
(`presets.plant_outliers(compensate=True)`: the same float function, so the same float perplexity), the "massive
activations" real Qwen checkpoints have and the embedded model lacks; each copy against its own float32 model, next to "int8 weights
alone" (the int8-rounded weights in a float product), the error int8's integer product is to stay near.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pocketjax as pj  # noqa: E402
from benchmarks.common import (DEFAULT_CACHE_DIR, add_options, machine, markdown_table, model_folder,  # noqa: E402
                               parse_ints, write_json)
from benchmarks.peers import launch  # noqa: E402
from benchmarks.presets import GGUF_TYPES, plant_outliers  # noqa: E402
from pocketjax.model import decoder, quant  # noqa: E402
from pocketjax.engine.engine import Engine  # noqa: E402
from pocketjax.engine.request import BatchedRequest  # noqa: E402
from pocketjax.model.decoder import forward_logits  # noqa: E402
from pocketjax.engine.sampling_params import SamplingParams  # noqa: E402

EMBEDDED = Path(__file__).resolve().parent.parent / "pocketjax" / "assets" / "pocket-coder"
# (compute dtype, weight quantization, KV cache dtype)
SPEED_VARIANTS = [("float32", None, None), ("bfloat16", None, None), ("float32", "int8", None),
                  ("float32", "int4", None), ("bfloat16", "int8", None), ("bfloat16", "int4", None),
                  ("float32", None, "int8"), ("bfloat16", None, "int8"), ("bfloat16", None, "float8_e4m3fn")]
PPL_MODES = [None, "int8", "int4", "int8+head", "int4+head", "int4+head8"]
KV_MODES = ["int8", "float8_e4m3fn"]
SEED_64L = dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8)


def resolve_model(name: str | None) -> Path:
    if name is None:
        return EMBEDDED if (EMBEDDED / "config.json").exists() else model_folder("qwen3-tiny")
    return model_folder(name)


def weight_bytes(model: pj.Model) -> tuple[int, int]:
    """(bytes of the linear layers, bytes of every parameter)."""
    linear = sum(quant_nbytes(p[k]) for p in model.params["layers"] for k in quant.LINEAR_NAMES)
    return linear, sum(int(leaf.nbytes) for leaf in jax.tree.leaves(model.params))


def one_digit(flat):
    """The int8 activations as first landed (W8A8: one int8 digit per row, scale max|row| / 127), what two digits
    replaced; `tests/test_quant.py` shows the outlier bounds fail with it."""
    digits, step = TWO_DIGITS(flat)
    return digits.at[flat.shape[0]:].set(0), step


TWO_DIGITS = quant.activation_digits
ACTIVATION_FORMS = {"int8, XLA's form (two digits)": TWO_DIGITS, "int8, one digit (W8A8)": one_digit}


@contextlib.contextmanager
def activations_as(digits_fn):
    """Run `pj.logits` in XLA's forms (where int8 is XLA's integer dot: a mesh, no compiler; the native kernel keeps
    activations whole) with `digits_fn` as `quant.activation_digits` (jit caches cleared on the way in and out)."""
    impl = decoder.logits_impl
    quant.activation_digits = digits_fn
    decoder.logits_impl = lambda mesh=None: "xla"
    jax.clear_caches()
    try:
        yield
    finally:
        quant.activation_digits = TWO_DIGITS
        decoder.logits_impl = impl
        jax.clear_caches()


def rounded(model: pj.Model) -> pj.Model:
    """The model of its quantized weights' rounding alone: each dequantized, multiplied in float."""
    return dataclasses.replace(model, params=quant.dequantize_params(model.params, model.dtype))


def quant_nbytes(w) -> int:
    return w.nbytes if isinstance(w, quant.QuantizedWeight) else int(w.nbytes)


def eval_tokens(folder: Path, config, seqs: int, length: int) -> tuple[np.ndarray, str]:
    """[seqs, length] tokens to score, and where they come from."""
    if (folder / "tokenizer.json").exists():  # the embedded model's own held-out split (every 50th stdlib file)
        from pocketjax.training.bpe import PAD_TOKEN, split_holdout, stdlib_corpus
        from pocketjax.serve.tokenizer import Tokenizer
        from pocketjax.training.data import encode_windows
        tokenizer = Tokenizer.from_folder(folder)
        held = split_holdout(stdlib_corpus(), every=50)[1]
        windows = encode_windows(tokenizer, held, tokenizer.token_id(PAD_TOKEN), length - 1)
        if len(windows) >= seqs:
            pick = np.linspace(0, len(windows) - 1, seqs).astype(int)
            return windows[pick], f"{seqs} held-out stdlib windows of {length}"
    model = pj.load_model(folder, dtype="float32")
    engine = Engine(model, max_batch_size=seqs, max_seq_len=length + 16, prefill_chunk=64)
    rng = np.random.default_rng(0)
    reqs = [BatchedRequest(i, [int(t) for t in rng.integers(0, config.vocab_size, 4)],
                           SamplingParams(max_tokens=length - 4, temperature=1.0, seed=i, ignore_eos=True))
            for i in range(seqs)]
    for r in reqs:
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        engine.batch_decode_step(reqs)
    return np.asarray([list(r.prompt_tokens) + r.generated_tokens for r in reqs], np.int32), \
        "sampled from the float32 model (random weights)"


def perplexity(model: pj.Model, tokens: np.ndarray, kv_dtype: str | None = None) -> float:
    logits = np.asarray(pj.logits(model, tokens[:, :-1], kv_dtype=kv_dtype), np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    nll = -np.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
    return float(np.exp(nll))


def decode_cycle(engine: Engine, concurrency: int, prompt_len: int, gen_len: int, rng) -> float:
    """One greedy prefill + decode of `concurrency` requests; returns the decode tokens/s."""
    reqs = [BatchedRequest(i, [int(t) for t in rng.integers(0, engine.model.config.vocab_size, prompt_len)],
                           SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True))
            for i in range(concurrency)]
    for r in reqs:
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    start = time.perf_counter()
    while not all(r.finished for r in reqs):
        engine.batch_decode_step(reqs)
    elapsed = time.perf_counter() - start
    for r in reqs:
        engine.free_slot(r.request_id)
    return concurrency * (gen_len - 1) / elapsed


def decode_speeds(models: dict[str, tuple[pj.Model, str | None]], concurrency: int, prompt_len: int, gen_len: int,
                  repeats: int) -> dict[str, tuple[float, float]]:
    """{variant: (best, median) warm decode tokens/s} for {variant: (model, kv_dtype)}. Variants are interleaved
    round by round, so a burst of load from other processes hits all of them alike; the best round is the least
    disturbed one."""
    engines = {name: Engine(m, max_batch_size=concurrency, max_seq_len=max(128, prompt_len + gen_len),
                            prefill_chunk=64, kv_dtype=kv) for name, (m, kv) in models.items()}
    rng = np.random.default_rng(1)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(repeats + 1):  # round 0 compiles every shape
        for name, engine in engines.items():
            rate = decode_cycle(engine, concurrency, prompt_len, gen_len, rng)
            if round_:
                rates[name].append(rate)
    return {name: (max(r), statistics.median(r)) for name, r in rates.items()}


def gguf_perplexities(folder: Path, tokens: np.ndarray, kinds: list[str], base: float, source: str) -> list[dict]:
    """llama.cpp's perplexity of each GGUF encoding of `folder` on `tokens` (benchmarks/peers/llamacpp_peer.py, one
    process per encoding: a crash costs that row only), against pocketjax's float32 perplexity `base`. The GGUFs
    (Q4_0 / Q4_K_M by llama.cpp's own quantizer from the float32 one) go to the cache dir, never the model's folder."""
    rows = []
    for kind in kinds:
        spec = {"task": "perplexity", "checkpoint": str(folder), "dtype": "float32", "kind": kind, "seed": 0,
                "tokens": tokens.tolist(), "threads": len(os.sched_getaffinity(0)),
                "gguf_dir": str(Path(DEFAULT_CACHE_DIR) / f"{folder.name}-gguf")}
        for row in launch.run_peer(sys.executable, "llamacpp", spec, timeout=1800):
            if "skipped" in row:
                rows.append({"kind": "ppl", "variant": f"llama.cpp {kind} GGUF", "ppl": None, "increase": None,
                             "skipped": row["skipped"], "source": source})
            else:
                rows.append(row | {"ppl": row["ppl"], "increase": row["ppl"] / base - 1, "source": source})
    return rows


def forward_temp_bytes(model: pj.Model, length: int = 64) -> int:
    """XLA's temporary buffer bytes for one full forward: shows whether dequantized weights pile up."""
    tokens = jnp.zeros((1, length), jnp.int32)
    return forward_logits.lower(model.params, model.config, tokens).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or a preset of benchmarks/presets.py; default: embedded")
    add_options(p, concurrency="1,4", prompt_len=32, gen_len=32, repeats=5)
    p.add_argument("--ppl-seqs", type=int, default=8)
    p.add_argument("--ppl-len", type=int, default=256)
    p.add_argument("--outliers", default="30,300",
                   help="also score copies of the model with two channels planted this many times larger through "
                        "every RMSNorm weight (presets.plant_outliers: real Qwen checkpoints' massive activations); "
                        "'' for none")
    p.add_argument("--no-speed", action="store_true", help="skip the decode speed rounds (the slow part)")
    p.add_argument("--gguf-types", default="float32,q8_0,q4_0,q4_k_m",
                   help="GGUF encodings of the same checkpoint whose llama.cpp perplexity is scored on the same "
                        f"tokens, each in its own process (of {', '.join(GGUF_TYPES)}; '' for none; needs "
                        "llama-cpp-python and gguf)")
    add_options(p, json=None)
    args = p.parse_args()
    folder = resolve_model(args.model)
    config = pj.ModelConfig.from_folder(folder)
    records: list[dict] = []

    # bytes: every variant against the bfloat16 model
    bf16_linear, bf16_total = weight_bytes(pj.load_model(folder, dtype="bfloat16"))
    for mode in PPL_MODES[1:]:
        linear, total = weight_bytes(pj.load_model(folder, dtype="bfloat16", quantize=mode))
        records.append({"kind": "weights", "variant": mode, "linear_bytes": linear, "total_bytes": total,
                        "linear_vs_bf16": linear / bf16_linear, "total_vs_bf16": total / bf16_total})
    for name, cfg in (("model, planned", config), ("64-layer seed TP2, planned", SEED_64L)):
        plans = {kv: pj.plan_memory(cfg, tp=1 if name.startswith("model") else 2, dtype="bfloat16", kv_dtype=kv)
                 for kv in ["bfloat16"] + KV_MODES}
        for kv in KV_MODES:
            records.append({"kind": "kv", "variant": f"{kv} KV ({name})", "kv_bytes": plans[kv].kv_cache,
                            "vs_bf16": plans[kv].kv_cache / plans["bfloat16"].kv_cache})
    bf16_model = pj.load_model(folder, dtype="bfloat16")
    allocated = {kv: Engine(bf16_model, max_batch_size=8, max_seq_len=1024, kv_dtype=kv).cache.nbytes
                 for kv in [None] + KV_MODES}  # the arrays an Engine really holds, scales included
    for kv in KV_MODES:
        records.append({"kind": "kv", "variant": f"{kv} KV (model, allocated 8 x 1024)", "kv_bytes": allocated[kv],
                        "vs_bf16": allocated[kv] / allocated[None]})

    # transient memory of one forward: the dequantized operand is per matmul, not per model
    for mode in (None, "int8", "int4"):
        model = pj.load_model(folder, dtype="float32", quantize=mode)
        records.append({"kind": "temp", "variant": mode or "float32", "forward_temp_bytes": forward_temp_bytes(model)})
    largest = max(int(np.prod(w.shape)) for p in model.params["layers"] for w in p.values()
                  if isinstance(w, quant.QuantizedWeight)) * 4

    # perplexity: on the model, then on copies with planted outlier channels, each against its own float32 model
    tokens, source = eval_tokens(folder, config, args.ppl_seqs, args.ppl_len)
    planted = [(f"outliers x{f:g}", plant_outliers(folder, Path(DEFAULT_CACHE_DIR) / f"{folder.name}-x{f:g}", f,
                                                    compensate=True))
               for f in (float(x) for x in args.outliers.split(",") if x)]
    for label, path in [("", folder)] + planted:
        base = None
        for mode in PPL_MODES + ["int8 weights alone", *ACTIVATION_FORMS]:
            if mode == "int8 weights alone":  # the int8-rounded weights in a float product: what int8 cannot beat
                ppl = perplexity(rounded(pj.load_model(path, dtype="float32", quantize="int8")), tokens)
            elif mode in ACTIVATION_FORMS:  # XLA's int8 form (two digits), and as first landed (one), for contrast
                with activations_as(ACTIVATION_FORMS[mode]):
                    ppl = perplexity(pj.load_model(path, dtype="float32", quantize="int8"), tokens)
            else:
                ppl = perplexity(pj.load_model(path, dtype="float32", quantize=mode), tokens)
            base = base or ppl
            records.append({"kind": "ppl", "variant": f"{mode or 'float32'}{', ' + label if label else ''}",
                            "ppl": ppl, "increase": ppl / base - 1, "source": source})
        if label:
            continue
        float_model = pj.load_model(folder, dtype="float32")
        for kv in KV_MODES:
            ppl = perplexity(float_model, tokens, kv_dtype=kv)
            records.append({"kind": "ppl", "variant": f"{kv} KV cache", "ppl": ppl, "increase": ppl / base - 1,
                            "source": source})
        ppl = perplexity(pj.load_model(folder, dtype="float32", quantize="int4"), tokens, kv_dtype="int8")
        records.append({"kind": "ppl", "variant": "int4, int8 KV cache", "ppl": ppl, "increase": ppl / base - 1,
                        "source": source})
        records += gguf_perplexities(folder, tokens, [t for t in args.gguf_types.split(",") if t], base, source)

    # decode speed
    models = {f"{mode or dtype} ({dtype} compute)" + (f", {kv} KV" if kv else ""):
              (pj.load_model(folder, dtype=dtype, quantize=mode), kv) for dtype, mode, kv in SPEED_VARIANTS}
    for c in ([] if args.no_speed else parse_ints(args.concurrency)):
        for name, (best, median) in decode_speeds(models, c, args.prompt_len, args.gen_len, args.repeats).items():
            records.append({"kind": "decode", "variant": name, "concurrency": c, "decode_tok_s": best,
                            "decode_tok_s_median": median})

    info = machine("platform", "devices", "backend", "jax", devices=jax.local_device_count(), model=str(folder),
                   layers=config.num_layers, hidden=config.hidden_size, vocab=config.vocab_size,
                   largest_dequantized_bytes=int(largest))
    write_json(args.json, {"machine": info, "records": records})
    print_table(info, records)


def print_table(info: dict, records: list[dict]) -> None:
    print(f"\nmodel {info['model']} ({info['layers']} layers, hidden {info['hidden']}, vocab "
          f"{info['vocab']}), {info['backend']} x{info['devices']}, jax {info['jax']}")
    kind = lambda k: [r for r in records if r["kind"] == k]  # noqa: E731
    print("\n" + markdown_table(["weights", "linear bytes", "vs bf16", "all bytes", "vs bf16"], (
        [r["variant"], f"{r['linear_bytes']:,}", f"{r['linear_vs_bf16']:.3f}x", f"{r['total_bytes']:,}",
         f"{r['total_vs_bf16']:.3f}x"] for r in kind("weights"))))
    print("\n" + markdown_table(["KV cache", "bytes", "vs bf16"], (
        [r["variant"], f"{r['kv_bytes']:,}", f"{r['vs_bf16']:.3f}x"] for r in kind("kv"))))
    print(f"\nlargest dequantized weight: {info['largest_dequantized_bytes']:,} bytes\n")
    print(markdown_table(["forward temp (T=64)", "bytes"], (
        [r["variant"], f"{r['forward_temp_bytes']:,}"] for r in kind("temp"))))
    ppl = kind("ppl")
    print("\n" + markdown_table([f"perplexity ({ppl[0]['source']})", "ppl", "increase"], (
        [r["variant"], f"{r['ppl']:.4f}", f"{100 * r['increase']:+.2f}%"] if r["ppl"] is not None
        else [r["variant"], f"skipped: {r['skipped']}".replace("|", "/"), "-"] for r in ppl)))
    if kind("decode"):  # none with --no-speed
        print("\n" + markdown_table(["decode (noisy shared CPU)", "concurrency", "best tok/s", "median tok/s"], (
            [r["variant"], r["concurrency"], f"{r['decode_tok_s']:.1f}", f"{r['decode_tok_s_median']:.1f}"]
            for r in kind("decode"))))


if __name__ == "__main__":
    main()
