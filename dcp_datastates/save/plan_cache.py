"""The plan cache: a save's plan per structure of the state, reused while that structure holds.

What depends only on the structure of the state (names, dtypes, shapes, devices, shardings: the
scan's signature) is computed once per ``PlanContext`` and reused while its signature is
unchanged; each checkpoint reads fresh only the tensors' memory and the serialized non-tensor
values (``scan``). A miss's plan is recorded (``build_plan``) once the engine's checksum grid step
is known.
"""

from __future__ import annotations

import threading
import types

from ..forking import new_locks_in_child
from ..format.layout import data_file_name
from .items import SourceItem
from .plan import FilePlan, PlanContext, PlannedFile, StagePlan
from .scan import Scan

__all__ = ["find_plan", "build_plan", "plan_stats"]

# A run may save a few structures (model, optimizer, ...) with separate writers.
_MAX_PLANS = 4

_plans: dict[PlanContext, list[StagePlan]] = {}
_plans_lock = threading.Lock()
new_locks_in_child(globals(), "_plans_lock")
_hits = [0, 0]  # hits, misses (process-wide; tests read them through plan_stats)


def find_plan(context: PlanContext, scan: Scan | None, decision: frozenset | None = None) -> StagePlan | None:
    """The cached plan for this context and structure, built with ``decision`` (the current
    ownership decision), or None (also counted as a miss)."""
    plan = None
    with _plans_lock:
        plans = _plans.get(context, []) if scan is not None else []
        for k, p in enumerate(plans):
            if p.signature == scan.signature and p.decision is decision:
                plan = plans.pop(k)
                # Most recently used first; the least is evicted.
                plans.insert(0, plan)
                break
        _hits[0 if plan is not None else 1] += 1
    return plan


def build_plan(context: PlanContext, scan: Scan, flat: dict, files: list[PlannedFile], skipped: set,
               elsewhere: set, decision: frozenset | None, piece: int) -> StagePlan | None:
    """Record what the full path just did for this structure (``files``: the planned files it
    submitted), after checking that each item comes from exactly the memory the scan found
    (else nothing is cached)."""
    position = {name: i for i, name in enumerate(flat)}
    seen: set[int] = set()
    file_plans = []
    for pf in files:
        template = []
        for it, off in zip(pf.sources, pf.layout.offsets):
            i = position.get(it.key[0])
            if i is None or i in seen or not _same_source(scan, i, it):
                return None
            seen.add(i)
            template.append((i, it.entry.nbytes, off))
        untagged = data_file_name(context.rank, pf.index)
        locations = types.MappingProxyType(dict(pf.locations(untagged, piece)))
        file_plans.append(FilePlan(pf.index, pf.device, pf.layout, tuple(template), pf.keys, locations, pf.mirrors,
                                   pf.mirror_of, untagged))
    # (a skipped replica kept here as a mirror is staged like the rest: not late)
    late = tuple(sorted(i for k in (*skipped, *elsewhere) if (i := position.get(k[0])) is not None and i not in seen))
    plan = StagePlan(scan.signature, tuple(file_plans), frozenset(skipped), frozenset(elsewhere), decision, late)
    with _plans_lock:
        kept = [p for p in _plans.get(context, ()) if p.signature != scan.signature]
        _plans[context] = [plan] + kept[: _MAX_PLANS - 1]
    return plan


def _same_source(scan: Scan, i: int, it: SourceItem) -> bool:
    if i in scan.payloads:
        return it.entry.kind == "bytes" and it.entry.nbytes == scan.payloads[i].numel()
    # The engine skips empty items.
    same_memory = it.entry.nbytes == 0 or it.ptr == scan.ptrs[i]
    return it.entry.kind == "tensor" and same_memory and it.device == scan.devices[i]


def plan_stats() -> dict:
    """Process-wide counts of stage() calls that reused a cached plan, and that did not."""
    return {"hits": _hits[0], "misses": _hits[1]}
