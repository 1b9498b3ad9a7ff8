"""The device side of one engine: its weights, KV cache and slot state, and the one place the jitted steps are called.

`Device` owns `(params, cache, slot state)`: the cache and the slot state are donated to every step that writes
them, so only the object that holds them may call the steps, and it replaces them with what each step returns. No
caller (the engine, warm-up, a benchmark) threads donated buffers by hand.

`STEP_KINDS` is the one table of step kinds: for each `plan.Signature` step name, the jitted function, the builder of a
plan of that shape that writes nothing, and what feeds it. Warm-up (`Device.warmup`: every signature of the engine's
rules, so no request waits for a compile), `empty_plan` and `Device.lower` (the program a call of that shape runs:
HLO checks, benchmarks) loop over it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from ..errors import RequestError
from ..model.config import ModelConfig
from ..model.kv_cache import KVCache
from . import plan as plans
from .plan import Signature, StepRules, signatures
from .steps import (SlotState, copy_slot_prefix, decode_sample_step, decode_step, prefill_step, sample_step,
                    verify_sample_step, verify_step)
from .weights import refuse_deleted_params


@dataclass(frozen=True)
class StepKind:
    """One step kind: its jitted function, a plan of a signature's shape that writes nothing, what feeds it."""

    function: Any  # the jitted step (`steps.py`)
    empty: Callable[[StepRules, Signature], Any] | None  # None: takes no plan (copy_prefix)
    feeds: str  # "forward": (params, cache, plan) -> (cache, logits, ...); "decode": (params, cache, slot state,
    # plan) -> (cache, logits); "sampler": (slot state, logits, plan) -> (slot state, ...); "fused": (params, cache,
    # slot state, plan, sample plan) -> (cache, slot state, ...); "copy": (cache, src, dst, length) -> cache
    logits: str = ""  # forward steps: the logits they produce; samplers: the logits they read ("token" [rows,
    # vocab] in the model's dtype, "verify" [rows, width, vocab] float32)


STEP_KINDS: dict[str, StepKind] = {
    "prefill": StepKind(prefill_step, plans.empty_prefill, "forward", "token"),
    "prefill_scored": StepKind(prefill_step, plans.empty_prefill, "forward", "token"),  # prompt logprobs
    "decode": StepKind(decode_step, plans.empty_decode, "decode", "token"),
    "decode_sample": StepKind(decode_sample_step, plans.empty_decode_sample, "fused"),
    **{name: StepKind(sample_step, plans.empty_sample, "sampler", "token")
       for name in ("sample_first", "sample_next", "sample_first_masked", "sample_next_masked")},
    "verify": StepKind(verify_step, plans.empty_verify, "forward", "verify"),
    "sample_verify": StepKind(verify_sample_step, plans.empty_verify_sample, "sampler", "verify"),
    "copy_prefix": StepKind(copy_slot_prefix, None, "copy"),
}
STEP_FUNCTIONS = tuple({id(k.function): k.function for k in STEP_KINDS.values()}.values())


def compiled_count() -> int:
    """How many call signatures the step functions hold so far, in this process (every engine's together)."""
    return sum(f._cache_size() for f in STEP_FUNCTIONS)


def step_kind(name: str) -> StepKind:
    kind = STEP_KINDS.get(name)
    if kind is None:
        raise RequestError(f"no step {name!r} (a plan.Signature names one of {', '.join(STEP_KINDS)})")
    return kind


def empty_plan(rules: StepRules, call: Signature) -> Any:
    """A plan of `call`'s shape that writes nothing: zero-length chunks, inactive rows, rows that end no prompt
    (slot state untouched)."""
    kind = step_kind(call.step)
    if kind.empty is None:
        raise RequestError(f"step {call.step!r} takes no plan")
    return kind.empty(rules, call)


def plan_args(kind: StepKind, plan: Any) -> tuple:
    """A plan as the step's arguments: a fused step's is the pair (decode plan, sample plan)."""
    return plan if kind.feeds == "fused" else (plan,)


class Device:
    """One engine's weights and donated buffers, and the steps that run on them (`run`)."""

    def __init__(self, params: Any, config: ModelConfig, impl: str, dtype: Any):
        self.params, self.config, self.impl, self.dtype = params, config, impl, dtype  # dtype: the model's
        self.cache: KVCache | None = None
        self.state: SlotState | None = None  # each slot's next decode input and penalty state
        self.warm = False  # warm-up ran: a step that compiles afterwards is logged (`run`)

    @refuse_deleted_params  # a training step that donated the params: a ConfigError naming update_params
    def run(self, name: str, *args: Any) -> Any:
        """Step `name` (a `plan.Signature` step) on this device's buffers: a plan (a sampler: logits, plan; a fused
        step: its two plans; copy_prefix: src, dst, length); the buffers it donates are replaced by the step's results,
        the rest is returned (one value, a tuple of several, or None). Once warm, a call that compiles says so in a
        log line (a rare variant, or a shape warm-up did not cover)."""
        kind = step_kind(name)
        before = compiled_count() if self.warm else None
        if kind.feeds == "copy":
            self.cache = kind.function(self.cache, *args)
            out = [None]
        elif kind.feeds == "sampler":
            self.state, *out = kind.function(self.state, *args)
        elif kind.feeds == "fused":
            self.cache, self.state, *out = kind.function(self.params, self.cache, self.state, *args,
                                                         config=self.config, impl=self.impl)
        else:
            lead = (self.params, self.cache, self.state) if kind.feeds == "decode" else (self.params, self.cache)
            self.cache, *out = kind.function(*lead, *args, config=self.config, impl=self.impl)
        if before is not None and compiled_count() != before:
            logging.getLogger("pocketjax").info("pocketjax: compiled a %s step on first use (warm-up does not cover "
                                                "its shape or variant)", name)
        return out[0] if len(out) == 1 else tuple(out)

    def _logits(self, kind: StepKind, call: Signature) -> jax.ShapeDtypeStruct:
        """What a sampler of `call`'s shape reads: the logits of the forward step before it."""
        if kind.logits == "verify":
            return jax.ShapeDtypeStruct((call.rows, call.width, self.config.vocab_size), jnp.float32)
        return jax.ShapeDtypeStruct((call.rows, self.config.vocab_size), self.dtype)

    def lower(self, rules: StepRules, call: Signature) -> jax.stages.Lowered:
        """The program for `call` on this device's buffers: by construction the program a call of that shape runs."""
        kind = step_kind(call.step)
        if kind.feeds == "copy":
            return kind.function.lower(self.cache, np.int32(0), np.int32(0), np.int32(0))
        plan = kind.empty(rules, call)
        if kind.feeds == "sampler":
            return kind.function.lower(self.state, self._logits(kind, call), plan)
        lead = (self.params, self.cache) + ((self.state,) if kind.feeds in ("decode", "fused") else ())
        return kind.function.lower(*lead, *plan_args(kind, plan), config=self.config, impl=self.impl)

    def warmup(self, rules: StepRules, progress: bool = True, prompt_logprobs: bool = False,
               steering: bool = False, return_hidden: bool = False,
               progress_callback: Callable[[int, int], None] | None = None) -> int:
        """Compile every signature of `rules` (`plan.signatures`) with plans that write nothing, so slots, their
        cached prefixes and the slot state are unchanged; returns how many were new (0 once warm).

        Afterwards no mix of prompt lengths, batch sizes, sampling options, logprobs or prefix reuse compiles again.
        Requests with `prompt_logprobs` compile their prefill variant on first use unless `prompt_logprobs=True`
        compiles it here too; `rules.structured` the masked samplers (structured outputs) as well; `steering` the
        forward steps with steering vectors, `return_hidden` the prefill and decode steps that return the stream.
        `progress_callback(done, total)` after each call (a server's /health reports it while warming up).
        """
        before = compiled_count()
        logits: dict[tuple[str, int], Any] = {}  # (kind of logits, rows) -> the latest forward step's
        calls = signatures(rules, prompt_logprobs, steering, return_hidden)
        if calls:  # the first forward and sampler calls see the cache and slot state as allocated, and a step may
            # return them in another form (on a mesh, the state comes back replicated over it): run both again
            calls += [calls[0], next(c for c in calls if c.step.startswith("sample_first"))]
        bar = tqdm(calls, desc="pocketjax warm-up", unit="shape", disable=not progress)
        for done, call in enumerate(bar, 1):
            bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in call._asdict().items() if v), refresh=False)
            kind = STEP_KINDS[call.step]
            if kind.feeds == "copy":  # slot 0 onto itself, its own length: nothing changes
                self.run(call.step, np.int32(0), np.int32(0), np.int32(self.cache.lengths[0]))
            elif kind.feeds == "sampler":
                self.run(call.step, logits[kind.logits, call.rows], kind.empty(rules, call))
            elif kind.feeds == "fused":
                self.run(call.step, *kind.empty(rules, call))
            else:
                out = self.run(call.step, kind.empty(rules, call))
                logits[kind.logits, call.rows] = out[0] if isinstance(out, tuple) else out  # (prefill, decode: tuples)
            if progress_callback is not None:
                progress_callback(done, len(calls))
        jax.block_until_ready((self.cache, self.state))
        self.warm = True
        return compiled_count() - before
