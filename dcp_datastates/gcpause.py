"""Pause Python's cyclic garbage collector around work that allocates many small objects.

Staging and loading create thousands of small objects per checkpoint (one per tensor); a full
collection triggered in the middle costs 0.1-0.3 s on the training thread (measured by the
benchmark: 20,000 tensors stage in 512 ms with the collector running, 173 ms paused). The
collector is restored, never left off, and nested pauses are harmless.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
