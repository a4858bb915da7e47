"""A data file staged now and written once DCP's planning says where and what.

Two things can be unknown at ``stage()``: which rank writes a plain tensor (DCP's planner decides,
see ``stage/ownership.py``) and, when the user names the folder only through ``checkpoint_id``, where
the file goes (DCP passes it to ``reset()`` after staging). Such items are copied into the host
cache at once, like any other (an engine streaming job: copies and checksums on the engine's
threads), but nothing is flushed until ``set_destination`` and ``set_selection`` have both been
called. Then one consumer thread takes the chunks in file order and writes the selected items back
to back after a fresh safetensors header (local file or fsspec object), recomputing each item's
CRC32C on the final file's grid as the bytes pass, and gives every cache slot back. Items not
selected are dropped; when none is, no file is created.

The held bytes stay in the cache until the plan arrives, so the writer holds only what fits in
half of it (the rest would stall other copies); a held file whose plan never comes (the save
failed on another rank before writing) gives its slots back after ``timeout`` seconds, or at once
when ``abort`` is called.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from . import folders
from .errors import CheckpointWriteError
from .checkpoint_format import ItemLocation, piece_ranges, plan_file
from .remote import UPLOAD_BLOCK_SIZE, _buffer, _discard
from .stage.pipeline import item_location, written
from .stage.items import ItemKey, SourceItem

__all__ = ["HeldFile"]


class _Destination:
    def __init__(self, folder: str, name: str, sync: bool, remote: Any) -> None:
        self.folder, self.name, self.sync, self.remote = folder, name, sync, remote

    def url(self) -> str:
        return self.remote.url_of(self.name) if self.remote is not None else os.path.join(self.folder, self.name)


class HeldFile:
    """One held data file: ``items`` are copied into the host cache by an engine streaming job."""

    def __init__(self, engine, items: list[SourceItem], device: int, stream: int, label: str,
                 selection: frozenset | None = None, selection_known: bool = False,
                 timeout: float = 600.0) -> None:
        self.items = items
        self.keys = [it.key for it in items]
        self.layout = plan_file([it.entry for it in items])
        spans = [(it.ptr, it.entry.nbytes, off) for it, off in zip(items, self.layout.offsets)]
        self.job = engine.submit_stream(label, self.layout.header, self.layout.file_size, spans, device, stream)
        self.engine = engine
        self.device = device
        self._timeout = timeout
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._dest: _Destination | None = None
        self._selection = selection
        self._selection_known = selection_known
        self._aborted: str | None = None
        self._planner: threading.Thread | None = None  # DCP's thread planning this save
        self.result: Future = Future()  # {key: ItemLocation} of the items written
        self.name: str | None = None
        threading.Thread(target=self._run, name="dcp-datastates-held", daemon=True).start()

    # ------------------------------------------------------------------------------ decisions
    def set_destination(self, folder: str, name: str, *, sync: bool, remote: Any = None) -> None:
        with self._ready:
            self._dest = _Destination(folder, name, sync, remote)
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

    # ------------------------------------------------------------------------- job interface
    def wait_staged(self, timeout: float | None = None) -> bool:
        return self.job.wait_staged(timeout)

    def is_staged(self) -> bool:
        return self.job.is_staged()

    def is_done(self) -> bool:
        return self.result.done()

    def selected_keys(self) -> list[ItemKey]:
        sel = self._selection
        return [k for k in self.keys if sel is None or k in sel]

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
                self.result.set_result({})
                return
            self.result.set_result(self._write(dest, kept))
        except BaseException as exc:  # noqa: BLE001 - surfaces from result
            if not self.result.done():
                self.result.set_exception(exc if isinstance(exc, CheckpointWriteError) else CheckpointWriteError(str(exc)))

    def _drain(self) -> None:
        while True:
            chunk = self.job.next_chunk()
            if chunk is None:
                break
            self.job.release(chunk[0])

    def _write(self, dest: _Destination, kept: list[tuple[SourceItem, int]]) -> dict[ItemKey, ItemLocation]:
        final = plan_file([it.entry for it, _ in kept])
        piece = self.job.piece_size()
        located = [item_location(dest.name, it.entry, foff, final.data_start, piece, (), final.file_size)
                   for (it, _), foff in zip(kept, final.offsets)]
        writer = _open(dest)
        try:
            writer.write(memoryview(final.header))
            crcs = _GridChecksums(self.engine, located)
            spans = [(off, off + it.entry.nbytes, foff) for (it, off), foff in zip(kept, final.offsets)]
            k = 0  # first kept span not fully written
            while True:
                chunk = self.job.next_chunk()
                if chunk is None:
                    break
                coff, ptr, n = chunk
                try:
                    cend = coff + n
                    while k < len(spans) and spans[k][1] <= coff:
                        k += 1
                    j = k
                    while j < len(spans) and spans[j][0] < cend:
                        a, b = max(spans[j][0], coff), min(spans[j][1], cend)
                        if b > a:
                            view = _buffer(ptr + (a - coff), b - a)
                            writer.write(view)
                            crcs.add(j, spans[j][2] + (a - spans[j][0]), ptr + (a - coff), b - a)
                        j += 1
                finally:
                    self.job.release(coff)
            error = self.job.error()
            if error:
                raise CheckpointWriteError(error)
            writer.close()
        except BaseException as exc:
            writer.discard()
            if not isinstance(exc, CheckpointWriteError):
                self.job.fail(f"writing {dest.url()} failed: {exc}")
                raise CheckpointWriteError(f"writing {dest.url()} failed: {type(exc).__name__}: {exc}") from exc
            raise
        return {it.key: written(loc, dest.name, tuple(crcs.of(j)), final.file_size)
                for j, ((it, _), loc) in enumerate(zip(kept, located))}


class _GridChecksums:
    """CRC32C of each item's pieces on the final file's checksum grid (``piece_ranges``: the
    engine's grid), fed in file order."""

    def __init__(self, engine, locations: list[ItemLocation]) -> None:
        self.engine = engine
        self._ends = [[off + n for off, n in piece_ranges(loc)] for loc in locations]
        self._done: list[list[int]] = [[] for _ in locations]
        self._running = [0] * len(locations)

    def add(self, item: int, pos: int, ptr: int, n: int) -> None:
        ends, done = self._ends[item], self._done[item]
        while n > 0:
            end = ends[len(done)]
            take = min(n, end - pos)
            crc = self.engine.crc32c(ptr, take, self._running[item])
            pos, ptr, n = pos + take, ptr + take, n - take
            if pos == end:
                done.append(crc)
                crc = 0
            self._running[item] = crc

    def of(self, item: int) -> list[int]:
        return self._done[item]


class _LocalWriter:
    def __init__(self, path: str, sync: bool) -> None:
        self.path, self.sync = path, sync
        folders.retire_local_file(path, _unlink_quietly)  # never write into a shared inode
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
        try:
            self.fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise CheckpointWriteError(f"cannot create data file {path}: {exc.strerror or exc}") from exc

    def write(self, view: memoryview) -> None:
        while view:
            try:
                written = os.write(self.fd, view)
            except OSError as exc:
                raise CheckpointWriteError(f"{self.path}: write failed: {exc.strerror or exc} (errno {exc.errno})") from exc
            view = view[written:]

    def close(self) -> None:
        try:
            if self.sync:
                os.fsync(self.fd)
        except OSError as exc:
            raise CheckpointWriteError(f"{self.path}: fsync failed: {exc.strerror or exc} (errno {exc.errno})") from exc
        finally:
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class _RemoteWriter:
    def __init__(self, folder, name: str) -> None:
        self.folder, self.path = folder, folder.join(name)
        self.f = folder.fs.open(self.path, "wb", block_size=UPLOAD_BLOCK_SIZE)

    def write(self, view: memoryview) -> None:
        self.f.write(view)

    def close(self) -> None:
        self.f.close()
        self.f = None

    def discard(self) -> None:
        if self.f is not None:
            _discard(self.folder, self.path, self.f)
            self.f = None


def _open(dest: _Destination):
    if dest.remote is not None:
        return _RemoteWriter(dest.remote, dest.name)
    return _LocalWriter(os.path.join(folders.local_path(dest.folder), dest.name), dest.sync)
