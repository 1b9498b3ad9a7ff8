"""The rules that shape the engine's compiled steps (minimal for now: `bucket`; the step plans join it here)."""
from __future__ import annotations


def bucket(n: int, smallest: int, largest: int) -> int:
    """The compiled size for n: the next power of two >= max(n, smallest), capped at `largest`."""
    size = smallest
    while size < n:
        size *= 2
    return min(size, largest)
