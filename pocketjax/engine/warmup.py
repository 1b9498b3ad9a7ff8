"""Warm-up: compile every step signature an engine's rules can produce, before the first request.

Untouched, an engine compiles each (rows, chunk width, attention length) shape the first time traffic reaches it,
and the request that reaches it waits. `warmup` pays for all of them up front (with the persistent compile cache,
a later process reads them from disk instead). It runs the jitted steps of `steps.py` over (params, cache,
slot state) with `plan.empty_plan`s, which write nothing: zero-length chunks, inactive rows, a zero-length copy of a
slot onto itself, so slots and their cached prefixes are untouched. It knows nothing of `Engine`.
"""
from __future__ import annotations

import jax
import numpy as np
from tqdm.auto import tqdm

from ..model.config import ModelConfig
from ..model.decoder import Params
from ..model.kv_cache import KVCache
from .plan import StepRules, empty_plan, signatures
from .steps import (STEP_FUNCTIONS, SlotState, copy_slot_prefix, decode_step, prefill_step, sample_step,
                    verify_sample_step, verify_step)


def compiled_count() -> int:
    """How many call signatures the step functions hold so far, in this process (every engine's together)."""
    return sum(f._cache_size() for f in STEP_FUNCTIONS)


def warmup(params: Params, cache: KVCache, state: SlotState, *, config: ModelConfig, rules: StepRules,
           progress: bool = True, prompt_logprobs: bool = False, structured: bool = False
           ) -> tuple[KVCache, SlotState, int]:
    """Compile every signature of `rules` (`plan.signatures`); returns the cache and slot state (donated, so use
    these) and how many signatures were new (0 once warm).

    Afterwards no mix of prompt lengths, batch sizes, sampling options, logprobs or prefix reuse compiles again.
    Requests with `prompt_logprobs` compile their prefill variant on first use unless `prompt_logprobs=True`
    compiles it here too; `structured` compiles the masked samplers (structured outputs) as well.
    """
    before = compiled_count()
    logits, verified = {}, {}  # rows -> the latest forward step's logits, the latest verify step's
    calls = signatures(rules, prompt_logprobs, structured)
    if calls:  # the first forward and sampler calls see the cache and slot state as allocated, and a step may return
        # them in another form (on a mesh, the state comes back replicated over it): run both again in that form
        calls += [calls[0], next(c for c in calls if c.step == "sample_first")]
    step = dict(config=config, impl=rules.impl)
    bar = tqdm(calls, desc="pocketjax warm-up", unit="shape", disable=not progress)
    for call in bar:
        bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in call._asdict().items() if v), refresh=False)
        plan = empty_plan(rules, call) if call.step != "copy_prefix" else None
        if call.step in ("prefill", "prefill_scored"):
            cache, logits[call.rows], _ = prefill_step(params, cache, plan, **step)
        elif call.step == "decode":
            cache, logits[call.rows] = decode_step(params, cache, state, plan, **step)
        elif call.step == "verify":
            cache, verified[call.rows] = verify_step(params, cache, plan, **step)
        elif call.step == "sample_verify":
            state, _, _ = verify_sample_step(state, verified[call.rows], plan)
        elif call.step == "copy_prefix":
            length = np.int32(cache.lengths[0])  # slot 0 onto itself, its own length: nothing changes
            cache = copy_slot_prefix(cache, np.int32(0), np.int32(0), length)
        else:
            state, _ = sample_step(state, logits[call.rows], plan)
    jax.block_until_ready((cache, state))
    return cache, state, compiled_count() - before
