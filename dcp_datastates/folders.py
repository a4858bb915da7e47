"""Where a checkpoint lives: a local folder, or a folder on any fsspec file system (``s3://``,
``gs://``, ``az://``, ``memory://`` ...).

Local paths (and ``file://`` URLs, which are turned into local paths) keep the engine's direct
``pwrite``/``pread`` path and the fsync/rename commit protocol of ``commit.py``. Everything else
goes through ``RemoteFolder``: the small set of operations the writer, the reader and the commit
protocol need on an object store. Data objects are streamed by ``remote.py``.

``storage_options`` are passed to fsspec (``endpoint_url``, ``key``, ``secret``, ``anon`` ...);
fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL`` and the other ``FSSPEC_<PROTOCOL>_<OPTION>``
environment variables, or ``fsspec.config.conf``) applies as well.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any

from .checkpoint_format import MAX_METADATA_BYTES, METADATA_NAME
from .errors import CheckpointFormatError, CheckpointWriteError, IncompleteCheckpointError

__all__ = ["is_remote", "local_path", "normalize", "is_supported_url", "RemoteFolder", "remote_folder"]

_FILE_PREFIX = "file://"


def is_remote(path: str | os.PathLike | None) -> bool:
    """True for a URL that is not ``file://`` (those are read and written through fsspec)."""
    if path is None:
        return False
    s = os.fspath(path)
    return isinstance(s, str) and "://" in s and not s.startswith(_FILE_PREFIX)


def local_path(path: str | os.PathLike) -> str:
    """``file:///a/b`` -> ``/a/b``; anything else unchanged (as a str)."""
    s = os.fspath(path)
    if s.startswith(_FILE_PREFIX):
        s = s[len(_FILE_PREFIX) :]
        if s.startswith("localhost/"):
            s = s[len("localhost") :]
    return s


def normalize(path: str | os.PathLike | None) -> str | None:
    """A checkpoint location as the writer and reader keep it: a local path or a URL with no
    trailing slash."""
    if path is None:
        return None
    s = local_path(path)
    if is_remote(s):
        proto, _, rest = s.partition("://")
        rest = rest.rstrip("/")
        return f"{proto}://{rest}"
    return s


def is_supported_url(path: str | os.PathLike) -> bool:
    """True for a local path, a ``file://`` URL, or a URL whose protocol fsspec knows (an
    implementation need not be installed yet: using it then names the package to install)."""
    s = os.fspath(path)
    if not is_remote(s):
        return True
    try:
        from fsspec.registry import known_implementations, registry  # noqa: PLC0415
    except ImportError:  # pragma: no cover - fsspec is a dependency
        return False
    # Chained URLs (simplecache::s3://...) name one protocol per link.
    protocols = [link.split("://", 1)[0] for link in s.split("::") if link]
    return all(p in known_implementations or p in registry for p in protocols)


def retire_local_file(path: str, unlink) -> None:
    """Move an existing file at ``path`` out of the way so the next create makes a new inode (a
    hard link or symlink shared with another checkpoint must never be truncated in place);
    ``unlink(aside)`` frees it (the writer hands this to a background thread)."""
    import uuid  # noqa: PLC0415

    aside = f"{path}.old-{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except OSError:
        return  # no old file (or nothing we may move): the create reports real errors
    unlink(aside)


class RemoteFolder:
    """A checkpoint folder on an fsspec file system.

    ``url`` is the folder as the user wrote it (used in every message); ``root`` is the same
    folder as the file system spells it (no protocol). Object stores have no real folders:
    ``makedirs`` is best effort and "the folder exists" means "some object is under it".
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        from fsspec.core import url_to_fs  # noqa: PLC0415

        self.url = normalize(url)
        try:
            self.fs, root = url_to_fs(self.url, **dict(storage_options or {}))
        except ImportError as exc:
            raise ImportError(f"{self.url}: the fsspec implementation for this URL is not installed: {exc}") from exc
        self.root = root.rstrip("/")
        self.protocol = self.url.split("://", 1)[0]

    # ----------------------------------------------------------------------------- names
    def join(self, name: str) -> str:
        """``name`` inside the folder, as the file system spells it."""
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    @property
    def marker(self) -> str:
        return self.join(METADATA_NAME)

    def _fresh(self, path: str) -> None:
        """Forget cached listings (s3fs and others cache them) before a check that must see the
        store as it is now."""
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - a cache that cannot be invalidated is no cache
            pass

    # -------------------------------------------------------------------------- writing
    def prepare(self, *, overwrite: bool) -> bool:
        """Before any data object is written: create the folder where that means something; True
        when it holds a committed checkpoint (left in place: see commit.py), which
        ``overwrite=False`` refuses."""
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except FileExistsError:
            pass
        except (PermissionError, NotImplementedError):
            pass  # object stores: a bucket we may not create but may write into
        except Exception as exc:  # noqa: BLE001 - any store error (connection ...), with the URL
            raise CheckpointWriteError(f"cannot create checkpoint folder {self.url}: {_cause(exc)}") from exc
        self._fresh(self.marker)
        try:
            present = bool(self.fs.exists(self.marker))
        except Exception as exc:  # noqa: BLE001 - any store error, with the URL
            raise CheckpointWriteError(f"cannot check for a previous commit in {self.url}: {_cause(exc)}") from exc
        if present and not overwrite:
            raise CheckpointWriteError(f"{self.url} already holds a committed checkpoint and overwrite=False")
        return present

    def write_marker(self, data: bytes, name: str = METADATA_NAME) -> None:
        """Write a commit marker in one request (a single PUT on object stores: atomic, visible
        only once complete)."""
        try:
            self.fs.pipe_file(self.join(name), data)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointWriteError(f"committing checkpoint {self.url} failed: {_cause(exc)}") from exc
        self._fresh(self.join(name))

    def names(self) -> list[str]:
        """Names of the objects directly in the folder."""
        return list(self.sizes())

    def remove(self, name: str) -> None:
        self.fs.rm_file(self.join(name))

    # -------------------------------------------------------------------------- reading
    def read_marker(self, name: str = METADATA_NAME) -> bytes:
        """The bytes of a commit marker (``.metadata``). FileNotFoundError when nothing is stored
        at the URL, IncompleteCheckpointError when data is there but no marker."""

        marker = self.join(name)
        self._fresh(marker)
        try:
            size = int(self.fs.info(marker).get("size") or 0)
            if size > MAX_METADATA_BYTES:
                raise CheckpointFormatError(
                    f"{self.url_of(name)}: {size} bytes, more than the {MAX_METADATA_BYTES}-byte limit of a "
                    f"metadata file (not a dcp_datastates checkpoint, or damaged)"
                )
            return self.fs.cat_file(marker)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise CheckpointFormatError(f"{self.url_of(name)}: the commit marker is a folder, not a metadata file") from None
        except CheckpointFormatError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.url_of(name), "reading", exc) from exc
        if not self.has_objects():
            raise FileNotFoundError(f"no checkpoint at {self.url}: nothing is stored there")
        raise IncompleteCheckpointError(
            f"incomplete checkpoint {self.url}: there is no {name} commit marker "
            f"(the save did not finish or is still running)"
        )

    def has_objects(self) -> bool:
        self._fresh(self.root)
        try:
            return bool(self.fs.exists(self.root)) and bool(self.fs.ls(self.root, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.url, "listing", exc) from exc

    def sizes(self) -> dict[str, int]:
        """Name -> size of every object directly in the folder (one listing request)."""
        self._fresh(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.url, "listing", exc) from exc
        out = {}
        for e in entries:
            if e.get("type", "file") == "file":
                out[posixpath.basename(e["name"].rstrip("/"))] = int(e.get("size") or 0)
        return out

    def size(self, name: str) -> int | None:
        """Size of one object, None when it does not exist."""
        path = self.join(name)
        self._fresh(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.url_of(name), "looking up", exc) from exc
        if info.get("type", "file") != "file":
            raise CheckpointFormatError(f"checkpoint {self.url}: data file {name} is not a regular file")
        return int(info.get("size") or 0)

    def subfolders(self) -> list[str]:
        """Names of the folders (prefixes) directly under this one."""
        self._fresh(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.url, "listing", exc) from exc
        return [posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory"]

    def child(self, name: str) -> "RemoteFolder":
        sub = RemoteFolder.__new__(RemoteFolder)
        sub.url, sub.fs, sub.root, sub.protocol = self.url_of(name), self.fs, self.join(name), self.protocol
        return sub


def _cause(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def _store_error(url: str, doing: str, exc: BaseException) -> OSError:
    """An OSError naming the URL and the cause (connection refused, access denied ...)."""
    err = OSError(f"{doing} {url} failed: {_cause(exc)}")
    if isinstance(exc, OSError):
        err.errno = exc.errno
    return err


def remote_folder(url: str, storage_options: Mapping[str, Any] | None = None) -> RemoteFolder:
    return RemoteFolder(url, storage_options)
