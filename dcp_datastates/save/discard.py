"""Removing what a save that will never be committed wrote: its data files on this rank, as soon
as the failure is known there, so that a job retrying a failing save (a full disk, a quota) does
not fill the storage it is short of, and the folder holds only its last commit.

When a rank learns that its save failed:

- its own error (``write_data``, the planning, the coordinator's commit): the DCP adapter calls
  ``discard`` before raising;
- another rank's error: DCP sends the coordinator's ``CheckpointException`` to every rank
  (``compat.on_save_failure_sent``); each rank then discards the saves that the thread
  receiving it is running (``watch`` records them when DCP takes a save up, per thread);
- success: the coordinator's commit puts a ``CommitNotice`` in the metadata DCP broadcasts;
  unpickled on the other ranks, it ends the watch of that thread's saves.

What goes: every data file the save named (engine files, held files, late files), in the folder
it wrote and in one it was staged into before DCP renamed it; nothing else, so files of other
checkpoints (an incremental save's base, the folder's committed checkpoint) are never touched.
The save's jobs are failed first and waited for (bounded), so no writer recreates a file after
it went; an upload still running then removes its object once it ends. The tier (``tier.
discard``) decides for the files it keeps elsewhere. The folder itself stays: it is the user's
name for the checkpoint, and a retry writes there again.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ..commit import read_commit
from ..compat import on_save_failure_sent
from ..forking import keep_forever
from ..format.layout import METADATA_NAME
from .in_flight import StagedSave

__all__ = ["discard", "watch", "unwatch", "wait_settled", "CommitNotice"]

log = logging.getLogger("dcp_datastates")

# How long a discard waits for the save's jobs to end once failed (they stop at their next
# chunk): past it, the files are removed all the same.
JOB_END_WAIT_S = 30.0


def discard(staged: StagedSave, reason: str, tier) -> None:
    """``staged`` will never be committed: fail what still runs and remove every data file it
    wrote here (through ``tier.discard``). Idempotent; never raises."""
    with staged._lock:
        if staged.discarded:
            return
        staged.discarded = True
    try:
        staged.abandon(reason)
        _wait_ended(staged)
        tier.discard(staged, staged.path, staged.request.rank, lambda: _remove_files(staged))
    except Exception as exc:  # noqa: BLE001 - the save's own error is the one raised
        log.warning("dcp_datastates: could not remove what the failed save of %s wrote: %s", staged.path, exc)


def _wait_ended(staged: StagedSave) -> None:
    deadline = time.monotonic() + JOB_END_WAIT_S
    for j in staged.jobs():
        # One still running past the deadline: its file is removed all the same.
        j.wait_ended(max(0.0, deadline - time.monotonic()))


def _remove_files(staged: StagedSave) -> None:
    names = staged.file_names() - {None}
    for storage in {id(s): s for s in (staged.storage, staged.moved_from) if s is not None}.values():
        for name in names:
            storage.remove_quietly(name)
    for f in staged.files:
        # An upload still running: its object goes once it ends.
        if f.upload is not None and f.name is not None and not f.upload.done():
            f.upload.add_done_callback(lambda _, s=staged.storage, n=f.name: s.remove_quietly(n))


# ------------------------------------------------------------- the saves each DCP thread runs
# DCP thread -> (that thread, its save, the save's tier). A save leaves when its verdict is known:
# committed (the coordinator's ``finish``; ``CommitNotice`` elsewhere) or failed (``discard``).
# One whose thread ended, or started another save, without a verdict failed where nothing told
# this rank (a planner error before any hook of ours, a collective that broke): it is
# discarded then, unless its folder's commit lists its files (a verdict that went missing
# must never cost a committed checkpoint).
_lock = threading.Condition()
_watched: dict[int, tuple[threading.Thread, StagedSave, object]] = {}
_reaping = 0  # discards the reaper runs now
# Not a daemon: the interpreter's exit waits for it, so that a save failing right before the
# program ends still has its files removed.
_reaper: threading.Thread | None = None
_REAP_EVERY_S = 0.05


def watch(staged: StagedSave, tier) -> None:
    """DCP's current thread runs ``staged`` (its planning and writing), until ``unwatch``."""
    global _reaper
    me = threading.current_thread()
    with _lock:
        before = _watched.get(me.ident)
        _watched[me.ident] = (me, staged, tier)
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap, name="dcp-datastates-discard-watch")
            _reaper.start()
    if before is not None and before[1] is not staged:
        _discard_unless_committed(before[1], before[2])


def unwatch(staged: StagedSave | None = None) -> None:
    """The verdict on the current thread's save (``staged``, or whichever it runs) is known."""
    me = threading.get_ident()
    with _lock:
        entry = _watched.get(me)
        if entry is not None and (staged is None or entry[1] is staged):
            del _watched[me]


def _failed_here() -> None:
    """DCP sends (or receives) a failed save's exception on this thread: its save goes."""
    with _lock:
        entry = _watched.pop(threading.get_ident(), None)
    if entry is not None:
        discard(entry[1], "the save failed on another rank", entry[2])
        entry[1].close()


def _reap() -> None:
    """While saves are watched: those whose DCP thread ended without a verdict are discarded."""
    global _reaper, _reaping
    while True:
        time.sleep(_REAP_EVERY_S)
        with _lock:
            ended = [k for k, (t, _, _) in _watched.items() if not t.is_alive()]
            entries = [_watched.pop(k) for k in ended]
            if not entries and not _watched:
                _reaper = None
                _lock.notify_all()
                return
            _reaping += len(entries)
        for _, staged, tier in entries:
            try:
                _discard_unless_committed(staged, tier)
            finally:
                with _lock:
                    _reaping -= 1
                    _lock.notify_all()


def wait_settled(timeout: float | None = None) -> bool:
    """Wait until every save DCP runs in this process has its verdict and what the failed ones
    wrote is removed (False after ``timeout`` seconds)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        while _reaping or _watched:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            _lock.wait(0.05 if left is None else min(left, 0.05))
    return True


def _discard_unless_committed(staged: StagedSave, tier) -> None:
    for attempt in range(_COMMIT_LOOKUPS):
        try:
            if staged.storage is not None and staged.storage.has(METADATA_NAME):
                _, files = read_commit(staged.storage)
                if set(files) & staged.file_names():
                    return
            break
        except Exception as exc:  # noqa: BLE001 - a marker that cannot be read: the files may be its
            if attempt + 1 == _COMMIT_LOOKUPS:
                log.info("dcp_datastates: kept the files of the save of %s: its folder's commit could not be "
                         "read (%s)", staged.path, exc)
                return
            # A store's passing refusal.
            time.sleep(0.2 * (attempt + 1))
    discard(staged, "the save failed", tier)
    staged.close()


_COMMIT_LOOKUPS = 4


class CommitNotice:
    """Put in the metadata DCP broadcasts after the commit: where it is unpickled, the thread's
    save is known committed (nothing of it is removed)."""

    def __reduce__(self):
        return _committed_here, ()

    def __repr__(self) -> str:
        return "CommitNotice()"


def _committed_here() -> CommitNotice:
    unwatch()
    return CommitNotice()


def _forget_in_child() -> None:
    """A forked child runs none of the parent's saves: it must never judge or remove them."""
    global _lock, _watched, _reaper, _reaping
    keep_forever(_watched)
    _lock, _watched, _reaper, _reaping = threading.Condition(), {}, None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
on_save_failure_sent(_failed_here)
