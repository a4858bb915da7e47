"""A data file staged now and written once DCP's planning says where and what.

Two things can be unknown at ``stage()``: which rank writes a plain tensor (DCP's planner decides,
see ``save/ownership.py``) and, when the user names the folder only through ``checkpoint_id``, where
the file goes (DCP passes it to ``reset()`` after staging). Such items are copied into the host
cache at once, like any other (an engine streaming job: copies and checksums on the engine's
threads), but nothing is flushed until ``set_destination`` and ``set_selection`` have both been
called. Then one thread lays the selected items out anew (``plan_file``) and submits an engine job
that gathers them from the held chunks (local file or fsspec object, written by the engine like
every data file: header, data, checksums on the final file's grid), and gives every held slot back
once that job copied them. Items not
selected are dropped; when none is, no file is created.

In an incremental save (``incremental.py``) the items are also hashed there, from the held
chunks (XXH64, on this file's thread with the GIL released), and those whose bytes the base
checkpoint already holds are dropped from the selection: their locations are the base's
(references), and their slots are given back like the others'.

The held bytes stay in the cache until the plan arrives, so the writer holds only what fits in
half of it (the rest would stall other copies); a held file whose plan never comes (the save
failed on another rank before writing) gives its slots back after ``timeout`` seconds, or at once
when ``abort`` is called.

A save in flight holds two kinds of data-file jobs: ``in_flight.FileJob`` (a file the engine writes
as planned at the request) and ``HeldFile``. Both follow one protocol, ``DataFileWork`` (below),
so the save's steps (``StagedSave``, ``write.py``, ``discard.py``) never ask which kind a job is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from ..channel import channel_for
from ..errors import CheckpointWriteError
from ..format.layout import plan_file
from ..format.locations import ItemLocation
from ..native import engine_module
from ..storage import Storage
from .incremental import Incremental
from .items import ItemKey, SourceItem
from .plan import item_location

# For hash64_segments: the incremental save's content hash.
_engine = engine_module()

__all__ = ["DataFileWork", "HeldFile"]


@runtime_checkable
class DataFileWork(Protocol):
    """One data file of a save in flight: its items copied into the host cache (staging), then
    written (durable). ``in_flight.FileJob`` and ``HeldFile`` both follow it, with the same meaning
    for every member; a held file that writes none of its items creates no file.

    ``result`` and ``wait_ended`` are the two ends of a job: the first is what a save that
    commits waits for, the second what a save that is discarded waits for (bounded, never
    raising) before removing the job's file.

    - ``keys``: its items, in its (staged) layout's order.
    - ``name``: its file's name in the folder; None until known.
    - ``job``: the engine job copying its items (progress: ``bytes_done``, ``nbytes``).
    - ``mirrors``: peer_copies: the keeper stages this same file (save/ownership.py).
    - ``mirror_of``: peer_copies: the same file as that rank's mirrored one.
    - ``written``: once durable (set from ``result()``): its items' final locations.
    """

    keys: Sequence[ItemKey]
    name: str | None
    job: Any
    mirrors: bool
    mirror_of: int | None
    written: Mapping[ItemKey, ItemLocation] | None

    @property
    def device(self) -> int:
        """The CUDA device its items are copied from; -1 for host memory."""
        ...

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait (None: without bound) until every byte is in the host cache or the job failed;
        False when ``timeout`` passed first."""
        ...

    def is_staged(self) -> bool:
        """Every byte is in the host cache (or the job failed)."""
        ...

    def device_wait(self, stream_of: Callable[[int], int | None]) -> bool:
        """True when no host wait is needed for its copies: staged, or (copies from a GPU)
        the stream ``stream_of(device)`` now waits for all of them."""
        ...

    def is_done(self) -> bool:
        """It ended: written and durable, failed, or aborted (``result()`` returns at once)."""
        ...

    def result(self) -> dict[ItemKey, ItemLocation]:
        """Wait until the file is durable: the final locations (checksums included) of the
        items it wrote. Raises ``CheckpointWriteError`` when it failed or was aborted."""
        ...

    def wait_ended(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until it writes nothing any more (done, failed or
        aborted; an upload ended): True once so. Never raises (what a discard waits for)."""
        ...

    def abort(self, reason: str) -> None:
        """Fail it: nothing more of it is written, its cache slots come back (no-op once done)."""
        ...


class _Destination:
    def __init__(self, storage: Storage, name: str, sync: bool, direct_writes: bool | None, direct_io: bool) -> None:
        self.storage, self.name, self.sync, self.direct_writes = storage, name, sync, direct_writes
        self.direct_io = direct_io


class HeldFile:
    """One held data file: ``items`` are copied into the host cache by an engine streaming job
    (a ``DataFileWork``, whose docstring says what ``mirrors``, ``mirror_of`` and ``written`` mean)."""

    mirrors = False
    mirror_of: int | None = None
    written = None

    def __init__(self, engine, items: list[SourceItem], device: int, stream: int, label: str,
                 selection: frozenset | None = None, selection_known: bool = False,
                 timeout: float = 600.0, incremental: Incremental | None = None) -> None:
        self.items = items
        self.keys = [it.key for it in items]
        self.layout = plan_file([it.entry for it in items])
        spans = [(it.ptr, it.entry.nbytes, off) for it, off in zip(items, self.layout.offsets)]
        self.job = engine.submit_stream(label, self.layout.header, self.layout.file_size, spans, device, stream)
        self.engine = engine
        self.device = device
        self._timeout = timeout
        self._incremental = incremental
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._dest: _Destination | None = None
        self._selection = selection
        self._selection_known = selection_known
        self._aborted: str | None = None
        # DCP's thread planning this save.
        self._planner: threading.Thread | None = None
        # {key: ItemLocation} of the items written (``result()``).
        self._outcome: Future = Future()
        self.name: str | None = None
        threading.Thread(target=self._run, name="dcp-datastates-held", daemon=True).start()

    # ------------------------------------------------------------------------------ decisions
    def set_destination(self, storage: Storage, name: str, *, sync: bool, direct_writes: bool | None = None,
                        direct_io: bool = False) -> None:
        with self._ready:
            self._dest = _Destination(storage, name, sync, direct_writes, direct_io)
            self.name = name
            self._ready.notify_all()

    def set_selection(self, keep: frozenset | None) -> None:
        """The keys to write (None: all of them)."""
        with self._ready:
            self._selection, self._selection_known = keep, True
            self._ready.notify_all()

    def watch(self, thread: threading.Thread) -> None:
        """The save is planned on ``thread``; if it ends before the selection comes (the save failed
        on another rank, so DCP never calls write_data here), give the slots back at once."""
        with self._ready:
            self._planner = thread
            self._ready.notify_all()

    def selection_known(self) -> bool:
        with self._lock:
            return self._selection_known

    def abort(self, reason: str) -> None:
        """Give the slots back and write nothing (no-op once the file is written)."""
        with self._ready:
            if self._aborted is None:
                self._aborted = reason
            self._ready.notify_all()
        self.job.fail(reason)

    # ------------------------------------------------------------------ DataFileWork (above)
    def wait_staged(self, timeout: float | None = None) -> bool:
        return self.job.wait_staged(timeout)

    def is_staged(self) -> bool:
        return self.job.is_staged()

    def device_wait(self, stream_of: Callable[[int], int | None]) -> bool:
        # (No stream waits for a held file's copies: the host waits.)
        return self.is_staged()

    def is_done(self) -> bool:
        return self._outcome.done()

    def result(self) -> dict[ItemKey, ItemLocation]:
        return self._outcome.result()

    def wait_ended(self, timeout: float) -> bool:
        try:
            self._outcome.exception(timeout=timeout)
            return True
        except Exception:  # noqa: BLE001 - still running (TimeoutError): it ends on its own
            return False

    # -------------------------------------------------------------------------------- consumer
    def _wait_for_plan(self) -> tuple[_Destination | None, frozenset | None]:
        deadline = time.monotonic() + self._timeout
        with self._ready:
            while self._aborted is None and (self._dest is None or not self._selection_known):
                left = deadline - time.monotonic()
                if self._planner is not None and not self._planner.is_alive():
                    self._aborted = f"the save of {self.job.path} ended before writing (it failed on another rank)"
                    break
                if left <= 0:
                    self._aborted = (
                        f"held data of {self.job.path} got no plan within {self._timeout:.0f} s "
                        "(the save failed or stalled before writing); its cache space is given back"
                    )
                    break
                self._ready.wait(min(left, 0.2))
            return (None, None) if self._aborted is not None else (self._dest, self._selection)

    def _run(self) -> None:
        try:
            dest, keep = self._wait_for_plan()
            if dest is None:
                self.job.fail(self._aborted or "aborted")
                raise CheckpointWriteError(self._aborted or "aborted")
            kept = [(it, off) for it, off in zip(self.items, self.layout.offsets) if keep is None or it.key in keep]
            if not kept:
                self._drain()
                self._outcome.set_result({})
                return
            self._outcome.set_result(self._write(dest, kept))
        except BaseException as exc:  # noqa: BLE001 - surfaces from result
            if not self._outcome.done():
                self._outcome.set_exception(exc if isinstance(exc, CheckpointWriteError) else CheckpointWriteError(str(exc)))

    def _drain(self) -> None:
        while True:
            chunk = self.job.next_chunk()
            if chunk is None:
                break
            self.job.release(chunk[0])

    def _write(self, dest: _Destination, kept: list[tuple[SourceItem, int]]) -> dict[ItemKey, ItemLocation]:
        """Lay the kept items out anew and have the engine write that file from the held chunks
        (every byte of every data file comes from the engine, checksums included): take every
        piece the held job hands out, submit a job whose items are gathered from those chunks,
        give the chunks back once it copied them. In an incremental save, the items the base
        holds unchanged are not written: their locations are the base's."""
        taken = []
        found: dict[ItemKey, ItemLocation] = {}
        digests: list[int | None] = [None] * len(kept)
        job = upload = None
        try:
            while (chunk := self.job.next_chunk()) is not None:
                taken.append(chunk)
            error = self.job.error()
            if error:
                raise CheckpointWriteError(error)
            segments = [_segments(taken, off, it.entry.nbytes) for it, off in kept]
            if self._incremental is not None:
                digests, kept, segments, found = self._unchanged(kept, segments)
            if kept:
                final = plan_file([it.entry for it, _ in kept])
                items = [(segs or 0, it.entry.nbytes, foff) for (it, _), segs, foff in zip(kept, segments, final.offsets)]
                job, upload = self._submit(dest, final, items)
                # Until copied out of the held chunks.
                job.wait_staged()
        finally:
            for off, _, _ in taken:
                self.job.release(off)
        if job is None:
            # Every item unchanged: no file.
            return found
        if upload is not None:
            # Raises CheckpointWriteError naming the URL.
            upload.result()
        job.wait_done()
        if job.error():
            raise CheckpointWriteError(job.error())
        crcs, piece = job.checksums(), job.piece_size()
        found.update(
            (it.key, item_location(dest.name, it.entry, foff, final.data_start, piece, tuple(crcs[j]), final.file_size,
                                   digest))
            for j, ((it, _), foff, digest) in enumerate(zip(kept, final.offsets, digests)))
        return found

    def _unchanged(self, kept: list, segments: list) -> tuple[list, list, list, dict[ItemKey, ItemLocation]]:
        """Hash the kept items' held bytes: (the digests, items and segments still to write, the
        base's locations of the unchanged ones)."""
        # The GIL released while it reads.
        digests = _engine.hash64_segments(segments)
        same: dict[ItemKey, ItemLocation] = {}
        write, write_segments, write_digests = [], [], []
        for (it, off), segs, digest in zip(kept, segments, digests):
            tensor = it.entry.kind == "tensor"
            loc = self._incremental.unchanged(it.key, it.entry, digest) if tensor else None
            if loc is not None:
                same[it.key] = loc
                continue
            write.append((it, off))
            write_segments.append(segs)
            write_digests.append(digest if tensor else None)
        return write_digests, write, write_segments, same

    def _submit(self, dest: _Destination, final, items: list):
        """(engine job, upload future or None) writing the final file at its destination."""
        return channel_for(dest.storage).write_data_file(self.engine, dest.name, final.header, final.file_size,
                                                         items, sync=dest.sync, device=-1, stream=0,
                                                         direct_writes=dest.direct_writes, direct_io=dest.direct_io)


def _segments(taken: list[tuple[int, int, int]], offset: int, nbytes: int) -> list[tuple[int, int]]:
    """(pointer, length) of the parts of the held chunks ``taken`` ((file offset, pointer,
    length), in file order) that hold bytes [offset, offset + nbytes) of the held layout."""
    out, end = [], offset + nbytes
    for coff, ptr, n in taken:
        a, b = max(offset, coff), min(end, coff + n)
        if b > a:
            out.append((ptr + (a - coff), b - a))
    return out
