"""Step plans: what one jitted step call computes, as a value, and the one home of the rules that shape it.

Every compiled shape comes from here: `bucket`, `StepRules` (rows, prefill chunk width, attention length, the
dense-rows rule) and the constructors that turn requests into plans. A plan is a registered pytree dataclass: its
arrays are data (traced), its static choices (kv_len, dense, hooks, num_top, logprobs_mode) are meta fields, part
of the treedef and so of `jit`'s cache key by construction. The steps in `steps.py` take `(params, cache, plan)`; nothing else
spells their arguments out.

A new step input is a field here plus its use in the one step that reads it: an optional array is `None` when no
row needs it, so batches without it keep their treedef, and their compiled programs.

Warm-up, `Engine.lower` and the benchmarks build plans with `signatures` / `runner.empty_plan` (the `empty_*`
builders here), so they compile and time the very programs the engine runs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import jax
import numpy as np

from .request import BatchedRequest
from .processors import pack_limits
from .sampling import (EXACT, GREEDY, NUCLEUS, SAMPLED, Paths, SamplingArrays, covers, pack_sampling, paths_for,
                       penalizes)
from .sampling_params import DEFAULT_LOGPROBS_MODE, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from .structured import all_allowed

Rows = Sequence[BatchedRequest | None]  # one request per row; None: padding, or a row left out
# The sampler variants (`sampling.Paths`) each kind of step picks from, smallest first; warm-up compiles the (paths,
# num_top) pairs of WARM, the rest (EXACT: a top_k above the candidates) compile on first use, said in a log line.
# A variant holding more parts gives the same tokens, so a batch may run a larger one than it needs.
DECODE_CHAIN = (GREEDY, SAMPLED, NUCLEUS, EXACT)  # decode_sample, sample_verify: every token
SPARSE_CHAIN = (GREEDY, NUCLEUS, EXACT)  # first tokens and masked samplers: fewer programs, a little more work
WARM = {DECODE_CHAIN: ((GREEDY, 0), (SAMPLED, 0), (NUCLEUS, 0), (NUCLEUS, MAX_LOGPROBS)),
        SPARSE_CHAIN: ((GREEDY, 0), (NUCLEUS, 0), (NUCLEUS, MAX_LOGPROBS))}


def bucket(n: int, smallest: int, largest: int) -> int:
    """The compiled size for n: the next power of two >= max(n, smallest), capped at `largest`."""
    size = smallest
    while size < n:
        size *= 2
    return min(size, largest)


@dataclass(frozen=True)
class StepRules:
    """How an engine buckets its calls: the only place that turns counts and lengths into compiled sizes."""

    num_slots: int
    max_seq_len: int
    prefill_chunk: int
    min_prefill_bucket: int
    min_kv_bucket: int
    impl: str  # resolved attention implementation
    vocab_size: int
    verify_width: int = 0  # positions per row of a speculative verify step (k + 1); 0: the engine never verifies
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE  # which logprobs the samplers report (prompt logprobs: always raw)
    num_layers: int = 0  # the model's: the shape of a steered step's vectors [rows, num_layers, hidden_size]
    hidden_size: int = 0
    structured: bool = False  # the engine serves structured outputs: every first-token sampler is the masked one
    decode_steps: int = 1  # EngineConfig.decode_steps: warm-up compiles decode_sample for 1 and this many steps

    def rows(self, n: int) -> int:
        """Rows of a step over n requests."""
        return bucket(n, 1, self.num_slots)

    def width(self, n: int) -> int:
        """Chunk width of a prefill whose longest chunk has n tokens."""
        return bucket(n, self.min_prefill_bucket, self.prefill_chunk)

    def kv_len(self, needed: int) -> int:
        """Attention length covering `needed` cached positions. The kernels skip blocks past each slot's length
        themselves, so they always get the whole cache (one program per row count)."""
        if self.impl != "xla":
            return self.max_seq_len
        return bucket(needed, self.min_kv_bucket, self.max_seq_len)

    def paths(self, sampling: SamplingArrays, num_top: int, chain: tuple[Paths, ...]) -> Paths:
        """The sampler variant for these packed rows: the first of `chain` (`DECODE_CHAIN` / `SPARSE_CHAIN`) that
        covers what they need (`sampling.paths_for`); a step returning top logprobs takes NUCLEUS at least, so
        `WARM` stays a handful of programs per row count."""
        need = paths_for(sampling, self.vocab_size)
        return next(v for v in chain if covers(v, need) and (not num_top or covers(v, NUCLEUS)))

    def dense(self, rows: int) -> bool:
        """Whether a decode over `rows` rows puts slot i in row i, so attention reads the cache in place.

        Not for one slot: with its only row, XLA:CPU turns the cache write into a select over a dynamic-update-slice
        and copies every layer's cache several times per step once attention reads all of it
        (`tests/test_engine.py::test_one_slot_decode_never_copies_the_cache` checks the compiled program)."""
        return rows == self.num_slots > 1


def _pytree(cls: type) -> type:
    """Register a frozen plan dataclass: fields marked `static` in their metadata are meta (hashed into the jit key),
    the others data."""
    meta = [f.name for f in fields(cls) if f.metadata.get("static")]
    data = [f.name for f in fields(cls) if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static(default: Any = None) -> Any:
    """A plan field that is a static choice (a meta field of the pytree)."""
    return field(default=default, metadata={"static": True})


@_pytree
@dataclass(frozen=True)
class PrefillPlan:
    """One prompt chunk per row: `lengths[b]` tokens of row b written at `starts[b]..` of slot `slots[b]`."""

    tokens: Any  # int32 [rows, width]
    slots: Any  # int32 [rows]; padding rows read slot 0 but write nothing (length 0)
    starts: Any  # int32 [rows]
    lengths: Any  # int32 [rows]
    selector: Any = None  # int32 [rows]: row b runs hooks[selector[b] - 1] (0: none); None when no row has a hook
    targets: Any = None  # int32 [rows, width]: prompt token after each position; None: no row scores its prompt
    scored: Any = None  # int32 [1 or rows]: the rows whose prompt positions are scored (with `targets`), padded
    # with a repeat (`scored_rows`)
    steer: Any = None  # float32 [rows, layers, hidden]: added to row b's stream after each layer (None: no row
    # steers; `SamplingParams.steer`); data, so every set of vectors runs one program
    kv_len: int = static(0)
    hooks: tuple = static(())
    num_top: int = static(0)  # top logprobs per scored position (the engine asks for all it can: one program)
    capture: bool = static(False)  # return each row's residual stream at its last token (SamplingParams.return_hidden)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


@_pytree
@dataclass(frozen=True)
class DecodePlan:
    """One token per row into slot `slots`: each row's input token and position are its slot's (`steps.SlotState`,
    on device, written by the sampler before), so nothing of a step's inputs but its rows comes from the host;
    inactive rows write and attend to nothing. `kv_len` covers the furthest position a row can be at."""

    slots: Any  # int32 [rows]
    active: Any  # bool [rows]
    selector: Any = None  # as PrefillPlan.selector
    steer: Any = None  # as PrefillPlan.steer
    # With steps > 1 (`decode_sample` only): each row's stop ids int32 [rows, STOP_WIDTH] (padding -1) and budget
    # int32 [rows] (tokens it may still generate): a row stops on the device after either, writing nothing more.
    stop_ids: Any = None
    budget: Any = None
    kv_len: int = static(0)
    dense: bool = static(False)  # row i is slot i for every slot (StepRules.dense)
    hooks: tuple = static(())
    capture: bool = static(False)  # as PrefillPlan.capture
    steps: int = static(1)  # decode + sample steps in the program (EngineConfig.decode_steps)

    @property
    def rows(self) -> int:
        return self.slots.shape[0]


@_pytree
@dataclass(frozen=True)
class SamplePlan:
    """The sampler over a forward step's rows. With `prompt_masks`, the rows that end a prompt (`rows_on`) get their
    first token (index 0 of their random stream, whose key is (seed, index)) and restart their slot's state;
    without, every active row continues from its slot's state (the index is its `generated` count)."""

    slots: Any  # int32 [rows]
    rows_on: Any  # bool [rows]: rows whose slot state is updated (final prompt chunk / active decode row)
    sampling: SamplingArrays
    prompt_masks: Any = None  # bool [rows, vocab]: each ending prompt's tokens; None for decode rows
    positions: Any = None  # int32 [rows] with prompt_masks: where each first token goes (its prompt's length)
    # int32 [rows, ceil(vocab / 32)]: the tokens each row may take (structured outputs, `processors.TokenLimits`;
    # other rows all ones); None when no row of the step is constrained or limited, so such steps keep their
    # treedef and programs. bias_ids / bias [rows, MAX_LOGIT_BIAS] (logit_bias, padded with id vocab) come with it.
    allowed: Any = None
    bias_ids: Any = None
    bias: Any = None
    num_top: int = static(0)  # top logprobs returned per row
    logprobs_mode: str = static(DEFAULT_LOGPROBS_MODE)  # the engine's (`sampling.sample`): one program per engine
    paths: Paths = static(EXACT)  # the sampler's parts (`sampling.paths_for` of the rows): one program per variant

    @property
    def first(self) -> bool:
        return self.prompt_masks is not None


@_pytree
@dataclass(frozen=True)
class VerifyPlan:
    """Speculative verification: row b feeds its last token and `lengths[b] - 1` draft tokens at `starts[b]..` of
    slot `slots[b]` (the slot's cached length), and gets the logits at every position. The K/V written past what
    the row accepts stay invisible: the slot's cached length advances by the accepted count only, and attention
    reads keys up to each query's position. Rows without a draft have length 1 (a decode in the same call)."""

    tokens: Any  # int32 [rows, verify_width]
    slots: Any  # int32 [rows]
    starts: Any  # int32 [rows]
    lengths: Any  # int32 [rows]: 1 + draft length; 0 for padding rows
    selector: Any = None  # as PrefillPlan.selector
    steer: Any = None  # as PrefillPlan.steer
    kv_len: int = static(0)
    hooks: tuple = static(())

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


@_pytree
@dataclass(frozen=True)
class VerifySamplePlan:
    """The sampler over a verify step's positions: position j of row b draws the token the request would draw at
    step `steps[b] + j` after the drafts before j, so accepting drafts while they equal what is drawn is exact."""

    slots: Any  # int32 [rows]
    rows_on: Any  # bool [rows]: active rows (their slot's state continues after the tokens they accept)
    steps: Any  # int32 [rows]: index of the token each row's first position generates
    starts: Any  # int32 [rows]: the position of each row's first fed token (its slot's cached length)
    sampling: SamplingArrays
    drafts: Any  # int32 [rows, verify_width - 1]
    num_drafts: Any  # int32 [rows]
    num_top: int = static(0)
    logprobs_mode: str = static(DEFAULT_LOGPROBS_MODE)
    paths: Paths = static(EXACT)  # as SamplePlan.paths
    penalized: bool = static(True)  # some row penalizes: the program builds every position's penalty counts


# ---- from requests -----------------------------------------------------------------------------------------------

def row_selector(rows: Rows) -> tuple[np.ndarray | None, tuple]:
    """The hooks of a step's rows: (selector int32 [len(rows)], the distinct hooks ordered by id), or (None, ())
    when no row has one, so a hook-free batch compiles exactly the programs it would without hooks."""
    found = {r.sampling.hook for r in rows if r is not None and r.sampling.hook is not None}
    if not found:
        return None, ()
    hooks = tuple(sorted(found, key=id))  # the same set reuses its programs whatever the rows
    selector = np.zeros(len(rows), np.int32)
    for i, r in enumerate(rows):
        if r is not None and r.sampling.hook is not None:
            selector[i] = hooks.index(r.sampling.hook) + 1
    return selector, hooks


def row_steering(rules: StepRules, rows: Rows) -> np.ndarray | None:
    """The steering vectors of a step's rows, float32 [len(rows), layers, hidden] (zero where a row or layer has
    none), or None when no row steers: an unsteered batch compiles exactly the programs it would without steering."""
    steered = [(i, r.steering) for i, r in enumerate(rows) if r is not None and r.steering is not None]
    if not steered:
        return None
    steer = np.zeros((len(rows), rules.num_layers, rules.hidden_size), np.float32)
    for i, table in steered:
        steer[i] = table
    return steer


def top_count(rows: Rows) -> int:
    """Top logprobs the sampler returns for these rows: all it can (one program) when any asked, else none."""
    return MAX_LOGPROBS if any(r is not None and r.sampling.logprobs for r in rows) else 0


def scored_positions(req: BatchedRequest, begin: int, n: int) -> int:
    """How many positions of req's chunk of n prompt tokens from `begin` score the prompt token after them (the
    prompt's last token scores nothing: it yields the first generated one)."""
    return max(0, min(n, len(req.prompt_tokens) - 1 - begin))


def unlimited(rows: int, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(allowed, bias_ids, bias) of rows that may take every token with no bias: a masked sampler's neutral rows,
    bit for bit the unmasked sampler's tokens (`sampling.sample`)."""
    return (all_allowed(rows, vocab), np.full((rows, MAX_LOGIT_BIAS), vocab, np.int32),
            np.zeros((rows, MAX_LOGIT_BIAS), np.float32))


def scored_rows(named: np.ndarray, rows: int) -> np.ndarray:
    """The rows a scored prefill computes logits for, int32: one when one row asked (the common mixed chunk),
    else every row of the chunk (`named` first, then a repeat of the first: a padded row computes and writes the same
    values twice). Two sizes per prefill shape, so prompt logprobs warm up in two programs, not one per count."""
    size = 1 if len(named) == 1 else rows
    return np.concatenate([named, np.full(size - len(named), named[0])]).astype(np.int32)


def prefill_plans(rules: StepRules, chunks: Sequence[tuple[BatchedRequest, int]]
                  ) -> tuple[PrefillPlan, SamplePlan | None]:
    """The prefill of the next n prompt tokens of each (request, n), and the sampler over the rows whose prompt it
    ends (None when none does). Rows that asked for prompt logprobs score the token after each position (a chunk's
    last position scores the first token of the next chunk; the prompt's last token scores nothing)."""
    rows = rules.rows(len(chunks))
    width = rules.width(max(n for _, n in chunks))
    tokens = np.zeros((rows, width), np.int32)
    slots, starts, lengths = (np.zeros(rows, np.int32) for _ in range(3))
    final = np.zeros(rows, bool)
    masks = np.zeros((rows, rules.vocab_size), bool)
    targets, counts = np.zeros((rows, width), np.int32), np.zeros(rows, np.int32)
    for i, (req, n) in enumerate(chunks):
        begin = req.num_prefilled
        tokens[i, :n] = req.prompt_tokens[begin: begin + n]
        slots[i], starts[i], lengths[i] = req.slot_id, begin, n
        final[i] = begin + n == len(req.prompt_tokens)
        if final[i]:
            masks[i, np.asarray(req.prompt_tokens)] = True
        if req.sampling.prompt_logprobs is not None:
            counts[i] = scored_positions(req, begin, n)
            targets[i, :counts[i]] = req.prompt_tokens[begin + 1: begin + 1 + counts[i]]
    padded = [r for r, _ in chunks] + [None] * (rows - len(chunks))
    selector, hooks = row_selector(padded)
    scored = counts.any()  # only a chunk with a row that asked pays for every position's logits
    plan = PrefillPlan(tokens, slots, starts, lengths, selector, targets if scored else None,
                       scored_rows(np.flatnonzero(counts), rows) if scored else None, row_steering(rules, padded),
                       kv_len=rules.kv_len(int((starts + lengths).max())), hooks=hooks,
                       num_top=MAX_LOGPROBS if scored else 0,
                       capture=any(final[i] and r.sampling.return_hidden for i, (r, _) in enumerate(chunks)))
    if not final.any():
        return plan, None
    requests = [r for r, _ in chunks]
    sampling = pack_sampling([r.sampling for r in requests], [r.seed for r in requests], pad_to=rows)
    limits = pack_limits([r if final[i] else None for i, r in enumerate(requests)] + [None] * (rows - len(chunks)),
                         rules.vocab_size) or (unlimited(rows, rules.vocab_size) if rules.structured else (None,) * 3)
    num_top = top_count(requests)
    return plan, SamplePlan(slots, final, sampling, masks, np.where(final, starts + lengths, 0).astype(np.int32),
                            *limits, num_top=num_top, logprobs_mode=rules.logprobs_mode,
                            paths=rules.paths(sampling, num_top, SPARSE_CHAIN))


def decode_rows(rules: StepRules, running: Sequence[BatchedRequest]) -> tuple[list[BatchedRequest | None], bool]:
    """The rows of a decode step over `running` and whether it is dense (then row i holds the request of slot i)."""
    rows = rules.rows(len(running))
    dense = rules.dense(rows)
    if dense:
        order = {r.slot_id: r for r in running}
        return [order.get(s) for s in range(rows)], True
    return list(running) + [None] * (rows - len(running)), False


STOP_WIDTH = 8  # stop ids a row can stop on inside a multi-step program (a row with more decodes one step at a time)


def decode_plans(rules: StepRules, running: Sequence[BatchedRequest], reach: Callable[[BatchedRequest], int],
                 steps: int = 1, stops: Callable[[BatchedRequest], tuple[Sequence[int], int]] | None = None
                 ) -> tuple[list[BatchedRequest | None], DecodePlan, SamplePlan]:
    """The decode step over `running` and its sampler: each row continues from its slot's state on device, so any
    requests can share a step whatever ran before; `reach(req)`: the furthest position req's token can be at (its
    slot's cached length plus what its steps in flight may add), which sizes the attention. `steps` > 1: that many
    steps in one program (`steps.decode_sample_step`), `stops(req)` giving each row's stop ids (at most STOP_WIDTH)
    and how many tokens it may still generate."""
    rows, dense = decode_rows(rules, running)
    active = np.array([r is not None for r in rows])
    slots = np.arange(len(rows), dtype=np.int32) if dense else np.zeros(len(rows), np.int32)
    for i, r in enumerate(rows):
        if r is not None:
            slots[i] = r.slot_id
    selector, hooks = row_selector(rows)
    last = max(reach(r) for r in running)
    stop_ids = budget = None
    if steps > 1:
        stop_ids, budget = np.full((len(rows), STOP_WIDTH), -1, np.int32), np.zeros(len(rows), np.int32)
        for i, r in enumerate(rows):
            if r is not None:
                ids, budget[i] = stops(r)
                stop_ids[i, :len(ids)] = ids
    plan = DecodePlan(slots, active, selector, row_steering(rules, rows), stop_ids, budget,
                      kv_len=rules.kv_len(last + steps), dense=dense, hooks=hooks,
                      capture=any(r is not None and bool(r.sampling.return_hidden) for r in rows), steps=steps)
    sampling = pack_sampling([r.sampling if r else SamplingParams(temperature=0.0) for r in rows],
                             [r.seed if r else 0 for r in rows])
    limits = pack_limits(rows, rules.vocab_size) or (None, None, None)
    num_top = top_count(rows)
    chain = SPARSE_CHAIN if limits[0] is not None else DECODE_CHAIN
    return rows, plan, SamplePlan(slots, active, sampling, None, None, *limits, num_top=num_top,
                                  logprobs_mode=rules.logprobs_mode, paths=rules.paths(sampling, num_top, chain))


def verify_plans(rules: StepRules, running: Sequence[BatchedRequest], drafts: Sequence[Sequence[int]],
                 cached: Callable[[int], int]) -> tuple[list[BatchedRequest | None], VerifyPlan, VerifySamplePlan]:
    """A verify step over `running`, each fed its last token then its draft (up to verify_width - 1 tokens, may be
    empty) at its slot's next positions (`cached(slot)`: the slot's cached token count), and its sampler."""
    n = len(running)
    rows, width = rules.rows(n), rules.verify_width
    tokens, draft = np.zeros((rows, width), np.int32), np.zeros((rows, width - 1), np.int32)
    slots, starts, lengths, steps, counts = (np.zeros(rows, np.int32) for _ in range(5))
    for i, (req, d) in enumerate(zip(running, drafts)):
        tokens[i, 0], tokens[i, 1: 1 + len(d)], draft[i, :len(d)] = req.last_token, d, d
        slots[i], starts[i], lengths[i] = req.slot_id, cached(req.slot_id), 1 + len(d)
        steps[i], counts[i] = len(req.generated_tokens), len(d)
    padded = list(running) + [None] * (rows - n)
    selector, hooks = row_selector(padded)
    plan = VerifyPlan(tokens, slots, starts, lengths, selector, row_steering(rules, padded),
                      kv_len=rules.kv_len(int((starts + lengths).max())), hooks=hooks)
    sampling = pack_sampling([r.sampling for r in running], [r.seed for r in running], pad_to=rows)
    num_top = top_count(padded)
    return padded, plan, VerifySamplePlan(slots, lengths > 0, steps, starts, sampling, draft, counts,
                                          num_top=num_top, logprobs_mode=rules.logprobs_mode,
                                          paths=rules.paths(sampling, num_top, DECODE_CHAIN),
                                          penalized=penalizes(sampling))


def decode_at(rules: StepRules, positions: Sequence[int], steps: int = 1) -> tuple[DecodePlan, SamplePlan]:
    """The greedy decode step (`steps` of them in one program, no row stopping) the engine would run for requests in
    slots 0..n-1 whose next tokens go at `positions`: what benchmarks time on a scratch engine (its slots' state says
    where each row is)."""
    stand_ins = [BatchedRequest(i, [0], SamplingParams(temperature=0.0), slot_id=i, seed=0)
                 for i in range(len(positions))]
    _, plan, sample = decode_plans(rules, stand_ins, lambda r: positions[r.slot_id], steps, lambda r: ((), steps))
    return plan, sample


# ---- every signature, and plans that write nothing (warm-up, Engine.lower, benchmarks) ---------------------------

class Signature(NamedTuple):
    """One step call shape: `step` over `rows` rows (0: not a batch); the other fields where the step has them."""

    step: str  # prefill, prefill_scored (prompt logprobs), sample_first, decode_sample (a decode and its sampler in
    # one program), copy_prefix; decode (the forward pass alone) with sample_next_masked: a step whose masks wait
    # for the host (structured outputs); sample_first_masked / sample_next: the other samplers; verify
    # (speculative: every position's logits), sample_verify
    rows: int = 0
    width: int = 0  # prefill chunk bucket (verify: its width, k + 1)
    kv_len: int = 0  # attention length bucket
    num_top: int = 0  # top logprobs the sampler returns
    steered: bool = False  # a forward step with steering vectors (`PrefillPlan.steer`): its own program
    captured: bool = False  # a prefill or decode step returning the residual stream (`PrefillPlan.capture`)
    paths: Paths | None = None  # a sampler's parts (`sampling.Paths`; None: EXACT); decode_sample's sampler
    penalized: bool = False  # sample_verify: builds every position's penalty counts (`VerifySamplePlan.penalized`)
    scored: int = 0  # prefill_scored: rows whose prompt is scored (`scored_rows`: 1, or 0 for every row)
    steps: int = 1  # decode_sample: decode + sample steps in the program (`DecodePlan.steps`)


def signatures(rules: StepRules, prompt_logprobs: bool = False, steering: bool = False,
               return_hidden: bool = False) -> list[Signature]:
    """Every step signature an engine with these rules can call; each sampler follows a forward step over its rows,
    each device-fed decode a sampler. `prompt_logprobs` adds the prefill variant that scores prompt tokens (one per
    prefill shape: as many compiles again as the plain prefill, which is why it is opt-in); `rules.structured` (an
    engine that can serve structured outputs: it has a tokenizer) the samplers with token masks and the forward pass
    their steps run alone. Each sampler comes in the variants of `WARM` (`sampling.Paths`; the others compile on first
    use); a decode step is its forward pass and sampler in one program (`decode_sample`)."""
    if rules.max_seq_len < 2:  # no prompt fits: nothing ever runs
        return []
    rows = sorted({rules.rows(n) for n in range(1, rules.num_slots + 1)})
    kv = {end: rules.kv_len(end) for end in range(1, rules.max_seq_len)}  # cached tokens -> attention length
    kv_lens = sorted(set(kv.values()))
    shortest = {}  # chunk width -> the shortest chunk compiled at it (a prompt leaves one position to generate)
    for n in range(min(rules.prefill_chunk, rules.max_seq_len - 1), 0, -1):
        shortest[rules.width(n)] = n
    calls = []
    for r in rows:
        prefill = [Signature("prefill", r, w, k) for w, n in sorted(shortest.items()) for k in kv_lens if k >= kv[n]]
        calls += prefill
        if prompt_logprobs:  # two programs per prefill shape: one scored row, or every row (`scored_rows`)
            calls += [c._replace(step="prefill_scored", scored=n) for c in prefill for n in sorted({1, r})]
        first = "sample_first_masked" if rules.structured else "sample_first"
        calls += [Signature(first, r, num_top=t, paths=p) for p, t in WARM[SPARSE_CHAIN]]
        calls += [Signature("decode_sample", r, kv_len=k, num_top=t, paths=p, steps=n) for k in kv_lens
                  for p, t in WARM[DECODE_CHAIN] for n in sorted({1, rules.decode_steps})]
        if rules.structured:  # a step whose masks wait for the tokens in flight: its forward pass, then its sampler
            calls += [Signature("decode", r, kv_len=k) for k in kv_lens]
            calls += [Signature("sample_next_masked", r, num_top=t, paths=p) for p, t in WARM[SPARSE_CHAIN]]
        if rules.verify_width:
            w = rules.verify_width
            calls += [Signature("verify", r, w, k) for k in kv_lens]
            calls += [Signature("sample_verify", r, w, num_top=t, paths=p, penalized=pen) for p, t in WARM[DECODE_CHAIN]
                      for pen in ((False, True) if p != GREEDY else (False,))]  # (a penalized batch is never GREEDY)
    forward = ("prefill", "decode_sample", "decode", "verify")
    if steering:  # every forward step again with steering vectors (one program each, whatever the vectors)
        calls += [c._replace(steered=True) for c in calls if c.step in forward]
    if return_hidden:  # prefill and decode again returning the residual stream (SamplingParams.return_hidden)
        calls += [c._replace(captured=True) for c in calls if c.step in forward[:3]]
    if rules.num_slots > 1:  # a prefix is copied from another slot only
        calls.append(Signature("copy_prefix"))
    return calls


def empty_steer(rules: StepRules, call: Signature) -> np.ndarray | None:
    """A steered signature's (zero) steering vectors, else None."""
    return np.zeros((call.rows, rules.num_layers, rules.hidden_size), np.float32) if call.steered else None


def empty_prefill(rules: StepRules, call: Signature) -> PrefillPlan:
    """A prefill (scored or not) of `call`'s shape that writes nothing: zero-length chunks."""
    r, zeros = call.rows, np.zeros(call.rows, np.int32)
    empty = np.zeros((r, call.width), np.int32)
    scored = call.step == "prefill_scored"
    return PrefillPlan(empty, zeros, zeros, zeros, None, empty if scored else None,
                       np.zeros(call.scored or r, np.int32) if scored else None, empty_steer(rules, call),
                       kv_len=call.kv_len,
                       num_top=MAX_LOGPROBS if scored else 0, capture=call.captured)


def empty_decode(rules: StepRules, call: Signature) -> DecodePlan:
    """A decode step of `call`'s shape over inactive rows."""
    dense = rules.dense(call.rows)
    slots = np.arange(call.rows, dtype=np.int32) if dense else np.zeros(call.rows, np.int32)
    stops = (np.full((call.rows, STOP_WIDTH), -1, np.int32), np.zeros(call.rows, np.int32)) if call.steps > 1 else ()
    return DecodePlan(slots, np.zeros(call.rows, bool), None, empty_steer(rules, call), *stops, kv_len=call.kv_len,
                      dense=dense, capture=call.captured, steps=call.steps)


def empty_sample(rules: StepRules, call: Signature) -> SamplePlan:
    """A sampler (first token or next, masked or not) of `call`'s shape whose rows are off: slot state untouched."""
    r, zeros = call.rows, np.zeros(call.rows, np.int32)
    sampling = pack_sampling([SamplingParams(temperature=0.0)] * r, [0] * r)
    first = call.step.startswith("sample_first")
    masks, positions = (np.zeros((r, rules.vocab_size), bool), zeros) if first else (None, None)
    limits = unlimited(r, rules.vocab_size) if call.step.endswith("_masked") else (None, None, None)
    return SamplePlan(zeros, np.zeros(r, bool), sampling, masks, positions, *limits, num_top=call.num_top,
                      logprobs_mode=rules.logprobs_mode, paths=call.paths or EXACT)


def empty_decode_sample(rules: StepRules, call: Signature) -> tuple[DecodePlan, SamplePlan]:
    """A decode step and its sampler (`decode_sample`) of `call`'s shape over inactive rows."""
    return empty_decode(rules, call), empty_sample(rules, call._replace(step="sample_next"))


def empty_verify(rules: StepRules, call: Signature) -> VerifyPlan:
    """A verify step of `call`'s shape over zero-length rows."""
    zeros = np.zeros(call.rows, np.int32)
    return VerifyPlan(np.zeros((call.rows, call.width), np.int32), zeros, zeros, zeros, steer=empty_steer(rules, call),
                      kv_len=call.kv_len)


def empty_verify_sample(rules: StepRules, call: Signature) -> VerifySamplePlan:
    """A verify sampler of `call`'s shape whose rows are off."""
    r, zeros = call.rows, np.zeros(call.rows, np.int32)
    sampling = pack_sampling([SamplingParams(temperature=0.0)] * r, [0] * r)
    return VerifySamplePlan(zeros, np.zeros(r, bool), zeros, zeros, sampling, np.zeros((r, call.width - 1), np.int32),
                            zeros, num_top=call.num_top, logprobs_mode=rules.logprobs_mode,
                            paths=call.paths or EXACT, penalized=call.penalized)
