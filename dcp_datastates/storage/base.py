"""The folder interface: names, small files, listing, moves and removals of a checkpoint folder.

What the save, the load, the commit protocol and the tiers do to a folder. Two implementations:
``LocalStorage`` (a folder of this machine: fsync and atomic rename) and ``ObjectStorage``
(any fsspec file system: one-PUT small files). The engine's bulk bytes take the data channel
(``dcp_datastates.channel``), which is built on a ``Storage`` and which this layer never imports.

Where the two truly differ, the method says what each does; callers never ask which one they
hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import IO

from ..errors import CheckpointWriteError

__all__ = ["Storage"]


class Storage(ABC):
    """A checkpoint folder. ``location`` is the folder as the user wrote it (every message names
    it); ``where(name)`` names one file in it the same way."""

    location: str

    # ------------------------------------------------------------------------------ names
    @abstractmethod
    def where(self, name: str) -> str:
        """File ``name`` of the folder, as messages show it (a path or a URL)."""

    @abstractmethod
    def child(self, name: str) -> "Storage":
        """The folder ``name`` directly inside this one."""

    @property
    def name(self) -> str:
        """The folder's own name (the last part of its location)."""
        return self.location.rstrip("/").rsplit("/", 1)[-1]

    @abstractmethod
    def parent(self) -> "Storage":
        """The folder holding this one."""

    def sibling(self, name: str) -> "Storage":
        """The folder ``name`` beside this one (same parent): the checkpoint an incremental
        save's reference names."""
        return self.parent().child(name)

    @abstractmethod
    def subfolders(self) -> list[str]:
        """Names of the folders directly inside this one ([] when it does not exist)."""

    # ------------------------------------------------------------------------------ state
    @abstractmethod
    def check_folder(self) -> None:
        """Raise FileNotFoundError (or NotADirectoryError) naming the location when nothing is
        there to read a checkpoint from; return when the folder exists."""

    @abstractmethod
    def has(self, name: str) -> bool:
        """True when file ``name`` exists (a regular file; object stores: an object)."""

    @abstractmethod
    def sizes(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """name -> size of the regular files directly in the folder (of ``names`` only, when
        given; missing ones are left out). A name that is a symlink, FIFO or device raises
        CheckpointFormatError: checkpoint files are read from inside the folder only."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size of one file, None when it does not exist."""

    # ------------------------------------------------------------------------------ small files
    @abstractmethod
    def read_small(self, name: str, *, limit: int, what: str) -> bytes:
        """The bytes of the small file ``name`` (``what`` names it in messages), at most
        ``limit`` bytes (CheckpointFormatError beyond). FileNotFoundError when it is absent."""

    @abstractmethod
    def put(self, name: str, data: bytes, *, sync: bool) -> None:
        """Write small file ``name`` atomically: a reader sees the old bytes or the new ones.
        Local: a temporary name, fsync (with ``sync``), rename, folder fsync. Object stores:
        one PUT. Raises OSError or the store's error; leaves no temporary behind."""

    def remove_stale_temporaries(self, prefix: str) -> None:  # noqa: B027 - a no-op where a PUT leaves none
        """Temporaries of ``put`` left by a process killed before its rename (local folders; a
        PUT leaves none)."""
        return None

    # ------------------------------------------------------------------------------ files
    @abstractmethod
    def prepare(self, *, overwrite: bool, marker: str) -> bool:
        """Before a save writes here: create the folder where that means something; True when
        file ``marker`` (the commit marker) is there, which ``overwrite=False`` refuses with
        ``exists_error``."""

    def exists_error(self) -> CheckpointWriteError:
        """What ``prepare(overwrite=False)`` raises on a committed folder. Its words begin as stock
        DCP's FileSystemWriter's do, for code that looks for them."""
        return CheckpointWriteError(f"Checkpoint already exists and overwrite=False: {self.location} already holds a "
                                    "committed checkpoint")

    @abstractmethod
    def make_folder(self) -> None:
        """Create the folder at once, where a folder is cheap and others look for it: ``prepare``
        runs off the training thread, but a caller may list the new step's folder right after
        the save call (TorchTitan's ``keep_latest_k`` counts it). Raises CheckpointWriteError."""

    @abstractmethod
    def names(self) -> list[str]:
        """Names of the files directly in the folder."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete file ``name`` (raises when that fails)."""

    def discard(self, name: str) -> None:
        """Delete file ``name``, which nothing needs any more, waiting only until its name is
        free (what the commit's cleanup calls). Here: ``remove``."""
        self.remove(name)

    def remove_quietly(self, name: str) -> None:
        try:
            self.remove(name)
        except Exception:  # noqa: BLE001 - already gone, or the store hiccups: a harmless leftover
            pass

    @abstractmethod
    def open_read(self, name: str) -> IO[bytes]:
        """A binary file object reading ``name`` (local: no symlink followed, no FIFO)."""

    @abstractmethod
    def create(self, name: str, *, sync: bool) -> AbstractContextManager[IO[bytes]]:
        """A binary file object writing ``name`` (replacing it); durable when the ``with``
        block ends without error (local: fsynced with ``sync``; object stores: the object
        appears at close). On error nothing is left under ``name``'s new content."""

    def move(self, name: str, dst: "Storage", new_name: str) -> None:
        """Move file ``name`` to ``dst`` as ``new_name``: a rename where the two share a file
        system, else a copy then a removal."""
        with self.open_read(name) as fin, dst.create(new_name, sync=False) as fout:
            while block := fin.read(16 << 20):
                fout.write(block)
        self.remove(name)
