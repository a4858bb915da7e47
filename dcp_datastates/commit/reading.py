"""What a committed checkpoint is, checked the same way by every reader of checkpoints (the
load, ``verify``, ``convert``, the tiers, the commit itself before it writes a marker)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointFormatError, DataStatesError, IncompleteCheckpointError
from ..forking import new_locks_in_child
from ..format.document import MAX_METADATA_BYTES
from ..format.layout import METADATA_NAME, STEP_NUMBER, rank_marker_name
from ..format.locations import FileInfo, own_files, split_reference
from ..format.metadata import decode_metadata
from ..storage import Storage, open_storage

log = logging.getLogger("dcp_datastates")

__all__ = ["read_commit", "check_data_files", "remember_commit", "file_size_error", "check_commit", "is_committed", "latest_checkpoint",
           "checkpoint_id", "data_file", "by_folder", "referenced_by", "step_folders"]

Location = "str | os.PathLike | Storage"


def _looks_like_stock_dcp(raw: bytes) -> bool:
    """DCP's FileSystemWriter pickles its Metadata (protocol 2+ starts with 0x80); never unpickled."""
    return raw[:1] == b"\x80"


def _stock_dcp_error(location: str, marker: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{marker}: {location} is a stock DCP checkpoint (pickled .metadata, .distcp data files), not one written by "
        f"DataStatesWriter; load it with torch.distributed.checkpoint.FileSystemReader, or convert it with "
        f"torch.distributed.checkpoint.format_utils.dcp_to_torch_save (both unpickle it: only for checkpoints "
        f"you trust); nothing of it was unpickled here"
    )


def _committed_subfolders(storage: Storage) -> list[str]:
    """Names of the folders directly under ``storage`` that hold a commit marker, by step number."""
    found = [n for n in storage.subfolders() if storage.child(n).has(METADATA_NAME)]

    def step(name: str) -> tuple:
        m = STEP_NUMBER.search(name)
        return (0, int(m.group(1))) if m else (1, 0)

    return sorted(found, key=step)


def _missing_marker_error(storage: Storage, name: str) -> IncompleteCheckpointError:
    runs = _committed_subfolders(storage) if name == METADATA_NAME else []
    path = storage.location
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


def read_commit(location: Location, *, storage_options: Mapping[str, Any] | None = None,
                rank: int | None = None, name: str | None = None) -> tuple[Metadata, dict[str, FileInfo]]:
    """Read and decode the commit marker of a checkpoint folder (``rank``: that rank's
    rank-local marker; ``name``: another file of the same format, e.g. ``PENDING_NAME``): the
    one place that maps "no folder", "no marker", "a folder of checkpoints", "a stock DCP
    checkpoint" and "marker is not a regular file" to clear errors. Returns DCP's ``Metadata``
    and the per-file table."""
    storage = open_storage(location, storage_options)
    name = name or (METADATA_NAME if rank is None else rank_marker_name(rank))
    raw = _read_marker(storage, name)
    return decode_metadata(raw, storage.where(name))


def _read_marker(storage: Storage, name: str) -> bytes:
    """The bytes of marker ``name`` (read_commit's errors for a missing or foreign one)."""
    try:
        raw = storage.read_small(name, limit=MAX_METADATA_BYTES, what="the commit marker")
    except (FileNotFoundError, NotADirectoryError):
        # Says so when there is no folder at all.
        storage.check_folder()
        raise _missing_marker_error(storage, name) from None
    if _looks_like_stock_dcp(raw):
        raise _stock_dcp_error(storage.location, storage.where(name))
    return raw


# The tiers ask for the checkpoint id of the same few folders at every save (each local copy and
# its durable folder: the drain, drain_pending, eviction, choosing the copy to load), and decoding
# a marker costs time per item, several times per save, which adds up on a large checkpoint.
# A marker's id and file table are kept per content (a hash of its bytes, which are read
# each time): a marker replaced or damaged, even in place with the same size, is decoded again.
_SUMMARIES_KEPT = 64
_summaries: OrderedDict[bytes, tuple[str | None, dict[str, FileInfo]]] = OrderedDict()
_summaries_lock = threading.Lock()
new_locks_in_child(globals(), "_summaries_lock")


def _commit_summary(storage: Storage) -> tuple[str | None, dict[str, FileInfo]]:
    """(checkpoint id, data files) of the folder's commit marker; read_commit's errors."""
    raw = _read_marker(storage, METADATA_NAME)
    key = _content_key(raw)
    with _summaries_lock:
        known = _summaries.get(key)
        if known is not None:
            _summaries.move_to_end(key)
            return known
    md, files = decode_metadata(raw, storage.where(METADATA_NAME))
    summary = (md.storage_meta.save_id if md.storage_meta is not None else None, files)
    _remember(key, summary)
    return summary


def remember_commit(raw: bytes, save_id: str | None, files: dict[str, FileInfo]) -> None:
    """A marker just written (``raw``, encoded from a checkpoint ``save_id`` listing ``files``):
    its first ``checkpoint_id`` needs no decode either."""
    _remember(_content_key(raw), (save_id, files))


def _content_key(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=16).digest()


def _remember(key: bytes, summary: tuple[str | None, dict[str, FileInfo]]) -> None:
    with _summaries_lock:
        _summaries[key] = summary
        _summaries.move_to_end(key)
        while len(_summaries) > _SUMMARIES_KEPT:
            _summaries.popitem(last=False)


def data_file(storage: Storage, name: str, beside: Storage | None = None) -> tuple[Storage, str]:
    """(folder, file name in it) of data file ``name`` as a checkpoint's metadata lists it: a file
    of the checkpoint itself, or (incremental saves) a reference to a file of the checkpoint
    folder beside it that holds those bytes (``format.locations.reference_name``), beside ``beside``
    when given (a node-local copy refers to the durable checkpoints beside its durable path)."""
    ref = split_reference(name)
    return (storage, name) if ref is None else ((beside or storage).sibling(ref[0]), ref[1])


def by_folder(storage: Storage, names, beside: Storage | None = None) -> list[tuple[Storage, dict[str, str]]]:
    """``names`` (as the metadata lists them) grouped by the folder holding them: (folder, {name
    in that folder: name in the metadata}), the checkpoint's own folder first. References
    resolve beside ``beside`` (default: the checkpoint's folder; a node-local copy's are its
    durable checkpoint's)."""
    groups: dict[str, tuple[Storage, dict[str, str]]] = {"": (storage, {})}
    for name in names:
        ref = split_reference(name)
        key = "" if ref is None else ref[0]
        if key not in groups:
            groups[key] = ((beside or storage).sibling(key), {})
        groups[key][1][name if ref is None else ref[1]] = name
    return [g for g in groups.values() if g[1]]


def file_size_error(where: str, name: str, size: int | None, expected: int, *,
                    location: str | None = None) -> IncompleteCheckpointError | None:
    """The error for data file ``name`` of checkpoint ``where`` found with ``size`` bytes (None:
    missing) where the metadata records ``expected``; None when they agree."""
    what = f"data file {name}"
    if split_reference(name) is not None:
        what = f"data file {name} (an earlier checkpoint's file that this incremental checkpoint refers to)"
    if size is None:
        seen = f"{location}; " if location else ""
        return IncompleteCheckpointError(
            f"incomplete checkpoint {where}: {what} is missing ({seen}the metadata lists it)"
        )
    if size != expected:
        return IncompleteCheckpointError(f"incomplete checkpoint {where}: {what} {size_text(size, expected)}")
    return None


def size_text(size: int, expected: int) -> str:
    return f"is {size} bytes, the metadata expects {expected} ({'truncated' if size < expected else 'replaced or appended to'})"


def check_data_files(location: Location, files: dict[str, FileInfo], *,
                     storage_options: Mapping[str, Any] | None = None, references: bool = True,
                     beside: Storage | None = None) -> None:
    """Every data file in ``files`` exists as a regular file inside the folder (not a symlink,
    FIFO or device) with the recorded size; an incremental save's references too (beside
    ``beside`` when given), unless ``references`` is off (a node-local copy holds its own files
    only: its references are durable files)."""
    storage = open_storage(location, storage_options)
    if not references:
        files = own_files(files)
    for folder, names in by_folder(storage, files, beside):
        sizes = folder.sizes(names)
        for own, name in names.items():
            error = file_size_error(storage.location, name, sizes.get(own), files[name].size,
                                    location=None if folder is storage else folder.where(own))
            if error is not None:
                raise error


def check_commit(location: Location, *, storage_options: Mapping[str, Any] | None = None) -> None:
    """Raise unless the folder holds a complete checkpoint: the marker decodes and every data
    file it lists exists with the recorded size. IncompleteCheckpointError when something is
    missing or short, CheckpointFormatError when the marker is damaged. Reads no tensor data."""
    storage = open_storage(location, storage_options)
    _, files = read_commit(storage)
    check_data_files(storage, files)


def is_committed(location: Location, *, check_files: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> bool:
    """True when the folder holds a commit marker; with ``check_files``, only when
    ``check_commit`` also passes (marker decodes, data files present with the right sizes)."""
    storage = open_storage(location, storage_options)
    if not check_files:
        return storage.has(METADATA_NAME)
    try:
        check_commit(storage)
    except (DataStatesError, OSError):
        return False
    return True


def checkpoint_id(location: Location, storage_options: Mapping[str, Any] | None = None, *,
                  references: bool = True) -> str | None:
    """The id (``storage_meta.save_id``) in the commit marker of a folder; None when it holds no
    complete checkpoint (or the store cannot be reached). ``references`` off: an incremental
    save's references are not looked for (``check_data_files``)."""
    storage = open_storage(location, storage_options)
    try:
        save_id, files = _commit_summary(storage)
        check_data_files(storage, files, references=references)
    except (DataStatesError, OSError):
        return None
    except Exception as exc:  # noqa: BLE001 - an unreachable store (botocore, aiohttp ...): no copy known there
        log.debug("dcp_datastates: cannot read the commit of %s: %s", storage.location, exc)
        return None
    return save_id


def referenced_by(location: Location, *, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The committed checkpoints beside ``location`` (same parent folder) whose metadata refers
    to data files of it (incremental saves): deleting ``location`` would break them, so retention
    keeps it while this list is not empty. Reads each sibling's marker (no decode: a marker that
    names ``../<this folder>/`` refers to it; a damaged one that cannot be read counts as
    referring, so nothing is deleted on a guess)."""
    storage = open_storage(location, storage_options)
    own = storage.name
    # The JSON string's opening quote and text.
    needle = json.dumps(f"../{own}/")[:-1].encode()
    parent = storage.parent()
    found = []
    for name in sorted(parent.subfolders()):
        if name == own:
            continue
        folder = parent.child(name)
        try:
            raw = folder.read_small(METADATA_NAME, limit=MAX_METADATA_BYTES, what="the commit marker")
        except (FileNotFoundError, NotADirectoryError):
            # Not a committed checkpoint.
            continue
        except (DataStatesError, OSError) as exc:
            log.warning("dcp_datastates: cannot read %s (%s): keeping %s in case it refers to it",
                        folder.where(METADATA_NAME), exc, storage.location)
            found.append(folder.location)
            continue
        if needle in raw:
            found.append(folder.location)
    return found


def step_folders(root: Storage) -> list[str]:
    """The folders directly under ``root`` with a step number in their name, the highest first."""
    candidates = [(int(m.group(1)), name) for name in root.subfolders() if (m := STEP_NUMBER.search(name))]
    return [name for _, name in sorted(candidates, reverse=True)]


def latest_checkpoint(root: Location, *, check_files: bool = True,
                      storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The newest complete checkpoint folder directly under ``root`` (``step-100``, ``ckpt_7`` ...):
    the highest number in the name among folders holding a valid commit; None if there is none.

    Folders without a number in their name are ignored. Candidates are examined from the highest
    number down, so only the newest ones are read. With ``check_files`` (the default) a folder
    counts only if its marker decodes and its data files are all present with the right sizes;
    otherwise a marker file is enough. (``dcp_datastates.latest_checkpoint`` also takes
    ``local_tier``: ``tiers.latest_checkpoint``.)
    """
    storage = open_storage(root, storage_options)
    for name in step_folders(storage):
        folder = storage.child(name)
        if is_committed(folder, check_files=check_files):
            return folder.location
    return None
