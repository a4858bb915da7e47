"""How each checkpoint went: bytes, training stall, time to staged, time to durable, GB/s.

The writer calls ``record(...)`` for every checkpoint; the coordinator logs one INFO line per
committed checkpoint on the ``dcp_datastates`` logger (the way TorchTitan logs its own), and
``recent_checkpoints()`` returns the same figures for trainers that log to their own tracker:

    for s in dcp_datastates.recent_checkpoints(1):
        tracker.log({"ckpt/stall_s": s.stall_s, "ckpt/durable_s": s.durable_s, "ckpt/GBps": s.gb_per_s})
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

from ..forking import new_locks_in_child

__all__ = ["CheckpointStats", "record", "recent_checkpoints", "HISTORY"]

log = logging.getLogger("dcp_datastates")

HISTORY = 64  # checkpoints kept per process; older ones are dropped


@dataclass(frozen=True)
class CheckpointStats:
    """One checkpoint as seen by one rank. Times are seconds from the save call.

    Attributes:
        path: the checkpoint folder or URL.
        rank, world_size: this rank and the number of ranks that saved.
        bytes: data bytes this rank wrote (the coordinator may pass the checkpoint's total).
        stall_s: time the training thread spent on the checkpoint (the save call, and any wait
            for staging before the next ``optimizer.step()``).
        staged_s: until every byte was in the host cache, or written to its file with direct
            writes (live tensors free to change).
        durable_s: until the files were durable and ``.metadata`` committed; None until then.
            With ``local_tier``: until the durable tier was committed (after the drain).
        local_s: with ``local_tier``, until the local copy was committed; else None.
        coordinator: whether this rank commits (and logs); default: rank 0.
        error: why the checkpoint failed, None when it did not.
    """

    path: str
    rank: int
    world_size: int
    bytes: int
    stall_s: float
    staged_s: float | None
    durable_s: float | None = None
    coordinator: bool | None = None
    error: str | None = None
    local_s: float | None = None

    def __post_init__(self) -> None:
        if self.bytes < 0:
            raise ValueError(f"CheckpointStats.bytes: must be >= 0, got {self.bytes}")
        for name in ("stall_s", "staged_s", "durable_s", "local_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"CheckpointStats.{name}: expected seconds >= 0 or None, got {value!r}")
        if self.coordinator is None:
            object.__setattr__(self, "coordinator", self.rank == 0)

    @property
    def committed(self) -> bool:
        return self.durable_s is not None and self.error is None

    @property
    def gb_per_s(self) -> float | None:
        """Bytes per second from the save call to durable, in GB/s (10^9); None until durable."""
        if not self.committed or not self.durable_s:
            return None
        return self.bytes / self.durable_s / 1e9

    def summary(self) -> str:
        """The line the coordinator logs."""
        staged = f"{self.staged_s:.3f} s" if self.staged_s is not None else "n/a"
        if self.error is not None:
            return (
                f"dcp_datastates: checkpoint {self.path} FAILED: {self.error} ({self.bytes / 1e9:.3f} GB, "
                f"training stalled {self.stall_s * 1e3:.1f} ms, staged in {staged})"
            )
        return (
            f"dcp_datastates: checkpoint {self.path}: {self.bytes / 1e9:.3f} GB, training stalled "
            f"{self.stall_s * 1e3:.1f} ms, staged in {staged}, durable in {self.durable_s:.3f} s "
            f"({self.gb_per_s:.2f} GB/s), {self.world_size} rank(s)"
        )


_lock = threading.Lock()
new_locks_in_child(globals(), "_lock")
_history: collections.deque = collections.deque(maxlen=HISTORY)


def record(stats: CheckpointStats) -> None:
    """Keep ``stats`` (a record for the same path and rank still without ``durable_s`` is
    replaced, so a writer may record at staged and again at commit) and, on the coordinator, log
    the one INFO line once the checkpoint is committed (or a WARNING when it failed)."""
    if not isinstance(stats, CheckpointStats):
        raise TypeError(f"record: expected CheckpointStats, got {type(stats).__name__}")
    with _lock:
        for i, old in enumerate(_history):
            if old.path == stats.path and old.rank == stats.rank and old.durable_s is None and old.error is None:
                del _history[i]
                break
        _history.append(stats)
    if not stats.coordinator:
        return
    if stats.error is not None:
        log.warning("%s", stats.summary())
    elif stats.durable_s is not None:
        log.info("%s", stats.summary())


def recent_checkpoints(n: int | None = None) -> list[CheckpointStats]:
    """The last ``n`` checkpoints recorded in this process (all kept ones when None), oldest
    first."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"recent_checkpoints: n must be a non-negative integer or None, got {n!r}")
    with _lock:
        items = list(_history)
    return items if n is None else items[len(items) - n :] if n else []


def _clear() -> None:
    """Forget every record (tests)."""
    with _lock:
        _history.clear()
