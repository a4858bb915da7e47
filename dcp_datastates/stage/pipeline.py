"""The staging pipeline: a flat state dict -> this rank's ``RankPlan``, the same type on a
plan-cache hit and a miss. The writer only submits what it holds.

Miss: items (``items.py``) -> owners (``ownership.py``) -> one ``PlannedFile`` per device
(``files.py``), recorded in the plan cache (``plan_cache.py``) once the engine's checksum grid
step is known. Hit: the cached files with this checkpoint's pointers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..version_guard import VersionGuard
from .files import PlanContext, PlannedFile, planned_file
from .items import SourceItem, items_of_flat
from .ownership import DecisionKey, Ownership, decisions, is_plain_tensor, plain_signature, split_by_owner
from .plan_cache import Scan, StagePlan, build_plan, find_plan, scan_state

__all__ = ["HeldGroup", "RankPlan", "plan_stage", "on_one_device"]


@dataclass
class HeldGroup:
    """Items copied now whose file is written later: ``known`` when this rank writes all of them
    (only the folder is not named yet), else DCP's plan selects them."""

    items: list[SourceItem]
    known: bool


@dataclass(eq=False)
class RankPlan:
    """What ``stage()`` submits for one checkpoint on this rank."""

    files: list[PlannedFile]  # written at once, in this order (k of __<rank>_<k>)
    held: list[HeldGroup]  # staged now, written after DCP's planning
    skipped: set  # DTensor replicas another rank writes
    elsewhere: set  # plain tensors the ownership decision gives to other ranks
    guard: VersionGuard  # the sources copied lazily
    late_guard: VersionGuard  # tensors this rank may have to write later from live memory
    decision_key: DecisionKey | None = None  # what the ownership decision is kept under
    learn: bool = False  # no decision was known: learn it from this save's plan
    plain_keys: frozenset = frozenset()
    _record: Callable[[int], object] | None = field(default=None, repr=False)

    def remember(self, piece: int) -> None:
        """Cache this (missed) plan for the next checkpoints, on a checksum grid of step ``piece``."""
        if self._record is not None:
            self._record(piece)


def plan_stage(flat: dict, *, rank: int, world: int, dedup: bool, cuda: bool, folder_known: bool,
               hold_limit: Callable[[], int]) -> RankPlan:
    """This rank's plan for ``flat``. ``dedup``: replicated values are written by one rank;
    ``cuda``: the engine copies CUDA memory itself; ``folder_known``: files can be written now;
    ``hold_limit()``: the most bytes this rank may hold for DCP's plan (else it writes them)."""
    scan = scan_state(flat)
    dkey = DecisionKey(rank, world, scan.plain_signature() if scan is not None else None) if dedup else None
    decision = decisions().get(dkey) if dkey is not None and dkey.plain is not None else None
    context = PlanContext(rank, world, dedup, cuda)
    cached = find_plan(context, scan, decision) if folder_known else None
    if cached is not None:
        plan = _from_cache(cached, scan)
    else:
        plan = _from_items(flat, scan, context, decision, folder_known, hold_limit)
    if dedup and plan.decision_key is None and dkey is not None and dkey.plain is not None:
        plan.decision_key = dkey
    return plan


def _from_cache(cached: StagePlan, scan: Scan) -> RankPlan:
    # The scan read every tensor's version counter: guard the copied ones (all but the late).
    versions = scan.versions
    if cached.late:
        versions = list(versions)
        for i in cached.late:
            versions[i] = None
    late = cached.late
    return RankPlan(
        [fp.planned(scan) for fp in cached.files], [], set(cached.skipped), set(cached.elsewhere),
        VersionGuard(scan.names, scan.tensors, versions),
        VersionGuard([scan.names[i] for i in late], [scan.tensors[i] for i in late], [scan.versions[i] for i in late]),
    )


def _from_items(flat: dict, scan: Scan | None, context: PlanContext, decision: frozenset | None,
                folder_known: bool, hold_limit: Callable[[], int]) -> RankPlan:
    """Lay out every file from the items themselves; the plan is cacheable when the scan
    covered the state and nothing is held."""
    rank, world, dedup = context.rank, context.world, context.dedup
    items = items_of_flat(flat, scan.payloads if scan is not None else None)
    decision_key = None
    if dedup and scan is None:  # states the scan does not cover: key decisions on the items
        decision_key = DecisionKey(rank, world, plain_signature(items, flat))
        decision = decisions().get(decision_key)
    own = split_by_owner(items, flat, rank, world, decision, dedup)
    if own.held and sum(it.entry.nbytes for it in own.held) > hold_limit():
        own.owned.extend(own.held)  # too big to hold: every holder writes its copy this time
        own.held = []
    guard, late_guard = _guards(flat, own)
    files: list[PlannedFile] = []
    held: list[HeldGroup] = []
    if not folder_known:  # nothing can be flushed before the folder is named
        held += [HeldGroup(group, True) for group in _by_device(own.owned)]
    else:
        for k, group in enumerate(_by_device(own.owned)):
            device, group = on_one_device(context.cuda, group)
            files.append(planned_file(k, device, group))
    held += [HeldGroup(group, False) for group in _by_device(own.held)]
    record = None
    if scan is not None and files and not held:
        def record(piece: int) -> object:
            return build_plan(context, scan, flat, files, own.skipped, own.elsewhere, decision, piece)
    return RankPlan(
        files, held, own.skipped, own.elsewhere, guard, late_guard, decision_key, dedup and decision is None,
        frozenset(it.key for it in items if is_plain_tensor(flat.get(it.key[0]))), record,
    )


def _guards(flat: dict, own: Ownership) -> tuple[VersionGuard, VersionGuard]:
    """The version counters of what this rank copies lazily, and of what it may have to write
    later from live memory (plain tensors given elsewhere, skipped replicas)."""
    lazy = [it for it in (*own.owned, *own.held) if it.entry.kind == "tensor" and not it.copied]
    later = []
    for key in (*own.elsewhere, *own.skipped):
        obj = flat.get(key[0])
        if isinstance(obj, torch.Tensor):
            later.append((key[0], obj.to_local() if hasattr(obj, "to_local") else obj))
    return (VersionGuard([it.key[0] for it in lazy], [it.keepalive for it in lazy]),
            VersionGuard([n for n, _ in later], [t for _, t in later]))


def _by_device(items: list[SourceItem]) -> list[list[SourceItem]]:
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
