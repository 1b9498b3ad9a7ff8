"""Train a small Qwen3 on the Python standard library: the embedded default model, built offline.

The README's first command, the notebooks and the tests need a model that writes real text without a download.
This module trains one through the very `forward_logits` the engine serves (so what is trained is exactly what is
loaded), and writes it as a complete Hugging Face folder that transformers loads as-is — the embedded model is
checked against the same reference code as released Qwen checkpoints.

    python -m pocketjax.training.train --tiny --out pocketjax/assets/pocket-coder   # ~30 min on 2 idle cores

rebuilds the committed asset (4000 steps of 8 x 256 tokens, seed 0; add --minutes M to fit a budget instead) and
measures it (`evaluation.evaluate_model`: held-out perplexity, function headers that complete to parsing code).

Functions are pure over explicit pytrees: `init_params`, `loss`, `train`, `evaluate`, `greedy`, `save_checkpoint`.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..model.checkpoint import nest, param_tensors, write_safetensors
from ..model.config import ModelConfig
from ..model.decoder import Params, forward_logits, loss
from .data import encode_windows, shuffled_batches
from .evaluation import evaluate, evaluate_model

# The embedded model's recipe, sized by measurement: two idle CPU cores train ~5,000 tokens/s at this size and
# batch 8 (one shared core at batch 4: ~700), so ~30 minutes buy 8.2M tokens, 2.3 passes over the 3.5M-token
# stdlib. For that compute (~2e14 FLOPs) a compute-optimal model is a few million parameters, which is where four
# layers and a 4096 vocabulary (a cheap output layer) sit; float32 weights (4.2M params, 17 MB) fit the asset
# budget, so nothing is lost to rounding. 1.2M tokens gave held-out perplexity 43; 8.2M: see train_report.json.
TINY_ARCH: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
)
TINY_RECIPE: dict[str, Any] = dict(
    vocab_size=4096, seq_len=256, batch_size=8, steps=4000, lr=2e-3, warmup=50, weight_decay=0.1, clip=1.0,
    final_lr_fraction=0.1, holdout_every=50, seed=0, dtype="float32",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
Log = Callable[[str], None]


# ---------------------------------------------------------------------------------------------------------------
# Parameters


def init_params(config: ModelConfig, key: jax.Array, std: float = 0.02, dtype=jnp.float32) -> Params:
    """A fresh params pytree, Qwen-style: normal(0, std) linears and embedding, ones for norms, zeros for biases.

    Each tensor draws from `fold_in(key, its index)`, so adding a tensor never reshuffles the others.
    """

    def init(i: int, name: str, shape: tuple[int, ...]) -> jax.Array:
        if name.endswith("norm.weight"):
            return jnp.ones(shape, dtype)
        if name.endswith(".bias"):
            return jnp.zeros(shape, dtype)
        return (std * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(dtype)

    return nest(config, ((path, init(i, name, shape)) for i, (path, name, shape) in enumerate(param_tensors(config))))


def count_params(params: Params) -> int:
    """Number of scalars in the pytree (a tied embedding is one tensor, so it counts once)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------------------------------------------
# Optimizer


def decay_mask(params: Params) -> Any:
    """Weight decay on matrices only (linears, embedding); norms and biases are left alone."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def adam_direction(weight_decay: float, clip: float, b1: float = 0.9, b2: float = 0.95) -> optax.GradientTransformation:
    """AdamW up to the learning rate: clip by global norm, Adam moments, decoupled weight decay.

    `optax.adamw` with the learning rate applied by the step instead of baked in: the schedule's length can then
    be fixed after the step is compiled (the --minutes budget is measured, not guessed).
    """
    return optax.chain(optax.clip_by_global_norm(clip), optax.scale_by_adam(b1=b1, b2=b2, eps=1e-8),
                       optax.add_decayed_weights(weight_decay, mask=decay_mask))


def lr_schedule(lr: float, warmup: int, steps: int, final_fraction: float = 0.1) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` steps, then cosine decay to `final_fraction * lr` at `steps`."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
                                              end_value=lr * final_fraction)


@lru_cache(maxsize=8)
def make_step(config: ModelConfig, weight_decay: float, clip: float):
    """The jitted update: (params, opt_state, tokens [B, T], lr) -> (params, opt_state, loss, grad norm).

    Params and optimizer state are donated, so XLA updates them in place instead of holding two copies. Cached
    per (config, hyperparameters), so repeated `train` calls reuse the compiled step.
    """
    optimizer = adam_direction(weight_decay, clip)

    def step(params, opt_state, tokens, lr):
        value, grads = jax.value_and_grad(loss)(params, tokens, config)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
        return params, opt_state, value, optax.tree.norm(grads)

    return jax.jit(step, donate_argnums=(0, 1))


def train(config: ModelConfig, batches: Iterable[np.ndarray], steps: int, lr: float, warmup: int, *,
          params: Params | None = None, seed: int = 0, weight_decay: float = 0.1, clip: float = 1.0,
          final_lr_fraction: float = 0.1, minutes: float | None = None, log_every: int = 50,
          log: Log | None = print) -> tuple[Params, list[dict]]:
    """Train with AdamW + warmup/cosine; returns (params, history of logged {step, loss, lr, grad_norm, tok_s}).

    Starts from `params` when given (left untouched), else from `init_params(config, key(seed))`.
    `batches` yields int arrays [B, T]. With `minutes`, the step time is measured during warmup and `steps` is
    cut to what fits the budget; warmup does not depend on `steps`, so the run equals one started with the
    final step count (logged), and a hard stop at 110% of the budget guards against a slowed machine.
    """
    # A copy, because the step donates its input: the caller's arrays stay valid.
    params = init_params(config, jax.random.key(seed)) if params is None else jax.tree.map(jnp.copy, params)
    opt_state = adam_direction(weight_decay, clip).init(params)
    step = make_step(config, weight_decay, clip)
    schedule = lr_schedule(lr, warmup, steps, final_lr_fraction)
    calibrate_at = max(2, warmup)
    history: list[dict] = []
    losses: list[jax.Array] = []
    batches = iter(batches)
    start = time.perf_counter()
    t_first = t_log = start
    tokens_since_log = 0
    i = 0
    while i < steps:
        batch = np.asarray(next(batches), np.int32)
        params, opt_state, value, grad_norm = step(params, opt_state, batch, jnp.float32(schedule(i)))
        losses.append(value)
        tokens_since_log += batch.shape[0] * (batch.shape[1] - 1)
        i += 1
        if i == 1:  # the first step includes compilation; time from here on
            value.block_until_ready()
            t_first = t_log = time.perf_counter()
            tokens_since_log = 0
            if log:
                log(f"compiled the train step in {t_first - start:.1f}s")
        if minutes is not None and i == calibrate_at:
            value.block_until_ready()
            per_step = (time.perf_counter() - t_first) / (i - 1)
            fit = int((minutes * 60 - (time.perf_counter() - start)) / per_step) + i
            if fit < steps:
                steps = max(fit, i)
                schedule = lr_schedule(lr, warmup, steps, final_lr_fraction)
            if log:
                log(f"{per_step:.2f}s/step: training for {steps} steps (reproduce with --steps {steps})")
        out_of_time = minutes is not None and time.perf_counter() - start > 1.1 * minutes * 60 and i < steps
        if i % log_every == 0 or i == steps or out_of_time:
            mean = float(jnp.mean(jnp.stack(losses)))
            now = time.perf_counter()
            record = dict(step=i, loss=mean, lr=float(schedule(i - 1)), grad_norm=float(grad_norm),
                          tok_s=tokens_since_log / max(now - t_log, 1e-9), elapsed_s=now - start)
            history.append(record)
            losses, t_log, tokens_since_log = [], now, 0
            if log:
                log("step {step:6d}  loss {loss:.4f}  lr {lr:.2e}  |g| {grad_norm:.2f}  {tok_s:.0f} tok/s  "
                    "{elapsed_s:.0f}s".format(**record))
        if out_of_time:
            if log:
                log(f"stopped at step {i} of {steps}: past 110% of the {minutes} minute budget")
            break
    return params, history


def greedy(params: Params, config: ModelConfig, prompt: Sequence[int], max_new_tokens: int,
           stop_ids: Sequence[int] = (), bucket: int = 64) -> list[int]:
    """The greedy continuation of `prompt` (new ids only) by repeated full forwards, no cache.

    The sequence is right-padded to a multiple of `bucket`: causal attention makes the padding invisible to
    the real positions, and one shape per bucket keeps recompiles rare. A reference, not a fast path.
    """
    ids = list(prompt)
    for _ in range(max_new_tokens):
        length = len(ids)
        padded = np.zeros((1, -(-length // bucket) * bucket), np.int32)
        padded[0, :length] = ids
        next_id = int(jnp.argmax(forward_logits(params, config, jnp.asarray(padded))[0, length - 1]))
        ids.append(next_id)
        if next_id in stop_ids:
            break
    return ids[len(prompt):]


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face folder


def hf_config(arch: dict[str, Any], vocab_size: int, eos_token_ids: Sequence[int], bos_token_id: int | None,
              pad_token_id: int | None = None, dtype: str = "float32", tie_word_embeddings: bool = True
              ) -> dict[str, Any]:
    """A Qwen3 config.json dict that transformers 4 and 5 and `ModelConfig.from_dict` all read the same way.

    Both spellings of dtype (`torch_dtype`, `dtype`) and of RoPE (`rope_theta`, `rope_parameters`) are written,
    with equal values, so older and newer readers agree.
    """
    theta = float(arch.get("rope_theta", 10000.0))
    layers = arch["num_hidden_layers"]
    eos = list(eos_token_ids)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": arch["hidden_size"],
        "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_key_value_heads"],
        "head_dim": arch["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": arch.get("max_position_embeddings", 2048),
        "rms_norm_eps": arch.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": pad_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def generation_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the config's special ids and sampling defaults that suit a small code model."""
    return {
        "bos_token_id": config_dict.get("bos_token_id"),
        "eos_token_id": config_dict.get("eos_token_id"),
        "pad_token_id": config_dict.get("pad_token_id"),
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.95,
        "repetition_penalty": 1.0,
    }


def save_checkpoint(params: Params, config_dict: dict[str, Any], out_dir: str | Path,
                    tokenizer_dir: str | Path | None = None) -> Path:
    """Write a complete Hugging Face folder: config.json, model.safetensors, generation_config.json (+ tokenizer).

    Weights are stored in the config's dtype (`dtype`/`torch_dtype`, default float32) under HF names, in HF's layout
    (as loaded: linears [out, in]); a tied model stores no lm_head.weight. Tokenizer files are copied from
    `tokenizer_dir` when given. Returns the folder.
    """
    config = ModelConfig.from_dict(config_dict)
    dtype = np.dtype(jnp.dtype(config.dtype))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, name, _ in param_tensors(config):
        value = params
        for key in path:
            value = value[key]
        tensors[name] = np.ascontiguousarray(np.asarray(jnp.asarray(value).astype(dtype)))
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    write_json(out / "config.json", config_dict)
    write_json(out / "generation_config.json", generation_config(config_dict))
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != out.resolve():
        for file in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / file).exists():
                shutil.copyfile(Path(tokenizer_dir) / file, out / file)
    return out


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def round_to(params: Params, dtype: str) -> Params:
    """Params rounded to `dtype` and back to float32: exactly what a checkpoint saved in `dtype` loads as."""
    return jax.tree.map(lambda x: x.astype(dtype).astype(jnp.float32), params)


# ---------------------------------------------------------------------------------------------------------------
# Command line

SAMPLE_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):\n")


def train_tiny(out: Path, minutes: float | None, recipe: dict[str, Any], arch: dict[str, Any],
               log: Log = print) -> dict[str, Any]:
    """The embedded-model recipe end to end (tokenizer, packed data, training, evaluation, folder); the report."""
    from .bpe import EOS_TOKEN, PAD_TOKEN, split_holdout, stdlib_corpus, train_tokenizer

    t0 = time.perf_counter()
    texts = stdlib_corpus()
    train_texts, held_texts = split_holdout(texts, every=recipe["holdout_every"])
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_tokenizer(train_texts, recipe["vocab_size"], tmp)
        eot, im_end = tokenizer.token_id(PAD_TOKEN), tokenizer.token_id(EOS_TOKEN)
        train_windows, held_windows = (encode_windows(tokenizer, t, eot, recipe["seq_len"])
                                       for t in (train_texts, held_texts))
        train_tokens = train_windows.shape[0] * recipe["seq_len"]
        log(f"corpus: {len(train_texts)} train / {len(held_texts)} held-out files, {train_tokens} / "
            f"{held_windows.shape[0] * recipe['seq_len']} tokens, vocab {tokenizer.vocab_size} "
            f"({time.perf_counter() - t0:.0f}s)")

        config_dict = hf_config(arch, tokenizer.vocab_size, (eot, im_end), bos_token_id=eot, pad_token_id=eot,
                                dtype=recipe["dtype"])
        config = ModelConfig.from_dict(config_dict)
        log(f"model: {config.num_params() / 1e6:.2f}M params, {json.dumps(arch)}")
        batches = shuffled_batches(train_windows, recipe["batch_size"], recipe["seed"])
        t_train = time.perf_counter()
        params, history = train(config, batches, recipe["steps"], recipe["lr"], recipe["warmup"],
                                seed=recipe["seed"], weight_decay=recipe["weight_decay"], clip=recipe["clip"],
                                final_lr_fraction=recipe["final_lr_fraction"], minutes=minutes, log=log)
        train_s = time.perf_counter() - t_train
        steps_done = history[-1]["step"]

        saved = round_to(params, recipe["dtype"])
        held_loss = evaluate(saved, config, held_windows, recipe["batch_size"])
        samples = {p: tokenizer.decode(greedy(saved, config, tokenizer.encode(p), 48, (eot, im_end)),
                                       skip_special_tokens=False) for p in SAMPLE_PROMPTS}
        report = {
            "recipe": recipe, "arch": arch, "params": count_params(params), "steps": steps_done,
            "data": {"source": f"the .py files of Python {sys.version.split()[0]}'s standard library (bpe.stdlib_files)",
                     "train_files": len(train_texts), "held_out_files": len(held_texts),
                     "held_out_tokens": int(held_windows.shape[0] * recipe["seq_len"])},
            "tokens_seen": steps_done * recipe["batch_size"] * recipe["seq_len"],
            "train_tokens_per_epoch": int(train_tokens), "train_seconds": round(train_s, 1),
            "final_train_loss": history[-1]["loss"], "held_out_loss": held_loss,
            "held_out_perplexity": math.exp(held_loss), "samples": samples,
            "command": f"python -m pocketjax.training.train --tiny --out {out} --steps {steps_done}",
            "jax_version": jax.__version__, "history": history,
        }
        save_checkpoint(params, config_dict, out, tokenizer_dir=tmp)
    report["evaluation"] = evaluate_model(out, recipe["holdout_every"], recipe["seq_len"])
    write_json(out / "train_report.json", report)
    (out / "README.md").write_text(model_card(out.name, report), encoding="utf-8")
    log(f"held-out loss {held_loss:.4f}, perplexity {math.exp(held_loss):.2f}; {steps_done} steps, "
        f"{report['tokens_seen'] / 1e6:.1f}M tokens in {train_s / 60:.1f} min")
    for prompt, text in samples.items():
        log(f"--- greedy: {prompt!r}\n{prompt}{text}")
    log(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")
    return report


def model_card(name: str, report: dict[str, Any]) -> str:
    """README.md for the folder: what the model is, how to rebuild it, how good it is."""
    sample = next(iter(report["samples"].items()))
    return (
        f"# {name}\n\n"
        f"pocketjax's embedded model: a {report['params'] / 1e6:.1f}M-parameter Qwen3 decoder with a "
        f"{report['recipe']['vocab_size']}-token byte-level BPE, both trained from scratch on the Python "
        f"standard library's source (PSF License). It completes Python code; it is a test and demo model, "
        f"not an assistant.\n\n"
        f"- rebuild: `{report['command']}` (CPU, fixed seed {report['recipe']['seed']})\n"
        f"- {report['steps']} steps, {report['tokens_seen'] / 1e6:.2f}M tokens, "
        f"{report['train_seconds'] / 60:.0f} min on a 2-core CPU; context trained: {report['recipe']['seq_len']}\n"
        f"- final train loss {report['final_train_loss']:.3f}; held-out loss {report['held_out_loss']:.3f} "
        f"(perplexity {report['held_out_perplexity']:.1f}) on every {report['recipe']['holdout_every']}th file\n"
        + (f"- {report['evaluation']['parse_rate']:.0%} of 50 held-out function headers complete (greedy, 48 tokens, "
           f"cut at the first blank line) to code that `ast.parse` accepts\n" if "evaluation" in report else "")
        + "\n"
        f"Greedy sample:\n\n```python\n{sample[0]}{sample[1]}\n```\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pocketjax.training.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", required=True,
                        help="the embedded-model recipe: BPE tokenizer + small Qwen3 trained on the Python stdlib")
    parser.add_argument("--out", required=True, type=Path, help="output Hugging Face folder")
    parser.add_argument("--steps", type=int, default=TINY_RECIPE["steps"],
                        help="optimizer steps (the cosine schedule's length)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="training-time budget: cut --steps to what fits, measured during warmup")
    parser.add_argument("--seed", type=int, default=TINY_RECIPE["seed"])
    parser.add_argument("--batch-size", type=int, default=TINY_RECIPE["batch_size"])
    parser.add_argument("--lr", type=float, default=TINY_RECIPE["lr"])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=TINY_RECIPE["dtype"],
                        help="dtype of the saved weights (training is float32)")
    args = parser.parse_args(argv)
    recipe = {**TINY_RECIPE, "steps": args.steps, "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
              "dtype": args.dtype}
    train_tiny(args.out, args.minutes, recipe, TINY_ARCH)
    return 0


if __name__ == "__main__":
    sys.exit(main())
