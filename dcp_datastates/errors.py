"""Exceptions raised by dcp_datastates. Every message names the checkpoint and, where it applies,
the file, item and byte range involved."""

from __future__ import annotations

import threading

__all__ = [
    "DataStatesError",
    "IncompleteCheckpointError",
    "CheckpointFormatError",
    "ChecksumMismatchError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "UnsafeCheckpointError",
    "RestartError",
    "checkpoint_error_cause",
]


class DataStatesError(Exception):
    """Base class of every error this library raises on purpose."""


class IncompleteCheckpointError(DataStatesError):
    """The folder has no valid commit marker (``.metadata``): the save never finished."""


class CheckpointFormatError(DataStatesError):
    """A metadata file or a data-file header is malformed, truncated, or of an unknown version."""


class ChecksumMismatchError(DataStatesError):
    """Bytes read back do not match the checksum recorded when they were written."""


class CheckpointMismatchError(DataStatesError, RuntimeError, ValueError):
    """The state dict being loaded does not match the checkpoint (keys, shapes or dtypes).

    Also a RuntimeError and a ValueError: DCP's default planner raises RuntimeError for a
    missing key and ValueError for a size mismatch, and code catching those catches this too."""


class CheckpointWriteError(DataStatesError):
    """Writing a checkpoint failed (disk full, permission, I/O error, ...)."""


# The exception of the last failed metadata read on each thread (None after a successful one).
# DCP's load calls read_metadata on the thread that called dcp.load, then raises its own
# AssertionError in place of that exception: this is how it is found again without a reader.
_metadata_reads = threading.local()


def record_metadata_read(error: BaseException | None) -> None:
    """Called by the reader after each metadata read: the exception it raised, or None."""
    _metadata_reads.error = error


def checkpoint_error_cause(exc: BaseException, reader=None) -> BaseException:
    """The error behind what ``dcp.save`` / ``dcp.load`` raised, for code that reacts to it
    (fall back to an older checkpoint when the newest is incomplete, say).

    DCP wraps every rank's error into ``CheckpointException`` (a BaseException); this returns the
    first failing rank's exception instead. DCP also turns a failed ``read_metadata`` into an
    ``AssertionError`` (2.9: a bare one, without the message). The reader keeps the exception
    its ``read_metadata`` raised, and it is returned as it was (``IncompleteCheckpointError``,
    ``CheckpointFormatError``, ``FileNotFoundError``, ...), on every torch release: from
    ``reader`` when given (``DataStatesReader.metadata_error``), else from the last metadata read
    on this thread. Anything else is returned unchanged.
    """
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and type(exc).__name__ == "CheckpointException":
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) and value else value
            if isinstance(inner, BaseException):
                exc = inner
                break
    if isinstance(exc, AssertionError):
        recorded = getattr(reader, "metadata_error", None) if reader is not None else None
        if recorded is None:
            recorded = getattr(_metadata_reads, "error", None)
        if isinstance(recorded, BaseException):
            return recorded
    return exc


class RestartError(DataStatesError):
    """A rank could not take its part in ``prepare_restart`` (raised on every rank, naming it)."""


class UnsafeCheckpointError(DataStatesError):
    """Loading a stored value would import a class or function outside PyTorch's ``weights_only``
    allowlist (it could run code from the checkpoint). Pass ``trusted=True`` to the reader
    (``--trust`` on the command line) only for checkpoints whose writer you trust."""
