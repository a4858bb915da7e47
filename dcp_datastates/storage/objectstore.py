"""A checkpoint folder on any fsspec file system (``s3://``, ``gs://``, ``az://``, ``memory://`` ...).

Object stores have no real folders: ``prepare`` is best effort and "the folder exists" means
"some object is under it". Small files are one PUT each (atomic, visible only once complete).
A file written through ``create`` appears only when it is closed; on an error inside the block
its upload is discarded (``discard_upload``). The data files go through ``channel.objectstore``.

``storage_options`` are passed to fsspec (``endpoint_url``, ``key``, ``secret``, ``anon`` ...);
fsspec's own configuration (``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables, or
``fsspec.config.conf``) applies as well.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from typing import Any

from ..errors import CheckpointFormatError, CheckpointWriteError
from .base import Storage
from .paths import normalize

__all__ = ["ObjectStorage", "discard_upload", "describe_error"]

def describe_error(exc: BaseException) -> str:
    """The cause of a store's error in a message: its type and its words."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def _store_error(url: str, doing: str, exc: BaseException) -> OSError:
    """An OSError naming the URL and the cause (connection refused, access denied ...)."""
    err = OSError(f"{doing} {url} failed: {describe_error(exc)}")
    if isinstance(exc, OSError):
        err.errno = exc.errno
    return err


class ObjectStorage(Storage):
    """``location`` is the folder as the user wrote it; ``root`` the same folder as the file
    system spells it (no protocol)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *, _fs=None, _root=None) -> None:
        self.location = normalize(url)
        if _fs is not None:
            self.fs, self.root = _fs, _root
            return
        from fsspec.core import url_to_fs  # noqa: PLC0415

        try:
            self.fs, root = url_to_fs(self.location, **dict(storage_options or {}))
        except ImportError as exc:
            raise ImportError(f"{self.location}: the fsspec implementation for this URL is not installed: {exc}") from exc
        self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"ObjectStorage({self.location!r})"

    # ------------------------------------------------------------------------------ names
    def fs_path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def where(self, name: str) -> str:
        return f"{self.location}/{name}"

    def child(self, name: str) -> "ObjectStorage":
        return ObjectStorage(self.where(name), _fs=self.fs, _root=self.fs_path(name))

    def parent(self) -> "ObjectStorage":
        return ObjectStorage(self.location.rsplit("/", 1)[0], _fs=self.fs, _root=self.root.rsplit("/", 1)[0])

    def _fresh(self, path: str) -> None:
        """Forget cached listings (s3fs and others cache them) before a check that must see the
        store as it is now."""
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - a cache that cannot be invalidated is no cache
            pass

    def _entries(self) -> list[dict]:
        self._fresh(self.root)
        try:
            return self.fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.location, "listing", exc) from exc

    def subfolders(self) -> list[str]:
        return [posixpath.basename(e["name"].rstrip("/")) for e in self._entries() if e.get("type") == "directory"]

    # ------------------------------------------------------------------------------ state
    def check_folder(self) -> None:
        self._fresh(self.root)
        try:
            present = bool(self.fs.exists(self.root)) and bool(self.fs.ls(self.root, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            present = False
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.location, "listing", exc) from exc
        if not present:
            raise FileNotFoundError(f"no checkpoint at {self.location}: nothing is stored there")

    def has(self, name: str) -> bool:
        return self.size(name) is not None

    def sizes(self, names: Iterable[str] | None = None) -> dict[str, int]:
        out = {}
        for e in self._entries():
            if e.get("type", "file") == "file":
                out[posixpath.basename(e["name"].rstrip("/"))] = int(e.get("size") or 0)
        if names is None:
            return out
        wanted = {}
        for name in names:
            size = out.get(name)
            if size is None:
                # Listings can be partial on some stores: ask for the object itself.
                size = self.size(name)
            if size is not None:
                wanted[name] = size
        return wanted

    def size(self, name: str) -> int | None:
        path = self.fs_path(name)
        self._fresh(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.where(name), "looking up", exc) from exc
        if info.get("type", "file") != "file":
            raise CheckpointFormatError(f"checkpoint {self.location}: data file {name} is not a regular file")
        return int(info.get("size") or 0)

    # ------------------------------------------------------------------------------ small files
    def read_small(self, name: str, *, limit: int, what: str) -> bytes:
        path = self.fs_path(name)
        self._fresh(path)
        try:
            size = int(self.fs.info(path).get("size") or 0)
            if size > limit:
                raise CheckpointFormatError(
                    f"{self.where(name)}: {size} bytes, more than the {limit}-byte limit of a metadata file "
                    f"(not a dcp_datastates checkpoint, or damaged)"
                )
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.where(name)}: no such object") from None
        except IsADirectoryError:
            raise CheckpointFormatError(f"{self.where(name)}: {what} is a folder, not a metadata file") from None
        except CheckpointFormatError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.where(name), "reading", exc) from exc

    def put(self, name: str, data: bytes, *, sync: bool) -> None:
        try:
            self.fs.pipe_file(self.fs_path(name), data)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointWriteError(f"writing {self.where(name)} failed: {describe_error(exc)}") from exc
        self._fresh(self.fs_path(name))

    # ------------------------------------------------------------------------------ files
    def make_folder(self) -> None:
        # A store's "folder" is a prefix, neither cheap to make nor listed: prepare() does it, off the training thread.
        pass

    def prepare(self, *, overwrite: bool, marker: str) -> bool:
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except FileExistsError:
            pass
        except (PermissionError, NotImplementedError):
            # Object stores: a bucket we may not create but may write into.
            pass
        except Exception as exc:  # noqa: BLE001 - any store error (connection ...), with the URL
            raise CheckpointWriteError(f"cannot create checkpoint folder {self.location}: {describe_error(exc)}") from exc
        self._fresh(self.fs_path(marker))
        try:
            present = bool(self.fs.exists(self.fs_path(marker)))
        except Exception as exc:  # noqa: BLE001 - any store error, with the URL
            raise CheckpointWriteError(f"cannot check for a previous commit in {self.location}: {describe_error(exc)}") from exc
        if present and not overwrite:
            raise self.exists_error()
        return present

    def names(self) -> list[str]:
        return list(self.sizes())

    def remove(self, name: str) -> None:
        self.fs.rm_file(self.fs_path(name))

    def open_read(self, name: str):
        return self.fs.open(self.fs_path(name), "rb")

    @contextmanager
    def create(self, name: str, *, sync: bool):
        # The object appears when the file object closes (multipart completed); an error inside
        # the block discards the upload.
        f = self.fs.open(self.fs_path(name), "wb")
        try:
            yield f
        except BaseException:
            discard_upload(self, self.fs_path(name), f)
            raise
        f.close()

    def move(self, name: str, dst: Storage, new_name: str) -> None:
        if isinstance(dst, ObjectStorage) and dst.fs is self.fs:
            self.fs.mv(self.fs_path(name), dst.fs_path(new_name))
            return
        super().move(name, dst, new_name)


def discard_upload(store: ObjectStorage, path: str, f) -> None:
    """Throw away a partly written object: abort the multipart upload where the file object
    buffers (object stores create the object only at close), else delete what was written."""
    from fsspec.spec import AbstractBufferedFile  # noqa: PLC0415

    try:
        f.discard()
    except Exception:  # noqa: BLE001 - best effort: the store may be unreachable
        pass
    if isinstance(f, AbstractBufferedFile):
        # Never commit from __del__.
        f.closed = True
        return
    try:
        f.close()
    except Exception:  # noqa: BLE001
        pass
    try:
        store.fs.rm_file(path)
    except Exception:  # noqa: BLE001
        pass
