"""The commit protocol: ``.metadata`` is the commit marker, written last and atomically.

- Before any rank writes new data into a folder, it removes an existing ``.metadata`` (and syncs
  the folder), so a crash midway never leaves an old marker describing new, partial data.
- The coordinator writes the marker only after every rank's data is durable: a temporary name,
  fsync, rename over ``.metadata``, fsync of the folder.
"""

from __future__ import annotations

import os
import re

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from .errors import CheckpointWriteError
from .metadata import METADATA_NAME, ItemLocation, encode_metadata

__all__ = ["prepare_folder", "write_commit", "is_committed", "latest_checkpoint"]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_folder(path: str, *, overwrite: bool) -> None:
    """Create the folder and invalidate an existing commit before new data is written."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise CheckpointWriteError(f"cannot create checkpoint folder {path}: {exc.strerror or exc}") from exc
    marker = os.path.join(path, METADATA_NAME)
    if not os.path.exists(marker):
        return
    if not overwrite:
        raise CheckpointWriteError(f"{path} already holds a committed checkpoint and overwrite=False")
    try:
        os.unlink(marker)
    except FileNotFoundError:  # another rank invalidated it first
        pass
    _fsync_dir(path)


def write_commit(path: str, md: Metadata, locations: dict[MetadataIndex, ItemLocation], *, sync: bool) -> None:
    data = encode_metadata(md, locations)
    tmp = os.path.join(path, f"{METADATA_NAME}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(path, METADATA_NAME))
        if sync:
            _fsync_dir(path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CheckpointWriteError(f"committing checkpoint {path} failed: {exc}") from exc


def is_committed(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), METADATA_NAME))


_STEP = re.compile(r"(\d+)(?!.*\d)")


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint folder directly under ``root`` (``step-100``, ``ckpt_7`` ...):
    the highest number in the name among folders holding a commit marker; None if there is none."""
    root = os.fspath(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    best: tuple[int, str] | None = None
    for name in names:
        m = _STEP.search(name)
        full = os.path.join(root, name)
        if m and os.path.isdir(full) and is_committed(full):
            key = (int(m.group(1)), name)
            if best is None or key > best:
                best = key
    return None if best is None else os.path.join(root, best[1])
