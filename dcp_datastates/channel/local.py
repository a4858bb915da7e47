"""The data channel of a folder of this machine: the engine's ``pwrite`` and ``pread`` jobs."""

from __future__ import annotations

import functools
from contextlib import contextmanager

from ..native import engine_module
from ..storage import LocalStorage
from .base import DataChannel, StartedDataFile

__all__ = ["LocalChannel"]


class LocalChannel(DataChannel):
    storage: LocalStorage

    @functools.cached_property
    def memory_backed(self) -> bool:
        """Whether the folder (or the existing folder it will be made in) is on tmpfs or ramfs."""
        return engine_module().memory_backed(self.storage.location)

    def writes_direct(self, direct_writes: bool | None) -> bool:
        return self.memory_backed if direct_writes is None else direct_writes

    def start_data_file(self, engine, label: str, header: bytes, file_size: int, spans: list, *, sync: bool,
                        device: int, stream: int, direct_writes: bool | None = None,
                        direct_io: bool = False) -> StartedDataFile:
        # Host memory to a memory-backed folder: the write is a memory copy, so the cache's copy
        # in front of it would only double the work (the engine writes from the sources).
        direct = device < 0 and self.writes_direct(direct_writes)
        job = engine.submit_write(self.storage.where(label), header, file_size, spans, sync, device, stream,
                                  named=False, direct=direct, direct_io=direct_io)

        def name_it(name: str, defer=None) -> None:
            # Never write into a shared inode.
            self.storage.move_aside(name, defer)
            # The engine's flush workers start writing it now.
            job.set_destination(self.storage.where(name))

        return job, None, name_it

    def read_into(self, engine, name: str, ranges: list, checks: list | None, threads: int) -> tuple | None:
        return engine.read_into(self.storage.where(name), ranges, checks, threads)

    @contextmanager
    def create_streamed(self, name: str, *, sync: bool):
        with self.storage.create(name, sync=sync) as f:
            yield _WritebackFile(f) if sync else f


class _WritebackFile:
    """A file written front to back whose bytes start their way to the disk every
    ``WRITEBACK_BYTES``, as the engine does for its own files: without it the whole file sits
    dirty until the final fsync, which then takes a large share of the copy's time."""

    WRITEBACK_BYTES = 8 << 20

    def __init__(self, f) -> None:
        self._f = f
        self._written = 0
        # Bytes whose writeback was started.
        self._started = 0

    def write(self, data) -> int:
        n = self._f.write(data)
        self._written += n
        if self._written - self._started >= self.WRITEBACK_BYTES:
            self._f.flush()
            engine_module().start_writeback(self._f.fileno(), self._started, self._written - self._started)
            self._started = self._written
        return n

    def __getattr__(self, name: str):
        return getattr(self._f, name)
