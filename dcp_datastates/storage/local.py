"""A checkpoint folder on this machine: safe opens, atomic small files, moves and removals.

The commit protocol's small files are written atomically (temporary name, fsync, rename, folder
fsync). The data files go through ``channel.local``.

Every read opens a regular file inside the folder only: never through a symlink, never blocking
on a FIFO (``open_for_reading``); a data file is always written on a new inode, so a hard link
or symlink shared with another checkpoint is never truncated in place.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterable
from contextlib import contextmanager

from ..errors import CheckpointFormatError, CheckpointWriteError
from ..forking import ThreadPool
from .base import Storage

__all__ = ["LocalStorage", "open_for_reading", "file_kind", "not_regular_error", "wait_for_discards"]

# Reads of checkpoint files: never through a symlink, never blocking on a FIFO.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages ("a symbolic link", "a FIFO" ...)."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def not_regular_error(where: str, what: str, full: str, mode: int) -> CheckpointFormatError:
    detail = ""
    if stat.S_ISLNK(mode):
        try:
            detail = f" to {os.readlink(full)!r}"
        except OSError:
            pass
        detail += "; checkpoint files are read only from inside the folder, never through a link (copy it with `cp -L`)"
    return CheckpointFormatError(f"checkpoint {where}: {what} is {file_kind(mode)}{detail}, not a regular file")


def open_for_reading(full: str, what: str | None = None) -> int:
    """A descriptor of the regular file ``full``, opened without following a symlink or
    blocking on a FIFO. Raises CheckpointFormatError for anything that is not a regular file."""
    folder, name = os.path.dirname(full), os.path.basename(full)
    try:
        fd = os.open(full, _READ_FLAGS)
    except OSError as exc:
        # O_NOFOLLOW met a symlink.
        if exc.errno == errno.ELOOP:
            raise not_regular_error(folder, what or name, full, os.lstat(full).st_mode) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_regular_error(folder, what or name, full, st.st_mode)
    os.set_blocking(fd, True)
    return fd


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems (FUSE, network mounts) cannot sync a directory: nothing to do there.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# Files a commit made obsolete are renamed to this prefix at once and unlinked in the background.
_DISCARDED_PREFIX = ".dcpds-discarded-"


# Unlinks discarded files, one at a time. Python's exit waits for what is queued.
_discards = ThreadPool(max_workers=1, thread_name_prefix="dcp-datastates-discard")


def _discard_in_background(folder: str, path: str) -> None:
    try:
        _discards.submit(_unlink_discarded, folder, path)
    except RuntimeError:
        # The interpreter is shutting down: no new background work.
        _unlink_discarded(folder, path)


def _unlink_discarded(folder: str, path: str) -> None:
    """Unlink ``path``, then any other discarded file of ``folder`` (left by a process that
    exited before unlinking it; a second unlink of one is harmless)."""
    _unlink_quietly(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if name.startswith(_DISCARDED_PREFIX):
            _unlink_quietly(os.path.join(folder, name))


def wait_for_discards(timeout: float | None = None) -> None:
    """Wait until every file this process discarded so far (``LocalStorage.discard``) is unlinked
    (TimeoutError after ``timeout`` seconds)."""
    _discards.submit(lambda: None).result(timeout)


class LocalStorage(Storage):
    def __init__(self, path: str) -> None:
        self.location = path

    def __repr__(self) -> str:
        return f"LocalStorage({self.location!r})"

    # ------------------------------------------------------------------------------ names
    def where(self, name: str) -> str:
        return os.path.join(self.location, name)

    def child(self, name: str) -> "LocalStorage":
        return LocalStorage(self.where(name))

    def parent(self) -> "LocalStorage":
        return LocalStorage(os.path.dirname(os.path.abspath(self.location)))

    def subfolders(self) -> list[str]:
        try:
            names = os.listdir(self.location)
        except OSError:
            return []
        return [n for n in names if os.path.isdir(self.where(n))]

    # ------------------------------------------------------------------------------ state
    def check_folder(self) -> None:
        if not os.path.exists(self.location):
            raise FileNotFoundError(f"no checkpoint at {self.location}: the folder does not exist")
        if not os.path.isdir(self.location):
            raise NotADirectoryError(f"no checkpoint at {self.location}: it is a file, not a checkpoint folder")

    def has(self, name: str) -> bool:
        return os.path.isfile(self.where(name))

    def sizes(self, names: Iterable[str] | None = None) -> dict[str, int]:
        if names is None:
            names = self.names()
        out = {}
        for name in names:
            full = self.where(name)
            try:
                # lstat: a symlink is refused, not followed.
                st = os.lstat(full)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise not_regular_error(self.location, f"data file {name}", full, st.st_mode)
            out[name] = st.st_size
        return out

    def size(self, name: str) -> int | None:
        return self.sizes([name]).get(name)

    # ------------------------------------------------------------------------------ small files
    def read_small(self, name: str, *, limit: int, what: str) -> bytes:
        full = self.where(name)
        if os.path.isdir(full) and not os.path.islink(full):
            raise CheckpointFormatError(f"{full}: {what} is a folder, not a metadata file")
        fd = open_for_reading(full, f"{what} {name}")
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise CheckpointFormatError(
                    f"{full}: {size} bytes, more than the {limit}-byte limit of a metadata file "
                    f"(not a dcp_datastates checkpoint, or damaged)"
                )
            # One byte more: notices a file that grew meanwhile.
            chunks, left = [], size + 1
            while left > 0:
                chunk = os.read(fd, min(left, 64 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            raw = b"".join(chunks)
            if len(raw) > size:
                raise CheckpointFormatError(f"{full}: {what} changed while it was read (a save is running?)")
            return raw
        finally:
            os.close(fd)

    def put(self, name: str, data: bytes, *, sync: bool) -> None:
        folder = self.location
        tmp = os.path.join(folder, f"{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, os.path.join(folder, name))
            if sync:
                _fsync_dir(folder)
                _fsync_dir(os.path.dirname(os.path.abspath(folder)))
        except OSError:
            _unlink_quietly(tmp)
            raise

    def remove_stale_temporaries(self, prefix: str) -> None:
        try:
            names = os.listdir(self.location)
        except OSError:
            return
        for name in names:
            if name.startswith(prefix):
                _unlink_quietly(self.where(name))

    # ------------------------------------------------------------------------------ files
    def make_folder(self) -> None:
        path = self.location
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise CheckpointWriteError(f"cannot create checkpoint folder {path}: {exc.strerror or exc}") from exc
        # makedirs(exist_ok=True) accepts nothing else, but be explicit.
        if not os.path.isdir(path):
            raise CheckpointWriteError(f"cannot create checkpoint folder {path}: a file is in the way")

    def prepare(self, *, overwrite: bool, marker: str) -> bool:
        self.make_folder()
        committed = os.path.lexists(self.where(marker))
        if committed and not overwrite:
            raise self.exists_error()
        return committed

    def names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.location) if not os.path.isdir(self.where(n))]
        except OSError:
            return []

    def remove(self, name: str) -> None:
        os.unlink(self.where(name))

    def discard(self, name: str) -> None:
        """Renamed aside at once (its name is free, and no listing counts it as a data file) and
        unlinked in the background: freeing a large file is slow on some file systems (ext4
        mounted with ``discard``, for one), and the save that made it obsolete is durable
        already; its ``upload_completion`` need not wait for that."""
        aside = self.where(f"{_DISCARDED_PREFIX}{uuid.uuid4().hex}")
        os.rename(self.where(name), aside)
        _discard_in_background(self.location, aside)

    def open_read(self, name: str):
        return os.fdopen(open_for_reading(self.where(name)), "rb")

    @contextmanager
    def create(self, name: str, *, sync: bool):
        full = self.where(name)
        with open(full, "wb") as f:
            yield f
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def move(self, name: str, dst: Storage, new_name: str) -> None:
        if isinstance(dst, LocalStorage):
            src, target = self.where(name), dst.where(new_name)
            try:
                os.rename(src, target)
            except OSError:
                # Another file system: copy, then drop the original.
                shutil.copyfile(src, target)
                os.unlink(src)
            return
        super().move(name, dst, new_name)

    def move_aside(self, name: str, defer=None) -> None:
        """Move an existing file ``name`` out of the way so that the next write of that name makes
        a new inode (a hard link shared with another checkpoint is never written into); the old
        file is unlinked through ``defer(fn, *args)`` (a background thread) or at once."""
        path = self.where(name)
        aside = f"{path}.old-{uuid.uuid4().hex}"
        try:
            os.rename(path, aside)
        except OSError:
            # No old file (or nothing we may move): the create reports real errors.
            return
        if defer is None:
            _unlink_quietly(aside)
        else:
            defer(_unlink_quietly, aside)
