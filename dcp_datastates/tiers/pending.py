"""A checkpoint committed on the nodes' local tiers: its pending metadata and the ranks' drain reports.

With several ranks each rank drains its own files (``drain.drain_rank``) and reports in the
durable folder (``.drain-<rank>.json``: the checkpoint id and an error or none, or a heartbeat
while it drains); the coordinator writes the checkpoint's metadata there as ``PENDING_NAME``
first (from then on the checkpoint is restorable from the nodes' local copies), waits for every
rank that wrote files (``wait_drained``), then commits and removes both (``clear_pending``).
"""

from __future__ import annotations

import json
import time

from ..commit import checkpoint_id, read_commit
from ..errors import CheckpointWriteError
from ..format.layout import PENDING_NAME, data_file_parts
from ..format.metadata import encode_metadata
from ..storage import Storage, open_storage

__all__ = ["file_ranks", "write_pending", "read_pending", "drain_report_name", "report_drained", "report_draining",
           "drained_ok", "all_drained", "wait_drained", "clear_pending", "newest_pending"]


def file_ranks(locations) -> set[int]:
    """The ranks that wrote the data files of ``locations`` ({index: ItemLocation})."""
    return {parts[0] for loc in locations.values() if (parts := data_file_parts(loc.file)) is not None}


def _read_small(durable: Storage, name: str) -> bytes | None:
    try:
        return durable.read_small(name, limit=1 << 20, what="a drain record")
    except Exception:  # noqa: BLE001 - absent, unreadable or the store is down: not reported
        return None


def write_pending(durable: Storage, md, locations, *, sync: bool) -> bytes:
    """The coordinator: the checkpoint is committed on every node's local tier (DCP gathered every
    rank's results); record its metadata in the durable folder before the drains end. Returns
    the encoded metadata."""
    data = encode_metadata(md, locations)
    durable.put(PENDING_NAME, data, sync=sync)
    return data


def read_pending(durable: "str | Storage", storage_options: dict | None = None, *, uncommitted_only: bool = False):
    """(Metadata, files) of the checkpoint pending in ``durable`` when it is not the committed
    one (a save interrupted or failed between the local commits and the durable one); else None.
    ``uncommitted_only``: only when ``durable`` holds no commit at all (what a load may read: a
    folder that holds a commit is that checkpoint until a new one is committed there)."""
    durable = open_storage(durable, storage_options)
    try:
        md, files = read_commit(durable, name=PENDING_NAME)
    except Exception:  # noqa: BLE001 - none, damaged, or the store is down: nothing pending known
        return None
    pending_id = md.storage_meta.save_id if md.storage_meta is not None else None
    committed_id = checkpoint_id(durable)
    if pending_id is None or pending_id == committed_id or (uncommitted_only and committed_id is not None):
        return None
    return md, files


def drain_report_name(rank: int) -> str:
    return f".drain-{rank}.json"


def report_drained(durable: Storage, rank: int, save_id: str, error: str | None) -> None:
    data = json.dumps({"save_id": save_id, "error": error}).encode()
    durable.put(drain_report_name(rank), data, sync=False)


def report_draining(durable: Storage, rank: int, save_id: str, beat: int) -> None:
    """This rank's drain of ``save_id`` is alive (``beat`` counts its reports): what the
    coordinator tells a slow drain from a node that stopped by (``wait_drained``)."""
    data = json.dumps({"save_id": save_id, "error": None, "draining": beat}).encode()
    durable.put(drain_report_name(rank), data, sync=False)


def _drain_report(durable: Storage, rank: int, save_id: str) -> dict | None:
    raw = _read_small(durable, drain_report_name(rank))
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("save_id") == save_id else None


def drained_ok(durable: Storage, rank: int, save_id: str) -> bool:
    """True when ``rank`` reported its drain of ``save_id`` without error."""
    report = _drain_report(durable, rank, save_id)
    return report is not None and not report.get("error") and "draining" not in report


def all_drained(durable: Storage, save_id: str, ranks: set[int]) -> bool:
    """True when every rank of ``ranks`` reported its drain of ``save_id`` without error."""
    return all(drained_ok(durable, r, save_id) for r in ranks)


def wait_drained(durable: Storage, save_id: str, ranks: set[int], timeout: float, stall: float) -> None:
    """The coordinator: wait until every rank of ``ranks`` reported its drain of ``save_id``;
    raise CheckpointWriteError at the first error, naming the ranks whose drain showed no
    progress for ``stall`` seconds (a node frozen or cut off: ``stall_timeout``), or those
    not done after ``timeout`` seconds (``drain_timeout``)."""
    left, delay = set(ranks), 0.02
    start = time.monotonic()
    # rank -> (its last report's beat, when it changed)
    seen = {r: (None, start) for r in left}
    while left:
        now = time.monotonic()
        for r in sorted(left):
            report = _drain_report(durable, r, save_id)
            if report is not None and report.get("error"):
                raise CheckpointWriteError(f"rank {r}: {report['error']}")
            if report is not None and "draining" not in report:
                left.discard(r)
                continue
            beat = None if report is None else report["draining"]
            if beat != seen[r][0]:
                seen[r] = (beat, now)
        if not left:
            return
        stalled = sorted(r for r in left if now - seen[r][1] > stall)
        if stalled:
            raise CheckpointWriteError(
                f"draining to the durable tier {durable.location}: rank(s) {stalled} showed no progress for "
                f"{stall:g} s (stall_timeout): their node may be frozen or cut off; nothing was committed there, "
                f"the checkpoint stays on the local tiers"
            )
        if now - start > timeout:
            raise CheckpointWriteError(
                f"draining to the durable tier {durable.location}: rank(s) {sorted(left)} did not report within "
                f"{timeout:g} s (drain_timeout); nothing was committed there, the checkpoint stays on the local tiers"
            )
        time.sleep(delay)
        delay = min(0.5, delay * 2, stall / 4)


def clear_pending(durable: Storage, ranks: set[int]) -> None:
    """After the durable commit: the pending metadata and the ranks' reports go (best effort)."""
    for name in [PENDING_NAME] + [drain_report_name(r) for r in sorted(ranks)]:
        durable.remove_quietly(name)


def newest_pending(root: Storage, step_of) -> tuple[tuple, str] | None:
    """(step key, location) of the newest folder directly under ``root`` holding a checkpoint
    committed on the local tiers and not yet durably (several ranks); None when there is none."""
    found = []
    for name in root.subfolders():
        key = step_of(name)
        if key is None:
            continue
        folder = root.child(name)
        if folder.has(PENDING_NAME) and read_pending(folder, uncommitted_only=True) is not None:
            found.append((key, folder.location))
    return max(found) if found else None
