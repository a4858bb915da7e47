"""A conversion's output: its folder or file checked and created, and new files written into it.

``dcp_datastates.convert`` writes through these: an output that exists is refused unless
``force`` (and must be a folder, or a file, as the conversion writes); each new file is created
under a temporary name and renamed into place, never opened through a link planted in the output
folder.
"""

from __future__ import annotations

import os
import tempfile


def _prepare_output(out: str, force: bool, is_dir: bool, create: bool = True) -> None:
    if os.path.exists(out):
        if is_dir:
            if not os.path.isdir(out):
                raise ValueError(f"output {out} exists and is not a folder")
            if os.listdir(out) and not force:
                raise ValueError(f"output folder {out} is not empty (pass --force to write into it)")
        else:
            if os.path.isdir(out):
                raise ValueError(f"output {out} is a folder; --to torch writes one file")
            if not force:
                raise ValueError(f"output file {out} exists (pass --force to overwrite it)")
    if not create:
        return
    if is_dir:
        os.makedirs(out, exist_ok=True)
    else:
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)


def _write_new_file(folder: str, name: str, data: bytes) -> None:
    """Write ``folder/name`` under a new, unpredictable temporary name and rename it into place
    (replaces a link planted there, never follows it)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, os.path.join(folder, name))
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _create_new(path: str, mode: str = "wb"):
    """Open a file that must not exist yet, never through a symlink (O_EXCL | O_NOFOLLOW)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, 0o666), mode)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
