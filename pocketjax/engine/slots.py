"""The slot table: which request holds which KV-cache slot, and which tokens each slot's cache holds.

A freed slot keeps its tokens until it is taken again, so a request that starts with the same tokens (the next turn
of a conversation, a shared system prompt) finds them cached: `allocate` picks the free slot with the longest
common prefix, and names a donor slot (free or held) whose longer prefix the engine copies on device.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CapacityError, RequestError


def hashable(value: Any) -> bool:
    """True when value can key a dict (a request id must)."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Stale:
    """The tag of K/V computed under weights since replaced: equal only to itself, so never shared."""


@dataclass(frozen=True)
class Allocation:
    slot: int
    cached: int  # prompt tokens whose K/V the slot will hold before prefill starts
    donor: int | None = None  # copy the first `cached` positions of this slot into `slot` first


class SlotTable:
    """Host bookkeeping of the cache's slots (no device arrays: the Engine does the copies)."""

    def __init__(self, num_slots: int):
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]  # tokens whose K/V each slot holds
        # what else those K/V depend on (the request's intervention hook): a prefix is shared only under the same tag
        self.tags: list[Any] = [None] * num_slots
        self.free: list[int] = list(range(num_slots))  # least recently freed first
        self.owner: dict[Any, int] = {}  # request_id -> slot

    def __len__(self) -> int:
        return len(self.tokens)

    def slot_of(self, request_id: Any) -> int | None:
        return self.owner.get(request_id) if hashable(request_id) else None

    def allocate(self, request_id: Any, prompt: Sequence[int] | None = None, tag: Any = None) -> Allocation:
        """Take a free slot for request_id; with its prompt, the one (and donor) that caches most of it among the
        slots whose K/V were computed under the same `tag`."""
        if not hashable(request_id):
            raise RequestError(f"request_id must be hashable, got {type(request_id).__name__}")
        if request_id in self.owner:
            raise RequestError(f"request_id {request_id!r} already holds slot {self.owner[request_id]}")
        if not self.free:
            raise CapacityError(f"no free slot: all {len(self)} slots are held")
        alloc = Allocation(self.free[0], 0)
        if prompt is not None:
            usable = len(prompt) - 1  # the last prompt token is always run: it yields the first token's logits
            def shared(s: int) -> int:
                return common_prefix(self.tokens[s], prompt) if self.tags[s] == tag else 0

            matches = {s: min(shared(s), usable) for s in self.free}
            slot = max(self.free, key=lambda s: matches[s])  # max keeps the first (LRU) on ties
            donor = max(range(len(self)), key=shared)
            donor_len = min(shared(donor), usable)
            alloc = (Allocation(slot, donor_len, donor) if donor_len > matches[slot]
                     else Allocation(slot, max(matches[slot], 0)))
        self.tokens[alloc.slot] = list(prompt[: alloc.cached]) if prompt is not None else []
        self.tags[alloc.slot] = tag
        self.free.remove(alloc.slot)
        self.owner[request_id] = alloc.slot
        return alloc

    def forget(self) -> None:
        """Share no slot's K/V again (the weights changed): each slot gets a tag equal to no request's."""
        self.tags = [Stale() for _ in self.tags]

    def release(self, request_id: Any) -> int:
        """Give request_id's slot back; its cached tokens stay reusable. Returns the slot."""
        if not hashable(request_id) or request_id not in self.owner:
            raise RequestError(f"request_id {request_id!r} holds no slot")
        slot = self.owner.pop(request_id)
        self.free.append(slot)
        return slot
