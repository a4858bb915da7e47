"""Exceptions raised by dcp_datastates. Every message names the checkpoint and, where it applies,
the file, item and byte range involved."""

from __future__ import annotations

__all__ = [
    "DataStatesError",
    "IncompleteCheckpointError",
    "CheckpointFormatError",
    "ChecksumMismatchError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
]


class DataStatesError(Exception):
    """Base class of every error this library raises on purpose."""


class IncompleteCheckpointError(DataStatesError):
    """The folder has no valid commit marker (``.metadata``): the save never finished."""


class CheckpointFormatError(DataStatesError):
    """A metadata file or a data-file header is malformed, truncated, or of an unknown version."""


class ChecksumMismatchError(DataStatesError):
    """Bytes read back do not match the checksum recorded when they were written."""


class CheckpointMismatchError(DataStatesError):
    """The state dict being loaded does not match the checkpoint (keys, shapes or dtypes)."""


class CheckpointWriteError(DataStatesError):
    """Writing a checkpoint failed (disk full, permission, I/O error, ...)."""
