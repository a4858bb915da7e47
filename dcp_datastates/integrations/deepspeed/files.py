"""The files DeepSpeed expects in a checkpoint folder: pointer files and ``latest``.

A DataStates checkpoint of a DeepSpeed tag is one DCP checkpoint in ``<save_dir>/<tag>/`` (its
safetensors data files and ``.metadata``). DeepSpeed still looks for its own file names there
(``load_checkpoint`` globs ``*_model_states.pt``), so each file it asked to save gets a small
JSON *pointer* under that name, saying which checkpoint holds it and how to convert it to
DeepSpeed's ``torch.save`` layout. ``latest`` names the newest tag; it is written last, by rank
0, once the tag's checkpoint is committed and its pointers are on disk, and atomically
(temporary name, fsync, rename, folder fsync), so a kill at any moment leaves it naming a
complete checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import BinaryIO, Callable

__all__ = ["POINTER_FORMAT", "LATEST", "write_pointer", "read_pointer", "sync_pointers", "write_latest",
           "write_atomically", "fsync_path"]

POINTER_FORMAT = "dcp_datastates.deepspeed/pointer"
POINTER_VERSION = 1
LATEST = "latest"
# A pointer is ~300 bytes; a larger file is DeepSpeed's own.
_POINTER_MAX = 4096


def _pointer_bytes(name: str) -> bytes:
    doc = {
        "format": POINTER_FORMAT,
        "version": POINTER_VERSION,
        "checkpoint": ".",
        "item": name,
        "note": ("this file is a pointer: the data is in this folder's DataStates checkpoint (safetensors "
                 "files and .metadata). For DeepSpeed's torch.save layout (zero_to_fp32, universal "
                 "checkpoints) run: dcp-datastates convert <this folder> <out folder> --to deepspeed"),
    }
    return (json.dumps(doc, indent=1) + "\n").encode()


def write_pointer(path: str) -> None:
    """Write the pointer file for DeepSpeed file ``path`` (not synced: ``sync_pointers`` does that
    before ``latest`` names the tag)."""
    data = _pointer_bytes(os.path.basename(path))
    try:
        with open(path, "rb") as f:
            if f.read(len(data) + 1) == data:
                # A re-save of the tag: the pointer is there already.
                return
    except OSError:
        pass
    _replace(path, data, sync=False)


def read_pointer(path: str) -> dict | None:
    """The pointer at ``path``, or None when the file is not one of ours (DeepSpeed's own file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_POINTER_MAX + 1)
    except OSError:
        return None
    if len(head) > _POINTER_MAX or not head.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == POINTER_FORMAT else None


def sync_pointers(folder: str, names: list[str]) -> None:
    """Make the pointers of ``names`` in ``folder`` durable: missing ones are written (another
    rank's, on a file system that did not show them yet), each is fsynced, then the folder."""
    for name in names:
        path = os.path.join(folder, name)
        if read_pointer(path) is None:
            _replace(path, _pointer_bytes(name), sync=True)
            continue
        fsync_path(path)
    fsync_path(folder)


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag``, atomically and durably."""
    _replace(os.path.join(save_dir, LATEST), str(tag).encode(), sync=True)
    fsync_path(save_dir)


def _replace(path: str, data: bytes, *, sync: bool) -> None:
    def write(f) -> None:
        f.write(data)

    write_atomically(path, write, sync=sync)


def write_atomically(path: str, write: Callable[[BinaryIO], None], *, sync: bool) -> None:
    """Create ``path`` through ``write(file)`` on a new temporary name beside it, then rename it
    into place (a reader sees the old file or the whole new one; a link planted at ``path`` is
    replaced, never followed). ``sync``: fsync the file before the rename."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def fsync_path(path: str) -> None:
    """fsync a file or a folder (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
