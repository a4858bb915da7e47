"""Which items share a data file: one device per engine job, host items cut for the flush threads.

``by_device`` and ``on_one_device``: one engine job copies from one device; ``split_for_writers``:
the host items a rank writes itself, in up to one file per flush thread.
"""

from __future__ import annotations

import dataclasses

from .items import SourceItem

__all__ = ["SPLIT_MIN_BYTES", "split_for_writers", "by_device", "on_one_device"]


#: The least a file split off by ``split_for_writers`` holds: smaller states stay in one file.
SPLIT_MIN_BYTES = 32 << 20


def split_for_writers(items: list[SourceItem], parts: int) -> list[list[SourceItem]]:
    """Host ``items`` (one device group, in order) cut into up to ``parts`` runs of about equal
    bytes, each of at least ``SPLIT_MIN_BYTES``: one file per flush thread where the engine writes
    from the sources to a memory-backed folder, whose file system takes one writer per file at a
    time (tmpfs: a second thread in the same file adds nothing, a second file does)."""
    total = sum(it.entry.nbytes for it in items)
    parts = min(parts, total // SPLIT_MIN_BYTES)
    if parts <= 1 or not items or items[0].device != -1:
        return [items] if items else []
    out: list[list[SourceItem]] = [[]]
    done = 0
    for it in items:
        if out[-1] and done >= total * len(out) / parts and len(out) < parts:
            out.append([])
        out[-1].append(it)
        done += it.entry.nbytes
    return out


def by_device(items: list[SourceItem]) -> list[list[SourceItem]]:
    """The items split by the device they live on (one engine job copies from one device): a
    single list when they share one, as CPU-only states do; else host items first (small
    non-tensor values, staged at once ahead of the device copies), then by device index."""
    first = items[0].device if items else -1
    if all(it.device == first for it in items):
        return [items] if items else []
    groups: dict[int, list[SourceItem]] = {}
    for it in items:
        groups.setdefault(it.device, []).append(it)
    return [groups[d] for d in sorted(groups)]


def on_one_device(cuda: bool, items: list[SourceItem]) -> tuple[int, list[SourceItem]]:
    """(device, items) for one engine job. CUDA items are copied to host memory now (blocking)
    when the engine has no CUDA runtime (``cuda`` false) or they share a job with items of
    another device."""
    device = items[0].device if items else -1
    if device < 0 and all(it.device < 0 for it in items):
        return -1, items
    if cuda and all(it.device == device for it in items):
        return device, items
    host = []
    for it in items:
        if it.device >= 0:
            t = it.keepalive.to("cpu")
            it = dataclasses.replace(it, ptr=t.data_ptr() if it.entry.nbytes else 0, keepalive=t, device=-1, copied=True)
        host.append(it)
    return -1, host
