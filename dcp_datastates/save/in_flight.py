"""The save in flight on this rank: ``StagedSave``, and a ``FileJob`` per data file the engine writes.

``StagedSave`` is the handle the registry of saves in flight keeps (``runtime.inflight``): what
``stage()`` started, what DCP's steps need of it later, and its end (``close``, ``abandon``).
Its data-file jobs follow one protocol (``held_file.DataFileWork``): a ``FileJob`` here, or a
``HeldFile`` whose items wait in the host cache for DCP's plan.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence, Set
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointWriteError
from ..format.locations import ItemLocation, all_written
from ..runtime import inflight
from ..storage import Storage
from .held_file import HeldFile
from .items import ItemKey
from .ownership import DecisionKey
from .version_guard import VersionGuard, freed_message, torn_message

__all__ = ["FileJob", "SaveRequest", "StagedSave"]


@dataclass(eq=False)
class FileJob:
    """One data file written by the engine (a local file, or streamed to an object store): a
    ``held_file.DataFileWork``, like the save's held files.

    - ``index``: k in ``__<rank>_<k>``.
    - ``name``: None until the save's folder is prepared (``request.prepare_destination``).
    - ``locations``: shared with a cached stage plan: never mutated.
    - ``upload``: object stores: resolves once the object is complete in the store.
    - ``name_it``: names the file of a job started unnamed (``Storage.start_data_file``).
    - ``side_buffer``: the request-time copies' buffer (``side_buffers.copy_small_at_request``),
      given back once staged.
    - ``mirrors``: peer_copies: the keeper stages this same file (save/ownership.py).
    - ``mirror_of``: peer_copies: the same file as that rank's mirrored one (not this save's data).
    - ``written``: once durable: its items' final locations.
    """

    index: int
    name: str | None
    job: Any
    keys: Sequence[ItemKey]
    locations: Mapping[ItemKey, ItemLocation]
    keepalive: list[Any] | None
    engine: Any
    file_size: int
    upload: Future | None = None
    name_it: Callable[..., None] | None = None
    side_buffer: Any = None
    mirrors: bool = False
    mirror_of: int | None = None
    written: Mapping[ItemKey, ItemLocation] | None = None

    @property
    def device(self) -> int:
        return self.job.device

    def wait_staged(self, timeout: float | None = None) -> bool:
        return self.job.wait_staged(timeout)

    def is_staged(self) -> bool:
        return self.job.is_staged()

    def is_done(self) -> bool:
        return self.job.is_done() and (self.upload is None or self.upload.done())

    def device_wait(self, stream_of) -> bool:
        if self.job.device < 0:
            return self.job.is_staged()
        stream = stream_of(self.job.device)
        return stream is not None and self.engine.device_wait(self.job, stream)

    def abort(self, reason: str) -> None:
        try:
            self.job.fail(reason)
        except Exception:  # noqa: BLE001 - a job that cannot be failed finishes on its own
            pass

    def wait_ended(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            ended = bool(self.job.wait_done(timeout))
        except Exception:  # noqa: BLE001 - never raises: a discard removes the file all the same
            ended = False
        if self.upload is not None:
            try:
                self.upload.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - still uploading: its object goes once it ends
                ended = False
        return ended

    def result(self) -> dict[ItemKey, ItemLocation]:
        """Wait until the file is durable; its items' final locations (checksums included)."""
        error = None
        if self.upload is not None:
            exc = self.upload.exception()
            if exc is not None:
                error = str(exc)
        self.job.wait_done(None)
        self.keepalive = None
        error = error or self.job.error()
        if error:
            raise CheckpointWriteError(error)
        return all_written(self.locations, self.keys, self.name, self.job.checksums(), self.file_size)


@dataclass(frozen=True)
class SaveRequest:
    """What a save was asked, and what its plan decided at the request: set once, never changed
    (a new record replaces it while the request is made: ``with_plan``).

    - ``rank``: this rank (global); ``requested``: when (``time.monotonic``); ``pid``: the
      process that requested it (not a forked child).
    - ``incremental``: incremental=True: the save's decisions (``incremental.Incremental``,
      which learns as the save goes); None: off.
    - ``skipped``: DTensor replicas another rank writes; ``elsewhere``: plain tensors the
      decision gives to other ranks.
    - ``decision_key``, ``learn``, ``plain_keys``: who writes a replicated value (ownership);
      ``learn``: no decision was known, learn it from this save's plan.
    - ``direct_io``: its synced data files are written past the page cache (``rhythm``).
    """

    rank: int = 0
    requested: float = field(default_factory=time.monotonic)
    pid: int = field(default_factory=os.getpid)
    incremental: Any = None
    skipped: Set = frozenset()
    elsewhere: Set = frozenset()
    decision_key: DecisionKey | None = None
    learn: bool = False
    plain_keys: frozenset = frozenset()
    direct_io: bool = False

    def with_plan(self, plan) -> "SaveRequest":
        """This request with the decisions of ``plan`` (``plan.StagePlan``)."""
        return dataclasses.replace(self, skipped=plan.skipped, elsewhere=plan.elsewhere, decision_key=plan.decision_key, learn=plan.learn, plain_keys=plan.plain_keys)


@dataclass(eq=False)
class StagedSave:
    """Everything ``stage()`` started for one checkpoint on this rank: its ``request`` (immutable)
    and its progress (the rest: the folder, the files, the guard, the outcome).

    - ``path``: None: the folder is named later (checkpoint_id given to DCP only).
    - ``storage``: the folder ``path`` names.
    - ``tag``: file-name tag when the folder already holds a committed checkpoint.
    - ``moved_from``: staged into this folder, then DCP named another (reset).
    - ``guard``: the sources this rank copies; ``late_guard``: tensors it may have to write from
      live memory.
    - ``error``: raised from prepare_local_plan.
    - ``abandoned``: why the save was abandoned (Ctrl-C at exit, an error): never commit.
    - ``discarded``: what it wrote was removed (save/discard.py).
    - ``stall_s``: the training thread's time in stage(); ``staged_s``: request -> every byte in
      the host cache.
    - ``planner``: DCP's thread planning this save.
    - ``flat``: the state as flattened at the request (its tensors are the sources).
    - ``payloads``: fqn -> a non-tensor value's bytes, serialized at the request.
    - ``destination``: the folder prepared and the files named (``request.prepare_destination``).
    - ``collector_pause``: Python's cyclic GC paused for this save (runtime/inflight.py), ended by
      ``end_collector_pause``.
    """

    path: str | None
    storage: Storage | None = None
    request: SaveRequest = field(default_factory=SaveRequest)
    tag: str | None = None
    files: list[FileJob] = field(default_factory=list)
    held: list[HeldFile] = field(default_factory=list)
    moved_from: Storage | None = None
    guard: VersionGuard | None = None
    late_guard: VersionGuard | None = None
    error: BaseException | None = None
    abandoned: str | None = None
    discarded: bool = False
    stall_s: float = 0.0
    staged_s: float | None = None
    _sealed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    finished: threading.Event = field(default_factory=threading.Event)
    planner: threading.Thread | None = None
    flat: dict | None = None
    payloads: dict = field(default_factory=dict)
    destination: Future | None = None
    collector_pause: Any = None

    def end_collector_pause(self, after: float = 0.0) -> None:
        """The save's objects are about to be freed (``after`` seconds from now, once the
        callers return): the collector may run again."""
        pause, self.collector_pause = self.collector_pause, None
        if pause is not None:
            pause.release(after)

    def is_over(self) -> bool:
        """Finished, or given up by DCP: the thread that ran its DCP save has ended (the save
        failed on some rank; DCP calls nothing more here), or no DCP thread ever took it up."""
        if self.finished.is_set():
            return True
        t = self.planner
        if t is not None:
            return not t.is_alive()
        return self._never_planned()

    def awaits_planning(self) -> bool:
        """No DCP thread has taken it up yet (and it is not finished)."""
        return self.planner is None and not self.finished.is_set()

    def _never_planned(self) -> bool:
        """Staged, not planned, and no DCP thread left that could plan it: the ``dcp.async_save``
        that called ``stage()`` failed right after it (``AsyncCheckpointerType.PROCESS``, which
        cannot take this writer; no process group). Nothing will write or commit it, so it is
        closed here: its folder, its held cache slots and its references to the state come back.
        (Before, a later save into its folder was refused and the interpreter's exit waited for
        it forever.)"""
        if os.getpid() != self.request.pid:
            # A forked child's copy (Megatron's async helper; its exit asks whether saves are
            # over): the parent's threads and engine are not the child's to judge or to touch.
            return False
        if not all(j.is_staged() for j in self.jobs()) or inflight.dcp_executor_running():
            return False
        self.abandon("save abandoned: DCP never planned it (the dcp.async_save that staged it failed)")
        self.close()
        return True

    def close(self, collector_after: float = 0.0) -> None:
        """Needs nothing more from this rank: finished, its references to the state dropped, the
        collector free to run again (``collector_after`` seconds from now), out of the registry."""
        self.finished.set()
        self.flat, self.payloads, self.guard = None, {}, None
        self.end_collector_pause(after=collector_after)
        inflight.unregister(self)

    def jobs(self) -> list:
        return [*self.files, *self.held]

    def all_written(self) -> bool:
        return all(j.is_done() for j in self.jobs())

    def file_names(self) -> frozenset:
        return frozenset(f.name for f in self.files) | frozenset(h.name for h in self.held if h.name)

    def wait_staged(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for j in self.jobs():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not j.wait_staged(left):
                return False
        return True

    def device_wait(self, stream_of) -> bool:
        """True when no host wait is needed: some file copies from a GPU, and each file is staged
        or (GPU files) has the caller's stream now waiting for all its copies."""
        files = self.jobs()
        if not any(f.device >= 0 for f in files):
            return False
        return all(f.device_wait(stream_of) for f in files)

    def seal(self) -> None:
        """From now on the caller may change the sources: check none changed before (once)."""
        with self._lock:
            if self._sealed:
                return
            self._sealed = True
            guard, self.guard = self.guard, None
        if guard is None or self.error is not None:
            return
        changed = guard.first_changed()
        if changed is not None:
            self.error = CheckpointWriteError(torn_message(self.path or "(unnamed)", *changed))
            return
        freed = guard.first_freed()
        if freed is not None:
            self.error = CheckpointWriteError(freed_message(self.path or "(unnamed)", freed))

    def fail(self, exc: BaseException) -> None:
        """An error before DCP's planning: kept to be raised from prepare_local_plan (inside the
        planning collective, so every rank learns of it); nothing of this save gets written."""
        if self.error is None:
            self.error = exc
        self.abandon(f"save abandoned: {exc}")

    # The registry's save handle (runtime/inflight.py): what Ctrl-C at exit names and abandons.
    def abandon(self, reason: str) -> None:
        """Fail every job at once: nothing of this save gets written or committed."""
        if self.abandoned is None:
            self.abandoned = reason
        for j in self.jobs():
            j.abort(reason)

    def progress(self) -> tuple[int, int]:
        jobs = [j.job for j in self.jobs()]
        return sum(int(getattr(j, "bytes_done", 0)) for j in jobs), sum(int(j.nbytes) for j in jobs)

    def done(self) -> bool:
        return self.is_over()

    def nbytes(self) -> int:
        return sum(int(j.job.nbytes) for j in self.jobs())
