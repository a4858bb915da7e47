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
    "UnsafeCheckpointError",
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


def checkpoint_error_cause(exc: BaseException, reader=None) -> BaseException:
    """The error behind what ``dcp.save`` / ``dcp.load`` raised, for code that reacts to it
    (fall back to an older checkpoint when the newest is incomplete, say).

    DCP wraps every rank's error into ``CheckpointException`` (a BaseException); this returns the
    first failing rank's exception instead. DCP also turns a failed ``read_metadata`` into an
    ``AssertionError``, losing the type (2.9-2.11 without even the message). Pass the
    ``DataStatesReader`` of that load as ``reader``: it keeps the exception its
    ``read_metadata`` raised, which is then returned as it was, on every torch release. Without a
    reader, from a 2.13-style message ("global metadata read failed: <message>") an
    ``IncompleteCheckpointError``, a ``CheckpointFormatError`` or a ``FileNotFoundError`` /
    ``NotADirectoryError`` is rebuilt with the original message. Anything else is returned
    unchanged.
    """
    import re  # noqa: PLC0415

    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and type(exc).__name__ == "CheckpointException":
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) and value else value
            if isinstance(inner, BaseException):
                exc = inner
                break
    if isinstance(exc, AssertionError):
        recorded = getattr(reader, "metadata_error", None)
        if isinstance(recorded, BaseException):
            return recorded
        m = re.search(r"global metadata read failed: (.*?)(?:; rank local metadata read failed: |\Z)", str(exc), re.S)
        if m:
            text = m.group(1)
            if text.startswith("incomplete checkpoint "):
                return IncompleteCheckpointError(text)
            if text.startswith("no checkpoint at "):
                return NotADirectoryError(text) if "it is a file" in text else FileNotFoundError(text)
            if re.match(r"[^\n]*\.metadata: ", text):
                return CheckpointFormatError(text)
    return exc


class UnsafeCheckpointError(DataStatesError):
    """Loading a stored value would import a class or function outside PyTorch's ``weights_only``
    allowlist (it could run code from the checkpoint). Pass ``trusted=True`` to the reader
    (``--trust`` on the command line) only for checkpoints whose writer you trust."""
