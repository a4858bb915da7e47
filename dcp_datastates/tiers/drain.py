"""The drain: copy a committed local-tier checkpoint to its durable path and commit it there.

Every byte is copied, each checksum piece the local marker records verified while it is in
memory (``file_copy.py``), so the durable tier never receives (or commits) a local file damaged
after its commit. A file copied earlier, while the engine wrote it (``file_copy.follow``), is
taken only if every piece's CRC32C equals the one the save recorded, else it is copied again.
Only after every file is written is the durable marker written. See ``local_tier.py`` for the
design.
"""

from __future__ import annotations

import logging
import os
import threading

from ..commit import check_data_files, checkpoint_id, prepare_folder, read_commit, write_commit
from ..config import DataStatesConfig
from ..errors import CheckpointWriteError
from ..forking import new_locks_in_child
from ..format.layout import new_tag
from ..format.locations import moved, own_files
from ..storage import Storage, open_storage, root_of
from . import file_copy
from . import local_tier as tiers
from . import pending as pending_ckpt
from .file_copy import durable_name

log = logging.getLogger("dcp_datastates")

__all__ = ["drain", "drain_pending", "drain_rank", "drain_pending_ranks", "durable_name", "prepare_durable", "UNPREPARED"]

# One drain per durable path at a time in this process (a save's own drain and another save's
# drain_pending may both find the same local copy).
_drain_locks: dict[str, threading.Lock] = {}
_drain_locks_lock = threading.Lock()
new_locks_in_child(globals(), "_drain_locks_lock")


UNPREPARED = object()  # drain(tag=...): the durable folder is not prepared yet


def drain(local: str, durable: str, config: DataStatesConfig, tag=UNPREPARED, followed: dict | None = None,
          committed: tuple | None = None) -> None:
    """Copy the committed checkpoint ``local`` to ``durable`` and commit it there with the same
    checkpoint id (nothing to do when it already holds it). Raises CheckpointWriteError naming
    ``durable``; its previous commit stays. ``tag``: the durable file names' tag when the folder
    was prepared already (``prepare_durable``), with the files ``followed`` there under it.
    ``committed``: (Metadata, locations, data files) of the local commit this process has just
    written, in place of decoding its marker again."""
    with _drain_locks_lock:
        lock = _drain_locks.setdefault(durable, threading.Lock())
    with lock:
        local_id = checkpoint_id(local, references=False)
        if local_id is not None and checkpoint_id(durable, config.storage_options) == local_id:
            return
        _drain_unlocked(local, durable, config, tag, followed, committed)


def prepare_durable(durable: str, config: DataStatesConfig) -> str | None:
    """Make the durable folder; the tag of the durable file names (None when it holds no commit:
    a folder holding one keeps it until the new one is committed, so new names)."""
    store = open_storage(durable, config.storage_options)
    return new_tag() if prepare_folder(store, overwrite=True) else None


def _drain_unlocked(local: str, durable: str, config: DataStatesConfig, tag, followed: dict | None,
                    committed: tuple | None = None) -> None:
    try:
        _copy_and_commit(local, durable, config, tag, followed, committed)
    except CheckpointWriteError as exc:
        if str(exc).startswith(f"draining {local}"):
            raise
        raise CheckpointWriteError(f"draining {local} to the durable tier {durable} failed: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the store's own errors too (botocore, aiohttp ...)
        raise _drain_failed(local, durable, exc, "the local copy stays committed (drain_pending retries)") from exc


def _copy_and_commit(local: str, durable: str, config: DataStatesConfig, tag, followed: dict | None,
                     committed: tuple | None) -> None:
    """The drain's work; when it fails, the copies it made go (their names are new ones, never
    a committed checkpoint's), so the durable folder holds its previous commit alone."""
    if committed is None:
        md, files = read_commit(local)
        local_locations = md.storage_data
    else:
        md, local_locations, files = committed
    check_data_files(local, files, references=False)
    store = open_storage(durable, config.storage_options)
    if tag is UNPREPARED:
        tag = prepare_durable(durable, config)
    # An incremental save's references name durable files already (beside ``durable``): the
    # commit there checks them; only the copy's own files are copied.
    own = {name: info.size for name, info in own_files(files).items()}
    renamed = {name: durable_name(name, tag) for name in files}
    pieces = {name: p for name, p in file_copy.pieces_by_file(local_locations).items() if name in own}
    try:
        file_copy._copy_all(open_storage(local), store, own, pieces, renamed, config, followed)
        locations = {index: moved(loc, renamed[loc.file]) for index, loc in local_locations.items()}
        write_commit(store, md, locations, sync=config.sync_files)
    except BaseException:
        for name in own:
            store.remove_quietly(renamed[name])
        raise


def drain_rank(local: str, durable: str, locations: dict, renamed: dict[str, str], save_id: str, rank: int,
               config: DataStatesConfig, followed: dict | None = None, heartbeat: Heartbeat | None = None) -> None:
    """Several ranks, on a drain thread: copy the data files this rank wrote into its local copy
    ``local`` (their items are ``locations``, {MetadataIndex: ItemLocation}) to ``durable`` under
    the names ``renamed`` ({local name: durable name}, chosen by the coordinator), verifying
    every piece, then report the outcome in the durable folder (``pending_ckpt.report_drained``): the
    coordinator commits once every rank reported success, and fails the save on every rank at
    the first error. Then drains this rank's share of checkpoints an earlier run left pending."""
    error = None
    try:
        store = open_storage(durable, config.storage_options)
        try:
            _copy_files(local, store, locations, renamed, config, followed)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which raises it on every rank
            error = str(_drain_failed(local, durable, exc, "the durable tier keeps its previous commit"))
            for name in renamed.values():
                # Its copies go (new names: never a committed checkpoint's).
                store.remove_quietly(name)
    finally:
        # No beat after this: the report below is the last word, whatever happened above.
        if heartbeat is not None:
            heartbeat.stop()
    try:
        pending_ckpt.report_drained(store, rank, save_id, error)
    except Exception as exc:  # noqa: BLE001 - the coordinator then times out naming this rank
        log.warning("dcp_datastates: rank %d could not report its drain to %s: %s", rank, durable, exc)
    if error is None:
        drain_pending_ranks(config.local_tier, rank, config, skip=local, root=root_of(durable))
        tiers.evict_drained(config.local_tier, config.keep_local, config.storage_options)


class Heartbeat:
    """From the moment a rank's drain is queued until it reports, its drain report says it is
    draining, renewed every ``every`` seconds: the coordinator tells a live rank (slow, or its
    drain queued behind another) from a stopped one by it (``pending_ckpt.wait_drained``,
    ``stall_timeout``)."""

    def __init__(self, store: Storage, rank: int, save_id: str, every: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(store, rank, save_id, every),
                                        name="dcp-datastates-drain-beat", daemon=True)
        self._thread.start()

    def _beat(self, store: Storage, rank: int, save_id: str, every: float) -> None:
        count = 0
        while not self._stop.is_set():
            try:
                pending_ckpt.report_draining(store, rank, save_id, count)
            except Exception as exc:  # noqa: BLE001 - the store hiccups: the next beat may get through
                log.debug("dcp_datastates: rank %d: drain progress not reported: %s", rank, exc)
            count += 1
            self._stop.wait(every)

    def stop(self) -> None:
        """No more beats once this returns (the final report comes after the last one)."""
        self._stop.set()
        self._thread.join()


def _copy_files(local: str, durable: Storage, locations: dict, renamed: dict[str, str], config: DataStatesConfig,
                followed: dict | None = None) -> None:
    """One rank's data files of ``locations`` in the local copy ``local``, copied to ``durable``."""
    store = open_storage(local)
    pieces = file_copy.pieces_by_file(locations)
    file_copy._copy_all(store, durable, {name: os.stat(store.where(name)).st_size for name in pieces}, pieces, renamed, config,
              followed)


def drain_pending_ranks(local_tier: str, rank: int, config: DataStatesConfig, skip: str | None = None,
                        root: str | None = None) -> None:
    """Several ranks: for each checkpoint of this node's local tier that is committed on the local
    tiers and not durably (its save was killed or failed during the drain), drain this rank's files
    and report; the rank that sees every report complete commits it. Failures are logged: the
    checkpoint stays restorable from the local copies and the next save tries again."""
    for local in tiers.copies_with_records(local_tier):
        record = tiers.rank_record(local, rank)
        if local == skip or record is None:
            continue
        durable = record.get("durable")
        if not isinstance(durable, str) or not _under(durable, root):
            # Another store's copy: its own options drain it.
            continue
        store = open_storage(durable, config.storage_options)
        pending = pending_ckpt.read_pending(store)
        if pending is None or pending[0].storage_meta.save_id != record["save_id"]:
            continue
        md, _ = pending
        save_id = record["save_id"]
        try:
            if not pending_ckpt.drained_ok(store, rank, save_id):
                # Never rewrite a drained file.
                renamed = {n: d for d, n in record["files"].items()}
                mine = {i: loc for i, loc in md.storage_data.items() if loc.file in record["files"]}
                local_names = {i: moved(loc, record["files"][loc.file]) for i, loc in mine.items()}
                _copy_files(local, store, local_names, renamed, config)
                pending_ckpt.report_drained(store, rank, save_id, None)
            ranks = pending_ckpt.file_ranks(md.storage_data)
            if pending_ckpt.all_drained(store, save_id, ranks):
                write_commit(store, md, dict(md.storage_data), sync=config.sync_files)
                pending_ckpt.clear_pending(store, ranks)
                log.info("dcp_datastates: committed %s on the durable tier (its drain was interrupted)", durable)
        except Exception as exc:  # noqa: BLE001 - retried by the next save
            log.warning("dcp_datastates: rank %d: the pending checkpoint %s is still not durable: %s", rank, durable, exc)


def _drain_failed(local: str, durable: str, exc: Exception, outcome: str) -> CheckpointWriteError:
    detail = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.strerror else str(exc)
    return CheckpointWriteError(
        f"draining {local} to the durable tier {durable} failed: {type(exc).__name__}: {detail}; {outcome}"
    )


def drain_pending(local_tier: str, config: DataStatesConfig | None = None, *, root: str | None = None) -> list[str]:
    """Drain every committed local copy under ``local_tier`` whose durable tier does not hold
    the same checkpoint (a process killed before its drain); with ``root``, only those whose
    durable folder is directly under it (``config.storage_options`` are that store's: a copy bound
    for another store is left to a call with its own). Returns the durable paths drained; raises
    the first failure after trying them all."""
    config = config or DataStatesConfig()
    drained, errors = [], []
    try:
        names = sorted(os.listdir(local_tier))
    except FileNotFoundError:
        return []
    for name in names:
        local = os.path.join(local_tier, name)
        durable = tiers.durable_of(local)
        if durable is None or not _under(durable, root):
            continue
        local_id = checkpoint_id(local, references=False)
        if local_id is None or checkpoint_id(durable, config.storage_options) == local_id:
            continue
        try:
            drain(local, durable, config)
            drained.append(durable)
            log.info("dcp_datastates: drained the pending local copy %s to %s", local, durable)
        except CheckpointWriteError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return drained


def _under(durable: str, root: str | None) -> bool:
    return root is None or root_of(durable) == root.rstrip("/")


def drain_pending_quietly(local_tier: str, config: DataStatesConfig, root: str | None = None) -> list[str]:
    """``drain_pending`` after a save's own drain: what an earlier run left undrained goes to its
    durable tier now; a failure is logged, it does not fail this save (retried next time).
    Returns the durable paths drained (none when one failed)."""
    try:
        return drain_pending(local_tier, config, root=root)
    except CheckpointWriteError as exc:
        log.warning("dcp_datastates: a local copy is still not drained (retried at the next save): %s", exc)
        return []
