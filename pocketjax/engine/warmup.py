"""Warm-up: compile every step signature an Engine's configuration can produce, before the first request.

Untouched, an engine compiles each (rows, chunk width, attention length) shape the first time traffic reaches it,
and the request that reaches it waits. `warmup` pays for all of them up front (with the persistent compile cache,
a later process reads them from disk instead). It runs the jitted steps of `steps.py` on the engine's own cache
and penalty state (donated, then put back) with inputs that write nothing: zero-length chunks, inactive rows, a
zero-length copy of a slot onto itself, so slots and their cached prefixes are untouched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from .sampling import MAX_LOGPROBS, SamplingParams, pack_sampling
from .steps import bucket, copy_slot_prefix, decode_step, prefill_scored_step, prefill_step, sample_first, sample_next

if TYPE_CHECKING:
    from .engine import Engine


class Signature(NamedTuple):
    """One step call shape: `step` over `rows` rows (0: not a batch); the other fields where the step has them."""

    step: str  # prefill, prefill_scored (prompt logprobs), sample_first, decode, decode_fed (input tokens on device),
    # sample_next, copy_prefix
    rows: int = 0
    width: int = 0  # prefill chunk bucket
    kv_len: int = 0  # attention length bucket
    num_top: int = 0  # top logprobs the sampler returns


def signatures(engine: Engine, prompt_logprobs: bool = False) -> list[Signature]:
    """Every step signature `engine` can call, as `Engine._prefill_call` and `_dispatch` bucket them; each sampler
    follows a forward step over its rows, each device-fed decode a sampler. `prompt_logprobs` adds the prefill
    variant that scores prompt tokens (one per prefill shape: as many compiles again as the plain prefill, which
    is why it is opt-in)."""
    if engine.max_seq_len < 2:  # no prompt fits: nothing ever runs
        return []
    cfg, slots = engine.config, engine.num_slots
    rows = sorted({bucket(n, 1, slots) for n in range(1, slots + 1)})
    kv = {end: engine._kv_bucket(end) for end in range(1, engine.max_seq_len)}  # cached tokens -> attention length
    kv_lens = sorted(set(kv.values()))
    shortest = {}  # chunk width -> the shortest chunk compiled at it (a prompt leaves one position to generate)
    for n in range(min(cfg.prefill_chunk, engine.max_seq_len - 1), 0, -1):
        shortest[bucket(n, cfg.min_prefill_bucket, cfg.prefill_chunk)] = n
    tops = (0, MAX_LOGPROBS)
    calls = []
    for r in rows:
        prefill = [Signature("prefill", r, w, k) for w, n in sorted(shortest.items()) for k in kv_lens if k >= kv[n]]
        calls += prefill + ([c._replace(step="prefill_scored") for c in prefill] if prompt_logprobs else [])
        calls += [Signature("sample_first", r, num_top=t) for t in tops]
        calls += [Signature("decode", r, kv_len=k) for k in kv_lens]
        calls += [Signature("sample_next", r, num_top=t) for t in tops]
        calls += [Signature("decode_fed", r, kv_len=k) for k in kv_lens]
    if slots > 1:  # a prefix is copied from another slot only
        calls.append(Signature("copy_prefix"))
    return calls


def warmup(engine: Engine, progress: bool = True, prompt_logprobs: bool = False) -> int:
    """Compile every step signature `engine` can call (`signatures`); returns how many were new (0 once warm).

    Afterwards no mix of prompt lengths, batch sizes, sampling options, logprobs or prefix reuse compiles again:
    `engine.compiled_count()` stays put. Requests with `prompt_logprobs` compile their prefill variant on first use
    unless `prompt_logprobs=True` compiles it here too. Slots, their cached tokens and the penalty state are
    unchanged. Call it while nothing else drives the engine (before a Scheduler starts), and again after
    `allocate_batch_slots`.
    """
    before = engine.compiled_count()
    logits, tokens = {}, {}  # rows -> the latest forward step's logits, the latest sampled tokens (on device)
    calls = signatures(engine, prompt_logprobs)
    if calls:  # the first forward and sampler calls see the cache and penalties as allocated, and a step may return
        # them in another form (on a mesh, the penalties come back replicated over it): run both again in that form
        calls += [calls[0], next(c for c in calls if c.step == "sample_first")]
    bar = tqdm(calls, desc="pocketjax warm-up", unit="shape", disable=not progress)
    for call in bar:
        bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in call._asdict().items() if v), refresh=False)
        if call.step in ("prefill", "prefill_scored"):
            logits[call.rows] = _prefill(engine, call)
        elif call.step in ("decode", "decode_fed"):
            logits[call.rows] = _decode(engine, call, tokens[call.rows] if call.step == "decode_fed" else None)
        elif call.step == "copy_prefix":
            length = np.int32(engine.cache.lengths[0])  # slot 0 onto itself, its own length: nothing changes
            engine.cache = copy_slot_prefix(engine.cache, np.int32(0), np.int32(0), length)
        else:
            tokens[call.rows] = _sample(engine, call, logits[call.rows])
    jax.block_until_ready((engine.cache, engine.penalties))
    return engine.compiled_count() - before


def _prefill(engine: Engine, call: Signature) -> jax.Array:
    """A prefill of `call.rows` empty chunks (lengths 0 write nothing, no row scored); its logits."""
    r = call.rows
    zeros, empty = np.zeros(r, np.int32), np.zeros((r, call.width), np.int32)
    step = dict(config=engine.model.config, impl=engine.impl, kv_len=call.kv_len)
    if call.step == "prefill_scored":
        engine.cache, logits, _ = prefill_scored_step(engine.model.params, engine.cache, empty, zeros, zeros, zeros,
                                                      empty, np.zeros(r, bool), num_top=MAX_LOGPROBS, **step)
    else:
        engine.cache, logits = prefill_step(engine.model.params, engine.cache, empty, zeros, zeros, zeros, **step)
    return logits


def _decode(engine: Engine, call: Signature, tokens: jax.Array | None) -> jax.Array:
    """A decode step of `call.rows` inactive rows (they write nothing), fed `tokens` or zeros from the host."""
    r = call.rows
    dense = r == engine.num_slots > 1  # as Engine._fed_from_host decides it
    slots = np.arange(r, dtype=np.int32) if dense else np.zeros(r, np.int32)
    fed = np.zeros(r, np.int32) if tokens is None else tokens
    engine.cache, logits = decode_step(engine.model.params, engine.cache, fed, slots, np.zeros(r, np.int32),
                                       np.zeros(r, bool), config=engine.model.config, impl=engine.impl,
                                       kv_len=call.kv_len, dense=dense)
    return logits


def _sample(engine: Engine, call: Signature, logits: jax.Array) -> jax.Array:
    """The sampler over `call.rows` rows that end no prompt and are inactive (slot state untouched); its tokens."""
    r = call.rows
    zeros = np.zeros(r, np.int32)
    sampling = pack_sampling([SamplingParams(temperature=0.0)] * r, [0] * r)
    if call.step == "sample_first":
        vocab = engine.model.config.vocab_size
        engine.penalties, out = sample_first(engine.penalties, logits, zeros, np.zeros(r, bool),
                                             np.zeros((r, vocab), bool), sampling, num_top=call.num_top)
    else:
        engine.penalties, out = sample_next(engine.penalties, logits, zeros, np.zeros(r, bool), zeros, sampling,
                                            num_top=call.num_top)
    return out.tokens
