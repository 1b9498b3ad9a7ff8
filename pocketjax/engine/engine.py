"""Engine: the batch API over the slotted KV cache: allocate slots, prefill prompts, decode steps, free slots.

The host side only moves small integer arrays per step; the forward pass, sampling and penalty bookkeeping run in
the jitted steps of `steps.py`; a decode step and its sampler are one program (one dispatch per token; a step whose
token masks come from the host runs them as two). A decode step is split in two on the host, `decode_dispatch`
(queue it, return at once) and `decode_collect` (the one host read), so a caller can keep one step in flight while it
works on the tokens of the one before (the Scheduler's policy); `batch_decode_step` does both. A decode step's
inputs are each slot's state on device (`steps.SlotState`), so any requests can share a step queued behind steps the
host has not read.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import CapacityError, ConfigError, RequestError
from ..model.config import read_eos_ids
from ..model.decoder import Hook, Model
from ..model.kv_cache import KVCache, default_kv_dtype, init_cache
from ..model.layers import resolve_impl
from ..model.memory import check_fits, plan_memory
from ..model.quant import untiled_params
from ..model.sharding import init_sharded_cache, mesh_tp, to_host
from .config import OFF, EngineConfig, use_compile_cache
from .pending import PendingDecode, PendingPrefill, PendingVerify
from .plan import STOP_WIDTH, SamplePlan, Signature, StepRules, decode_plans, prefill_plans, scored_positions
from .request import BatchedRequest, RequestStatus, batch
from .sampling import SampleOutput, logprob_entry
from .slots import SlotTable
from .speculative import Speculator
from .processors import limits_of
from .structured import Constrainer
from .runner import Device, compiled_count
from .steps import SlotState
from .validation import check_request, steering_table
from .verifying import SpeculativeSteps
from .weights import placed


class Engine(SpeculativeSteps):
    """Slots + jitted batch prefill / decode over one model.

    Options are EngineConfig's fields (max_batch_size, max_seq_len, prefill_chunk, attention_impl, kv_dtype, ...),
    given as keywords or as `config`. A slot that is freed keeps its cached tokens until it is reused (`SlotTable`).
    `tokenizer` (a pocketjax Tokenizer or a tokenizers.Tokenizer) lets the engine serve structured outputs
    (`SamplingParams.structured`): the constraints are compiled against its tokens' bytes.
    """

    def __init__(self, model: Model, config: EngineConfig | None = None, *, seed: int = 0, tokenizer: Any = None,
                 **options: Any):
        self.config = EngineConfig.of(config, **options)
        if self.config.compile_cache_dir not in (None, OFF):  # asked for: process-wide, as JAX's cache is
            use_compile_cache(self.config.compile_cache_dir)
        self.impl = resolve_impl(self.config.attention_impl, self.config.kv_dtype,
                                 batch_invariant=self.config.batch_invariant)
        if self.impl != "cpu":  # XLA's forms read row-major values: untile the kernel's tiles once, not every step
            model = replace(model, params=untiled_params(model.params))  # (0.79x per step at 1 request otherwise)
        self.model = model
        self.eos_ids = frozenset(read_eos_ids(model.config, model.path))
        self.rng = np.random.default_rng(seed)
        self.device = Device(model.params, model.config, self.impl, model.dtype)  # weights, cache, slot state
        self.slots = SlotTable(0)
        self.requests: dict[Any, BatchedRequest] = {}  # request_id -> the request prefilled in its slot
        # hooks whose output shape was checked (`_check_hook`); held as the step functions' compile caches hold them
        self.checked_hooks: set[Hook] = set()
        spec = self.config.speculative
        self.speculator = Speculator(spec) if spec is not None else None  # None: no speculative decoding
        self.constrainer: Constrainer | None = None
        self.use_tokenizer(tokenizer)
        self.allocate_batch_slots(self.config.max_batch_size)

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Serve structured outputs with this tokenizer's tokens (None: refuse them); kept once set."""
        if tokenizer is not None and self.constrainer is None:
            self.constrainer = Constrainer(tokenizer, self.model.config.vocab_size, self.eos_ids)

    # ---- slots -------------------------------------------------------------------------------------------------
    def supports_batching(self) -> bool:
        return True

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_free_slots(self) -> int:
        return len(self.slots.free)

    @property
    def cache(self) -> KVCache | None:
        """The KV cache (read-only here: only `self.device` calls the steps that donate it)."""
        return self.device.cache

    @property
    def slot_state(self) -> SlotState | None:
        """Each slot's next decode input and penalty state, on device (read-only, as `cache`)."""
        return self.device.state

    @property
    def kv_dtype(self) -> str:
        """The KV cache form this engine chose: `kv_dtype=` or the model's default (`default_kv_dtype`: float32 for a
        16-bit model on CPU). `pj.logits` / `pj.logprobs` / `pj.loss` with it score as this engine samples."""
        return self.config.kv_dtype or default_kv_dtype(self.model.dtype)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def rules(self) -> StepRules:
        """How this engine buckets its step calls (`plan.StepRules`): what warm-up and benchmarks plan with."""
        cfg = self.config
        width = cfg.speculative.num_speculative_tokens + 1 if cfg.speculative is not None else 0
        c = self.model.config
        return StepRules(self.num_slots, cfg.max_seq_len, cfg.prefill_chunk, cfg.min_prefill_bucket,
                         cfg.min_kv_bucket, self.impl, c.vocab_size, width, cfg.logprobs_mode, c.num_layers,
                         c.hidden_size, structured=self.constrainer is not None, decode_steps=cfg.decode_steps)

    def allocate_batch_slots(self, n: int) -> None:
        """(Re)allocate the KV cache with n slots; refused while any slot is held."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"number of slots must be a positive integer, got {n!r}")
        if self.slots.owner:
            raise CapacityError(f"cannot reallocate slots while {len(self.slots.owner)} are held")
        c, mesh = self.model.config, self.model.mesh
        device = self.device
        device.cache = device.state = None  # drop the old cache before allocating the new one
        kv_dtype = self.kv_dtype
        shape = (c.num_layers, n, c.num_kv_heads, self.config.max_seq_len, c.head_dim, kv_dtype)
        plan = plan_memory(c, tp=mesh_tp(mesh) if mesh is not None else 1, dtype=jnp.dtype(self.model.dtype).name,
                           kv_dtype=kv_dtype, slots=n, max_seq_len=self.config.max_seq_len)
        check_fits(f"a KV cache of {n} slots x {self.config.max_seq_len} positions", plan.kv_cache,
                   list(mesh.devices.flat) if mesh is not None else jax.devices()[:1],
                   "use fewer slots (max_batch_size), a shorter max_seq_len, kv_dtype='int8', or tp=2")
        stacked = self.model.scan_layers  # the cache's layer layout follows the model's (decoder.layer_stack)
        if mesh is not None:  # created in its shards: the whole cache may not fit on one device
            device.cache = init_sharded_cache(mesh, *shape, stacked=stacked)
        else:
            device.cache = init_cache(*shape, stacked=stacked)
        device.state = SlotState.zeros(n, c.vocab_size)
        if mesh is not None:  # replicated over the mesh, as the sampler returns it: one compile, not two
            device.state = jax.device_put(device.state, NamedSharding(mesh, PartitionSpec()))
        self.slots = SlotTable(n)

    def allocate_slot(self, request: BatchedRequest | Any) -> int:
        """Hold a free slot for a request (a BatchedRequest or its id); returns the slot id.

        Given a BatchedRequest, takes the free slot already holding the longest prefix of its prompt, copies a
        longer prefix from any other slot on device, sets `cached_prefix_len`, and moves it to PREFILLING.
        """
        req = request if isinstance(request, BatchedRequest) else None
        if req is not None:
            self.validate(req)
            if req.in_flight:
                raise RequestError(f"request {req.request_id!r} still has a decode step in flight")
        request_id = req.request_id if req else request
        # Prompt logprobs need every prompt position computed, so such a request reuses no cached prefix (as vLLM);
        # its own prompt is cached as usual for the requests after it.
        reuse = req is not None and req.sampling.prompt_logprobs is None
        # A hook or steering changes the K/V it writes: a slot's cached prefix serves only requests with the same.
        alloc = self.slots.allocate(request_id, list(req.prompt_tokens) if reuse else None,
                                    req.sampling.cache_tag if req is not None else None)
        if alloc.donor is not None:
            self.device.run("copy_prefix", np.int32(alloc.donor), np.int32(alloc.slot), np.int32(alloc.cached))
        if req is not None:
            req.slot_id, req.cached_prefix_len, req.num_prefilled = alloc.slot, alloc.cached, alloc.cached
            req.status = RequestStatus.PREFILLING
            self.requests[request_id] = req
        return alloc.slot

    def free_slot(self, request_id: Any, finish_reason: str = "cancelled") -> None:
        """Release a request's slot: the one release signal. An unfinished request ends with `finish_reason`, and
        its rows in decode steps still in flight are dropped. The slot's cached tokens stay reusable."""
        self.slots.release(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.finish(finish_reason)

    # ---- validation ----------------------------------------------------------------------------------------------
    def validate(self, req: BatchedRequest) -> None:
        """Raise RequestError/SamplingError for a request this engine cannot run (`validation.check_request`)."""
        check_request(req, self.model, self.max_seq_len, self.constrainer, self.checked_hooks)

    def _slot(self, req: BatchedRequest) -> int:
        """The slot req holds (registering req as its holder when it was allocated by id)."""
        slot = self.slots.slot_of(req.request_id)
        if slot is None:
            raise RequestError(f"request_id {req.request_id!r} holds no slot: call allocate_slot first")
        if self.requests.setdefault(req.request_id, req) is not req:
            raise RequestError(f"request_id {req.request_id!r} is held by another request object")
        if req.status is RequestStatus.WAITING:
            req.status = RequestStatus.PREFILLING
        req.slot_id = slot
        self.slots.tags[slot] = req.sampling.cache_tag  # (allocated by id: its K/V are written under this hook)
        return slot

    # ---- prefill -------------------------------------------------------------------------------------------------
    def batch_prefill(self, requests: Sequence[BatchedRequest], token_budget: int | None = None
                      ) -> list[int | None]:
        """Prefill every request's prompt (after its cached prefix) in batched, chunked device calls.

        Returns each request's first generated token. With `token_budget`, runs ONE device call over at most that
        many prompt tokens (FCFS) and returns None for requests whose prompt is not finished yet.
        """
        results: dict[int, int] = {}
        while True:
            step = self.prefill_dispatch(requests, token_budget)
            if step is None:
                break
            results.update((id(r), t) for r, t in zip(step.requests, self.prefill_collect(step)) if t is not None)
            if token_budget is not None:
                break
        return [results.get(id(r)) for r in requests]

    def prefill_dispatch(self, requests: Sequence[BatchedRequest], token_budget: int | None = None,
                         after: PendingDecode | PendingVerify | PendingPrefill | None = None) -> PendingPrefill | None:
        """Queue ONE prefill call (prompt chunks of at most `token_budget` tokens in all, FCFS) and return without
        reading anything; None when no request has prompt left.

        A request whose prompt ends in it is DECODING at once with its first token in flight: the sampler wrote it
        into the slot's state on device, so a decode step queued behind this one feeds it, and `prefill_collect`
        reads it (and any prompt logprobs) later: an admission needs no host read of its own. `after`: the latest
        step still in flight (collected before this one, as decode steps are)."""
        if token_budget is not None and (not isinstance(token_budget, int) or isinstance(token_budget, bool)
                                         or token_budget < 1):
            raise RequestError(f"token_budget must be None or an int >= 1, got {token_budget!r}")
        if after is not None and (after.collected or after.following is not None):
            raise RequestError("after= must be the latest step dispatched and not collected yet")
        for req in batch(requests):
            self._prepare(req)
        pending = [r for r in requests if r.status is RequestStatus.PREFILLING]
        if not pending:
            return None
        chunks = self._plan_chunks(pending, token_budget)
        step = PendingPrefill(list(requests), chunks, previous=after)
        for req, n in chunks:
            if req.sampling.prompt_logprobs is not None and req.num_prefilled == 0:
                req.prompt_logprobs = [None]  # the first prompt token has no context
        plan, first = prefill_plans(self.rules, chunks)
        if first is not None:  # the first token's masks: each constrained matcher's start state
            ending = [r if first.rows_on[i] else None for i, (r, _) in enumerate(chunks)]
            first = self._constrain(first, ending + [None] * (plan.rows - len(chunks)))
        logits, step.prompt_out, step.captured = self.device.run("prefill", plan)
        for req, n in chunks:
            step.starts.append(req.num_prefilled)
            self.slots.tokens[req.slot_id].extend(req.prompt_tokens[req.num_prefilled: req.num_prefilled + n])
            req.num_prefilled += n
        if first is not None:
            masked = "_masked" if first.allowed is not None else ""
            step.out = self.device.run("sample_first" + masked, logits, first)
            step.rows = [(i, r) for i, (r, _) in enumerate(chunks) if first.rows_on[i] and not r.finished]
            for _, r in step.rows:
                r.status = RequestStatus.DECODING
                r.in_flight += 1
        return step

    def prefill_collect(self, step: PendingPrefill) -> list[int | None]:
        """Read a dispatched prefill (the one host read): each request's first token (None: its prompt did not end
        in it, or it ended since), and the prompt logprobs of its chunks. In dispatch order, as decode steps."""
        if step.collected:
            return step.results
        if step.previous is not None and not step.previous.collected:
            raise RequestError("collect steps in the order they were dispatched")
        step.previous = None
        for _, r in step.rows:
            r.in_flight -= 1
        step.results = [None] * len(step.requests)  # collected even if the read raises: never delivered twice
        if step.prompt_out is not None:
            self._deliver_prompt_logprobs(step, step.prompt_out)
        results: dict[int, int] = {}
        kept = [(i, r) for i, r in step.rows if not r.finished]  # a request freed since: its token is discarded
        if kept:
            self._deliver(kept, step.out, results, step.captured)
        step.out = step.prompt_out = step.captured = None
        step.results = [results.get(id(r)) for r in step.requests]
        self._sample_following(step)
        return step.results

    def _prepare(self, req: BatchedRequest) -> None:
        """What a request needs before its first prefill call (each part once): validation, its slot, seed, matcher,
        steering table and token limits."""
        if self.requests.get(req.request_id) is not req:  # checked once, when the engine first sees it
            self.validate(req)
        self._slot(req)
        if req.seed is None:
            req.seed = req.sampling.seed if req.sampling.seed is not None else int(self.rng.integers(2**32))
        if req.sampling.structured is not None and req.matcher is None:
            req.matcher = self.constrainer.start(req.sampling.structured)
        if req.sampling.steer and req.steering is None:
            req.steering = steering_table(req, self.model)
        if req.sampling.limited and req.limits is None:
            req.limits = limits_of(req.sampling, self.model.config.vocab_size, sorted(self.eos_ids),
                                   self.constrainer.tokenizer if self.constrainer is not None else None)

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

    @staticmethod
    def _deliver_prompt_logprobs(step: PendingPrefill, out: SampleOutput) -> None:
        """Append each scored row's prompt-token logprobs to its request (one transfer for the chunk): one per
        chunk position that has a following prompt token."""
        out = to_host(out)  # every process reads the same whole rows, even with dp across hosts
        for i, ((req, n), start) in enumerate(zip(step.chunks, step.starts)):
            k = req.sampling.prompt_logprobs
            if k is not None:
                scored = scored_positions(req, start, n)
                req.prompt_logprobs += [logprob_entry(out, (i, t), k) for t in range(scored)]

    # ---- decode --------------------------------------------------------------------------------------------------
    def batch_decode_step(self, requests: Sequence[BatchedRequest]) -> list[int | None]:
        """One device call that generates the next token of every unfinished request; None for the others."""
        return self.decode_collect(self.decode_dispatch(requests))

    def decode_dispatch(self, requests: Sequence[BatchedRequest], after: PendingDecode | PendingVerify | None = None,
                        steps: int = 1) -> PendingDecode:
        """Queue one decode step for every unfinished request and return without waiting for its tokens.

        `steps` > 1: up to that many steps in one program, rows stopping on the device at their stop ids and length
        (the tokens of as many single steps, bit for bit), when no row needs the host between steps (`multi_step`);
        otherwise one step.

        Each row feeds its slot's last sampled token at its slot's position, both on device (`steps.SlotState`), so
        the step can be queued behind steps whose tokens the host has not read. Without `after`, every request's
        earlier steps must be collected. With `after`, the latest uncollected step (decode or verify), the requests
        may have rows in it or not (a request that just joined needs no drain): a request whose tokens in flight end
        it by length is left out, one they end otherwise (a stop token) costs one row whose token `decode_collect`
        discards.
        """
        running = [r for r in batch(requests) if not r.finished]
        for req in running:
            self._slot(req)
            if req.status is not RequestStatus.DECODING:
                raise RequestError(f"request {req.request_id!r} must be prefilled before decoding")
        if after is None:
            busy = [r.request_id for r in running if r.in_flight]
            if busy:
                raise RequestError(f"requests {busy} have a decode step in flight: collect it, or pass it as after=")
        elif after.collected or after.following is not None:
            raise RequestError("after= must be the latest step dispatched and not collected yet")
        elif getattr(after, "logits", None) is not None:
            raise RequestError("after= is a step whose sampler waits for the step before it (it has constrained "
                               "rows): collect that step first")
        keep = [r for r in running if not self._reaches_length(r, len(r.generated_tokens) + r.in_flight)]
        step = PendingDecode(list(requests), [], None, None, previous=after)
        if not keep:
            return step
        n = steps if steps > 1 and self.multi_step(keep) else 1
        step.rows, step.plan, sample = decode_plans(
            self.rules, keep, lambda r: len(self.slots.tokens[r.slot_id]) + r.positions_ahead, n, self._stops)
        deferred = any(r.in_flight and self._masked_on_host(r, len(r.generated_tokens) + r.in_flight) for r in keep)
        if deferred:  # masks need tokens in flight: its sampler is queued when `after` is collected
            after.following = step
            step.sample = sample
        else:  # a row with tokens in flight needs no mask from the host at this index: its plan's static one holds
            step.sample = self._constrain(sample, [r if r is not None and not r.in_flight else None for r in step.rows])
        if step.sample.allowed is None:  # forward pass and sampler in one program: one dispatch per token
            step.out, step.captured = self.device.run("decode_sample", step.plan, step.sample)
        else:  # masked rows: the forward pass, then the masked sampler (now, or once the masks are known)
            logits, step.captured = self.device.run("decode", step.plan)
            if deferred:
                step.logits = logits
            else:
                step.out = self.device.run("sample_next_masked", logits, step.sample)
        for r in keep:
            r.in_flight += n
            r.positions_ahead += n
        return step

    def multi_step(self, requests: Sequence[BatchedRequest]) -> bool:
        """Whether a step of several decode steps can run these requests with no host between its steps: no token
        masks (structured outputs, logit_bias, bans, min_tokens), no returned hidden states, stop ids that fit the
        plan (`plan.STOP_WIDTH`), and some request with more than one token left to generate."""
        if any(r.matcher is not None or r.limits is not None or r.sampling.return_hidden for r in requests):
            return False
        stops = [self._stops(r) for r in requests]  # once per request: this runs on the decode path
        return all(len(ids) <= STOP_WIDTH for ids, _ in stops) and max(left for _, left in stops) > 1

    def _stops(self, req: BatchedRequest) -> tuple[list[int], int]:
        """req's stop ids on the device (its stop_token_ids, and the model's EOS ids unless ignore_eos) and how many
        tokens it may still generate beyond those in flight (`_reaches_length`'s bound)."""
        sp = req.sampling
        ids = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_ids)))
        limit = min(sp.max_tokens, self.max_seq_len - len(req.prompt_tokens))
        return ids, limit - len(req.generated_tokens) - req.in_flight

    def collect(self, step: PendingDecode | PendingVerify | PendingPrefill) -> list:
        """Read a dispatched step (`decode_collect` / `verify_collect` / `prefill_collect`)."""
        if isinstance(step, PendingPrefill):
            return self.prefill_collect(step)
        return self.verify_collect(step) if isinstance(step, PendingVerify) else self.decode_collect(step)

    def decode_collect(self, step: PendingDecode) -> list[int | None]:
        """Read a dispatched step's tokens (the one host sync) into its requests; returns each request's new token,
        None for requests that were finished, left out, or freed since the dispatch. Steps are collected in the
        order they were dispatched."""
        if step.collected:
            return step.results
        if step.previous is not None and not step.previous.collected:
            raise RequestError("collect decode steps in the order they were dispatched")
        step.previous = None
        if step.logits is not None:  # its sampler still waits (the previous collect did not queue it)
            self._sample_deferred(step)
        present = [(i, r) for i, r in enumerate(step.rows) if r is not None]
        n = step.plan.steps if step.plan is not None else 1
        for _, r in present:
            r.in_flight -= n
            r.positions_ahead -= n
        step.results = [None] * len(step.requests)  # collected even if the read raises: never delivered twice
        kept = [(i, r) for i, r in present if not r.finished]  # a row past its request's end is discarded
        results: dict[int, int] = {}
        if kept and n > 1:
            self._deliver_steps(kept, step.out, step.captured, results)
        elif kept:
            fed = [(r.slot_id, r.last_token) for _, r in kept]
            self._deliver(kept, step.out, results, step.captured)
            for slot, token in fed:  # recorded once its row is kept, so a discarded row leaves no trace
                self.slots.tokens[slot].append(token)
        step.results, step.out, step.captured = [results.get(id(r)) for r in step.requests], None, None
        self._sample_following(step)
        return step.results

    def _deliver_steps(self, rows: list[tuple[int, BatchedRequest]], out: SampleOutput, alive: Any,
                       results: dict[int, Any]) -> None:
        """The tokens of a multi-step decode ([steps, rows] outputs, `alive` [steps, rows]: which are real), in step
        order, as that many single steps would deliver them: a row ends at a stop id or its length on the device,
        and at a host-side end (a grammar cannot be in such a step; a stop string is the scheduler's) its later tokens
        are discarded. Each request's result is the list of its new tokens."""
        out, alive = to_host((out, alive))
        for t in range(alive.shape[0]):
            for i, req in rows:
                if alive[t, i] and not req.finished:
                    fed = req.last_token
                    results.setdefault(id(req), []).append(self._append_token(req, out, (t, i)))
                    self.slots.tokens[req.slot_id].append(fed)  # as a single step records the token it fed

    def _sample_following(self, step: PendingDecode | PendingVerify) -> None:
        """Queue the sampler of the step after `step` that waited for its tokens (its rows' masks need them)."""
        following, step.following = step.following, None
        if following is not None and following.logits is not None:
            self._sample_deferred(following)

    # ---- structured outputs ----------------------------------------------------------------------------------
    @staticmethod
    def _masked_on_host(req: BatchedRequest, index: int) -> bool:
        """Whether the mask of req's token number `index` needs the tokens before it (a grammar, a bad word of
        several tokens, min_tokens not reached): its sampler then waits for them (`_sample_deferred`)."""
        return req.matcher is not None or (req.limits is not None and req.limits.dynamic(index))

    def _constrain(self, sample: SamplePlan, rows: list[BatchedRequest | None]) -> SamplePlan:
        """`sample` with the token masks of its constrained and limited rows, every previous token of theirs
        delivered: the grammar's mask and the bans that depend on the output so far, ANDed into the static masks
        the plan carries (`processors.pack_limits`; None: no such row, today's program)."""
        if sample.allowed is None:
            return sample
        allowed = np.array(sample.allowed)
        grammar = self.constrainer.masks(rows) if self.constrainer is not None else None
        if grammar is not None:
            allowed &= grammar
        for i, r in enumerate(rows):
            if r is not None and r.limits is not None and not r.finished:
                r.limits.ban(allowed[i], r.generated_tokens)
        return replace(sample, allowed=allowed)

    def _sample_deferred(self, step: PendingDecode) -> None:
        """Queue the sampler of a step whose forward pass ran before its constrained rows' masks were known (their
        matchers have taken the previous step's tokens now). Rows whose request ended since are not counted in
        their slot's penalty state (their tokens are discarded)."""
        on = np.array([r is not None and not r.finished for r in step.rows])
        sample = self._constrain(replace(step.sample, rows_on=step.sample.rows_on & on), step.rows)
        logits, step.logits = step.logits, None
        step.out = self.device.run("sample_next_masked", logits, sample)

    # ---- shared --------------------------------------------------------------------------------------------------
    def _deliver(self, rows: list[tuple[int, BatchedRequest]], out: SampleOutput, results: dict[int, int],
                 captured: Any = None) -> None:
        """Move sampled tokens (and the captured streams [rows, layers + 1, H] when a row asked for return_hidden)
        to the host in one transfer and append them to their requests; end finished ones."""
        out, captured = to_host((out, captured))
        for i, req in rows:
            if req.sampling.return_hidden:  # the stream at the position whose logits gave this token
                req.hidden.append(np.asarray(captured[i, list(req.sampling.return_hidden)], np.float32))
            results[id(req)] = self._append_token(req, out, i)

    def _append_token(self, req: BatchedRequest, out: SampleOutput, index: int | tuple[int, int]) -> int:
        """Append the token at `index` of host `out` (with its logprobs) to req; end req on a stop token, its grammar's
        end or its length. Returns the token."""
        token = int(out.tokens[index])
        req.logprobs.append(logprob_entry(out, index, req.sampling.logprobs))
        req.generated_tokens.append(token)
        req.last_token = token
        sp = req.sampling
        if req.matcher is not None and self.constrainer.advance(req, token):
            return token  # the grammar ended it: "stop", or "error" (req.error)
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_ids):
            req.finish("stop")
        elif self._reaches_length(req, len(req.generated_tokens)):
            req.finish("length")
        else:
            req.status = RequestStatus.DECODING
        return token

    def _reaches_length(self, req: BatchedRequest, generated: int) -> bool:
        """True when `generated` tokens end req by length: max_tokens, or the cache's last position."""
        return generated >= req.sampling.max_tokens or len(req.prompt_tokens) + generated >= self.max_seq_len

    def warmup(self, progress: bool = True, prompt_logprobs: bool = False, steering: bool = False,
               return_hidden: bool = False, progress_callback: Callable[[int, int], None] | None = None) -> int:
        """Compile every step shape this engine can call (`plan.signatures`), so no request waits for a compile;
        returns how many were new. Run it while nothing else drives the engine, and again after
        `allocate_batch_slots`. `prompt_logprobs` also compiles the prefill variant that scores prompt tokens
        (otherwise compiled on first use). With a tokenizer, the masked samplers of structured outputs are compiled and
        llguidance's tokenizer built too. `steering` compiles the forward steps of requests with
        `SamplingParams.steer` (one program per shape, whatever the vectors), `return_hidden` those of requests with
        `SamplingParams.return_hidden` (one per shape, whatever the layers). Slots, their cached tokens and the slot
        state are unchanged. `progress_callback(done, total)` after each call (a server reports it on /health)."""
        new = self.device.warmup(self.rules, progress, prompt_logprobs, steering,
                                 return_hidden, progress_callback)
        if self.constrainer is not None:  # llguidance's view of the vocabulary, built once
            self.constrainer.prepare()
        return new

    def lower(self, signature: Signature) -> jax.stages.Lowered:
        """This engine's own program for `signature` (a `plan.Signature`), lowered on its params, cache and penalty
        state: what HLO checks and benchmarks inspect (`.compile().as_text()`), by construction the program a call
        of that shape runs."""
        return self.device.lower(self.rules, signature)

    def compiled_count(self) -> int:
        """How many call signatures the step functions hold so far (a steady workload must not add any).

        Requests with `SamplingParams.hook` add signatures too: every distinct set of
        hooks in a step compiles its own prefill and decode programs, which `warmup` cannot know in advance.
        """
        return compiled_count()

    def update_params(self, params: Any) -> None:
        """Serve `params` from the next step on, with no recompile: the same tree, shapes and dtypes as the loaded
        weights (a ConfigError names the first leaf that differs; nothing changes then). Leaves that already have
        the engine's shardings are used as they are (no copy); others are placed onto them. Requests in flight
        continue on the new weights from their next step (their cached K/V stay those of the old ones); every
        cached prefix is forgotten, so no new request reuses K/V of the old weights. LoRA: pass the params with
        the new adapter leaves (the frozen base leaves are the same arrays, so nothing of them is copied)."""
        self.model = replace(self.model, params=placed(self.model.params, params))
        self.device.params = self.model.params
        self.slots.forget()
