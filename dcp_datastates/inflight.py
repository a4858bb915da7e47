"""The checkpoints this process is writing right now, so Ctrl-C at exit can say which and abandon them.

A save handle is any object with:

- ``path: str``: the checkpoint folder or URL;
- ``progress() -> (bytes_durable, bytes_total)``: this rank's data bytes written so far / in all;
- ``abandon(reason: str) -> None``: fail the save at once so nothing is committed; returns
  immediately (the threads waiting on it wake up and fail);
- optionally ``done() -> bool``: True once the save needs nothing more (it is then not listed).

The writer registers a handle when ``stage()`` starts a save and unregisters it once the save is
committed or failed (``writer._StagedSave`` is such a handle).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

__all__ = ["SaveHandle", "register", "unregister", "inflight"]


class SaveHandle(Protocol):
    path: str

    def progress(self) -> tuple[int, int]: ...

    def abandon(self, reason: str) -> None: ...


_lock = threading.Lock()
_saves: list[Any] = []


def register(save: SaveHandle) -> None:
    """Add a save in flight (registering the same handle twice lists it once)."""
    with _lock:
        if not any(s is save for s in _saves):
            _saves.append(save)


def unregister(save: SaveHandle) -> None:
    """Remove a save (committed, failed or abandoned); unknown handles are ignored."""
    with _lock:
        _saves[:] = [s for s in _saves if s is not save]


def inflight() -> list:
    """The saves in flight, oldest first."""
    with _lock:
        saves = list(_saves)
    return [s for s in saves if not _finished(s)]


def _finished(save: Any) -> bool:
    done = getattr(save, "done", None)
    try:
        return bool(done()) if callable(done) else False
    except Exception:  # noqa: BLE001 - a broken handle counts as still in flight
        return False
