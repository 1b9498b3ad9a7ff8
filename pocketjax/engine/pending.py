"""A prefill, decode or verify step on its way: dispatched to the device, its tokens not yet read by the host.

`Engine.prefill_dispatch` / `decode_dispatch` / `verify_dispatch` return one, `Engine.collect` reads it;
`decode_policy.DecodePolicy` keeps the ones in flight between scheduler steps. Steps are collected in the order they
were dispatched (each names the one before it, `previous`, until it is collected).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .plan import DecodePlan, SamplePlan, VerifyPlan, VerifySamplePlan
from .request import BatchedRequest
from .sampling import SampleOutput


@dataclass(eq=False)
class PendingDecode:
    """A dispatched decode step whose sampled tokens stay on device until `Engine.decode_collect` reads them.

    Its tokens also wait in the slots' state (`steps.SlotState`), so a next step can be queued before they reach the
    host, for any requests.
    """

    requests: list[BatchedRequest]  # as given to decode_dispatch: the order of decode_collect's result
    rows: list[BatchedRequest | None]  # row i's request; None: padding, or a request left out of this step
    plan: DecodePlan  # the forward step's inputs
    sample: SamplePlan  # the sampler's
    out: SampleOutput | None = None  # None when no row was active (nothing was dispatched) or once collected
    previous: PendingStep | None = None  # the step dispatched before this one, until this one
    # is collected (steps are collected in the order they were dispatched)
    results: list[int | None] | None = None  # set by decode_collect
    # Structured outputs: a step fed on device whose rows include constrained ones queues its forward pass only;
    # its logits wait here for the masks, which need the previous step's tokens, and `decode_collect` of that step
    # queues the sampler (`following` links it to this one until then).
    logits: Any = None
    following: PendingDecode | None = None
    captured: Any = None  # [rows, layers + 1, H] on device when a row asked for return_hidden (`DecodePlan.capture`)

    @property
    def collected(self) -> bool:
        return self.results is not None


@dataclass(eq=False)
class PendingVerify:
    """A dispatched speculative verify step (`Engine.verify_dispatch`), read by `Engine.verify_collect`."""

    requests: list[BatchedRequest]  # as given to verify_dispatch: the order of verify_collect's result
    rows: list[BatchedRequest | None]
    plan: VerifyPlan
    sample: VerifySamplePlan
    out: SampleOutput | None = None  # [rows, width] per field; None once collected
    accepted: Any = None  # int32 [rows] on device: drafts each row accepted
    previous: PendingStep | None = None  # always None: a verify step is dispatched with nothing in flight
    results: list[list[int] | None] | None = None  # set by verify_collect
    following: PendingDecode | None = None  # as PendingDecode.following

    @property
    def collected(self) -> bool:
        return self.results is not None


@dataclass(eq=False)
class PendingPrefill:
    """A dispatched prefill call (`Engine.prefill_dispatch`) whose first tokens and prompt logprobs stay on device
    until `Engine.prefill_collect` reads them; the requests whose prompt ended in it are decoding already (their
    first token is in their slot's state, so decode steps can be queued behind it)."""

    requests: list[BatchedRequest]  # as given to prefill_dispatch: the order of prefill_collect's result
    chunks: list[tuple[BatchedRequest, int]]  # row i: (request, prompt tokens of it this call writes)
    starts: list[int] = field(default_factory=list)  # row i's first prompt position in this call
    rows: list[tuple[int, BatchedRequest]] = field(default_factory=list)  # rows that sampled a first token
    out: SampleOutput | None = None  # their first tokens; None when no prompt ended or once collected
    prompt_out: SampleOutput | None = None  # the chunk's prompt logprobs when a row asked for them
    captured: Any = None  # [rows, layers + 1, H] when a row asked for return_hidden
    previous: PendingStep | None = None
    results: list[int | None] | None = None  # set by prefill_collect
    following: PendingDecode | None = None  # as PendingDecode.following

    @property
    def collected(self) -> bool:
        return self.results is not None


PendingStep = PendingDecode | PendingVerify | PendingPrefill
