"""Warm-up: compile every step signature an engine's rules can produce, before the first request.

Untouched, an engine compiles each (rows, chunk width, attention length) shape the first time traffic reaches it,
and the request that reaches it waits. `warmup` pays for all of them up front (with the persistent compile cache,
a later process reads them from disk instead). It runs the jitted steps of `steps.py` over (params, cache,
penalties) with `plan.empty_plan`s, which write nothing: zero-length chunks, inactive rows, a zero-length copy of a
slot onto itself, so slots and their cached prefixes are untouched. It knows nothing of `Engine`.
"""
from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from tqdm.auto import tqdm

from ..model.config import ModelConfig
from ..model.decoder import Params
from ..model.kv_cache import KVCache
from .plan import StepRules, empty_plan, signatures
from .steps import (STEP_FUNCTIONS, Penalties, copy_slot_prefix, decode_step, prefill_step, sample_step,
                    verified_inputs, verify_sample_step, verify_step)


def compiled_count() -> int:
    """How many call signatures the step functions hold so far, in this process (every engine's together)."""
    return sum(f._cache_size() for f in STEP_FUNCTIONS)


def warmup(params: Params, cache: KVCache, penalties: Penalties, *, config: ModelConfig, rules: StepRules,
           progress: bool = True, prompt_logprobs: bool = False, structured: bool = False
           ) -> tuple[KVCache, Penalties, int]:
    """Compile every signature of `rules` (`plan.signatures`); returns the cache and penalties (donated, so use
    these) and how many signatures were new (0 once warm).

    Afterwards no mix of prompt lengths, batch sizes, sampling options, logprobs or prefix reuse compiles again.
    Requests with `prompt_logprobs` compile their prefill variant on first use unless `prompt_logprobs=True`
    compiles it here too; `structured` compiles the masked samplers (structured outputs) as well.
    """
    before = compiled_count()
    logits, tokens = {}, {}  # rows -> the latest forward step's logits, the latest sampled tokens (on device)
    verified = {}  # rows -> the latest verify step's logits
    drawn, verified_steps = {}, {}  # rows -> its sampler's (tokens, accepted); the step indices computed from them
    calls = signatures(rules, prompt_logprobs, structured)
    if calls:  # the first forward and sampler calls see the cache and penalties as allocated, and a step may return
        # them in another form (on a mesh, the penalties come back replicated over it): run both again in that form
        calls += [calls[0], next(c for c in calls if c.step == "sample_first")]
    step = dict(config=config, impl=rules.impl)
    bar = tqdm(calls, desc="pocketjax warm-up", unit="shape", disable=not progress)
    for call in bar:
        bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in call._asdict().items() if v), refresh=False)
        if call.step in ("prefill", "prefill_scored"):
            cache, logits[call.rows], _ = prefill_step(params, cache, empty_plan(rules, call), **step)
        elif call.step in ("decode", "decode_fed"):
            fed = tokens[call.rows] if call.step == "decode_fed" else None
            cache, logits[call.rows] = decode_step(params, cache, empty_plan(rules, call, fed), **step)
        elif call.step == "decode_verified":  # inputs from the verify's outputs, as Engine._fed_after_verify has them
            r = call.rows
            plan = empty_plan(rules, call._replace(step="decode"))
            fed, positions, verified_steps[r] = verified_inputs(*drawn[r], plan.positions, plan.positions,
                                                                np.arange(r, dtype=np.int32), plan.active)
            cache, logits[r] = decode_step(params, cache, replace(plan, tokens=fed, positions=positions), **step)
        elif call.step == "sample_verified":
            plan = replace(empty_plan(rules, call._replace(step="sample_next")), steps=verified_steps[call.rows])
            penalties, _ = sample_step(penalties, logits[call.rows], plan)
        elif call.step == "verify":
            cache, verified[call.rows] = verify_step(params, cache, empty_plan(rules, call), **step)
        elif call.step == "sample_verify":
            penalties, out, accepted = verify_sample_step(penalties, verified[call.rows], empty_plan(rules, call))
            drawn[call.rows] = (out.tokens, accepted)
        elif call.step == "copy_prefix":
            length = np.int32(cache.lengths[0])  # slot 0 onto itself, its own length: nothing changes
            cache = copy_slot_prefix(cache, np.int32(0), np.int32(0), length)
        else:
            penalties, out = sample_step(penalties, logits[call.rows], empty_plan(rules, call))
            tokens[call.rows] = out.tokens
    jax.block_until_ready((cache, penalties))
    return cache, penalties, compiled_count() - before
