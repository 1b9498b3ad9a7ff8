"""Engine: the slotted KV cache and the seed's batch API over two jitted, cache-donating step functions.

The host side only moves small integer arrays per step; the forward pass, sampling and penalty bookkeeping run
inside one device call. Every shape is bucketed by `buckets()` so a steady workload never recompiles.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .config import EngineConfig, ModelConfig
from .errors import CapacityError, ConfigError, RequestError
from .kv_cache import KVCache, copy_prefix, init_cache
from .layers import resolve_impl
from .model import Model, decode_forward, prefill_forward
from .sharding import init_sharded_cache
from .sampling import MAX_LOGPROBS, SampleOutput, SamplingArrays, SamplingParams, pack_sampling, sample


@dataclass
class BatchedRequest:
    """One request as the engine sees it; the engine fills slot_id .. finish_reason as it runs."""

    request_id: Any
    prompt_tokens: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    slot_id: int | None = None
    cached_prefix_len: int = 0
    generated_tokens: list[int] = field(default_factory=list)
    last_token: int | None = None
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens whose K/V are in the slot (cached prefix included)
    seed: int | None = None  # resolved seed (sampling.seed, or drawn by the engine)


@dataclass(frozen=True)
class Completion:
    """A finished request: generated token ids, their text (when a tokenizer is at hand), and why it stopped."""

    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    request_id: Any = None


@dataclass(eq=False)
class PendingDecode:
    """A dispatched decode step whose sampled tokens are still on device until `Engine.decode_collect` reads them.

    The next step can take its input tokens from `out` without a host round trip while the rows keep their order,
    so the host work on one step's tokens overlaps the device work of the next.
    """

    requests: list[BatchedRequest]  # as given to decode_dispatch: the order of decode_collect's result
    rows: list[BatchedRequest | None]  # row i's request; None: padding, or a request left out of this step
    slots: np.ndarray
    positions: np.ndarray
    steps: np.ndarray  # index of the token each row generates (the sampler's key is (seed, step))
    dense: bool
    out: SampleOutput | None = None  # None when no row was active (nothing was dispatched) or once collected
    previous: PendingDecode | None = None  # the uncollected step whose tokens fed this one
    results: list[int | None] | None = None  # set by decode_collect

    @property
    def collected(self) -> bool:
        return self.results is not None

    def continues(self, requests: Sequence[BatchedRequest]) -> bool:
        """True when every request has a row here, so a next step can read all its input tokens on device."""
        held = {id(r) for r in self.rows if r is not None}
        return all(id(r) in held for r in requests)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Penalties:
    """Per-slot sampling state on device: the prompt's tokens and the generated-token counts."""

    prompt_mask: jax.Array  # bool [slots, vocab]: tokens of each slot's prompt (repetition penalty)
    output_counts: jax.Array  # int32 [slots, vocab]: generated-token counts (presence/frequency penalty)


def bucket(n: int, smallest: int, largest: int) -> int:
    """The compiled size for n: the next power of two >= max(n, smallest), capped at `largest`."""
    size = smallest
    while size < n:
        size *= 2
    return min(size, largest)


# The forward steps and the sampler are separate jitted calls, chained on device without a host sync: the
# sampler then compiles once per batch bucket instead of once per (batch, chunk, attention length) shape.

@partial(jax.jit, static_argnames=("config", "impl", "kv_len"), donate_argnames=("cache",))
def prefill_step(params, cache: KVCache, tokens, slots, starts, lengths, *, config: ModelConfig, impl: str,
                 kv_len: int) -> tuple[KVCache, jax.Array]:
    """Write one prompt chunk per row into the cache; logits [B, vocab] of each row's last chunk token."""
    return prefill_forward(params, config, impl, kv_len, cache, tokens, slots, starts, lengths)


@partial(jax.jit, static_argnames=("config", "impl", "kv_len", "dense"), donate_argnames=("cache",))
def decode_step(params, cache: KVCache, tokens, slots, positions, active, *, config: ModelConfig, impl: str,
                kv_len: int, dense: bool) -> tuple[KVCache, jax.Array]:
    """One token per row. `dense`: row i is slot i for every slot, so attention reads the cache in place."""
    return decode_forward(params, config, impl, kv_len, cache, tokens, slots, positions, active, dense=dense)


@partial(jax.jit, static_argnames=("num_top",), donate_argnames=("penalties",))
def sample_first(penalties: Penalties, logits, slots, final, prompt_masks, sampling: SamplingArrays, *,
                 num_top: int) -> tuple[Penalties, SampleOutput]:
    """First token of rows whose prompt ended (`final`); resets those slots' penalty state to the new prompt."""
    zeros = jnp.zeros(prompt_masks.shape, jnp.int32)
    out = sample(logits, sampling, prompt_masks, zeros, jnp.zeros_like(slots), num_top=num_top)
    rows = jnp.where(final, slots, penalties.prompt_mask.shape[0])
    mask = penalties.prompt_mask.at[rows].set(prompt_masks, mode="drop")
    counts = penalties.output_counts.at[rows].set(0, mode="drop").at[rows, out.tokens].add(1, mode="drop")
    return Penalties(mask, counts), out


@partial(jax.jit, static_argnames=("num_top",), donate_argnames=("penalties",))
def sample_next(penalties: Penalties, logits, slots, active, steps, sampling: SamplingArrays, *,
                num_top: int) -> tuple[Penalties, SampleOutput]:
    """Next token of every active row, with penalties from its slot's state; counts the new tokens."""
    out = sample(logits, sampling, penalties.prompt_mask[slots], penalties.output_counts[slots], steps,
                 num_top=num_top)
    rows = jnp.where(active, slots, penalties.prompt_mask.shape[0])
    counts = penalties.output_counts.at[rows, out.tokens].add(1, mode="drop")
    return Penalties(penalties.prompt_mask, counts), out


@partial(jax.jit, donate_argnames=("cache",))
def copy_slot_prefix(cache: KVCache, src, dst, length) -> KVCache:
    """Copy the first `length` cached positions of slot src into slot dst (a shared prompt prefix)."""
    return copy_prefix(cache, src, dst, length)


def read_eos_ids(model: Model) -> frozenset[int]:
    """EOS ids from generation_config.json (what generate() uses) and config.json."""
    ids = set(model.config.eos_token_ids)
    if model.path:
        gen = Path(model.path) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return frozenset(ids)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Engine:
    """Slots + jitted batch prefill / decode over one model: the seed's batch API.

    A slot that is freed keeps its cached tokens until it is reused, so a follow-up request that starts with the
    same tokens (the next turn of a conversation, a shared system prompt) skips recomputing them.
    """

    def __init__(self, model: Model, max_batch_size: int = 8, max_seq_len: int = 2048, prefill_chunk: int = 512,
                 attention_impl: str = "auto", seed: int = 0, config: EngineConfig | None = None,
                 kv_dtype: str | None = None):
        self.model = model
        self.config = config or EngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                             prefill_chunk=prefill_chunk, attention_impl=attention_impl,
                                             kv_dtype=kv_dtype)
        self.config.validate()
        self.impl = resolve_impl(self.config.attention_impl, self.config.kv_dtype)
        self.eos_ids = read_eos_ids(model)
        self.rng = np.random.default_rng(seed)
        self.cache: KVCache | None = None
        self.penalties: Penalties | None = None
        self.slot_of: dict[Any, int] = {}
        self.allocate_batch_slots(self.config.max_batch_size)

    # ---- slots -------------------------------------------------------------------------------------------------
    def supports_batching(self) -> bool:
        return True

    @property
    def num_slots(self) -> int:
        return len(self.slot_tokens)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def allocate_batch_slots(self, n: int) -> None:
        """(Re)allocate the KV cache with n slots; refused while any slot is held."""
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"number of slots must be a positive integer, got {n!r}")
        if self.slot_of:
            raise CapacityError(f"cannot reallocate slots while {len(self.slot_of)} are held")
        c = self.model.config
        self.cache = self.penalties = None  # drop the old cache before allocating the new one
        kv_dtype = self.config.kv_dtype or jnp.dtype(self.model.dtype).name
        shape = (c.num_layers, n, c.num_kv_heads, self.config.max_seq_len, c.head_dim, kv_dtype)
        if self.model.mesh is not None:  # created in its shards: the whole cache may not fit on one device
            self.cache = init_sharded_cache(self.model.mesh, *shape)
        else:
            self.cache = init_cache(*shape)
        self.penalties = Penalties(jnp.zeros((n, c.vocab_size), bool), jnp.zeros((n, c.vocab_size), jnp.int32))
        self.slot_tokens: list[list[int]] = [[] for _ in range(n)]
        self.free_slots: list[int] = list(range(n))  # least recently freed first
        self._inflight: PendingDecode | None = None  # the last dispatched decode step (it may be uncollected)

    def allocate_slot(self, request: BatchedRequest | Any) -> int:
        """Hold a free slot for a request (a BatchedRequest or its id); returns the slot id.

        Given a BatchedRequest, prefers the free slot already holding the longest prefix of its prompt, copies a
        longer prefix from any other slot on device, and sets `cached_prefix_len` accordingly.
        """
        req = request if isinstance(request, BatchedRequest) else None
        request_id = req.request_id if req else request
        if request_id in self.slot_of:
            raise RequestError(f"request_id {request_id!r} already holds slot {self.slot_of[request_id]}")
        if not self.free_slots:
            raise CapacityError(f"no free slot: all {self.num_slots} slots are held")
        slot = self.free_slots[0]
        prefix = 0
        if req is not None:
            prompt = list(req.prompt_tokens)
            matches = {s: min(common_prefix(self.slot_tokens[s], prompt), len(prompt) - 1) for s in self.free_slots}
            slot = max(self.free_slots, key=lambda s: matches[s])  # max keeps the first (LRU) on ties
            prefix = matches[slot]
            donor = max(range(self.num_slots), key=lambda s: common_prefix(self.slot_tokens[s], prompt))
            donor_len = min(common_prefix(self.slot_tokens[donor], prompt), len(prompt) - 1)
            if donor_len > prefix:
                self.cache = copy_slot_prefix(self.cache, np.int32(donor), np.int32(slot), np.int32(donor_len))
                prefix = donor_len
            prefix = max(prefix, 0)
            self.slot_tokens[slot] = prompt[:prefix]
            req.slot_id, req.cached_prefix_len, req.num_prefilled = slot, prefix, prefix
        else:
            self.slot_tokens[slot] = []
        self.free_slots.remove(slot)
        self.slot_of[request_id] = slot
        return slot

    def free_slot(self, request_id: Any) -> None:
        """Release a request's slot; its cached tokens stay reusable until the slot is taken again."""
        if request_id not in self.slot_of:
            raise RequestError(f"request_id {request_id!r} holds no slot")
        self.free_slots.append(self.slot_of.pop(request_id))

    # ---- validation ----------------------------------------------------------------------------------------------
    def validate(self, req: BatchedRequest) -> None:
        """Raise RequestError/SamplingError for a request this engine cannot run."""
        prompt = req.prompt_tokens
        if len(prompt) == 0:
            raise RequestError(f"request {req.request_id!r}: empty prompt")
        if len(prompt) >= self.max_seq_len:
            raise RequestError(f"request {req.request_id!r}: prompt of {len(prompt)} tokens does not fit "
                               f"max_seq_len={self.max_seq_len} (one position is needed to generate)")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"request {req.request_id!r}: token id {bad[0]!r} outside the vocabulary [0, {vocab})")
        if not isinstance(req.sampling, SamplingParams):
            raise RequestError(f"request {req.request_id!r}: sampling must be a SamplingParams")
        req.sampling.validate(vocab)

    def _slot(self, req: BatchedRequest) -> int:
        slot = self.slot_of.get(req.request_id)
        if slot is None:
            raise RequestError(f"request_id {req.request_id!r} holds no slot: call allocate_slot first")
        req.slot_id = slot
        return slot

    # ---- prefill -------------------------------------------------------------------------------------------------
    def batch_prefill(self, requests: Sequence[BatchedRequest], token_budget: int | None = None
                      ) -> list[int | None]:
        """Prefill every request's prompt (after its cached prefix) in batched, chunked device calls.

        Returns each request's first generated token. With `token_budget`, runs ONE device call over at most that
        many prompt tokens (FCFS) and returns None for requests whose prompt is not finished yet.
        """
        for req in requests:
            self.validate(req)
            self._slot(req)
            if req.seed is None:
                req.seed = req.sampling.seed if req.sampling.seed is not None else int(self.rng.integers(2**32))
        results: dict[int, int] = {}
        while True:
            pending = [r for r in requests if r.num_prefilled < len(r.prompt_tokens)]
            if not pending:
                break
            chunks = self._plan_chunks(pending, token_budget)
            self._prefill_call(chunks, results)
            if token_budget is not None:
                break
        return [results.get(id(r)) for r in requests]

    def _plan_chunks(self, pending: list[BatchedRequest], budget: int | None) -> list[tuple[BatchedRequest, int]]:
        chunks = []
        left = budget if budget is not None else float("inf")
        for req in pending[: self.num_slots]:
            n = min(len(req.prompt_tokens) - req.num_prefilled, self.config.prefill_chunk, left)
            if n <= 0:
                break
            chunks.append((req, int(n)))
            left -= n
        return chunks

    def _prefill_call(self, chunks: list[tuple[BatchedRequest, int]], results: dict[int, int]) -> None:
        cfg = self.config
        rows = bucket(len(chunks), 1, self.num_slots)
        width = bucket(max(n for _, n in chunks), cfg.min_prefill_bucket, cfg.prefill_chunk)
        vocab = self.model.config.vocab_size
        tokens = np.zeros((rows, width), np.int32)
        slots = np.full(rows, self.num_slots, np.int32)  # padding rows target no slot: their writes are dropped
        starts = np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)
        final = np.zeros(rows, bool)
        masks = np.zeros((rows, vocab), bool)
        for i, (req, n) in enumerate(chunks):
            begin = req.num_prefilled
            tokens[i, :n] = req.prompt_tokens[begin: begin + n]
            slots[i], starts[i], lengths[i] = req.slot_id, begin, n
            final[i] = begin + n == len(req.prompt_tokens)
            if final[i]:
                masks[i, np.asarray(req.prompt_tokens)] = True
        kv_len = self._kv_bucket(int((starts + lengths).max()))
        sampling = pack_sampling([r.sampling for r, _ in chunks], [r.seed for r, _ in chunks], pad_to=rows)
        num_top = MAX_LOGPROBS if any(r.sampling.logprobs for r, _ in chunks) else 0
        gather_slots = np.where(slots < self.num_slots, slots, 0).astype(np.int32)
        # padding rows read slot 0 but write nothing: their lengths are 0 and `final` is False
        self.cache, logits = prefill_step(self.model.params, self.cache, tokens, gather_slots, starts, lengths,
                                          config=self.model.config, impl=self.impl, kv_len=kv_len)
        for req, n in chunks:
            self.slot_tokens[req.slot_id].extend(req.prompt_tokens[req.num_prefilled: req.num_prefilled + n])
            req.num_prefilled += n
        if final.any():
            self.penalties, out = sample_first(self.penalties, logits, gather_slots, final, masks, sampling,
                                               num_top=num_top)
            self._deliver([(i, r) for i, (r, _) in enumerate(chunks) if final[i]], out, results)

    # ---- decode --------------------------------------------------------------------------------------------------
    def batch_decode_step(self, requests: Sequence[BatchedRequest]) -> list[int | None]:
        """One device call that generates the next token of every unfinished request; None for the others."""
        return self.decode_collect(self.decode_dispatch(requests))

    def decode_dispatch(self, requests: Sequence[BatchedRequest]) -> PendingDecode:
        """Queue one decode step for every unfinished request and return without waiting for its tokens.

        If the last dispatched step is still uncollected and holds a row for each request, this step reads its input
        tokens from that step's output on device, so it is queued before they reach the host; a request the token in
        flight ends by length is left out, one it ends otherwise (a stop token, a stop string) costs one row whose
        token `decode_collect` discards. Otherwise that step is collected first and this one is fed from the host.
        """
        running = [r for r in requests if not r.finished]
        for req in running:
            self._slot(req)
            if req.last_token is None or req.num_prefilled < len(req.prompt_tokens):
                raise RequestError(f"request {req.request_id!r} must be prefilled before decoding")
        previous = self._inflight if self._inflight is not None and not self._inflight.collected else None
        if previous is not None and previous.continues(running):
            step = self._dispatch_chained(previous, running, requests)
        else:
            if previous is not None:
                self.decode_collect(previous)
            step = self._dispatch_fed(requests)
        self._inflight = step
        return step

    def decode_collect(self, step: PendingDecode) -> list[int | None]:
        """Read a dispatched step's tokens (the one sync) into its requests; returns each request's new token, None
        for requests that were finished, left out, or released since the dispatch. Collects older steps first."""
        if step.results is not None:
            return step.results
        if step.previous is not None:
            self.decode_collect(step.previous)
            step.previous = None
        step.results = [None] * len(step.requests)  # collected even if the read raises: never delivered twice
        kept = [(i, r) for i, r in enumerate(step.rows) if r is not None and self._holds(r, int(step.slots[i]))]
        results: dict[int, int] = {}
        if kept:
            fed = [(r.slot_id, r.last_token) for _, r in kept]
            self._deliver(kept, step.out, results)
            for slot, token in fed:  # recorded once its row is kept, so a discarded row leaves no trace
                self.slot_tokens[slot].append(token)
        step.results, step.out = [results.get(id(r)) for r in step.requests], None
        return step.results

    def _dispatch_fed(self, requests: Sequence[BatchedRequest]) -> PendingDecode:
        """A step whose input tokens come from the host: every earlier step is collected."""
        running = [r for r in requests if not r.finished]
        rows = bucket(len(running), 1, self.num_slots)
        # One slot reads it through the gather path: with its only row, XLA:CPU turns the cache write into a
        # select over a dynamic-update-slice and copies every layer's cache 8 times per step once attention reads
        # all of it (Qwen3-0.6B shapes, kv bucket == max_seq_len: 182 ms vs 139 ms gathered; 114-130 ms both below).
        dense = rows == self.num_slots > 1
        if dense:  # row i is slot i: attention reads the cache without gathering rows
            order = {r.slot_id: r for r in running}
            row_reqs = [order.get(s) for s in range(rows)]
        else:
            row_reqs = running + [None] * (rows - len(running))
        tokens = np.zeros(rows, np.int32)
        slots = np.arange(rows, dtype=np.int32) if dense else np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        steps = np.zeros(rows, np.int32)
        for i, req in enumerate(row_reqs):
            if req is not None:
                tokens[i], slots[i], positions[i] = req.last_token, req.slot_id, len(self.slot_tokens[req.slot_id])
                steps[i] = len(req.generated_tokens)
        return self._dispatch(PendingDecode(list(requests), row_reqs, slots, positions, steps, dense), tokens)

    def _dispatch_chained(self, previous: PendingDecode, running: list[BatchedRequest],
                          requests: Sequence[BatchedRequest]) -> PendingDecode:
        """A step fed `previous`'s sampled tokens on device: same rows, one position and one step further."""
        going = {id(r) for r in running if not self._reaches_length(r, len(r.generated_tokens) + 1)}
        rows = [r if r is not None and id(r) in going else None for r in previous.rows]
        active = np.array([r is not None for r in rows])
        step = PendingDecode(list(requests), rows, previous.slots, np.where(active, previous.positions + 1, 0),
                             np.where(active, previous.steps + 1, 0), previous.dense, previous=previous)
        return self._dispatch(step, previous.out.tokens if previous.out is not None else None)

    def _dispatch(self, step: PendingDecode, tokens) -> PendingDecode:
        """Queue the forward pass and the sampler over `step`'s rows (nothing when no row is active)."""
        present = [r for r in step.rows if r is not None]
        if not present:
            return step
        active = np.array([r is not None for r in step.rows])
        kv_len = self._kv_bucket(int(step.positions.max()) + 1)
        sampling = pack_sampling([r.sampling if r else SamplingParams(temperature=0.0) for r in step.rows],
                                 [r.seed if r else 0 for r in step.rows])
        num_top = MAX_LOGPROBS if any(r.sampling.logprobs for r in present) else 0
        self.cache, logits = decode_step(self.model.params, self.cache, tokens, step.slots, step.positions, active,
                                         config=self.model.config, impl=self.impl, kv_len=kv_len, dense=step.dense)
        self.penalties, step.out = sample_next(self.penalties, logits, step.slots, active, step.steps, sampling,
                                               num_top=num_top)
        return step

    def _holds(self, req: BatchedRequest, slot: int) -> bool:
        """True while req is unfinished and still holds `slot`: its token of a step in flight is still wanted."""
        return not req.finished and self.slot_of.get(req.request_id) == slot

    # ---- shared --------------------------------------------------------------------------------------------------
    def _kv_bucket(self, needed: int) -> int:
        if self.impl != "xla":
            return self.max_seq_len  # the kernels skip blocks past each slot's length themselves
        return bucket(needed, self.config.min_kv_bucket, self.max_seq_len)

    def _deliver(self, rows: list[tuple[int, BatchedRequest]], out: SampleOutput, results: dict[int, int]) -> None:
        """Move sampled tokens to the host (one transfer) and append them to their requests; mark finished ones."""
        out = jax.device_get(out)
        for i, req in rows:
            token = int(out.tokens[i])
            n = req.sampling.logprobs
            top = {int(t): float(lp) for t, lp in zip(out.top_ids[i, :n], out.top_logprobs[i, :n])} if n else {}
            req.logprobs.append((float(out.logprobs[i]), top))
            req.generated_tokens.append(token)
            req.last_token = token
            results[id(req)] = token
            self._check_finished(req, token)

    def _check_finished(self, req: BatchedRequest, token: int) -> None:
        sp = req.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_ids):
            req.finished, req.finish_reason = True, "stop"
        elif self._reaches_length(req, len(req.generated_tokens)):
            req.finished, req.finish_reason = True, "length"

    def _reaches_length(self, req: BatchedRequest, generated: int) -> bool:
        """True when `generated` tokens end req by length: max_tokens, or the cache's last position."""
        return generated >= req.sampling.max_tokens or len(req.prompt_tokens) + generated >= self.max_seq_len

    def compiled_count(self) -> int:
        """How many call signatures the step functions hold so far (a steady workload must not add any).

        A decode step fed its tokens on device (`decode_dispatch` chaining) adds one signature per shape the first
        time; it reuses the executable compiled for the host-fed step.
        """
        steps = (prefill_step, decode_step, sample_first, sample_next, copy_slot_prefix)
        return sum(f._cache_size() for f in steps)
