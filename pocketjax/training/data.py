"""Training text as arrays: documents packed into fixed-length rows, and seeded endless batches of them.

Shared by the embedded model's trainer (`train`), its evaluation and LoRA fine-tuning (`finetune`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

import numpy as np


def pack(docs: Iterable[Sequence[int]], separator: int, seq_len: int) -> np.ndarray:
    """Documents joined by `separator` (each one followed by it), cut into rows int32 [N, seq_len + 1].

    Consecutive rows overlap by one token, so every token of the stream is a target exactly once; the tail that
    does not fill a row is dropped.
    """
    stream = np.fromiter(chain.from_iterable(chain(d, (separator,)) for d in docs), dtype=np.int32)
    rows = max((len(stream) - 1) // seq_len, 0)
    index = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[index] if rows else np.zeros((0, seq_len + 1), np.int32)


def encode_windows(tokenizer: Any, texts: Sequence[str], separator: int, seq_len: int) -> np.ndarray:
    """`texts` tokenized (a pocketjax Tokenizer, batch-encoded by its backend) and packed by `pack`."""
    encodings = tokenizer.backend.encode_batch(list(texts), add_special_tokens=False)
    return pack((e.ids for e in encodings), separator, seq_len)


def shuffled_batches(windows: np.ndarray, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless batches [batch_size, T] of `windows`, reshuffled every epoch by a seeded generator."""
    if len(windows) < batch_size:
        raise ValueError(f"{len(windows)} windows cannot fill a batch of {batch_size}")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(windows))
        for j in range(0, len(order) - batch_size + 1, batch_size):
            yield windows[order[j:j + batch_size]]
