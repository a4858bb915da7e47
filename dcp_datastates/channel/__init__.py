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

import weakref

from ..storage import LocalStorage, ObjectStorage, Storage
from .base import DataChannel, DataFileJob, StartedDataFile
from .local import LocalChannel
from .objectstore import ObjectChannel

__all__ = ["DataChannel", "DataFileJob", "StartedDataFile", "LocalChannel", "ObjectChannel", "channel_for"]


# One channel per storage object for as long as it lives: what a channel learns of its folder
# (LocalChannel.memory_backed: a statfs) is asked once, not at every file a save starts.
_channels: "weakref.WeakKeyDictionary[Storage, DataChannel]" = weakref.WeakKeyDictionary()


def channel_for(storage: Storage) -> DataChannel:
    """The data channel of ``storage`` (the same object for the same storage)."""
    channel = _channels.get(storage)
    if channel is None:
        channel = _channels.setdefault(storage, _new_channel(storage))
    return channel


def _new_channel(storage: Storage) -> DataChannel:
    if isinstance(storage, LocalStorage):
        return LocalChannel(storage)
    if isinstance(storage, ObjectStorage):
        return ObjectChannel(storage)
    raise TypeError(f"no data channel for {type(storage).__name__} ({storage.location}): "
                    "expected a LocalStorage or an ObjectStorage")
