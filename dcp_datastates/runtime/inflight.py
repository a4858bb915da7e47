"""The one registry of saves in flight in this process.

Every lazy save registers once, at ``stage()``, and leaves once it needs nothing more. The
registry answers the three questions asked about saves in flight:

- which are still staging (``staging()``): what ``wait_staged`` and every optimizer step wait
  for; a save leaves that list when all its bytes are in the host cache (``staged``);
- which folder each one writes (``claim``): a second save to the same folder is refused while
  the first runs (its commit could describe the other's files), and a commit never removes the
  files of a save still running there (``names_in_use``);
- which are unfinished (``inflight()``): what Ctrl-C at exit names and abandons.

A save handle is any object with:

- ``path: str | None``: the checkpoint folder or URL (None until DCP names it);
- ``progress() -> (bytes_durable, bytes_total)``; ``nbytes() -> int``;
- ``abandon(reason)``: fail the save at once so nothing is committed;
- ``wait_staged(timeout) -> bool``, ``seal()`` and, for copies from a GPU,
  ``device_wait(stream_of) -> bool`` (used by ``staging_wait``);
- ``file_names() -> frozenset``: the data files it writes; ``is_over() -> bool``;
- optionally ``done() -> bool``: True once the save needs nothing more (it is then not listed).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

__all__ = ["SaveHandle", "register", "unregister", "inflight", "staging", "staged", "claim", "release",
           "names_in_use", "FolderBusyError"]


class SaveHandle(Protocol):
    path: str | None

    def progress(self) -> tuple[int, int]: ...

    def abandon(self, reason: str) -> None: ...


class FolderBusyError(Exception):
    """Another save of this process still writes the folder (the caller words the error)."""


_lock = threading.Lock()
_saves: list[Any] = []  # every save in flight, oldest first
_staging: list[Any] = []  # those whose bytes are not all in the host cache yet
_claims: dict[str, Any] = {}  # folder -> the save writing it


def register(save: SaveHandle) -> None:
    """Add a save in flight, as staging (its copies were just submitted); twice lists it once."""
    with _lock:
        if not any(s is save for s in _saves):
            _saves.append(save)
        if not any(s is save for s in _staging):
            _staging.append(save)


def staged(save: SaveHandle) -> None:
    """All its bytes are in the host cache: ``wait_staged`` no longer waits for it."""
    with _lock:
        _staging[:] = [s for s in _staging if s is not save]


def unregister(save: SaveHandle) -> None:
    """Remove a save (committed, failed or abandoned), its claim included; unknown ones are ignored."""
    with _lock:
        _saves[:] = [s for s in _saves if s is not save]
        _staging[:] = [s for s in _staging if s is not save]
        for path in [p for p, s in _claims.items() if s is save]:
            del _claims[path]


def inflight() -> list:
    """The saves in flight, oldest first."""
    with _lock:
        saves = list(_saves)
    return [s for s in saves if not _finished(s)]


def staging() -> list:
    """The saves still staging, oldest first."""
    with _lock:
        return list(_staging)


# A save whose data is long written and that nothing finished failed elsewhere: its claim lapses.
_STALE_CLAIM_S = 600.0


def claim(path: str, save: SaveHandle) -> None:
    """``save`` writes the folder ``path``; FolderBusyError when another unfinished save does."""
    with _lock:
        other = _claims.get(path)
        if other is not None and other is not save and not other.is_over():
            if not (other.all_written() and time.monotonic() - other.requested > _STALE_CLAIM_S):
                raise FolderBusyError(path)
        _claims[path] = save


def release(path: str | None, save: SaveHandle) -> None:
    """``save`` no longer writes ``path``."""
    with _lock:
        if path is not None and _claims.get(path) is save:
            del _claims[path]


def names_in_use(path: str) -> frozenset:
    """Data files of a save into ``path`` still running in this process (never removed by a commit)."""
    with _lock:
        other = _claims.get(path)
    if other is None or other.is_over():
        return frozenset()
    return other.file_names()


def _finished(save: Any) -> bool:
    done = getattr(save, "done", None)
    try:
        return bool(done()) if callable(done) else False
    except Exception:  # noqa: BLE001 - a broken handle counts as still in flight
        return False
