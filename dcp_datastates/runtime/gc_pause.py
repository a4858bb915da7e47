"""Python's cyclic garbage collector paused while saves and loads hold many small objects.

A save makes tens of objects per tensor (DCP's write items and plans, our locations, the commit's
document) that live from the request to the commit. While they live, every collection the
training thread's own allocations trigger promotes them to the oldest generation, and once enough
were promoted Python runs a full collection: a walk of every tracked object of the process with
the GIL held, several per save with tens of thousands of tensors, on whichever thread allocated
last. Paused for the save's lifetime, the collector never sees them: they are freed by reference
counting when the save ends, before any collection runs.

Pauses are process-wide and counted: the collector is disabled while at least one is held and
enabled again when the last one ends, only if it was enabled when the first began (a program
that disabled it itself keeps it disabled, and gets no collection from us either). Each pause
ends by itself after ``max_s`` seconds, so a save that is never closed (a failure inside DCP before our hooks run) cannot leave the
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

_gc_lock = threading.Condition()
_gc_held: set[int] = set()
# Whether the collector was enabled when the first pause of the current run began.
_gc_restore = False
# (monotonic deadline, pause id), a heap.
_gc_deadlines: list[tuple[float, int]] = []
_gc_ids = itertools.count(1)
_gc_watchdog: threading.Thread | None = None
# When the collector was last paused or young-collected by the watchdog.
_gc_paused_since = 0.0
YOUNG_COLLECTION_EVERY_S = 1.0
#: Of the young collections (one every YOUNG_COLLECTION_EVERY_S), every 5th also collects generation 1.
MIDDLE_COLLECTION_EVERY = 5
_gc_young_collections = 0
# Set at exit: the watchdog collects nothing more and ends (_stop_gc_at_exit).
_gc_exiting = False


class CollectorPause:
    """One hold on the pause; ``release()`` ends it."""

    __slots__ = ("_id",)

    def __init__(self, pause_id: int) -> None:
        self._id = pause_id

    def release(self, after: float = 0.0) -> None:
        """End the pause, now or ``after`` seconds from now (on the watchdog: the caller's own
        objects, and its callers', are freed by then). Twice is harmless."""
        with _gc_lock:
            if after <= 0:
                _end_pause(self._id)
            elif self._id in _gc_held:
                heapq.heappush(_gc_deadlines, (time.monotonic() + after, self._id))
                _gc_lock.notify()

    @property
    def active(self) -> bool:
        with _gc_lock:
            return self._id in _gc_held


def pause_collector(max_s: float) -> CollectorPause:
    """Hold the collector paused until ``release()``, at most ``max_s`` seconds."""
    global _gc_restore, _gc_paused_since
    with _gc_lock:
        pause_id = next(_gc_ids)
        if not _gc_held:
            _gc_restore = gc.isenabled()
            _gc_paused_since = time.monotonic()
        # Also when held already: something may have enabled it meanwhile.
        gc.disable()
        _gc_held.add(pause_id)
        heapq.heappush(_gc_deadlines, (time.monotonic() + max_s, pause_id))
        _ensure_gc_watchdog()
        _gc_lock.notify()
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
    with _gc_lock:
        return len(_gc_held)


def _end_all_pauses() -> None:
    """End every pause now (tests start from a collector no earlier test's save still holds)."""
    with _gc_lock:
        for pause_id in list(_gc_held):
            _end_pause(pause_id)


def _end_pause(pause_id: int) -> None:
    """With the lock held."""
    if pause_id not in _gc_held:
        return
    _gc_held.discard(pause_id)
    if not _gc_held and _gc_restore:
        gc.enable()


def _ensure_gc_watchdog() -> None:
    global _gc_watchdog
    if (_gc_watchdog is None or not _gc_watchdog.is_alive()) and not _gc_exiting:
        _gc_watchdog = threading.Thread(target=_expire_pauses, name="dcp-datastates-gc-pause", daemon=True)
        _gc_watchdog.start()


def _expire_pauses() -> None:
    """Ends each pause at its deadline, and collects the young generation (every few times the
    middle one too) each ``YOUNG_COLLECTION_EVERY_S`` the collector stays paused without a break
    (saves back to back): the cyclic garbage made meanwhile is young, so that is cheap and frees
    it. One thread for all pauses, asleep in between."""
    global _gc_paused_since, _gc_young_collections
    while True:
        collect: int | None = None
        with _gc_lock:
            if _gc_exiting:
                return
            while _gc_deadlines and _gc_deadlines[0][1] not in _gc_held:
                # Released already.
                heapq.heappop(_gc_deadlines)
            now = time.monotonic()
            if _gc_deadlines and now >= _gc_deadlines[0][0]:
                _end_pause(heapq.heappop(_gc_deadlines)[1])
                continue
            # Only where the collector would run but for us: a program that turned it off itself
            # (TorchTitan's gc_freq does, then collects on its own schedule) keeps that policy.
            if _gc_held and _gc_restore and now >= _gc_paused_since + YOUNG_COLLECTION_EVERY_S:
                _gc_paused_since, _gc_young_collections = now, _gc_young_collections + 1
                # Mostly the youngest generation; every few, the middle one too: garbage that was
                # still alive at one young collection (a save in flight) was promoted there.
                collect = 1 if _gc_young_collections % MIDDLE_COLLECTION_EVERY == 0 else 0
            else:
                wake = [_gc_deadlines[0][0]] if _gc_deadlines else []
                if _gc_held and _gc_restore:
                    wake.append(_gc_paused_since + YOUNG_COLLECTION_EVERY_S)
                _gc_lock.wait(min(wake) - now if wake else None)
        # Outside the lock: a finalizer run by the collection may pause or release.
        if collect is not None:
            gc.collect(collect)


def _stop_gc_at_exit() -> None:
    """atexit (registered before the engine's: ``runtime.engine`` imports this module first; so it
    runs after the checkpoints are committed):
    end the watchdog before the interpreter finalizes. A collection it ran then, on a daemon
    thread, could free an object whose C++ destructor releases the GIL (torch's bindings do); the
    finalizing interpreter ends such a thread with pthread_exit when it takes the GIL back, inside
    a noexcept destructor: std::terminate, an aborted exit."""
    global _gc_exiting
    with _gc_lock:
        _gc_exiting = True
        _gc_lock.notify_all()
    watchdog = _gc_watchdog
    if watchdog is not None and watchdog is not threading.current_thread():
        watchdog.join(5.0)


atexit.register(_stop_gc_at_exit)


def _forget_pauses_in_child() -> None:
    """A forked child (a DataLoader worker) has none of the parent's saves, nor its watchdog:
    it starts with no pause held and the collector as it was before the parent's first pause."""
    global _gc_lock, _gc_watchdog, _gc_deadlines, _gc_held
    restore = bool(_gc_held) and _gc_restore
    _gc_lock, _gc_watchdog, _gc_deadlines, _gc_held = threading.Condition(), None, [], set()
    if restore:
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pauses_in_child)
