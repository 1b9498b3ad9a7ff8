"""What a request is, as the engine and the layers above it see it: its status, its tokens, its end.

The engine owns every transition of `status` (allocate_slot: PREFILLING; the last prompt chunk's token: DECODING;
a stop token, the length limit or `free_slot`: FINISHED), so a caller reads the phase instead of inferring it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import RequestError
from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # created, holds no slot
    PREFILLING = "prefilling"  # holds a slot; prompt tokens still to write
    DECODING = "decoding"  # prompt cached, first token out; one token per decode step
    FINISHED = "finished"  # ended (finish_reason says why); no later step delivers to it


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
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" (then `error` says why) once FINISHED
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens whose K/V are in the slot (cached prefix included)
    seed: int | None = None  # resolved seed (sampling.seed, or drawn by the engine)
    in_flight: int = 0  # decode steps dispatched for it whose tokens are not collected yet
    positions_ahead: int = 0  # positions its uncollected steps may write past its slot's cached tokens (at most)
    # with sampling.prompt_logprobs: one entry per prompt token prefilled so far, filled chunk by chunk; entry 0 is
    # None (the first token has no context)
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] = field(default_factory=list)
    # with sampling.structured: its llguidance matcher, advanced by every delivered token (`structured.Constrainer`)
    matcher: Any = None
    # with sampling.min_tokens / logit_bias / allowed_token_ids / bad_words: its `processors.TokenLimits`
    limits: Any = None
    # with sampling.steer: its vectors as float32 [layers, hidden] (zero rows where it steers no layer)
    steering: Any = None
    # with sampling.return_hidden: one float32 [len(return_hidden), hidden] per generated token
    hidden: list = field(default_factory=list)
    error: Exception | None = None  # why the engine ended it (finish_reason "error"): the grammar could not continue

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str) -> None:
        """End the request (engine side): later steps drop its rows and deliver nothing to it."""
        if not self.finished:
            self.status, self.finish_reason = RequestStatus.FINISHED, reason


@dataclass(frozen=True)
class Completion:
    """A finished request: generated token ids, their text (when a tokenizer is at hand), and why it stopped."""

    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    request_id: Any = None
    # aligned with prompt_tokens when sampling.prompt_logprobs was set (entry 0 None), else empty
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] = field(default_factory=list)
    # with sampling.return_hidden: [len(token_ids), len(return_hidden), hidden] float32 (None otherwise)
    hidden: Any = None


def batch(requests: Sequence[BatchedRequest]) -> Sequence[BatchedRequest]:
    """`requests`, once checked to be a sequence of BatchedRequest (RequestError naming what it got otherwise)."""
    if not isinstance(requests, Sequence) or isinstance(requests, str):
        raise RequestError(f"requests must be a list of BatchedRequest, got {type(requests).__name__}")
    bad = [r for r in requests if not isinstance(r, BatchedRequest)]
    if bad:
        raise RequestError(f"requests must be BatchedRequest objects, got {type(bad[0]).__name__}")
    return requests
