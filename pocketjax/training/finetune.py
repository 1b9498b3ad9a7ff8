"""LoRA fine-tuning with optax: only the adapters train, the loaded weights stay frozen (and may be quantized).

    pocketjax finetune --model PATH --data FILE --rank 8 --alpha 16 --targets q,v --steps 100 --out ADAPTER_DIR

writes a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) that `pj.load_model(PATH,
lora=ADAPTER_DIR)` merges and `peft.PeftModel.from_pretrained` opens. The Python entry point is `finetune`.

The trainable set is chosen by type on the NNX view (`nnx.split(view, nnx.LoRAParam, ...)`) and the step is a plain
jitted function of (adapters, optimizer state, frozen state, tokens), both donated: the same filter trains whatever
adapters a `pocketjax.nnx.Decoder` holds, and no base Param can reach the gradient. The optimizer, schedule and
data packing are the embedded-model trainer's (`train.adam_direction`, `lr_schedule`; `data.pack`, `encode_windows`).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import RequestError
from ..model.decoder import Model, cross_entropy, load_model
from ..model.lora import TARGETS, LoraConfig, write_adapter
from ..nnx import Decoder
from ..serve.llm import DEFAULT_MODEL
from ..serve.tokenizer import Tokenizer
from .data import encode_windows, pack, shuffled_batches
from .train import Log, adam_direction, lr_schedule


def token_windows(model: Model, data: Any, seq_len: int, tokenizer: Tokenizer | None = None) -> np.ndarray:
    """Training rows int32 [N, seq_len + 1] from a text file (Path, or str naming an existing file), a list of
    token-id lists (packed, each followed by the end-of-text id), or ready rows [N, seq_len + 1]."""
    if isinstance(data, np.ndarray) and data.ndim == 2:
        rows = data.astype(np.int32)
    else:
        separator = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
        if isinstance(data, (str, Path)):
            if not Path(data).is_file():
                raise RequestError(f"training data {str(data)!r} is not a file")
            tokenizer = tokenizer or Tokenizer.from_folder(model.path)
            text = Path(data).read_text(encoding="utf-8")
            rows = encode_windows(tokenizer, [text], separator, seq_len)
        else:
            rows = pack(data, separator, seq_len)
    if rows.shape[1] != seq_len + 1:
        raise RequestError(f"token rows must be [N, seq_len + 1 = {seq_len + 1}], got {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= model.config.vocab_size):
        raise RequestError(f"token ids must lie in [0, {model.config.vocab_size})")
    return rows


def make_step(graphdef: nnx.GraphDef, clip: float):
    """The jitted update (adapters, opt_state, frozen, tokens [B, T + 1], lr) -> (adapters, opt_state, loss)."""
    optimizer = adam_direction(0.0, clip)  # weight decay 0, the HF Trainer default PEFT's LoRA recipes keep

    def step(adapters, opt_state, frozen, tokens, lr):
        def loss(adapters):
            view = nnx.merge(graphdef, adapters, frozen)
            return cross_entropy(view(tokens[:, :-1]), tokens[:, 1:])

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        adapters = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), adapters, updates)
        return adapters, opt_state, value

    return jax.jit(step, donate_argnums=(0, 1)), optimizer


def finetune(model: Model, data: Any, lora: LoraConfig = LoraConfig(), *, steps: int = 100, lr: float = 1e-3,
             warmup: int = 10, batch_size: int = 4, seq_len: int = 128, seed: int = 0, clip: float = 1.0,
             tokenizer: Tokenizer | None = None, log_every: int = 10, log: Log | None = print
             ) -> tuple[Decoder, list[dict]]:
    """Train fresh LoRA adapters on `data` (see `token_windows`); returns (the NNX view holding them, the history
    of logged {step, loss, tok_s}). `view.to_model()` serves the merged weights; `view.adapter()` writes PEFT files.
    """
    windows = token_windows(model, data, seq_len, tokenizer)
    if len(windows) < batch_size:
        raise RequestError(f"the data gives {len(windows)} rows of {seq_len + 1} tokens, fewer than batch_size="
                           f"{batch_size}")
    view = Decoder(model, lora, rngs=nnx.Rngs(seed))
    graphdef, adapters, frozen = nnx.split(view, nnx.LoRAParam, ...)
    step, optimizer = make_step(graphdef, clip)
    opt_state = optimizer.init(adapters)
    schedule = lr_schedule(lr, warmup, steps)
    batches = shuffled_batches(windows, batch_size, seed)
    history, losses, tokens, t_log = [], [], 0, time.perf_counter()
    for i in range(1, steps + 1):
        batch = jnp.asarray(next(batches))
        adapters, opt_state, value = step(adapters, opt_state, frozen, batch, jnp.float32(schedule(i - 1)))
        losses.append(value)
        tokens += batch.shape[0] * (batch.shape[1] - 1)
        if i == 1:  # the first step compiles: time from here on
            value.block_until_ready()
            tokens, t_log = 0, time.perf_counter()
        if i % log_every == 0 or i == steps:
            now = time.perf_counter()
            record = dict(step=i, loss=float(jnp.mean(jnp.stack(losses))), tok_s=tokens / max(now - t_log, 1e-9))
            history.append(record)
            losses, tokens, t_log = [], 0, now
            if log:
                log("step {step:5d}  loss {loss:.4f}  {tok_s:.0f} tok/s".format(**record))
    nnx.update(view, adapters)
    return view, history


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pocketjax finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or Hub id (default: the embedded model)")
    parser.add_argument("--data", required=True, type=Path, help="a UTF-8 text file to train on")
    parser.add_argument("--out", required=True, type=Path, help="adapter folder to write (PEFT layout)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default="q,v", help=f"comma-separated, among {','.join(TARGETS)}")
    parser.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(rank) instead of alpha / rank")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, help="dtype of the frozen weights (default: the checkpoint's)")
    parser.add_argument("--quantize", default=None, help="quantize the frozen weights (QLoRA-style): int8 | int4")
    args = parser.parse_args(argv)
    lora = LoraConfig(rank=args.rank, alpha=args.alpha, targets=tuple(args.targets.split(",")), rslora=args.rslora)
    model = load_model(args.model or DEFAULT_MODEL, dtype=args.dtype, quantize=args.quantize)
    view, _ = finetune(model, args.data, lora, steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                       seq_len=args.seq_len, seed=args.seed, log=lambda s: print(s, file=sys.stderr))
    write_adapter(args.out, view.adapter(), base_model=args.model or str(DEFAULT_MODEL))
    print(f"wrote {args.out} (load it with pj.load_model(..., lora={str(args.out)!r}))", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
