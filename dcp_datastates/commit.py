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
import uuid

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from . import folders
from .checkpoint_format import METADATA_NAME, STEP_NUMBER, ItemLocation, decode_metadata, encode_metadata, rank_marker_name
from .errors import CheckpointWriteError, DataStatesError
from .integrity import check_data_files, read_commit

log = logging.getLogger("dcp_datastates")

__all__ = ["prepare_folder", "write_commit", "is_committed", "check_commit", "latest_checkpoint"]

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
    try:
        put_file(path, marker, data, sync=sync)
    except OSError as exc:
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


def put_file(folder: str, name: str, data: bytes, *, sync: bool, storage_options: dict | None = None) -> None:
    """Write the small file ``name`` of ``folder`` (local or fsspec) atomically: under a temporary
    name, fsynced with ``sync``, renamed over ``name`` (one PUT on object stores). Raises OSError
    (local) or the store's error; no temporary file is left behind."""
    if folders.is_remote(folder):
        folders.remote_folder(folder, storage_options).write_marker(data, name)
        return
    tmp = os.path.join(folder, f"{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")  # .metadata: _TMP_PREFIX
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
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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


def check_commit(path: str | os.PathLike, *, storage_options: dict | None = None) -> None:
    """Raise unless ``path`` holds a complete checkpoint: the marker decodes and every data file
    it lists exists with the recorded size. IncompleteCheckpointError when something is missing
    or short, CheckpointFormatError when the marker is damaged. Reads no tensor data."""
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


def latest_checkpoint(root: str | os.PathLike, *, check_files: bool = True, storage_options: dict | None = None) -> str | None:
    """The newest complete checkpoint folder directly under ``root`` (``step-100``, ``ckpt_7`` ...):
    the highest number in the name among folders holding a valid commit; None if there is none.

    Folders without a number in their name are ignored. Candidates are examined from the highest
    number down, so only the newest ones are read. With ``check_files`` (the default) a folder
    counts only if its marker decodes and its data files are all present with the right sizes;
    otherwise a marker file is enough. (``dcp_datastates.latest_checkpoint`` also takes
    ``local_tier``: ``tiers.latest_checkpoint``.)
    """
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
        m = STEP_NUMBER.search(name)
        if m:
            candidates.append((int(m.group(1)), name))
    for _, name in sorted(candidates, reverse=True):
        full = os.path.join(root, name)
        if os.path.isdir(full) and is_committed(full, check_files=check_files):
            return full
    return None


def _latest_remote(folder: "folders.RemoteFolder", *, check_files: bool, storage_options: dict | None) -> str | None:
    candidates = [(int(m.group(1)), name) for name in folder.subfolders() if (m := STEP_NUMBER.search(name))]
    for _, name in sorted(candidates, reverse=True):
        url = folder.url_of(name)
        if is_committed(url, check_files=check_files, storage_options=storage_options):
            return url
    return None
