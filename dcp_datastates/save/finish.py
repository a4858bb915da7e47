"""The end of a save on this rank: it leaves the registry of saves in flight, drops its
references to the state, and records its figures (``checkpoint_stats``). The commit itself is
the commit protocol's (``commit.write_commit``), called by the coordinator through its tier."""

from __future__ import annotations

import logging
import time

from . import checkpoint_stats, rhythm
from .in_flight import StagedSave
from .request import global_rank_world

__all__ = ["close_save"]

log = logging.getLogger("dcp_datastates")


def close_save(staged: StagedSave, *, path: str | None, coordinator: bool, error: BaseException | None = None,
               total_bytes: int | None = None, committed: bool = False, local_s: float | None = None) -> None:
    """The save needs nothing more from this rank: release its folder, leave the registry, and
    record its figures (the coordinator's record, with the commit, is logged; ``local_s``: the
    tier's word on its local copy)."""
    # DCP's plans and metadata are freed when its save returns, right after this: the collector
    # resumes a moment later, so that it never sees them (runtime/inflight.py).
    staged.close(collector_after=0.25)
    if error is None:
        rhythm.save_ended(staged.request.requested)
    rank, world = global_rank_world()
    try:
        checkpoint_stats.record(checkpoint_stats.CheckpointStats(
            path=str(path or staged.path), rank=rank, world_size=world,
            bytes=total_bytes if total_bytes is not None else staged.nbytes(),
            stall_s=staged.stall_s, staged_s=staged.staged_s,
            durable_s=time.monotonic() - staged.request.requested if committed else None,
            coordinator=coordinator, local_s=local_s,
            error=None if error is None else str(error).splitlines()[0][:500],
        ))
    except Exception as exc:  # noqa: BLE001 - figures must never fail a save
        log.debug("dcp_datastates: could not record checkpoint figures: %s", exc)
