"""Committing a checkpoint.

- A save into a folder that already holds a committed checkpoint leaves that commit alone and
  writes its data files under new names (``__<rank>_<k>.<tag>.safetensors``), so a save that
  fails or is killed midway leaves the old checkpoint loadable, untouched.
- The coordinator commits only after every rank's data is durable: it checks that every data
  file the new metadata lists is present with its size, then writes the marker atomically
  (``Storage.put``: temporary name, fsync, rename, folder fsync; one PUT on object stores).
  Only then are the files the new commit no longer references removed (data files of this
  library only, never anything else), together with leftovers of failed saves.
- Rank-local saves (DCP's ``use_collectives=False``) commit ``__<rank>.metadata`` per rank.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..errors import CheckpointWriteError, DataStatesError
from ..format.layout import METADATA_NAME, rank_marker_name
from ..format.locations import FileInfo, ItemLocation
from ..format.metadata import encode_commit
from ..storage import Storage, open_storage
from .reading import check_data_files, referenced_by, remember_commit

log = logging.getLogger("dcp_datastates")

__all__ = ["prepare_folder", "write_commit"]

_TMP_PREFIX = f"{METADATA_NAME}.tmp-"

# Data files this library writes (and their moved-aside copies); nothing else is ever removed.
_DATA_FILE = re.compile(r"^__\d+_\d+(\.[0-9a-f]{8,32})?\.safetensors(\.old-[0-9a-f]{32})?$")
_RANK_MARKER = re.compile(r"^__\d+\.metadata$")


def prepare_folder(location: "str | Storage", *, overwrite: bool, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Create the checkpoint folder if needed; True when it already holds a committed checkpoint.

    The previous commit is left in place: a new save writes its data files under new names and
    replaces ``.metadata`` atomically when it commits, so the folder holds the old checkpoint
    until then. Raises CheckpointWriteError when the folder cannot be made, or when it holds a
    committed checkpoint and ``overwrite`` is off."""
    return open_storage(location, storage_options).prepare(overwrite=overwrite, marker=METADATA_NAME)


def write_commit(
    location: "str | Storage",
    md: Metadata,
    locations: dict[MetadataIndex, ItemLocation],
    *,
    sync: bool,
    storage_options: Mapping[str, Any] | None = None,
    rank_local: int | None = None,
    in_use: frozenset = frozenset(),
    marker: str | None = None,
    references_beside: Storage | None = None,
) -> dict[str, FileInfo]:
    """Commit a checkpoint whose data files are all written: check that every data file the
    metadata lists is there with its size, write the marker atomically (``.metadata``,
    ``__<rank>.metadata`` for a rank-local save, or ``marker``), then remove what the new commit
    made obsolete (data files of this library that it does not reference, except ``in_use`` ones
    of saves still running in this process; for a global commit, older rank-local markers). An
    incremental save's references are checked beside ``references_beside`` (default: this
    folder; a node-local copy's: its durable checkpoint's).

    Returns the data files the commit lists. Raises CheckpointWriteError naming the folder and
    the cause; on failure the previous commit (if any) is untouched and no temporary file is left
    behind."""
    storage = open_storage(location, storage_options)
    path = storage.location
    try:
        data, files = encode_commit(md, locations, f"{path}/{METADATA_NAME} (being committed)")
        check_data_files(storage, files, beside=references_beside)
    except (DataStatesError, OSError) as exc:
        raise CheckpointWriteError(f"committing checkpoint {path} refused: {exc}") from exc
    marker = marker or (METADATA_NAME if rank_local is None else rank_marker_name(rank_local))
    try:
        storage.put(marker, data, sync=sync)
    except CheckpointWriteError as exc:
        raise CheckpointWriteError(f"committing checkpoint {path} failed: {exc}") from exc
    except OSError as exc:
        raise CheckpointWriteError(
            f"committing checkpoint {path} failed: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
        ) from exc
    remember_commit(data, md.storage_meta.save_id if md.storage_meta is not None else None, files)
    # Rank-local commits run at once on every rank: their temporaries are live.
    if rank_local is None:
        storage.remove_stale_temporaries(_TMP_PREFIX)
    try:
        names = storage.names()
    except Exception:  # noqa: BLE001 - the commit is durable; cleanup waits for the next one
        return files
    _remove_obsolete(names, set(files) | set(in_use), rank_local, storage.discard, lambda: referenced_by(storage))
    return files


def _remove_obsolete(names, keep: set, rank_local: int | None, remove, referring) -> None:
    """Best effort: the commit is already durable; a file that cannot be removed now is removed
    by the next commit into this folder. Data files stay while ``referring()`` names checkpoints
    that refer to this folder (incremental saves beside it may need the old files), asked only
    when there is one to remove."""
    own = None if rank_local is None else f"__{rank_local}_"
    users = None
    for name in names:
        if name in keep:
            continue
        data = bool(_DATA_FILE.match(name)) and (own is None or name.startswith(own))
        obsolete = data or (rank_local is None and bool(_RANK_MARKER.match(name)))
        if not obsolete:
            continue
        if data:
            if users is None:
                try:
                    users = referring()
                except Exception as exc:  # noqa: BLE001 - unknown: keep the files
                    users = [f"(unknown: {exc})"]
                if users:
                    log.info("dcp_datastates: kept the replaced data files of this folder: %s refer to it",
                             ", ".join(users))
            if users:
                continue
        try:
            remove(name)
        except Exception as exc:  # noqa: BLE001 - never fail a committed save over cleanup
            log.debug("dcp_datastates: could not remove obsolete %s: %s", name, exc)
