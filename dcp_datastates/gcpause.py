"""Pause Python's cyclic garbage collector while a checkpoint's many small objects are alive.

A save makes tens of objects per tensor (DCP's write items and plans, our locations, the commit's
document) that live from the request to the commit. While they live, every collection the
training thread's own allocations trigger promotes them to the oldest generation, and once enough
were promoted Python runs a full collection: a walk of every tracked object of the process with
the GIL held (measured: 3-5 of them per save at 20,000 tensors, 0.2-0.35 s each, on whichever
thread allocated last). Paused for the save's lifetime, the collector never sees them: they are
freed by reference counting when the save ends, before any collection runs.

Pauses are process-wide and counted: the collector is disabled while at least one is held and
enabled again when the last one ends, only if it was enabled when the first began (a program
that disabled it itself keeps it disabled, and gets no collection from us either). Each pause ends by itself after ``max_s`` seconds, so
a save that is never closed (a failure inside DCP before our hooks run) cannot leave the
collector off: at worst cyclic garbage waits that long. When saves follow each other without a
break, the pause never ends: then every ``YOUNG_COLLECTION_EVERY_S`` the young generation (every
object made since the pause began) is collected, and every ``MIDDLE_COLLECTION_EVERY``-th time
the middle one too (garbage still alive at a young collection was promoted there). That frees the
cyclic garbage made meanwhile without a walk of the whole heap: nothing enters the oldest
generation but the survivors of those rarer middle collections. Reference counting frees
everything acyclic, as always.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import heapq
import itertools
import os
import threading
import time
from typing import Iterator

__all__ = ["CollectorPause", "pause_collector", "gc_paused", "paused_count"]

_lock = threading.Condition()
_held: set[int] = set()
_restore = False  # whether the collector was enabled when the first pause of the current run began
_deadlines: list[tuple[float, int]] = []  # (monotonic deadline, pause id), a heap
_ids = itertools.count(1)
_watchdog: threading.Thread | None = None
_paused_since = 0.0  # when the collector was last paused or young-collected by the watchdog
YOUNG_COLLECTION_EVERY_S = 1.0
MIDDLE_COLLECTION_EVERY = 5  # of those young collections, every 5th also collects generation 1
_young_collections = 0
_exiting = False  # set at exit: the watchdog collects nothing more and ends (_stop_at_exit)


class CollectorPause:
    """One hold on the pause; ``release()`` ends it."""

    __slots__ = ("_id",)

    def __init__(self, pause_id: int) -> None:
        self._id = pause_id

    def release(self, after: float = 0.0) -> None:
        """End the pause, now or ``after`` seconds from now (on the watchdog: the caller's own
        objects, and its callers', are freed by then). Twice is harmless."""
        with _lock:
            if after <= 0:
                _end(self._id)
            elif self._id in _held:
                heapq.heappush(_deadlines, (time.monotonic() + after, self._id))
                _lock.notify()

    @property
    def active(self) -> bool:
        with _lock:
            return self._id in _held


def pause_collector(max_s: float) -> CollectorPause:
    """Hold the collector paused until ``release()``, at most ``max_s`` seconds."""
    global _restore, _paused_since
    with _lock:
        pause_id = next(_ids)
        if not _held:
            _restore = gc.isenabled()
            _paused_since = time.monotonic()
        gc.disable()  # also when held already: something may have enabled it meanwhile
        _held.add(pause_id)
        heapq.heappush(_deadlines, (time.monotonic() + max_s, pause_id))
        _ensure_watchdog()
        _lock.notify()
    return CollectorPause(pause_id)


@contextlib.contextmanager
def gc_paused(max_s: float = 600.0) -> Iterator[None]:
    """The collector paused around a block (one that allocates an object per item)."""
    pause = pause_collector(max_s)
    try:
        yield
    finally:
        pause.release()


def paused_count() -> int:
    """Pauses held now (for tests)."""
    with _lock:
        return len(_held)


def _end_all() -> None:
    """End every pause now (tests start from a collector no earlier test's save still holds)."""
    with _lock:
        for pause_id in list(_held):
            _end(pause_id)


def _end(pause_id: int) -> None:
    """With the lock held."""
    if pause_id not in _held:
        return
    _held.discard(pause_id)
    if not _held and _restore:
        gc.enable()


def _ensure_watchdog() -> None:
    global _watchdog
    if (_watchdog is None or not _watchdog.is_alive()) and not _exiting:
        _watchdog = threading.Thread(target=_expire, name="dcp-datastates-gc-pause", daemon=True)
        _watchdog.start()


def _expire() -> None:
    """Ends each pause at its deadline, and collects the young generation (every few times the
    middle one too) each ``YOUNG_COLLECTION_EVERY_S`` the collector stays paused without a break
    (saves back to back): the cyclic garbage made meanwhile is young, so that is cheap and frees
    it. One thread for all pauses, asleep in between."""
    global _paused_since, _young_collections
    while True:
        collect: int | None = None
        with _lock:
            if _exiting:
                return
            while _deadlines and _deadlines[0][1] not in _held:
                heapq.heappop(_deadlines)  # released already
            now = time.monotonic()
            if _deadlines and now >= _deadlines[0][0]:
                _end(heapq.heappop(_deadlines)[1])
                continue
            # Only where the collector would run but for us: a program that turned it off itself
            # (TorchTitan's gc_freq does, then collects on its own schedule) keeps that policy.
            if _held and _restore and now >= _paused_since + YOUNG_COLLECTION_EVERY_S:
                _paused_since, _young_collections = now, _young_collections + 1
                # Mostly the youngest generation; every few, the middle one too: garbage that was
                # still alive at one young collection (a save in flight) was promoted there.
                collect = 1 if _young_collections % MIDDLE_COLLECTION_EVERY == 0 else 0
            else:
                wake = [_deadlines[0][0]] if _deadlines else []
                if _held and _restore:
                    wake.append(_paused_since + YOUNG_COLLECTION_EVERY_S)
                _lock.wait(min(wake) - now if wake else None)
        if collect is not None:  # outside the lock: a finalizer run by the collection may pause or release
            gc.collect(collect)


def _stop_at_exit() -> None:
    """atexit (registered before the engine's, so it runs after the checkpoints are committed):
    end the watchdog before the interpreter finalizes. A collection it ran then, on a daemon
    thread, could free an object whose C++ destructor releases the GIL (torch's bindings do); the
    finalizing interpreter ends such a thread with pthread_exit when it takes the GIL back, inside
    a noexcept destructor: std::terminate, an aborted exit."""
    global _exiting
    with _lock:
        _exiting = True
        _lock.notify_all()
    watchdog = _watchdog
    if watchdog is not None and watchdog is not threading.current_thread():
        watchdog.join(5.0)


atexit.register(_stop_at_exit)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) has none of the parent's saves, nor its watchdog:
    it starts with no pause held and the collector as it was before the parent's first pause."""
    global _lock, _watchdog, _deadlines, _held
    restore = bool(_held) and _restore
    _lock, _watchdog, _deadlines, _held = threading.Condition(), None, [], set()
    if restore:
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
