"""vLLM's per-request logits processors as data: `min_tokens`, `allowed_token_ids`, `bad_words` and `logit_bias`.

Why this mechanism: structured outputs already feed the sampler a host-built bitmask per row and step
(`SamplePlan.allowed`, int32 [rows, ceil(V / 32)], 19 KB per row at Qwen's vocabulary); a ban is one more AND on
that mask, so every token ban here rides it, and the only new device input is the sparse additive bias
(`SamplePlan.bias_ids` / `bias`, [rows, MAX_LOGIT_BIAS], 2.4 KB per row) that travels with it. Both are arrays of
fixed shapes, so requests with different ids or biases share one compiled sampler (the "masked" variant, which
warm-up compiles), and a row's ban or bias touches only its own row: a row without any is untouched bit for bit.
A dense [rows, V] float bias would cost 600 KB per row per step; a per-request program would compile per request.

What is static (allowed_token_ids, bad words of one token, logit_bias) is packed with every step's plan, so such
a request keeps decode steps pipelined on device. What depends on the tokens so far (a bad word of several tokens,
min_tokens while it is not reached) is ANDed into the mask on the host once the previous token is known, the
deferred-sampler path structured outputs take (`Engine._constrain`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SamplingError
from .sampling_params import MAX_LOGIT_BIAS, SamplingParams


@dataclass(frozen=True)
class TokenLimits:
    """One request's bans and biases, resolved against a vocabulary (`limits_of`)."""

    static: np.ndarray | None  # int32 [words]: tokens allowed at every step (None: all)
    stops: np.ndarray  # int64 [n]: EOS and stop_token_ids, banned while fewer than min_tokens were generated
    min_tokens: int
    sequences: tuple[tuple[int, ...], ...]  # bad words of several tokens
    bias_ids: np.ndarray  # int32 [n]
    bias: np.ndarray  # float32 [n]

    def dynamic(self, generated: int) -> bool:
        """Whether the mask of the token at index `generated` depends on the tokens before it."""
        return bool(self.sequences) or (generated < self.min_tokens and len(self.stops) > 0)

    def ban(self, row: np.ndarray, tokens: Sequence[int]) -> None:
        """AND into `row` (int32 [words], in place) the bans that depend on `tokens`, the output so far."""
        banned = [int(t) for t in self.stops] if len(tokens) < self.min_tokens else []
        for seq in self.sequences:  # vLLM: the last token of a word whose other tokens end the output
            prefix = seq[:-1]
            if len(tokens) >= len(prefix) and tuple(tokens[len(tokens) - len(prefix):]) == prefix:
                banned.append(seq[-1])
        clear(row, banned)


def clear(row: np.ndarray, ids: Sequence[int]) -> None:
    """Clear the bits of `ids` in an int32 [words] mask row (llguidance's layout: bit t % 32 of word t // 32)."""
    if not len(ids):
        return
    ids = np.asarray(ids, np.int64)
    words = row.view(np.uint32)
    np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> list[tuple[int, ...]]:
    """Each bad word's token ids, as vLLM's `SamplingParams.update_from_tokenizer` finds them: the word without
    its leading spaces, and with one leading space when that spells a different first token in as many tokens
    (a word at the start of the text and one in the middle tokenize differently)."""
    def encode(text: str) -> tuple[int, ...]:  # a pocketjax Tokenizer gives ids, a tokenizers.Tokenizer an Encoding
        out = tokenizer.encode(text, add_special_tokens=False)
        return tuple(getattr(out, "ids", out))

    out: list[tuple[int, ...]] = []
    for word in words:
        plain, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        out.append(plain)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return [ids for ids in out if ids]


def limits_of(sp: SamplingParams, vocab_size: int, eos_ids: Sequence[int], tokenizer: Any) -> TokenLimits | None:
    """The TokenLimits of a request (None when it asks for none); SamplingError when it has bad words and there is
    no tokenizer to spell them with."""
    if not sp.limited:
        return None
    words = (vocab_size + 31) // 32
    static = None
    sequences: list[tuple[int, ...]] = []
    if sp.bad_words:
        if tokenizer is None:
            raise SamplingError("SamplingParams.bad_words needs an engine with a tokenizer (Engine(model, "
                                "tokenizer=...); LLM passes its own)")
        found = bad_word_ids(tokenizer, sp.bad_words)
        singles = [ids[0] for ids in found if len(ids) == 1 and ids[0] < vocab_size]
        sequences = [ids for ids in found if len(ids) > 1]
        if singles:
            static = np.full(words, -1, np.int32)
            clear(static, singles)
    if sp.allowed_token_ids is not None:
        bits = np.zeros(words * 32, bool)
        bits[np.asarray(sp.allowed_token_ids, np.int64)] = True
        allowed = np.packbits(bits.reshape(words, 32), axis=1, bitorder="little").view("<i4").reshape(words)
        static = allowed if static is None else static & allowed
    stops = sorted({*sp.stop_token_ids, *([] if sp.ignore_eos else eos_ids)}) if sp.min_tokens else []
    ids = np.array([t for t, _ in sp.logit_bias], np.int32)
    return TokenLimits(static, np.asarray(stops, np.int64), int(sp.min_tokens), tuple(sequences), ids,
                       np.array([b for _, b in sp.logit_bias], np.float32))


def pack_limits(rows: Sequence[Any], vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(allowed int32 [rows, words], bias_ids int32 [rows, MAX_LOGIT_BIAS], bias float32 [rows, MAX_LOGIT_BIAS]) for
    a step's rows (requests or None), their static parts filled in; None when no row is limited or constrained,
    so such a step keeps the plain sampler. Padding ids are `vocab_size` (dropped by the sampler)."""
    if not any(r is not None and (r.limits is not None or r.sampling.structured is not None) for r in rows):
        return None
    allowed = np.full((len(rows), (vocab_size + 31) // 32), -1, np.int32)
    bias_ids = np.full((len(rows), MAX_LOGIT_BIAS), vocab_size, np.int32)
    bias = np.zeros((len(rows), MAX_LOGIT_BIAS), np.float32)
    for i, r in enumerate(rows):
        limits = r.limits if r is not None else None
        if limits is None:
            continue
        if limits.static is not None:
            allowed[i] = limits.static
        n = len(limits.bias_ids)
        bias_ids[i, :n], bias[i, :n] = limits.bias_ids, limits.bias
    return allowed, bias_ids, bias
