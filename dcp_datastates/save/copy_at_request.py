"""The copy at the request: which small items a save copies when it is requested, not lazily.

What the next forward changes without a version bump (normalization statistics, counters) is
small: items up to ``CopyAtRequest.max_bytes`` are copied at the request (``request.py``,
``copy_small_at_request``), so the version guard leaves them out; ``request_copy_limit`` is the one
size the copy and the guard both go by.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

log = logging.getLogger("dcp_datastates")

__all__ = ["CopyAtRequest", "request_copy_limit"]


@dataclass(frozen=True)
class CopyAtRequest:
    """What a save copies at the request (``copy_at_request_max_bytes`` /
    ``copy_at_request_total_bytes``): items up to ``max_bytes`` bytes, at most ``total`` bytes
    of them (None: no bound), the smallest first (``request_copy_limit``)."""

    max_bytes: int = 0
    total: int | None = None


def request_copy_limit(sizes: list[int], max_bytes: int, total: int | None) -> int:
    """The size up to which a save's items are copied at the request: ``max_bytes``, or, when the
    items of 1..``max_bytes`` bytes hold more than ``total`` bytes in all, the largest size whose
    items together with every smaller one fit in ``total`` (0: none fit). The smallest come first:
    what the next forward changes without a version bump (normalization statistics, counters) is
    small. One number, so the copy and the version guard always agree on what was copied."""
    if max_bytes <= 0 or total is None:
        return max(0, max_bytes)
    small = [n for n in sizes if 0 < n <= max_bytes]
    if sum(small) <= total:
        return max_bytes
    small.sort()
    limit, taken = 0, 0
    for n, same in itertools.groupby(small):
        taken += n * sum(1 for _ in same)
        if taken > total:
            break
        limit = n
    left = [n for n in small if n > limit]
    key = (max_bytes, total, limit, len(left))
    if key not in _limits_told:
        _limits_told.add(key)
        log.warning(
            "dcp_datastates: %d tensors (and serialized values) of at most copy_at_request_max_bytes=%d bytes "
            "hold %d bytes, more than "
            "copy_at_request_total_bytes=%d: only those up to %d bytes are copied at the request; the other %d "
            "(%d bytes) are copied lazily under the version guard, so a change the next forward makes to one of "
            "them without a version bump (a BatchNorm statistic) would not be seen. Raise "
            "copy_at_request_total_bytes to copy them all.",
            len(small), max_bytes, sum(small), total, limit, len(left), sum(left))
    return limit


# The request_copy_limit warnings given (once per shape of the state).
_limits_told: set[tuple] = set()
