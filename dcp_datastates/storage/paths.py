"""Checkpoint locations as users write them: local paths, ``file://`` URLs and fsspec URLs.

Only the storage layer asks whether a location is local (``open_storage`` does, once per path);
everything above it holds a ``Storage``.
"""

from __future__ import annotations

import os

__all__ = ["normalize", "is_supported_url", "local_path", "is_remote", "root_of"]

_FILE_PREFIX = "file://"


def is_remote(path: str | os.PathLike | None) -> bool:
    """True for a URL that is not ``file://`` (read and written through fsspec)."""
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
        # "s3://": the store's error would not say what is missing.
        if not rest.strip("/"):
            raise ValueError(f"checkpoint URL {os.fspath(path)!r} names no bucket or folder after {proto}://")
        return f"{proto}://{rest.rstrip('/')}"
    # "" or "file://": no folder to make or read ("." names the current one).
    if not s:
        raise ValueError(f"checkpoint path {os.fspath(path)!r} is empty: name the checkpoint's folder")
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


def root_of(path: str) -> str:
    """The folder of checkpoints that checkpoint ``path`` (normalized) is directly under."""
    return path.rstrip("/").rsplit("/", 1)[0]
