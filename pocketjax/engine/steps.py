"""The device side of the engine: jitted, buffer-donating step functions and each slot's state (`SlotState`).

Each takes everything it reads as arguments and returns the updated state; the cache (and the slot state) is
donated, so XLA updates it in place and no step copies it. The forward steps and the sampler are separate jitted
calls, chained on device without a host sync: the sampler then compiles once per batch bucket instead of once per
(batch, chunk, attention length) shape. Each step takes `(params, cache, plan)`: the plan (`plan.py`) carries the
per-call arrays and static choices, so `config` and `impl` are the only static arguments left.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from ..model.config import ModelConfig
from ..model.decoder import Hook, Params, decode_forward, lm_head, prefill_forward
from ..model.kv_cache import KVCache, copy_prefix
from .plan import DecodePlan, PrefillPlan, SamplePlan, VerifyPlan, VerifySamplePlan
from .sampling import SampleOutput, sample, token_logprobs


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SlotState:
    """Each slot's sampling state on device: what its next decode step feeds, and its penalty state.

    The samplers write it (a first token: the slot restarts with its prompt; a decode or verify: one or more tokens
    further) and `decode_step` reads its input from it, so a decode step can be queued behind any step still in
    flight, for any requests, with no token or position sent from the host. Updates address slots; a row aimed at
    slot `num_slots` (padding, inactive) is dropped.
    """

    prompt_mask: jax.Array  # bool [slots, vocab]: tokens of each slot's prompt (repetition penalty)
    output_counts: jax.Array  # int32 [slots, vocab]: generated-token counts (presence/frequency penalty)
    token: jax.Array  # int32 [slots]: the last token sampled, the next decode step's input
    position: jax.Array  # int32 [slots]: where that token goes: the slot's cached length once it is written
    generated: jax.Array  # int32 [slots]: tokens generated so far (the next one's index in the random stream)

    @classmethod
    def zeros(cls, slots: int, vocab: int) -> SlotState:
        ints = [jnp.zeros(slots, jnp.int32) for _ in range(3)]  # three buffers: each is donated on its own
        return cls(jnp.zeros((slots, vocab), bool), jnp.zeros((slots, vocab), jnp.int32), *ints)

    @property
    def num_slots(self) -> int:
        return self.prompt_mask.shape[0]

    def restart(self, slots: jax.Array, prompt_masks: jax.Array) -> SlotState:
        """A new prompt in each of `slots` [R]: its mask bool [R, vocab] replaces the old one, counts go to 0."""
        return replace(self, prompt_mask=self.prompt_mask.at[slots].set(prompt_masks, mode="drop"),
                       output_counts=self.output_counts.at[slots].set(0, mode="drop"))

    def count(self, slots: jax.Array, tokens: jax.Array) -> SlotState:
        """One more occurrence of tokens [R] in the outputs of slots [R]."""
        return replace(self, output_counts=self.output_counts.at[slots, tokens].add(1, mode="drop"))

    def advance(self, slots: jax.Array, tokens: jax.Array, positions: jax.Array, generated: jax.Array) -> SlotState:
        """Slots [R] continue with `tokens` [R] at `positions` [R], `generated` tokens out."""
        return replace(self, token=self.token.at[slots].set(tokens, mode="drop"),
                       position=self.position.at[slots].set(positions, mode="drop"),
                       generated=self.generated.at[slots].set(generated, mode="drop"))


def row_hooks(hooks: tuple[Hook, ...], selector: jax.Array | None) -> Hook | None:
    """One hook for a batch whose row b runs `hooks[selector[b] - 1]` (0: none); None when `hooks` is empty.

    Every hook sees the whole batch and its output is kept only on its own rows, so a row without a hook gets its
    residual stream back untouched (bit for bit) and a row's result never depends on the others' hooks, provided
    each hook treats rows independently. A batch with no hooks passes neither argument and compiles the same
    program as before hooks existed; each distinct `hooks` tuple (static) compiles its own programs.
    """
    if not hooks:
        return None

    def hook(layer, x: jax.Array) -> jax.Array:
        out = x
        for i, fn in enumerate(hooks, 1):
            out = jnp.where((selector == i)[:, None, None], fn(layer, x), out)
        return out

    return hook


@partial(jax.jit, static_argnames=("config", "impl"), donate_argnames=("cache",))
def prefill_step(params, cache: KVCache, plan: PrefillPlan, *, config: ModelConfig, impl: str
                 ) -> tuple[KVCache, jax.Array, SampleOutput | None, jax.Array | None]:
    """Write one prompt chunk per row into the cache; logits [B, vocab] of each row's last chunk token, with
    `plan.targets` each position's log-probability of the token after it (`score_positions`; None otherwise), and
    with `plan.capture` the residual stream at each row's last token [B, layers + 1, H] (None otherwise).

    Scoring is a variant of its own (another treedef, so another program), run only for chunks where some row asked
    for prompt logprobs: the plain step never computes the [T, vocab] logits of every position.
    """
    hook = row_hooks(plan.hooks, plan.selector)
    args = (params, config, impl, plan.kv_len, cache, plan.tokens, plan.slots, plan.starts, plan.lengths)
    scoring = plan.targets is not None
    cache, logits, *rest = prefill_forward(*args, return_hidden=scoring, hook=hook, steer=plan.steer,
                                           capture=plan.capture)
    scores = score_positions(params, rest.pop(0), plan.targets, plan.scored, plan.num_top) if scoring else None
    return cache, logits, scores, rest[0] if plan.capture else None


def score_positions(params: Params, hidden: jax.Array, targets: jax.Array, scored: jax.Array,
                    num_top: int) -> SampleOutput:
    """Raw logprob of targets [B, T] under the logits at each position of hidden [B, T, H], and the top-`num_top`
    ([B, T] and [B, T, num_top]), for the rows `scored` int32 [n] names (its length is part of the program: the
    host pads it with a repeated row); other rows get zeros without computing their logits. Raw logprobs whatever
    the engine's logprobs_mode: nothing is sampled at a prompt position, so nothing processes it, and `LLM.score`
    sums them as log-likelihoods.

    One named row at a time (`lax.map`: a loop of known length), so the largest live array is one row's [T, vocab]
    logits, not the chunk's: at Qwen's vocab of 151,936 and T=512 that is 311 MB per row in float32 instead of
    2.5 GB for 8 rows. No branch on the data (a `lax.cond` drains an XLA:GPU stream): the rows are chosen by index.
    """
    out = lax.map(lambda args: token_logprobs(lm_head(params, args[0]), args[1], num_top),
                  (hidden[scored], targets[scored]))
    b, t = targets.shape
    empty = SampleOutput(targets, jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t, num_top), jnp.int32),
                         jnp.zeros((b, t, num_top), jnp.float32))
    return jax.tree_util.tree_map(lambda whole, rows: whole.at[scored].set(rows), empty, out)


def _decode(params, cache: KVCache, state: SlotState, plan: DecodePlan, config: ModelConfig, impl: str
            ) -> tuple[KVCache, jax.Array, jax.Array | None]:
    positions = jnp.where(plan.active, state.position[plan.slots], 0)
    cache, logits, *captured = decode_forward(
        params, config, impl, plan.kv_len, cache, state.token[plan.slots], plan.slots, positions, plan.active,
        dense=plan.dense, hook=row_hooks(plan.hooks, plan.selector), steer=plan.steer, capture=plan.capture)
    return cache, logits, captured[0] if plan.capture else None


@partial(jax.jit, static_argnames=("config", "impl"), donate_argnames=("cache",))
def decode_step(params, cache: KVCache, state: SlotState, plan: DecodePlan, *, config: ModelConfig, impl: str
                ) -> tuple[KVCache, jax.Array, jax.Array | None]:
    """One token per row, each its slot's last sampled token at its slot's position (`state`, read, not donated:
    the sampler after this step writes it); `plan.dense`: row i is slot i for every slot, so attention reads the
    cache in place. With `plan.capture`, also the residual stream of every row [B, layers + 1, H] (else None).

    The forward pass alone: what a step runs whose sampler must wait for masks the host computes from the tokens
    still in flight (structured outputs); every other decode step is `decode_sample_step`, one program."""
    return _decode(params, cache, state, plan, config, impl)


@partial(jax.jit, static_argnames=("config", "impl"), donate_argnames=("cache", "state"))
def decode_sample_step(params, cache: KVCache, state: SlotState, plan: DecodePlan, sample: SamplePlan, *,
                       config: ModelConfig, impl: str
                       ) -> tuple[KVCache, SlotState, SampleOutput, jax.Array | None]:
    """A decode step and its sampler as one program (one dispatch per token, no logits leaving it): the forward pass
    of `decode_step`, then `sample_step`'s draw; the cache and the slot state are both donated.

    `plan.steps` > 1: that many decode + sample steps in a loop of static length, each exactly the one step above
    over the rows still alive; a row dies after a token among its `plan.stop_ids` or once it has generated its
    `plan.budget`, and a dead row writes nothing (cache, slot state). Returns the outputs stacked [steps, rows, ...]
    and, in place of the captured stream, alive bool [steps, rows]: which rows' tokens are real."""
    if plan.steps == 1:
        cache, logits, captured = _decode(params, cache, state, plan, config, impl)
        state, out = _sample(state, logits, sample)
        return cache, state, out, captured

    def step(carry: tuple, index: jax.Array) -> tuple[tuple, tuple[SampleOutput, jax.Array]]:
        cache, state, alive = carry
        cache, logits, _ = _decode(params, cache, state, replace(plan, active=plan.active & alive), config, impl)
        state, out = _sample(state, logits, replace(sample, rows_on=sample.rows_on & alive))
        stopped = jnp.any(out.tokens[:, None] == plan.stop_ids, axis=1) | (index + 1 >= plan.budget)
        return (cache, state, alive & ~stopped), (out, alive)

    alive = plan.active & (plan.budget > 0)
    (cache, state, _), (out, alive) = lax.scan(step, (cache, state, alive), jnp.arange(plan.steps, dtype=jnp.int32))
    return cache, state, out, alive


@partial(jax.jit, donate_argnames=("state",))
def sample_step(state: SlotState, logits: jax.Array, plan: SamplePlan) -> tuple[SlotState, SampleOutput]:
    """The next token of every row, with its slot's penalties; the rows' slots continue with it (counted, fed to
    the next decode step at the next position).

    A plan with `prompt_masks` samples first tokens: those rows' slot state restarts with their prompt. A plan
    with `allowed` (structured outputs, `processors`) samples only the tokens each row's bitmask allows, plus its
    logit_bias (`sampling.sample`); `plan.paths` are the parts the sampler's program holds.
    """
    return _sample(state, logits, plan)


def _sample(state: SlotState, logits: jax.Array, plan: SamplePlan) -> tuple[SlotState, SampleOutput]:
    rows = jnp.where(plan.rows_on, plan.slots, state.num_slots)  # a row aimed past the slots is dropped
    if plan.first:
        zeros = jnp.zeros(plan.prompt_masks.shape, jnp.int32)
        steps = jnp.zeros(plan.slots.shape, jnp.int32)
        out = sample(logits, plan.sampling, plan.prompt_masks, zeros, steps, plan.allowed, plan.bias_ids,
                     plan.bias, num_top=plan.num_top, logprobs_mode=plan.logprobs_mode, paths=plan.paths)
        state = state.restart(rows, plan.prompt_masks).count(rows, out.tokens)
        return state.advance(rows, out.tokens, plan.positions, steps + 1), out
    steps = state.generated[plan.slots]
    out = sample(logits, plan.sampling, state.prompt_mask[plan.slots], state.output_counts[plan.slots],
                 steps, plan.allowed, plan.bias_ids, plan.bias, num_top=plan.num_top,
                 logprobs_mode=plan.logprobs_mode, paths=plan.paths)
    return state.count(rows, out.tokens).advance(rows, out.tokens, state.position[plan.slots] + 1, steps + 1), out


@partial(jax.jit, donate_argnames=("cache",))
def copy_slot_prefix(cache: KVCache, src, dst, length) -> KVCache:
    """Copy the first `length` cached positions of slot src into slot dst (a shared prompt prefix)."""
    return copy_prefix(cache, src, dst, length)


@partial(jax.jit, static_argnames=("config", "impl"), donate_argnames=("cache",))
def verify_step(params, cache: KVCache, plan: VerifyPlan, *, config: ModelConfig, impl: str
                ) -> tuple[KVCache, jax.Array]:
    """Write each row's last token and draft after its cached tokens (the prefill path: a chunk after a prefix);
    float32 logits [rows, verify_width, vocab] at every position (positions past a row's length are garbage)."""
    cache, _, hidden = prefill_forward(params, config, impl, plan.kv_len, cache, plan.tokens, plan.slots,
                                       plan.starts, plan.lengths, return_hidden=True,
                                       hook=row_hooks(plan.hooks, plan.selector), steer=plan.steer)
    return cache, lm_head(params, hidden)


@partial(jax.jit, donate_argnames=("state",))
def verify_sample_step(state: SlotState, logits: jax.Array, plan: VerifySamplePlan
                       ) -> tuple[SlotState, SampleOutput, jax.Array]:
    """The target's token at every verify position, how many drafts each row accepts, and the penalty counts of
    the accepted tokens.

    Position j of row b is sampled exactly as non-speculative decoding would sample the request's token number
    `steps[b] + j` had the drafts before j been generated: the same random stream (seed, step index) and penalty
    counts including drafts[:j]. Drafts are accepted while they equal the drawn token; the drawn token at the first
    mismatch (or after the last draft) is the bonus. With a one-hot draft this is speculative rejection sampling
    (P(accept t) = p(t); on rejection the token is distributed as p without t), and the output is token for token
    what non-speculative decoding draws. Returns the outputs [rows, width] and accepted [rows] (0..num_drafts); each
    active row's slot continues after its accepted drafts with the token drawn after them.
    """
    rows, width, vocab = logits.shape
    k = width - 1
    flat = lambda x: x.reshape(rows * width, *x.shape[2:])  # noqa: E731
    repeat = lambda x: jnp.repeat(x, width, axis=0)  # noqa: E731
    arrays = jax.tree_util.tree_map(repeat, plan.sampling)
    steps = (plan.steps[:, None] + jnp.arange(width)[None, :]).reshape(-1)

    def penalized() -> SampleOutput:  # every position's counts: the slot's plus the drafts before it
        before = jnp.arange(width)[:, None] > jnp.arange(k)[None, :]  # [width, k]: draft i precedes position j
        counted = before[None] & (jnp.arange(k) < plan.num_drafts[:, None])[:, None, :]  # [rows, width, k]
        extra = jnp.zeros((rows, width, vocab), jnp.int32).at[
            jnp.arange(rows)[:, None, None], jnp.arange(width)[None, :, None], plan.drafts[:, None, :]
        ].add(counted.astype(jnp.int32))
        counts = state.output_counts[plan.slots][:, None] + extra
        return sample(flat(logits), arrays, repeat(state.prompt_mask[plan.slots]), flat(counts), steps,
                      num_top=plan.num_top, logprobs_mode=plan.logprobs_mode, paths=plan.paths)

    def neutral() -> SampleOutput:  # no row penalizes: penalties are an exact identity, so skip their state
        return sample(flat(logits), arrays, None, None, steps, num_top=plan.num_top,
                      logprobs_mode=plan.logprobs_mode, paths=plan.paths)

    # The [rows * width, vocab] counts and masks cost more than the sampling itself (Qwen3's vocabulary: 143 of
    # 1443 ms at 8 rows on CPU, measured), and most batches have no penalized row: the host knows whether one has
    # (`plan.penalized`, static), so only such a batch's program builds them.
    out = penalized() if plan.penalized else neutral()
    out = jax.tree_util.tree_map(lambda x: x.reshape(rows, width, *x.shape[1:]), out)
    agree = (out.tokens[:, :k] == plan.drafts) & (jnp.arange(k)[None, :] < plan.num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
    kept = (jnp.arange(width)[None, :] <= accepted[:, None]) & plan.rows_on[:, None]
    slots = jnp.where(plan.rows_on, plan.slots, state.num_slots)
    state = replace(state, output_counts=state.output_counts.at[slots[:, None], out.tokens].add(
        kept.astype(jnp.int32), mode="drop"))
    bonus = jnp.take_along_axis(out.tokens, accepted[:, None], axis=1)[:, 0]  # drawn after the accepted drafts
    return state.advance(slots, bonus, plan.starts + accepted + 1, plan.steps + accepted + 1), out, accepted
