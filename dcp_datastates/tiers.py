"""Multi-level checkpoints: a node-local tier in front of the durable checkpoint path.

Where. With ``local_tier=DIR`` a save into ``path`` writes and commits its files in
``DIR/<basename of path>-<sha1(path)[:12]>/`` (``local_copy``), one folder per durable path, so
two paths never share a local copy. A ``.tier.json`` there names the durable path it drains to.

Commit. The local copy is committed with the usual protocol (``commit.write_commit``): its
``.metadata`` is the local commit marker; ``writer.local_commit`` (a Future) resolves then. The
durable copy is committed by the same protocol with the same metadata (data files renamed when
the durable folder already holds a commit), so both markers carry the same checkpoint id
(``storage_meta.save_id``) and checksums: a local copy whose id differs is never read.

Drain (``drain.py``). Each data file the local marker lists is copied in order to the durable
folder; every checksum piece's CRC32C is checked while it is in memory, so a local file damaged
after its commit fails the drain and the durable tier keeps its previous commit. Only after every
file is written is the durable marker written.

Futures. DCP resolves ``upload_completion`` (``dcp.async_save``) when the writer's ``finish``
returns: ``finish`` commits locally, resolves ``local_commit``, then drains in DCP's thread (not
the training thread; the host cache is free once the local files are durable). So
``upload_completion`` means durable, and a failing drain raises from it naming the durable path
while the local copy stays committed and loadable; ``drain_pending(local_tier)`` redoes it. With
``dcp.save`` the caller's thread runs ``finish``: it returns once the durable tier is committed.

Restart. ``choose_copy`` (the reader's ``local_tier=``) reads the local copy when it is complete,
every piece matches its checksum, and its id equals the durable marker's (or the durable tier has
no commit yet: killed before the drain); otherwise the durable copy. It logs which tier it read.

``latest_checkpoint(root, local_tier=DIR)`` also counts local copies of folders under ``root``
that were committed locally but not drained (``newest_local``); it returns the durable path.

Retention. After each drain, ``evict_drained`` keeps the ``keep_local`` newest local copies
(by commit time) and removes older ones only when their durable tier holds the same id.

The durable path may be local or any fsspec URL (the marker is one PUT there, as usual).

Several ranks. Each node has its own local tier, so no rank can drain another's files, and
only the coordinator sees the global metadata. So each rank drains its own files, inside
``write_data`` (DCP's save thread, never the training thread): its files are durable on the local
tier (``local_commit`` resolves on that rank), then copied and verified to the durable folder
under the names the coordinator chose in ``prepare_global_plan`` (``RankDrain``), and recorded in
``.tier-<rank>.json`` of the local copy (``record_rank_files``: checkpoint id, durable name ->
local name). DCP gathers every rank's results only once every drain returned, so the
coordinator's ``finish`` commits the durable folder directly; a drain failing on any rank fails
the save on every rank through DCP's own gather (nothing is committed, the durable tier keeps
its previous checkpoint). The reader then takes each data file from the local copy when that
node holds it for the same checkpoint id and its pieces verify, else from the durable folder
(``local_files``), and logs the count per tier on each rank.
Not yet for several ranks: a restart after a kill between a rank's local flush and the durable
commit reads the durable tier's previous checkpoint (the global metadata of the interrupted one
exists only in the coordinator's memory), and ``drain_pending`` handles one-process copies only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil

from . import commit, integrity
from .errors import CheckpointWriteError, DataStatesError

log = logging.getLogger("dcp_datastates")

__all__ = ["local_copy", "durable_of", "checkpoint_id", "choose_copy", "evict_drained", "newest_local", "local_files",
           "record_rank_files", "TIER_FILE"]

TIER_FILE = ".tier.json"
_RANK_FILES = re.compile(r"^\.tier-(\d+)\.json$")


def local_copy(local_tier: str, durable: str) -> str:
    """The local-tier folder of the checkpoint whose durable path is ``durable``."""
    base = os.path.basename(durable.rstrip("/")) or "checkpoint"
    key = hashlib.sha1(durable.encode()).hexdigest()[:12]
    return os.path.join(local_tier, f"{base}-{key}")


def record_durable(local: str, durable: str) -> None:
    """Name the durable path in the local copy (read by ``drain_pending`` after a restart)."""
    os.makedirs(local, exist_ok=True)
    tmp = os.path.join(local, f"{TIER_FILE}.tmp-{os.getpid()}")  # the ranks of a node share the copy
    with open(tmp, "w") as f:
        json.dump({"durable": durable}, f)
    os.replace(tmp, os.path.join(local, TIER_FILE))


def record_rank_files(local: str, rank: int, durable: str, save_id: str, renamed: dict[str, str]) -> None:
    """Several ranks: record in the local copy which durable files of checkpoint ``save_id`` this
    rank's local files are ({local name: durable name})."""
    tmp = os.path.join(local, f".tier-{rank}.json.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"durable": durable, "save_id": save_id, "files": {d: n for n, d in renamed.items()}}, f)
    os.replace(tmp, os.path.join(local, f".tier-{rank}.json"))


def _names(folder: str) -> list[str]:
    """The entries of ``folder``; none when it cannot be listed (gone, not a folder)."""
    try:
        return os.listdir(folder)
    except OSError:
        return []


def forget_rank_files(local: str, rank: int) -> None:
    """Drop this rank's record before it rewrites its files in the copy: a record must never
    name a local file whose bytes are not the recorded checkpoint's."""
    try:
        os.unlink(os.path.join(local, f".tier-{rank}.json"))
    except FileNotFoundError:
        pass


def _rank_records(local: str) -> list[tuple[int, dict]]:
    """(mtime_ns, record) of every ``.tier-<rank>.json`` of a local copy that reads as one."""
    out = []
    for name in _names(local):
        if not _RANK_FILES.match(name):
            continue
        full = os.path.join(local, name)
        try:
            with open(full) as f:
                record = json.load(f)
            files = record["files"]
            if isinstance(record.get("save_id"), str) and isinstance(files, dict):
                out.append((os.stat(full).st_mtime_ns, record))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def local_files(local: str, save_id: str | None) -> dict[str, str]:
    """{durable data file name: path in the local copy} of checkpoint ``save_id`` as recorded by
    the ranks of this node (several-rank saves); only files present as regular files."""
    out: dict[str, str] = {}
    if save_id is None:
        return out
    for _, record in _rank_records(local):
        if record["save_id"] != save_id:
            continue
        for durable_name, local_name in record["files"].items():
            if not isinstance(local_name, str) or os.path.basename(local_name) != local_name:
                continue  # a record naming a path outside the copy is not ours
            full = os.path.join(local, local_name)
            if os.path.isfile(full) and not os.path.islink(full):
                out[durable_name] = full
    return out


def _local_state(local: str) -> tuple[int, str | None, bool] | None:
    """(commit time, checkpoint id, committed here) of a local copy: its ``.metadata`` (one
    process: a checkpoint in its own right), else its ranks' records (several ranks: files of a
    checkpoint whose only commit is the durable one); None when it holds neither."""
    try:
        committed = os.stat(os.path.join(local, commit.METADATA_NAME)).st_mtime_ns
        return committed, checkpoint_id(local), True
    except OSError:
        pass
    records = _rank_records(local)
    if not records:
        return None
    ids = {r["save_id"] for _, r in records}
    return max(t for t, _ in records), (ids.pop() if len(ids) == 1 else None), False


def _removable(local: str, local_id: str | None, committed_here: bool, storage_options: dict | None) -> bool:
    """A copy committed here goes only once its durable tier holds the same checkpoint. A
    several-rank copy holds no commit of its own: either the durable tier has its checkpoint, or
    its save failed and nothing can restore it; either way removing it loses nothing."""
    if not committed_here:
        return True
    return local_id is not None and checkpoint_id(durable_of(local), storage_options) == local_id


def durable_of(local: str) -> str | None:
    """The durable path a local copy drains to; None when it names none (or not readably)."""
    try:
        with open(os.path.join(local, TIER_FILE)) as f:
            durable = json.load(f).get("durable")
    except (OSError, ValueError, AttributeError):
        return None
    return durable if isinstance(durable, str) else None


def checkpoint_id(path: str, storage_options: dict | None = None) -> str | None:
    """The id in the commit marker of ``path``; None when it holds no complete checkpoint."""
    try:
        md, files = integrity.read_commit(path, storage_options=storage_options)
        integrity.check_data_files(path, files, storage_options=storage_options)
    except (DataStatesError, OSError):
        return None
    except Exception as exc:  # noqa: BLE001 - an unreachable store (botocore, aiohttp ...): no copy known there
        log.debug("dcp_datastates: cannot read the commit of %s: %s", path, exc)
        return None
    return md.storage_meta.save_id if md.storage_meta is not None else None


def choose_copy(durable: str, config) -> str:
    """The folder to load ``durable`` from: its local copy when complete, verified and tied to
    the durable commit, else ``durable`` itself. Logs the choice and why."""
    from .drain import verify_copy  # drain imports this module

    local = local_copy(config.local_tier, durable)
    local_id = checkpoint_id(local)
    if local_id is None:
        if not _rank_records(local):  # a several-rank copy is used file by file (the reader logs it)
            log.info("dcp_datastates: reading %s from the durable tier (no complete local copy in %s)", durable, local)
        return durable
    durable_id = checkpoint_id(durable, config.storage_options)
    if durable_id is not None and durable_id != local_id:
        log.warning("dcp_datastates: reading %s from the durable tier: the local copy %s holds checkpoint %s, "
                    "the durable tier %s", durable, local, local_id, durable_id)
        return durable
    try:
        verify_copy(local, config)
    except (DataStatesError, OSError) as exc:
        log.warning("dcp_datastates: reading %s from the durable tier: the local copy is damaged: %s", durable, exc)
        return durable
    log.info("dcp_datastates: reading %s from the local tier %s%s", durable, local,
             "" if durable_id is not None else " (not drained yet: the durable tier has no commit)")
    return local


def evict_drained(local_tier: str, keep: int, storage_options: dict | None = None) -> list[str]:
    """Remove the local copies beyond the ``keep`` newest that ``_removable`` allows: a copy
    committed here and not drained yet is never removed. Returns the folders removed."""
    copies = []
    for name in _names(local_tier):
        local = os.path.join(local_tier, name)
        state = _local_state(local)
        if state is not None and durable_of(local) is not None:
            copies.append((state[0], local, state[1], state[2]))
    removed = []
    for _, local, local_id, committed_here in sorted(copies, reverse=True)[keep:]:
        if not _removable(local, local_id, committed_here, storage_options):
            continue  # not durable yet (or damaged): kept for drain_pending / the reader
        shutil.rmtree(local, ignore_errors=True)
        removed.append(local)
        log.info("dcp_datastates: removed the drained local copy %s (keep_local=%d)", local, keep)
    return removed


def free_bytes(folder: str) -> int:
    """Bytes an unprivileged writer may still use on the file system holding ``folder``."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def make_room(local_tier: str, need: int, current: str, storage_options: dict | None = None) -> None:
    """Before a save writes ``need`` bytes into its local copy ``current``: when the local tier
    has less free, remove local copies that are already durable (same checkpoint id on their
    durable tier), oldest first, until it has enough; never a copy that is not durable, nor
    ``current``. Raises CheckpointWriteError, naming the folder and the bytes, when that is not
    enough (the save fails before writing; every copy stays)."""
    os.makedirs(local_tier, exist_ok=True)
    free = free_bytes(local_tier)
    if free >= need:
        return
    copies = []
    for name in os.listdir(local_tier):
        local = os.path.join(local_tier, name)
        state = _local_state(local) if local != current else None
        if state is not None and durable_of(local) is not None:
            copies.append((state[0], local, state[1], state[2]))
    kept = []
    for _, local, local_id, committed_here in sorted(copies):
        if free >= need:
            break
        if not _removable(local, local_id, committed_here, storage_options):
            kept.append(local)
            continue
        shutil.rmtree(local, ignore_errors=True)
        free = free_bytes(local_tier)
        log.warning("dcp_datastates: the local tier %s was full: removed the drained local copy %s", local_tier, local)
    if free < need:
        raise CheckpointWriteError(
            f"local_tier {local_tier}: {free} bytes free, this save needs {need} bytes; "
            + (f"the local copies {', '.join(sorted(kept))} are not durable yet, so they were kept. "
               if kept else "no local copy there is durable to remove. ")
            + "Give the local tier more space or lower keep_local."
        )


def newest_local(root: str, local_tier: str, step_of) -> tuple[tuple, str] | None:
    """(step key, durable path) of the newest complete local copy whose durable folder is
    directly under ``root``; None when there is none."""
    found = []
    try:
        names = os.listdir(local_tier)
    except OSError:
        return None
    for name in names:
        local = os.path.join(local_tier, name)
        durable = durable_of(local)
        if durable is None or os.path.dirname(durable.rstrip("/")) != root.rstrip("/"):
            continue
        key = step_of(os.path.basename(durable.rstrip("/")))
        if key is not None and checkpoint_id(local) is not None:
            found.append((key, durable))
    return max(found) if found else None
