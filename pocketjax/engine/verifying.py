"""Speculative decoding's device steps (EngineConfig.speculative): draft on the host, verify on device, read.

`Engine` inherits these: they use its slots, device and token delivery, as its decode steps do. When to verify is
`decode_policy`'s; how drafts are made and backed off is `speculative`'s.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import RequestError
from ..model.sharding import to_host
from .decode_policy import DecodePolicy
from .pending import PendingVerify
from .plan import verify_plans
from .request import BatchedRequest, RequestStatus, batch
from .speculative import why_no_drafts


class SpeculativeSteps:
    """Engine's speculative half: `draft`, `verify_dispatch`, `verify_collect`, `batch_speculative_step`."""

    def draft(self, requests: Sequence[BatchedRequest], due: Sequence[bool] | None = None) -> list[list[int]]:
        """Each request's prompt-lookup draft for its next verify step ([] when it has none, is backing off, or the
        engine does not speculate). `due`: `speculator.due(requests)` when the caller already asked (it counts each
        request's backoff down once per step)."""
        if self.speculator is None:
            return [[] for _ in requests]
        due = self.speculator.due(requests) if due is None else due
        drafts = []
        for req, on in zip(requests, due):
            if not on or req.status is not RequestStatus.DECODING:
                drafts.append([])
                continue
            start = len(self.slots.tokens[req.slot_id])  # where the last token goes; the draft follows it
            room = min(req.sampling.max_tokens - len(req.generated_tokens) - 1, self.max_seq_len - 1 - start)
            drafts.append(self.speculator.propose(req, room))
        return drafts

    def verify_dispatch(self, requests: Sequence[BatchedRequest], drafts: Sequence[Sequence[int]]) -> PendingVerify:
        """Queue one verify step: every unfinished request runs its last token and its draft (`drafts[i]`, may be
        empty: a plain decode row) and gets 1 to len(draft) + 1 tokens at `verify_collect`. Fed from the host, so
        every earlier step of these requests must be collected."""
        if self.speculator is None:
            raise RequestError("this engine does not speculate: create it with speculative=dict(method='ngram', ...)")
        if len(drafts) != len(requests):
            raise RequestError(f"verify_dispatch: {len(requests)} requests but {len(drafts)} drafts")
        pairs = [(r, list(d)) for r, d in zip(batch(requests), drafts) if not r.finished]
        for req, d in pairs:
            self._slot(req)
            if req.status is not RequestStatus.DECODING:
                raise RequestError(f"request {req.request_id!r} must be prefilled before decoding")
            if req.in_flight:
                raise RequestError(f"request {req.request_id!r} has a decode step in flight: collect it first")
            reason = why_no_drafts(req)
            if reason is not None:
                raise RequestError(f"request {req.request_id!r} has {reason}: decode it with decode_dispatch")
            if len(d) > self.speculator.k or not all(isinstance(t, (int, np.integer)) for t in d):
                raise RequestError(f"request {req.request_id!r}: a draft is at most {self.speculator.k} token ids")
        step = PendingVerify(list(requests), [], None, None)
        if not pairs:
            return step
        step.rows, step.plan, step.sample = verify_plans(self.rules, [r for r, _ in pairs], [d for _, d in pairs],
                                                         lambda slot: len(self.slots.tokens[slot]))
        step.out, step.accepted = self.device.run("sample_verify", self.device.run("verify", step.plan), step.sample)
        for req, d in pairs:
            req.in_flight += 1
            req.positions_ahead += 1 + len(d)
        return step

    def verify_collect(self, step: PendingVerify) -> list[list[int] | None]:
        """Read a verify step (one host sync): each request gets its accepted drafts and the token after them, cut at
        a stop token or its length; returns each request's new tokens (None: finished before, or freed since)."""
        if step.collected:
            return step.results
        present = [(i, r) for i, r in enumerate(step.rows) if r is not None]
        for i, r in present:
            r.in_flight -= 1
            r.positions_ahead -= int(step.plan.lengths[i])
        step.results = [None] * len(step.requests)
        if not present:
            return step.results
        out, accepted = to_host((step.out, step.accepted))
        fed, drafted = np.asarray(step.plan.tokens), np.asarray(step.sample.num_drafts)
        results: dict[int, list[int]] = {}
        for i, req in present:
            if req.finished:  # freed or ended since the dispatch: its row is discarded
                continue
            n = int(accepted[i])
            if drafted[i]:  # (a row without a draft counted its lookup's miss when it drafted nothing)
                self.speculator.record(req, int(drafted[i]), n)
            new = results[id(req)] = []
            for j in range(n + 1):
                new.append(self._append_token(req, out, (i, j)))
                if req.finished:
                    break
            # the K/V kept: the fed last token and the accepted drafts before the final token (the rest is never read)
            self.slots.tokens[req.slot_id].extend(int(t) for t in fed[i, :len(new)])
        step.results, step.out, step.accepted = [results.get(id(r)) for r in step.requests], None, None
        self._sample_following(step)
        return step.results

    def batch_speculative_step(self, requests: Sequence[BatchedRequest]) -> list[list[int] | None]:
        """One decode step of every unfinished request under the server's policy (`decode_policy.DecodePolicy`,
        unpipelined): a verify of their drafts when the drafts are expected to pay for it, else a plain step. Each
        request's new tokens (1 or more), None for the others."""
        before = [None if r.finished else len(r.generated_tokens) for r in batch(requests)]
        DecodePolicy(self, pipeline=False).advance(requests)
        return [None if n is None else r.generated_tokens[n:] or None for r, n in zip(requests, before)]
