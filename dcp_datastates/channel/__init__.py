"""The data channel: how the engine writes and reads the data files of a storage.

A ``Storage`` (``dcp_datastates.storage``) is a folder: names, small files, listing, moving,
removing. It knows nothing of the engine. What moves a checkpoint's bulk bytes lives here, one
channel per kind of storage:

* ``LocalChannel``: the engine's ``pwrite`` jobs on a new inode, its parallel ``pread`` with each
  piece checked while hot, early writeback of files written front to back;
* ``ObjectChannel``: the engine's streaming jobs, each appended to one object by an uploader
  thread (a multipart upload), and parallel ranged GETs checked in memory.

``channel_for(storage)`` picks the channel; callers never ask which kind they hold.
"""

from __future__ import annotations

from ..storage import LocalStorage, ObjectStorage, Storage
from .base import DataChannel, DataFileJob, StartedDataFile
from .local import LocalChannel
from .objectstore import ObjectChannel

__all__ = ["DataChannel", "DataFileJob", "StartedDataFile", "LocalChannel", "ObjectChannel", "channel_for"]


def channel_for(storage: Storage) -> DataChannel:
    """The data channel of ``storage``."""
    if isinstance(storage, LocalStorage):
        return LocalChannel(storage)
    if isinstance(storage, ObjectStorage):
        return ObjectChannel(storage)
    raise TypeError(f"no data channel for {type(storage).__name__} ({storage.location}): "
                    "expected a LocalStorage or an ObjectStorage")
