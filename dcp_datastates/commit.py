"""The commit protocol: ``.metadata`` is the commit marker, written last and atomically, and a
checkpoint path always holds one good checkpoint: the old one until the new one is committed.

- A save into a folder that already holds a committed checkpoint leaves that commit alone and
  writes its data files under new names (``__<rank>_<k>.<tag>.safetensors``), so a save that
  fails or is killed midway leaves the old checkpoint loadable, untouched.
- The coordinator commits only after every rank's data is durable: it checks that every data
  file the new metadata lists is present with its size, writes the marker under a temporary
  name, fsyncs it, renames it over ``.metadata`` (atomic), fsyncs the folder and its parent.
  Only then are the files the new commit no longer references removed (data files of this
  library only, never anything else), together with leftovers of failed saves.
- A folder is a complete checkpoint when its marker decodes and every data file it lists is
  present with the recorded size (``check_commit``); ``latest_checkpoint`` returns the newest
  such folder under a root.
- Rank-local saves (DCP's ``use_collectives=False``) commit ``__<rank>.metadata`` per rank.
- Remote folders (fsspec URLs, see ``folders.py``): the same order; the marker is one PUT
  (atomic on object stores), written after every data object is complete.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import uuid

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from . import folders
from .errors import CheckpointFormatError, CheckpointWriteError, DataStatesError, IncompleteCheckpointError
from .metadata import METADATA_NAME, FileInfo, ItemLocation, decode_metadata, encode_metadata

log = logging.getLogger("dcp_datastates")

__all__ = ["prepare_folder", "write_commit", "rank_marker_name", "read_commit", "is_committed", "check_commit", "latest_checkpoint"]

_TMP_PREFIX = f"{METADATA_NAME}.tmp-"


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


def _remove_stale_markers(path: str) -> None:
    """Temporary markers left by a commit that was killed before its rename."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        if name.startswith(_TMP_PREFIX):
            try:
                os.unlink(os.path.join(path, name))
            except OSError:
                pass


def prepare_folder(path: str, *, overwrite: bool, storage_options: dict | None = None) -> bool:
    """Create the checkpoint folder if needed; True when it already holds a committed checkpoint.

    The previous commit is left in place: a new save writes its data files under new names and
    replaces ``.metadata`` atomically when it commits, so the folder holds the old checkpoint
    until then. Raises CheckpointWriteError when the folder cannot be made, or when it holds a
    committed checkpoint and ``overwrite`` is off."""
    if folders.is_remote(path):
        return folders.remote_folder(path, storage_options).prepare(overwrite=overwrite)
    path = folders.local_path(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise CheckpointWriteError(f"cannot create checkpoint folder {path}: {exc.strerror or exc}") from exc
    if not os.path.isdir(path):  # makedirs(exist_ok=True) accepts nothing else, but be explicit
        raise CheckpointWriteError(f"cannot create checkpoint folder {path}: a file is in the way")
    committed = os.path.lexists(os.path.join(path, METADATA_NAME))
    if committed and not overwrite:
        raise CheckpointWriteError(f"{path} already holds a committed checkpoint and overwrite=False")
    return committed


def rank_marker_name(rank: int) -> str:
    """The commit marker of one rank's rank-local save (``use_collectives=False``)."""
    return f"__{rank}{METADATA_NAME}"


# Data files this library writes (and their moved-aside copies); nothing else is ever removed.
_DATA_FILE = re.compile(r"^__\d+_\d+(\.[0-9a-f]{8,32})?\.safetensors(\.old-[0-9a-f]{32})?$")
_RANK_MARKER = re.compile(r"^__\d+\.metadata$")


def write_commit(
    path: str,
    md: Metadata,
    locations: dict[MetadataIndex, ItemLocation],
    *,
    sync: bool,
    storage_options: dict | None = None,
    rank_local: int | None = None,
    in_use: frozenset = frozenset(),
) -> None:
    """Commit a checkpoint whose data files are all written: check that every data file the
    metadata lists is there with its size, write the marker atomically (``.metadata``, or
    ``__<rank>.metadata`` for a rank-local save), then remove what the new commit made obsolete
    (data files of this library that it does not reference, except ``in_use`` ones of saves
    still running in this process; for a global commit, older rank-local markers).

    Raises CheckpointWriteError naming the folder and the cause; on failure the previous commit
    (if any) is untouched and no temporary file is left behind."""
    from .integrity import check_data_files  # noqa: PLC0415 - integrity imports this module

    data = encode_metadata(md, locations)
    _, files = decode_metadata(data, f"{path}/{METADATA_NAME} (being committed)")
    try:
        check_data_files(path, files, storage_options=storage_options)
    except (DataStatesError, OSError) as exc:
        raise CheckpointWriteError(f"committing checkpoint {path} refused: {exc}") from exc
    marker = METADATA_NAME if rank_local is None else rank_marker_name(rank_local)
    if folders.is_remote(path):
        folder = folders.remote_folder(path, storage_options)
        folder.write_marker(data, marker)
        _remove_obsolete(folder.names(), set(files) | set(in_use), rank_local, folder.remove)
        return
    path = folders.local_path(path)
    tmp = os.path.join(path, f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
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
        os.replace(tmp, os.path.join(path, marker))
        if sync:
            _fsync_dir(path)
            _fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CheckpointWriteError(
            f"committing checkpoint {path} failed: {exc.strerror or exc}"
            + (f": {exc.filename}" if exc.filename else "")
        ) from exc
    try:
        names = os.listdir(path)
    except OSError:
        return
    if rank_local is None:  # rank-local commits run at once on every rank: their temporaries are live
        _remove_stale_markers(path)
    _remove_obsolete(names, set(files) | set(in_use), rank_local, lambda n: os.unlink(os.path.join(path, n)))


def _remove_obsolete(names, keep: set, rank_local: int | None, remove) -> None:
    """Best effort: the commit is already durable; a file that cannot be removed now is removed
    by the next commit into this folder."""
    own = None if rank_local is None else f"__{rank_local}_"
    for name in names:
        if name in keep:
            continue
        obsolete = bool(_DATA_FILE.match(name)) and (own is None or name.startswith(own))
        obsolete = obsolete or (rank_local is None and bool(_RANK_MARKER.match(name)))
        if not obsolete:
            continue
        try:
            remove(name)
        except Exception as exc:  # noqa: BLE001 - never fail a committed save over cleanup
            log.debug("dcp_datastates: could not remove obsolete %s: %s", name, exc)


# A marker this large is not one (a million chunks encode to ~200 MB): refuse before reading it.
MAX_METADATA_BYTES = 1 << 30
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


def open_for_reading(full: str) -> int:
    """A descriptor of the regular file ``full``, opened without following a symlink or
    blocking on a FIFO. Raises CheckpointFormatError for anything that is not a regular file."""
    try:
        fd = os.open(full, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise not_regular_error(os.path.dirname(full), os.path.basename(full), full, os.lstat(full).st_mode) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_regular_error(os.path.dirname(full), os.path.basename(full), full, st.st_mode)
    os.set_blocking(fd, True)
    return fd


def _read_marker(path: str, marker: str) -> bytes:
    """The marker's bytes: a regular file inside the folder (no symlink, FIFO or device), read
    with its size checked first."""
    try:
        fd = os.open(marker, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise not_regular_error(path, METADATA_NAME, marker, os.lstat(marker).st_mode) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode):
                raise CheckpointFormatError(f"{marker}: the commit marker is a folder, not a metadata file")
            raise not_regular_error(path, f"the commit marker {METADATA_NAME}", marker, st.st_mode)
        if st.st_size > MAX_METADATA_BYTES:
            raise CheckpointFormatError(
                f"{marker}: {st.st_size} bytes, more than the {MAX_METADATA_BYTES}-byte limit of a metadata file "
                f"(not a dcp_datastates checkpoint, or damaged)"
            )
        chunks, left = [], st.st_size + 1  # one byte more: notices a file that grew meanwhile
        while left > 0:
            chunk = os.read(fd, min(left, 64 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        raw = b"".join(chunks)
        if len(raw) > st.st_size:
            raise CheckpointFormatError(f"{marker}: the commit marker changed while it was read (a save is running?)")
        return raw
    finally:
        os.close(fd)


def _looks_like_stock_dcp(raw: bytes) -> bool:
    """DCP's FileSystemWriter pickles its Metadata (protocol 2+ starts with 0x80); never unpickled."""
    return raw[:1] == b"\x80"


def _stock_dcp_error(path: str, marker: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{marker}: {path} is a stock DCP checkpoint (pickled .metadata, .distcp data files), not one written by "
        f"DataStatesWriter; load it with torch.distributed.checkpoint.FileSystemReader, or convert it with "
        f"torch.distributed.checkpoint.format_utils.dcp_to_torch_save (both unpickle it: only for checkpoints "
        f"you trust); nothing of it was unpickled here"
    )


def _committed_subfolders(path: str) -> list[str]:
    """Names of the folders directly under ``path`` that hold a commit marker, by step number."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    found = [
        n for n in names
        if os.path.isdir(os.path.join(path, n)) and os.path.isfile(os.path.join(path, n, METADATA_NAME))
    ]

    def step(name: str) -> tuple:
        m = _STEP.search(name)
        return (0, int(m.group(1))) if m else (1, 0)

    return sorted(found, key=step)


def _missing_marker_error(path: str, name: str = METADATA_NAME) -> IncompleteCheckpointError:
    runs = _committed_subfolders(path)
    if runs:
        shown = ", ".join(runs[-5:]) + (f" (and {len(runs) - 5} older)" if len(runs) > 5 else "")
        return IncompleteCheckpointError(
            f"incomplete checkpoint {path}: this is a folder of checkpoints, not a checkpoint: it holds the "
            f"committed checkpoint folder(s) {shown}; load one of them, e.g. the newest with "
            f"dcp_datastates.latest_checkpoint({path!r})"
        )
    return IncompleteCheckpointError(
        f"incomplete checkpoint {path}: there is no {name} commit marker "
        f"(the save did not finish or is still running)"
    )


def read_commit(path: str | os.PathLike, *, storage_options: dict | None = None,
                rank: int | None = None) -> tuple[Metadata, dict[str, FileInfo]]:
    """Read and decode the commit marker of ``path`` (a folder or a URL; ``rank``: that rank's
    rank-local marker): the one place that maps "no folder", "no marker", "a folder of
    checkpoints", "a stock DCP checkpoint" and "marker is not a regular file" to clear errors.
    Returns DCP's ``Metadata`` and the per-file table."""
    name = METADATA_NAME if rank is None else rank_marker_name(rank)
    if folders.is_remote(path):
        folder = folders.remote_folder(os.fspath(path), storage_options)
        raw = folder.read_marker(name)  # maps "nothing stored" and "no marker" itself
        where = folder.url_of(name)
        if _looks_like_stock_dcp(raw):
            raise _stock_dcp_error(folder.url, where)
        return decode_metadata(raw, where)
    path = folders.local_path(path)
    marker = os.path.join(path, name)
    try:
        raw = _read_marker(path, marker)
    except (FileNotFoundError, NotADirectoryError):
        if not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path}: the folder does not exist") from None
        if not os.path.isdir(path):
            raise NotADirectoryError(f"no checkpoint at {path}: it is a file, not a checkpoint folder") from None
        raise _missing_marker_error(path, name) from None
    except IsADirectoryError:
        raise CheckpointFormatError(f"{marker}: the commit marker is a folder, not a metadata file") from None
    if _looks_like_stock_dcp(raw):
        raise _stock_dcp_error(path, marker)
    return decode_metadata(raw, marker)


def check_commit(path: str | os.PathLike, *, storage_options: dict | None = None) -> None:
    """Raise unless ``path`` holds a complete checkpoint: the marker decodes and every data file
    it lists exists with the recorded size. IncompleteCheckpointError when something is missing
    or short, CheckpointFormatError when the marker is damaged. Reads no tensor data."""
    from .integrity import check_data_files  # noqa: PLC0415 - integrity imports this module

    _, files = read_commit(path, storage_options=storage_options)
    check_data_files(path, files, storage_options=storage_options)


def is_committed(path: str | os.PathLike, *, check_files: bool = False, storage_options: dict | None = None) -> bool:
    """True when ``path`` holds a commit marker; with ``check_files``, only when ``check_commit``
    also passes (marker decodes, data files present with the right sizes)."""
    if folders.is_remote(path) and not check_files:
        folder = folders.remote_folder(os.fspath(path), storage_options)
        return folder.size(METADATA_NAME) is not None
    path = os.fspath(path) if folders.is_remote(path) else folders.local_path(path)
    if not check_files:
        return os.path.isfile(os.path.join(path, METADATA_NAME))
    try:
        check_commit(path, storage_options=storage_options)
    except (DataStatesError, OSError):
        return False
    return True


_STEP = re.compile(r"(\d+)(?!.*\d)")


def latest_checkpoint(
    root: str | os.PathLike, *, check_files: bool = True, storage_options: dict | None = None,
    local_tier: str | os.PathLike | None = None,
) -> str | None:
    """The newest complete checkpoint folder directly under ``root`` (``step-100``, ``ckpt_7`` ...):
    the highest number in the name among folders holding a valid commit; None if there is none.

    Folders without a number in their name are ignored. Candidates are examined from the highest
    number down, so only the newest ones are read. With ``check_files`` (the default) a folder
    counts only if its marker decodes and its data files are all present with the right sizes;
    otherwise a marker file is enough. With ``local_tier``, a folder whose complete copy is in the
    local tier counts too (committed there, not drained yet: load it with that ``local_tier``).
    """
    if local_tier is not None:  # local_tier hook (tiers.py)
        from . import tiers

        durable = latest_checkpoint(root, check_files=check_files, storage_options=storage_options)
        step = (lambda name: int(m.group(1)) if (m := _STEP.search(name)) else None)
        local = tiers.newest_local(folders.normalize(root), os.path.abspath(os.fspath(local_tier)), step)
        if local is None or (durable is not None and step(os.path.basename(durable.rstrip("/"))) >= local[0]):
            return durable
        return local[1]
    if folders.is_remote(root):
        folder = folders.remote_folder(os.fspath(root), storage_options)
        return _latest_remote(folder, check_files=check_files, storage_options=storage_options)
    root = folders.local_path(root)
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return None
    candidates: list[tuple[int, str]] = []
    for name in names:
        m = _STEP.search(name)
        if m:
            candidates.append((int(m.group(1)), name))
    for _, name in sorted(candidates, reverse=True):
        full = os.path.join(root, name)
        if os.path.isdir(full) and is_committed(full, check_files=check_files):
            return full
    return None


def _latest_remote(folder: "folders.RemoteFolder", *, check_files: bool, storage_options: dict | None) -> str | None:
    candidates = [(int(m.group(1)), name) for name in folder.subfolders() if (m := _STEP.search(name))]
    for _, name in sorted(candidates, reverse=True):
        url = folder.url_of(name)
        if is_committed(url, check_files=check_files, storage_options=storage_options):
            return url
    return None
