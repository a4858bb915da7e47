"""How closely this process's saves follow each other: it decides ``direct_io``'s automatic mode.

With ``direct_io=None`` (the default) a synced save writes its data files past the page cache
(O_DIRECT) when saves *recur*: its request comes less than ``RECURRING`` times the last finished
save's duration (its request to its end on this rank) after the previous request, so that
checkpoints keep the disk busy for at least ``1 / RECURRING`` of the time. There the page cache
gives nothing a reader will use before the next checkpoint replaces it, and writing through it
costs the training loop a second pass over memory and the kernel's writeback; past it (O_DIRECT)
the bytes go from the host cache to the device. A save that does not recur (the first of a
process, or one long after the last) goes through the page cache: it is durable a little sooner
and a load right after it reads from memory. So does every save into a ``local_tier``: the drain
reads its files back at once. docs/benchmarks.md, "Training loop", has the measurements behind
the threshold.

The decision is this rank's, made once at the request: it picks a write path, never what is
written, so ranks may differ.
"""

from __future__ import annotations

import threading
import time

from ..forking import new_locks_in_child

__all__ = ["RECURRING", "direct_io_for", "save_ended", "forget"]

# Checkpoint writes busy for at least an eighth of the time: a save every 4 steps of a loop whose
# save takes about half a step is recurring, one every 100 steps is not.
RECURRING = 8

_lock = threading.Lock()
new_locks_in_child(globals(), "_lock")
_last_requested: float | None = None  # the last request of this process
_last_duration: float | None = None  # the last save that ended well: request to end, seconds


def direct_io_for(config, requested: float) -> bool:
    """Whether the save requested at ``requested`` (``time.monotonic``) writes its synced files
    with O_DIRECT; ``config.direct_io`` True or False decides alone. Records the request."""
    global _last_requested
    with _lock:
        recurring = (_last_requested is not None and _last_duration is not None
                     and requested - _last_requested < RECURRING * _last_duration)
        _last_requested = requested if _last_requested is None else max(_last_requested, requested)
    if config.direct_io is not None:
        return bool(config.direct_io)
    return bool(config.sync_files) and config.local_tier is None and recurring


def save_ended(requested: float, ended: float | None = None) -> None:
    """A save requested at ``requested`` ended well on this rank (now, or at ``ended``)."""
    global _last_duration
    with _lock:
        _last_duration = max(0.0, (time.monotonic() if ended is None else ended) - requested)


def forget() -> None:
    """Start over, as a new process would (tests)."""
    global _last_requested, _last_duration
    with _lock:
        _last_requested = _last_duration = None
