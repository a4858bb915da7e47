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

Multi-rank (not yet: refused inside DCP's planning, so every rank raises). Planned: each rank
drains its own files and writes a rank-local durable marker; the coordinator waits, bounded, for every rank's marker before
the global one, and a rank's failure reaches every rank through the writer's collective.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

from . import commit, integrity
from .errors import DataStatesError

log = logging.getLogger("dcp_datastates")

__all__ = ["local_copy", "durable_of", "checkpoint_id", "choose_copy", "evict_drained", "newest_local", "TIER_FILE"]

TIER_FILE = ".tier.json"


def local_copy(local_tier: str, durable: str) -> str:
    """The local-tier folder of the checkpoint whose durable path is ``durable``."""
    base = os.path.basename(durable.rstrip("/")) or "checkpoint"
    key = hashlib.sha1(durable.encode()).hexdigest()[:12]
    return os.path.join(local_tier, f"{base}-{key}")


def record_durable(local: str, durable: str) -> None:
    """Name the durable path in the local copy (read by ``drain_pending`` after a restart)."""
    os.makedirs(local, exist_ok=True)
    tmp = os.path.join(local, TIER_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"durable": durable}, f)
    os.replace(tmp, os.path.join(local, TIER_FILE))


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
    return md.storage_meta.save_id if md.storage_meta is not None else None


def choose_copy(durable: str, config) -> str:
    """The folder to load ``durable`` from: its local copy when complete, verified and tied to
    the durable commit, else ``durable`` itself. Logs the choice and why."""
    from .drain import verify_copy  # drain imports this module

    local = local_copy(config.local_tier, durable)
    local_id = checkpoint_id(local)
    if local_id is None:
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
    """Remove the local copies beyond the ``keep`` newest whose durable tier holds the same
    checkpoint id; a copy not drained yet is never removed. Returns the folders removed."""
    copies = []
    try:
        names = os.listdir(local_tier)
    except OSError:
        return []
    for name in names:
        local = os.path.join(local_tier, name)
        try:
            committed = os.stat(os.path.join(local, commit.METADATA_NAME)).st_mtime_ns
        except OSError:
            continue
        if durable_of(local) is not None:
            copies.append((committed, local))
    removed = []
    for _, local in sorted(copies, reverse=True)[keep:]:
        local_id = checkpoint_id(local)
        if local_id is None or checkpoint_id(durable_of(local), storage_options) != local_id:
            continue  # not durable yet (or damaged): kept for drain_pending / the reader
        shutil.rmtree(local, ignore_errors=True)
        removed.append(local)
        log.info("dcp_datastates: removed the drained local copy %s (keep_local=%d)", local, keep)
    return removed


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
