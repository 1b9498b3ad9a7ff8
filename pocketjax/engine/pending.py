"""A decode or verify step on its way: dispatched to the device, its tokens not yet read by the host.

`Engine.decode_dispatch` / `verify_dispatch` return one, `Engine.collect` reads it; `decode_policy.DecodePolicy` keeps
the one in flight between scheduler steps.
"""
from __future__ import annotations

from dataclasses import dataclass
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
    previous: PendingDecode | PendingVerify | None = None  # the step dispatched before this one, until this one
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
    results: list[list[int] | None] | None = None  # set by verify_collect
    following: PendingDecode | None = None  # as PendingDecode.following

    @property
    def collected(self) -> bool:
        return self.results is not None
