"""Planning a save on this rank: a flat state dict -> this rank's ``RankPlan`` (``plan_stage``).

The same typed plan (``plan``) on a plan-cache hit and a miss; the writer only submits what it
holds.

- Hit (``plan_cache.find_plan``, keyed on the ``scan``): the cached files with this checkpoint's
  pointers.
- Miss: items (``items.py``) -> owners of replicated values (``ownership.py``) -> one
  ``PlannedFile`` per device (``file_groups``), recorded in the plan cache once the engine's
  checksum grid step is known.

Either way the plan holds the version guards (``version_guard``) of what is copied lazily, and
the size up to which items are copied at the request (``copy_at_request``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .copy_at_request import CopyAtRequest, request_copy_limit
from .file_groups import by_device, on_one_device, split_for_writers
from .items import PLAIN, VALUE, SourceItem, classify, items_of_flat
from .ownership import DecisionKey, Ownership, decisions, plain_signature, split_by_owner
from .plan import HeldGroup, PlanContext, PlannedFile, RankPlan, StagePlan, planned_file
from .plan_cache import build_plan, find_plan
from .scan import Scan, scan_state
from .values import serialize_object
from .version_guard import VersionGuard

__all__ = ["plan_stage"]


def plan_stage(flat: dict, context: PlanContext, copies: CopyAtRequest, *, folder_known: bool,
               hold_limit: Callable[[], int], incremental: frozenset | None = None) -> RankPlan:
    """This rank's plan for ``flat``. ``context``: who this rank is and how its files are written
    (``PlanContext``; its ``mirroring``, the peer-copy pairs for the mirrored files, applies only
    with ``dedup`` and not with ``incremental``); ``copies``: the items copied at the request,
    which the version guard leaves out (their later changes cannot reach the checkpoint; the
    plan's ``copy_limit`` is the size they are copied up to); ``folder_known``: files can be
    written now; ``hold_limit()``: the most bytes this rank may hold for DCP's plan (else it
    writes them); ``incremental`` (None: off): this rank's tensors but these keys are held (up to
    ``hold_limit()`` bytes) until their hashes say which to write (incremental.py), and no cached
    plan is used."""
    if context.mirroring is not None and (not context.dedup or incremental is not None):
        context = dataclasses.replace(context, mirroring=None)
    rank, world, dedup = context.rank, context.world, context.dedup
    scan = scan_state(flat)
    dkey = DecisionKey(rank, world, scan.plain_signature() if scan is not None else None) if dedup else None
    decision = decisions().get(dkey) if dkey is not None and dkey.plain is not None else None
    cached = find_plan(context, scan, decision) if folder_known and incremental is None else None
    if cached is not None:
        plan = _from_cache(cached, scan, copies)
    else:
        plan = _from_items(flat, scan, context, decision, folder_known, hold_limit, copies, incremental)
    if dedup and plan.decision_key is None and dkey is not None and dkey.plain is not None:
        plan.decision_key = dkey
    return plan


def _from_cache(cached: StagePlan, scan: Scan, copies: CopyAtRequest) -> RankPlan:
    # The scan read every tensor's version counter: guard the lazily copied ones (all but the
    # late and those copied at the request).
    versions = scan.versions
    limit, small = cached.request_copies(copies.max_bytes, copies.total)
    unguarded = cached.late + small
    if unguarded:
        versions = list(versions)
        for i in unguarded:
            versions[i] = None
    late = cached.late
    return RankPlan(
        [fp.planned(scan) for fp in cached.files], [], cached.skipped, cached.elsewhere,
        VersionGuard(scan.names, scan.tensors, versions, scan.keeps, scan.ptrs),
        VersionGuard([scan.names[i] for i in late], [scan.tensors[i] for i in late], [scan.versions[i] for i in late]),
        payloads={scan.names[i]: buf for i, buf in scan.payloads.items()}, copy_limit=limit,
    )


def _from_items(flat: dict, scan: Scan | None, context: PlanContext, decision: frozenset | None,
                folder_known: bool, hold_limit: Callable[[], int], copies: CopyAtRequest,
                incremental: frozenset | None = None) -> RankPlan:
    """Lay out every file from the items themselves; the plan is cacheable when the scan
    covered the state and nothing is held."""
    rank, world, dedup = context.rank, context.world, context.dedup
    if scan is not None:
        items = items_of_flat(flat, scan.payloads, scan.kinds)
    else:
        # Each value classified once, here; the values serialized as the scan does.
        kinds = [classify(v) for v in flat.values()]
        items = items_of_flat(flat, {i: serialize_object(v) for i, (v, kind) in enumerate(zip(flat.values(), kinds))
                                     if kind == VALUE}, kinds)
    decision_key = None
    if dedup and scan is None:
        # States the scan does not cover: key decisions on the items.
        decision_key = DecisionKey(rank, world, plain_signature(items))
        decision = decisions().get(decision_key)
    own = split_by_owner(items, flat, rank, world, decision, dedup, context.mirroring)
    mirrored, kept = _mirror_groups(own)
    if own.held and sum(it.entry.nbytes for it in own.held) > hold_limit():
        # Too big to hold: every holder writes its copy this time.
        own.owned.extend(own.held)
        own.held = []
    staged_here = (*own.owned, *own.held, *own.mirrored, *(it for _, group in kept for it in group))
    limit = request_copy_limit([it.entry.nbytes for it in staged_here], copies.max_bytes, copies.total)
    guard, late_guard = _guards(flat, own, limit)
    files: list[PlannedFile] = []
    held: list[HeldGroup] = []
    if not folder_known:
        # Nothing can be flushed before the folder is named.
        held += [HeldGroup(mirrored, True, mirrors=True)] if mirrored else []
        held += [HeldGroup(group, True) for group in by_device(own.owned)]
        held += [HeldGroup(group, True, mirror_of=writer) for writer, group in kept]
    else:
        if incremental is not None:
            # Held until their hashes are known; the rest written now.
            room = hold_limit() - sum(it.entry.nbytes for it in own.held)
            candidates, own.owned = _candidates(own.owned, room, incremental)
            held += [HeldGroup(group, True) for group in by_device(candidates)]
        roles = [(mirrored, True, None)] if mirrored else []
        roles += [(part, False, None) for group in by_device(own.owned)
                  for part in split_for_writers(group, context.files_per_group)]
        roles += [(group, False, writer) for writer, group in kept]
        for k, (group, mirrors, mirror_of) in enumerate(roles):
            device, group = on_one_device(context.cuda, group)
            files.append(planned_file(k, device, group, mirrors=mirrors, mirror_of=mirror_of))
    held += [HeldGroup(group, False) for group in by_device(own.held)]
    record = None
    if scan is not None and files and not held:
        def record(piece: int) -> object:
            return build_plan(context, scan, flat, files, own.skipped, own.elsewhere, decision, piece)
    return RankPlan(
        files, held, own.skipped, own.elsewhere, guard, late_guard, decision_key, dedup and decision is None,
        frozenset(it.key for it in items if it.kind == PLAIN), record,
        payloads={it.key[0]: it.keepalive for it in items if it.entry.kind == "bytes"}, copy_limit=limit,
    )


def _mirror_groups(own: Ownership) -> tuple[list[SourceItem], list[tuple[int, list[SourceItem]]]]:
    """(this rank's mirrored items, [(writer, the items of its mirrored file held here)]): each one
    file on one device, as the other side lays it out; a group on several devices is not
    mirrored (its items are written, or left to their writer, as without peer copies)."""
    mirrored = own.mirrored
    if len(by_device(mirrored)) > 1:
        own.owned = mirrored + own.owned
        mirrored = []
    own.mirrored = mirrored
    kept = [(writer, group) for writer, group in sorted(own.kept.items()) if len(by_device(group)) == 1]
    own.kept = dict(kept)
    return mirrored, kept


def _candidates(items: list[SourceItem], room: int, direct: frozenset) -> tuple[list[SourceItem], list[SourceItem]]:
    """(tensors an incremental save holds for their hashes, up to ``room`` bytes, but those it
    writes ``direct``ly; the rest)."""
    held, rest = [], []
    for it in items:
        if it.entry.kind == "tensor" and 0 < it.entry.nbytes <= room and it.key not in direct:
            held.append(it)
            room -= it.entry.nbytes
        else:
            rest.append(it)
    return held, rest


def _guards(flat: dict, own: Ownership, copied_at_request: int) -> tuple[VersionGuard, VersionGuard]:
    """The version counters of what this rank copies lazily, and of what it may have to write
    later from live memory (plain tensors given elsewhere, skipped replicas)."""
    kept = [it for group in own.kept.values() for it in group]
    lazy = [it for it in (*own.owned, *own.held, *own.mirrored, *kept)
            if it.entry.kind == "tensor" and not it.copied and it.entry.nbytes > copied_at_request]
    staged = {it.key for it in kept}
    later = []
    for key in (*own.elsewhere, *(k for k in own.skipped if k not in staged)):
        obj = flat.get(key[0])
        if isinstance(obj, torch.Tensor):
            later.append((key[0], obj.to_local() if hasattr(obj, "to_local") else obj))
    # The tensors the copies read, detached at the request.
    kept_alive = [it.keepalive for it in lazy]
    return (VersionGuard([it.key[0] for it in lazy], kept_alive, None, kept_alive, [it.ptr for it in lazy]),
            VersionGuard([n for n, _ in later], [t for _, t in later]))
