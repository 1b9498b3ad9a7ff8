"""Speculative decoding, host side: prompt-lookup (n-gram) drafts per request, and when to try them.

A request's context is its prompt plus what it generated. The drafter proposes the tokens that followed the most
recent earlier occurrence of the context's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`),
up to k of them; the engine's verify step (`plan.VerifyPlan`, `steps.verify_step`) checks them in one call and
keeps the prefix the target model agrees with (`steps.verify_sample_step`: exact for greedy and seeded sampling).

`NgramIndex` keeps, for each n, a dict from n-gram to where it last ended, extended by the tokens appended since the
previous lookup: a step costs O(new tokens x n-gram sizes), never a rescan of a 4k-token context.

`Backoff` makes a request whose drafts keep failing (no match, or nothing accepted) try less often: after m misses
in a row it skips the next min(2**m - 1, MAX_SKIP) steps (MISS_SKIP when the lookup found nothing: that costs no
verify). A step where no request tries runs the plain pipelined decode, so free generation pays for a rejected
verify (k + 1 positions) only about once every MAX_SKIP + 1 steps.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import SpeculativeConfig
from .request import BatchedRequest

EMA = 0.25  # weight of the newest verify in a request's running mean of accepted drafts
WINDOW = 15  # step times kept per kind and row bucket (StepClock)
MIN_TIMED = 3  # step times needed before StepClock trusts a median
EXPLORE = 32  # every EXPLORE-th verify the clock refuses runs anyway, so a stale median is measured again
MAX_SKIP = 16  # most steps a request waits before it drafts again, after drafts that were all rejected
MISS_SKIP = 2  # most after lookups that found nothing (cheap: they cost no verify, only the step's pipelining)


class NgramIndex:
    """Most recent end position of every n-gram (n in [n_min, n_max]) of a growing token list, built incrementally."""

    def __init__(self, n_min: int, n_max: int):
        self.sizes = range(n_max, n_min - 1, -1)  # longest first: a longer match is a better predictor
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` (which
        only grows between calls) matching one; [] when none does."""
        last = len(tokens) - 1
        for end in range(self.indexed, last):  # every n-gram ending before the suffix itself
            for n in self.sizes:
                if end + 1 >= n:
                    self.ends[n][tuple(tokens[end + 1 - n: end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in self.sizes:
            if last + 1 < n:
                continue
            end = self.ends[n].get(tuple(tokens[last + 1 - n:]))
            if end is not None:
                return periodic(tokens, end, k)
        return []


def periodic(tokens: Sequence[int], end: int, k: int) -> list[int]:
    """The k tokens after `tokens` if what followed position `end` (where the suffix also ends) repeats: tokens
    after end, then, past the context's end, the draft itself with period len(tokens) - 1 - end. A loop of period 1
    ("a a a") thus drafts k tokens, not the one token left after its most recent occurrence."""
    period = len(tokens) - 1 - end
    draft = list(tokens[end + 1: end + 1 + k])
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft


@dataclass
class Backoff:
    """When a request drafts: every step while drafts pay, exponentially less often while they do not."""

    misses: int = 0  # consecutive tries that found no draft or had none of it accepted
    skip: int = 0  # steps left before the next try

    def due(self) -> bool:
        """Whether this step tries a draft; a step it skips counts down (call once per decode step)."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def record(self, accepted: int, cap: int = MAX_SKIP) -> None:
        """A try that accepted `accepted` draft tokens (0 also for a lookup that found none: then `cap` is
        MISS_SKIP)."""
        if accepted > 0:
            self.misses = 0
        else:
            self.misses += 1
            self.skip = min(2 ** self.misses - 1, cap)


@dataclass
class DraftState:
    """One request's drafter: its n-gram index, its backoff, its acceptance counts (for metrics and benchmarks)."""

    index: NgramIndex
    tokens: list[int]  # the context so far (prompt + generated), extended by what is new at each lookup
    backoff: Backoff = field(default_factory=Backoff)
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    expected: float | None = None  # running mean of drafts accepted per verify (None: none verified yet)


@dataclass
class StepClock:
    """Seconds per decode step as served (the lower quartile of the last WINDOW per row bucket and kind): what a
    verify costs on this machine and model relative to a plain step. On a GPU at a few rows both read the weights
    once and cost about the same; on a CPU with a small model a step is compute-bound and k + 1 positions cost
    several steps. A lower quartile, not the mean or median: a busy neighbour, or the first runs of a program just
    compiled (measured: 2x a plain step's time on pocket-coder, three in a row), only ever add time, and one kind
    can go many steps untimed while the other runs, so slow samples would stay (the Scheduler also drops steps
    that compiled).

    Kinds: "plain", a pipelined decode step (the next one queued before its tokens are read); "verify", from the
    moment the device went idle for it to its tokens read (drafting, dispatch, device); "fed", a plain step queued
    from the host after a verify, timed the same way: leaving speculation costs fed - plain more than staying plain.
    """

    times: dict[tuple[str, int], deque] = field(default_factory=dict)

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        """One step of `kind` ("plain", "verify" or "fed") over `rows` rows took `seconds`."""
        self.times.setdefault((kind, rows), deque(maxlen=WINDOW)).append(seconds)

    def seconds(self, kind: str, rows: int) -> float | None:
        """The step time (the lower quartile of the window), once MIN_TIMED steps of `kind` at `rows` were timed."""
        times = self.times.get((kind, rows), ())
        return sorted(times)[len(times) // 4] if len(times) >= MIN_TIMED else None

    def ratio(self, rows: int) -> float | None:
        """What a verify costs in plain steps at `rows`: its own time plus the extra time of the host-fed step that
        follows it when speculation stops (0 until such steps were timed), over a plain step's. 1 while too few
        verifies were timed (try them); None while verifies were timed but too few plain steps were (time those)."""
        verify, plain = self.seconds("verify", rows), self.seconds("plain", rows)
        if verify is None:
            return 1.0
        if plain is None:
            return None
        fed = self.seconds("fed", rows)
        return (verify + max(0.0, (fed or plain) - plain)) / plain


def why_no_drafts(req: BatchedRequest) -> str | None:
    """Why a request never drafts (None: it may): structured outputs and token limits (`processors`: their tokens
    are constrained by a mask and bias the verify step does not apply), and requests capturing activations (a verify
    returns none)."""
    sampling = req.sampling
    if getattr(sampling, "structured", None) is not None:
        return "a structured output (a token mask the verify step does not apply)"
    if sampling.limited:
        return ("token limits (min_tokens, logit_bias, allowed_token_ids or bad_words: a mask and bias the verify "
                "step does not apply)")
    if sampling.return_hidden:
        return "return_hidden (a verify step captures no activations)"
    return None


def drafts_nothing(req: BatchedRequest) -> bool:
    """True for a request that never drafts (`why_no_drafts`)."""
    return why_no_drafts(req) is not None


class Speculator:
    """Per engine: the speculative config and every running request's drafter (keyed by request id)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.states: dict[Any, tuple[BatchedRequest, DraftState]] = {}
        self.total_proposed = self.total_accepted = 0  # draft tokens verified, and accepted, over the engine's life
        self.histogram: Counter[int] = Counter()  # accepted drafts per verified row -> how often
        self.clock = StepClock()  # fed by the Scheduler, which alone sees steps as served
        self.refused: Counter[int] = Counter()  # verifies the clock refused, per row bucket

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def state(self, req: BatchedRequest) -> DraftState:
        held = self.states.get(req.request_id)
        if held is None or held[0] is not req:  # a new request under a reused id starts over
            index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            held = self.states[req.request_id] = (req, DraftState(index, list(req.prompt_tokens)))
        return held[1]

    def forget(self, request_id: Any) -> None:
        self.states.pop(request_id, None)

    def due(self, requests: Sequence[BatchedRequest]) -> list[bool]:
        """Which requests try a draft this step (counts the backoff down: once per decode step). None while any
        structured-output request runs: the verify step has no token mask, so such a batch decodes plainly."""
        if any(drafts_nothing(r) for r in requests if not r.finished):
            return [False] * len(requests)
        return [not r.finished and not drafts_nothing(r) and self.state(r).backoff.due() for r in requests]

    def propose(self, req: BatchedRequest, room: int) -> list[int]:
        """req's draft: at most min(k, room) tokens (room: how many more tokens it may still generate after the
        next one, and cache positions allow); [] (a miss) when the lookup finds none."""
        state = self.state(req)
        state.tokens += req.generated_tokens[len(state.tokens) - len(req.prompt_tokens):]
        draft = state.index.propose(state.tokens, min(self.k, room)) if room > 0 else []
        if not draft:
            state.backoff.record(0, MISS_SKIP)
        return draft

    def record(self, req: BatchedRequest, proposed: int, accepted: int) -> None:
        """A verified draft of `proposed` tokens of which `accepted` were kept."""
        state = self.state(req)
        state.proposed += proposed
        state.accepted += accepted
        self.total_proposed += proposed
        self.total_accepted += accepted
        prior = self.expected(req)
        self.histogram[accepted] += 1
        state.backoff.record(accepted)
        state.expected = (1 - EMA) * prior + EMA * accepted  # from the prior: one miss is no verdict

    def expected(self, req: BatchedRequest) -> float:
        """Drafts req is expected to have accepted per verify: its running mean; before its first verify, the mean
        over every verified row so far (what this engine's traffic accepts), or k / 2 before any."""
        mean = self.state(req).expected
        if mean is not None:
            return mean
        rows = sum(self.histogram.values())
        return sum(a * n for a, n in self.histogram.items()) / rows if rows else self.k / 2

    def pays(self, rows: int, running: int, gains: Sequence[float]) -> bool:
        """Whether a verify over `running` requests in `rows` rows, whose drafts are expected to gain `gains` tokens,
        beats a plain step: (running + sum(gains)) / verify seconds > running / plain seconds, by `clock`."""
        ratio = self.clock.ratio(rows)
        if ratio is not None and sum(gains) > running * (ratio - 1):
            return True
        self.refused[rows] += 1
        return ratio is not None and self.refused[rows] % EXPLORE == 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens over the engine's life (0 before any)."""
        return self.total_accepted / self.total_proposed if self.total_proposed else 0.0
