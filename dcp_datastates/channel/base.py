"""The data channel's interface: one storage's data files, written and read by the engine."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import IO, Any

from ..storage import Storage

__all__ = ["DataChannel", "DataFileJob", "StartedDataFile"]

#: (engine job, upload Future or None): what ``write_data_file`` returns. The Future, for object
#: stores, resolves when the object is complete in the store (or raises CheckpointWriteError).
DataFileJob = tuple[Any, "Future | None"]
#: What ``start_data_file`` returns: a ``DataFileJob`` and the call that names its file later,
#: ``name_it(name, defer)``.
StartedDataFile = tuple[Any, "Future | None", Callable[..., None]]


class DataChannel(ABC):
    """The engine's way to the data files of ``storage``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.storage!r})"

    def writes_direct(self, direct_writes: bool | None) -> bool:
        """Whether host memory goes to this storage's files without the host cache, given the
        ``direct_writes`` option (None: the channel's choice). Object stores: never."""
        return False

    @abstractmethod
    def start_data_file(self, engine, label: str, header: bytes, file_size: int, spans: list, *, sync: bool,
                        device: int, stream: int, direct_writes: bool | None = None,
                        direct_io: bool = False) -> StartedDataFile:
        """Hand one data file to the engine before its name is known (the folder is prepared off
        the training thread): the copies into the host cache start now, nothing is written until
        ``name_it(name, defer)`` names it; failing the job (``job.fail``) instead frees what it
        holds. ``label`` names the file in messages until then. (``write_data_file`` is this,
        named at once.) ``direct_writes`` and ``direct_io`` are the options of those names: local
        files of host memory may skip the host cache (None: where the folder is memory-backed);
        synced local files written from the cache may skip the page cache; object stores ignore
        both."""

    def write_data_file(self, engine, name: str, header: bytes, file_size: int, spans: list, *, sync: bool,
                        device: int, stream: int, defer=None, direct_writes: bool | None = None,
                        direct_io: bool = False) -> DataFileJob:
        """Hand one data file to the engine, named at once. Local: an engine file job writing a
        new inode (an old file there is moved aside and freed through ``defer(fn, *args)``, which
        runs cleanup off the caller's thread; default: at once). Object stores: an engine
        streaming job whose bytes an uploader thread appends to one object."""
        job, upload, name_it = self.start_data_file(engine, name, header, file_size, spans, sync=sync, device=device,
                                                    stream=stream, direct_writes=direct_writes, direct_io=direct_io)
        name_it(name, defer)
        return job, upload

    @abstractmethod
    def read_into(self, engine, name: str, ranges: list, checks: list | None, threads: int) -> tuple | None:
        """Fill every (dst_ptr, file_offset, nbytes) range from ``name``; with ``checks``
        ((range index, file offset, length, crc32c) pieces), verify each piece and return the
        first bad one as (range index, offset, length, expected, got); None when all match.
        Local: the engine's parallel preads, checking each piece while it is hot. Object
        stores: parallel ranged GETs, then the same check on the bytes in memory."""

    def create_streamed(self, name: str, *, sync: bool) -> AbstractContextManager[IO[bytes]]:
        """``storage.create`` for a large file written front to back (a copy between tiers):
        local files start their writeback as they go. Durable when the ``with`` block ends."""
        return self.storage.create(name, sync=sync)
