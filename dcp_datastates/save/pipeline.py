"""The staging pipeline: a flat state dict -> this rank's ``RankPlan`` (``plan_stage``), the
same typed plan on a plan-cache hit and a miss; the writer only submits what it holds.

- ``PlannedFile``: one data file to write (layout, per item its key, memory and keep-alive), and
  ``item_location``: every ``ItemLocation`` the writer reports is built here only.
- The plan cache (``scan_state`` / ``find_plan`` / ``build_plan``): what depends only on the
  structure of the state (names, dtypes, shapes, devices, shardings) is computed once and reused
  while its signature is unchanged; each checkpoint reads fresh only the tensors' memory and the
  serialized non-tensor values. States the fast scan does not cover (non-contiguous views, other
  devices, ShardedTensor, CheckpointableTensor shards, tensor subclasses) take the miss path.
- Miss: items (``items.py``) -> owners of replicated values (``ownership.py``) -> one
  ``PlannedFile`` per device, recorded in the plan cache once the engine's checksum grid step is
  known. Hit: the cached files with this checkpoint's pointers.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..compat import (
    HAS_CHECKPOINTABLE_TENSOR,
    dcp_compat_mode,
    flatten_state_dict,
    is_checkpointable_tensor,
    tensor_version,
    versions_of,
)
from ..forking import new_locks_in_child
from ..format.layout import FileEntry, FileLayout, ItemLocation, data_file_name, moved, plan_file
from .items import DTENSOR, PLAIN, VALUE, ItemKey, SourceItem, classify, items_of_flat
from .ownership import DecisionKey, Mirroring, Ownership, decisions, plain_signature, split_by_owner

log = logging.getLogger("dcp_datastates")

__all__ = [
    "flatten", "serialize_object", "VersionGuard", "torn_message", "HeldGroup", "RankPlan", "plan_stage", "on_one_device",
    "PlanContext", "PlannedFile", "planned_file", "item_location", "with_piece", "written",
    "Scan", "FilePlan", "StagePlan", "scan_state", "find_plan", "build_plan", "plan_stats", "request_copy_limit",
]



# ------------------------------------------------------------------------- the flat state
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


class _NeedsDcpFlatten(Exception):
    """A value ``_flatten`` leaves to DCP's own traversal (lists)."""


def _flatten(state_dict: dict) -> tuple[dict, dict]:
    """Exactly ``flatten_state_dict(state_dict)`` (same keys, order, paths and duplicate-key
    error), computed directly for nested mappings: about 2.5x faster than DCP's generic
    traversal, which matters on the training thread with tens of thousands of tensors. States
    holding lists (whose traversal depends on their contents) and DCP's 2.3 compatibility mode
    go through DCP itself."""
    if dcp_compat_mode() == "2_3":
        return flatten_state_dict(state_dict)
    flat: dict = {}
    mappings: dict = {}
    try:
        _walk(flat, mappings, "", (), state_dict)
    except _NeedsDcpFlatten:
        return flatten_state_dict(state_dict)
    return flat, mappings


def _walk(flat: dict, mappings: dict, prefix: str, path: tuple, node: Mapping) -> None:
    # A module-level function, not a closure calling itself: such a closure is a reference
    # cycle, which would keep the flat dict (and every tensor in it) alive until a collection.
    # Exact-type tests first: a plain tensor leaf (nearly every value) costs no ABC check.
    for k, v in node.items():
        if type(k) is not str:
            k = str(k)
        tv = type(v)
        if tv is not _Tensor and (tv is dict or isinstance(v, Mapping)):
            _walk(flat, mappings, prefix + k + ".", path + (k,), v)
            continue
        if tv is list or (tv is not _Tensor and isinstance(v, list)):
            raise _NeedsDcpFlatten
        name = prefix + k
        if name in flat:
            raise ValueError(f"duplicated flatten key {name}")
        flat[name] = v
        mappings[name] = path + (k,)


def flatten(state_dict: dict) -> tuple[dict, dict]:
    """(flat state dict, mappings), exactly as DCP's ``flatten_state_dict``."""
    return _flatten(state_dict)


def serialize_object(obj: Any) -> torch.Tensor:
    """The bytes DCP's planners produce for a non-tensor value (``torch.save``), made now so
    later changes to the object never reach the checkpoint, in a uint8 tensor of their own (what
    the engine copies them from)."""
    out = io.BytesIO()
    torch.save(obj, out)
    data = out.getvalue()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# ------------------------------------------------------------------------- the pipeline
@dataclass
class HeldGroup:
    """Items copied now whose file is written later: ``known`` when this rank writes all of them
    (only the folder is not named yet), else DCP's plan selects them."""

    items: list[SourceItem]
    known: bool
    mirrors: bool = False  # peer_copies: the keeper stages the same file (ownership.py, Mirrors)
    mirror_of: int | None = None  # peer_copies: the same file as that rank's mirrored one


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
    payloads: dict = field(default_factory=dict)  # fqn -> uint8 tensor: a value's bytes as serialized now
    copy_limit: int = 0  # items of 1..copy_limit bytes are copied at the request (request_copy_limit)

    def remember(self, piece: int) -> None:
        """Cache this (missed) plan for the next checkpoints, on a checksum grid of step ``piece``."""
        if self._record is not None:
            self._record(piece)


def plan_stage(flat: dict, *, rank: int, world: int, dedup: bool, cuda: bool, folder_known: bool,
               hold_limit: Callable[[], int], copied_at_request: int = 0, copied_at_request_total: int | None = None,
               incremental: frozenset | None = None, mirroring: Mirroring | None = None,
               files_per_group: int = 1) -> RankPlan:
    """This rank's plan for ``flat``. ``dedup``: replicated values are written by one rank;
    ``cuda``: the engine copies CUDA memory itself; ``folder_known``: files can be written now;
    ``hold_limit()``: the most bytes this rank may hold for DCP's plan (else it writes them);
    ``copied_at_request``: items up to this size are copied at the request (request.copy_small_at_request), so
    the version guard leaves them out (their later changes cannot reach the checkpoint), at most
    ``copied_at_request_total`` bytes of them, the smallest first (``request_copy_limit``; the
    plan's ``copy_limit`` is the size they are copied up to);
    ``incremental`` (None: off): this rank's tensors but these keys are held (up to
    ``hold_limit()`` bytes) until their hashes say which to write (incremental.py), and no
    cached plan is used. ``mirroring``: the peer-copy pairs, for the mirrored files (ownership.py;
    not with ``incremental``). ``files_per_group``: the host items this rank writes are spread
    over up to that many files (``split_for_writers``)."""
    scan = scan_state(flat)
    dkey = DecisionKey(rank, world, scan.plain_signature() if scan is not None else None) if dedup else None
    decision = decisions().get(dkey) if dkey is not None and dkey.plain is not None else None
    context = PlanContext(rank, world, dedup, cuda, mirroring if dedup and incremental is None else None,
                          files_per_group)
    cached = find_plan(context, scan, decision) if folder_known and incremental is None else None
    if cached is not None:
        plan = _from_cache(cached, scan, copied_at_request, copied_at_request_total)
    else:
        plan = _from_items(flat, scan, context, decision, folder_known, hold_limit, copied_at_request,
                           copied_at_request_total, incremental)
    if dedup and plan.decision_key is None and dkey is not None and dkey.plain is not None:
        plan.decision_key = dkey
    return plan


def _from_cache(cached: StagePlan, scan: Scan, copied_at_request: int, total: int | None) -> RankPlan:
    # The scan read every tensor's version counter: guard the lazily copied ones (all but the
    # late and those copied at the request).
    versions = scan.versions
    limit, small = cached.request_copies(copied_at_request, total)
    unguarded = cached.late + small
    if unguarded:
        versions = list(versions)
        for i in unguarded:
            versions[i] = None
    late = cached.late
    return RankPlan(
        [fp.planned(scan) for fp in cached.files], [], set(cached.skipped), set(cached.elsewhere),
        VersionGuard(scan.names, scan.tensors, versions, scan.keeps, scan.ptrs),
        VersionGuard([scan.names[i] for i in late], [scan.tensors[i] for i in late], [scan.versions[i] for i in late]),
        payloads={scan.names[i]: buf for i, buf in scan.payloads.items()}, copy_limit=limit,
    )


def _from_items(flat: dict, scan: Scan | None, context: PlanContext, decision: frozenset | None,
                folder_known: bool, hold_limit: Callable[[], int], copied_at_request: int, total: int | None,
                incremental: frozenset | None = None) -> RankPlan:
    """Lay out every file from the items themselves; the plan is cacheable when the scan
    covered the state and nothing is held."""
    rank, world, dedup = context.rank, context.world, context.dedup
    if scan is not None:
        items = items_of_flat(flat, scan.payloads, scan.kinds)
    else:  # each value classified once, here; the values serialized as the scan does
        kinds = [classify(v) for v in flat.values()]
        items = items_of_flat(flat, {i: serialize_object(v) for i, (v, kind) in enumerate(zip(flat.values(), kinds))
                                     if kind == VALUE}, kinds)
    decision_key = None
    if dedup and scan is None:  # states the scan does not cover: key decisions on the items
        decision_key = DecisionKey(rank, world, plain_signature(items))
        decision = decisions().get(decision_key)
    own = split_by_owner(items, flat, rank, world, decision, dedup, context.mirroring)
    mirrored, kept = _mirror_groups(own)
    if own.held and sum(it.entry.nbytes for it in own.held) > hold_limit():
        own.owned.extend(own.held)  # too big to hold: every holder writes its copy this time
        own.held = []
    staged_here = (*own.owned, *own.held, *own.mirrored, *(it for _, group in kept for it in group))
    limit = request_copy_limit([it.entry.nbytes for it in staged_here], copied_at_request, total)
    guard, late_guard = _guards(flat, own, limit)
    files: list[PlannedFile] = []
    held: list[HeldGroup] = []
    if not folder_known:  # nothing can be flushed before the folder is named
        held += [HeldGroup(mirrored, True, mirrors=True)] if mirrored else []
        held += [HeldGroup(group, True) for group in _by_device(own.owned)]
        held += [HeldGroup(group, True, mirror_of=writer) for writer, group in kept]
    else:
        if incremental is not None:  # held until their hashes are known; the rest written now
            room = hold_limit() - sum(it.entry.nbytes for it in own.held)
            candidates, own.owned = _candidates(own.owned, room, incremental)
            held += [HeldGroup(group, True) for group in _by_device(candidates)]
        roles = [(mirrored, True, None)] if mirrored else []
        roles += [(part, False, None) for group in _by_device(own.owned)
                  for part in split_for_writers(group, context.files_per_group)]
        roles += [(group, False, writer) for writer, group in kept]
        for k, (group, mirrors, mirror_of) in enumerate(roles):
            device, group = on_one_device(context.cuda, group)
            files.append(planned_file(k, device, group, mirrors=mirrors, mirror_of=mirror_of))
    held += [HeldGroup(group, False) for group in _by_device(own.held)]
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
    if len(_by_device(mirrored)) > 1:
        own.owned = mirrored + own.owned
        mirrored = []
    own.mirrored = mirrored
    kept = [(writer, group) for writer, group in sorted(own.kept.items()) if len(_by_device(group)) == 1]
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
    kept_alive = [it.keepalive for it in lazy]  # the tensors the copies read, detached at the request
    return (VersionGuard([it.key[0] for it in lazy], kept_alive, None, kept_alive, [it.ptr for it in lazy]),
            VersionGuard([n for n, _ in later], [t for _, t in later]))


def request_copy_limit(sizes: list[int], max_bytes: int, total: int | None) -> int:
    """The size up to which a save's items are copied at the request: ``max_bytes``, or, when the
    items of 1..``max_bytes`` bytes hold more than ``total`` bytes in all, the largest size whose
    items together with every smaller one fit in ``total`` (0: none fit). The smallest come first:
    what the next forward changes without a version bump (normalization statistics, counters) is
    small. One number, so the copy and the version guard always agree on what was copied."""
    if max_bytes <= 0 or total is None:
        return max(0, max_bytes)
    small = [n for n in sizes if 0 < n <= max_bytes]
    if sum(small) <= total:
        return max_bytes
    small.sort()
    limit, taken = 0, 0
    for n, same in itertools.groupby(small):
        taken += n * sum(1 for _ in same)
        if taken > total:
            break
        limit = n
    left = [n for n in small if n > limit]
    key = (max_bytes, total, limit, len(left))
    if key not in _limits_told:
        _limits_told.add(key)
        log.warning(
            "dcp_datastates: %d tensors (and serialized values) of at most copy_at_request_max_bytes=%d bytes "
            "hold %d bytes, more than "
            "copy_at_request_total_bytes=%d: only those up to %d bytes are copied at the request; the other %d "
            "(%d bytes) are copied lazily under the version guard, so a change the next forward makes to one of "
            "them without a version bump (a BatchNorm statistic) would not be seen. Raise "
            "copy_at_request_total_bytes to copy them all.",
            len(small), max_bytes, sum(small), total, limit, len(left), sum(left))
    return limit


_limits_told: set[tuple] = set()  # the request_copy_limit warnings given (once per shape of the state)


#: The least a file split off by ``split_for_writers`` holds: smaller states stay in one file.
SPLIT_MIN_BYTES = 32 << 20


def split_for_writers(items: list[SourceItem], parts: int) -> list[list[SourceItem]]:
    """Host ``items`` (one device group, in order) cut into up to ``parts`` runs of about equal
    bytes, each of at least ``SPLIT_MIN_BYTES``: one file per flush thread where the engine writes
    from the sources to a memory-backed folder, whose file system takes one writer per file at a
    time (tmpfs: 1 GiB took 0.37 s with one or two threads in one file, 0.19 s in two)."""
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


# ------------------------------------------------------------------------ planned files
@dataclass(frozen=True)
class PlanContext:
    """What a cached stage plan is valid for, besides the state's structure."""

    rank: int
    world: int
    dedup: bool  # replicated values are written by one rank
    cuda: bool  # the engine copies from CUDA memory itself
    mirroring: Mirroring | None = None  # peer_copies: who keeps whose copies (mirrored files)
    files_per_group: int = 1  # host items this rank writes itself: in up to this many files (split_for_writers)


@dataclass(eq=False)
class PlannedFile:
    """One data file to write: ``index`` is k of ``__<rank>_<k>``; items are in file order."""

    index: int
    device: int  # CUDA device the items' memory is on; -1: host memory
    layout: FileLayout
    keys: tuple[ItemKey, ...]
    spans: list[tuple[int, int, int]]  # per item: (pointer, nbytes, file offset), for the engine
    keepalive: list[Any]  # per item: what owns that memory until the engine copied it
    entries: tuple[FileEntry, ...] = ()  # the miss path's items (the hit path reuses ``cached``)
    sources: tuple[SourceItem, ...] = ()  # the miss path's items, for the plan cache's checks
    cached: Mapping[ItemKey, ItemLocation] | None = None  # locations of a cached plan (read-only)
    mirrors: bool = False  # peer_copies: the keeper stages this same file (ownership.py)
    mirror_of: int | None = None  # peer_copies: the same file as that rank's mirrored one
    untagged: str | None = None  # a cached plan's file name (no save tag); None: named from the rank
    _built: tuple | None = field(default=None, repr=False)  # (file, piece, locations) last built

    def locations(self, file: str, piece: int) -> Mapping[ItemKey, ItemLocation]:
        """Each item's location in ``file`` (the base name, no save tag), checksums not known yet,
        on an engine whose checksum grid step is ``piece``."""
        if self.cached is not None:
            first = next(iter(self.cached.values()), None)
            if first is None or first.piece_size == piece:
                return self.cached
            return {k: with_piece(loc, piece) for k, loc in self.cached.items()}
        if self._built is not None and self._built[:2] == (file, piece):
            return self._built[2]  # the writer's and the plan cache's tables are one
        start = self.layout.data_start
        built = {key: item_location(file, e, off, start, piece)
                 for key, e, off in zip(self.keys, self.entries, self.layout.offsets)}
        self._built = (file, piece, built)
        return built


def planned_file(index: int, device: int, items: list[SourceItem], *, mirrors: bool = False,
                 mirror_of: int | None = None) -> PlannedFile:
    """Lay out ``items`` back to back in one file (the plan-cache miss path)."""
    layout = plan_file([it.entry for it in items])
    return PlannedFile(
        index, device, layout, tuple(it.key for it in items),
        [(it.ptr, it.entry.nbytes, off) for it, off in zip(items, layout.offsets)],
        [it.keepalive for it in items], tuple(it.entry for it in items), tuple(items),
        mirrors=mirrors, mirror_of=mirror_of,
    )


# ------------------------------------------------------------------------------ item locations
def item_location(file: str, entry: FileEntry, offset: int, data_start: int, piece: int,
                  crc32c: tuple[int, ...] = (), file_size: int = 0, hash64: int | None = None) -> ItemLocation:
    """Where ``entry`` lives: bytes [offset, offset + nbytes) of ``file``, whose checksum grid
    starts at ``data_start`` with step ``piece``."""
    return ItemLocation(file, offset, entry.nbytes, entry.dtype, entry.shape, crc32c, data_start, piece, file_size,
                        hash64)


def with_piece(loc: ItemLocation, piece: int) -> ItemLocation:
    """The same location on a checksum grid of step ``piece``."""
    return loc._replace(piece_size=piece)


def written(loc: ItemLocation, file: str, crc32c: tuple[int, ...], file_size: int) -> ItemLocation:
    """The final location once the file is durable: its real name, checksums and size."""
    return moved(loc, file, crc32c=crc32c, file_size=file_size)


# ----------------------------------------------------------------------- the plan cache
try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch builds without distributed
    DTensor = None

_MAX_PLANS = 4  # a run may save a few structures (model, optimizer, ...) with separate writers


@dataclass
class Scan:
    """One pass over the flat state dict: the structure signature and, per value in flat order,
    the pointer to copy from and what keeps that memory alive."""

    signature: list
    ptrs: list[int]
    keeps: list
    devices: list[int]  # CUDA device index per value; -1 for host memory
    payloads: dict[int, torch.Tensor]  # the non-tensor values' bytes (uint8), serialized now, by flat position
    names: list[str]  # flat keys, in order
    tensors: list  # per value: the tensor the bytes come from (a DTensor's local shard); None for values
    versions: list  # per value: that tensor's version counter now (items.VersionGuard); None for values
    kinds: list  # per value: what it is (items.classify's answer, decided here once)

    def plain_signature(self) -> tuple:
        """Names, dtypes, shapes and devices of the plain tensors (what ownership decisions key on)."""
        return tuple(e for e in self.signature if len(e) == 5 and e[4] is None)


def _host_or_cuda(t: torch.Tensor) -> int | None:
    """-1 on the CPU, the device index on CUDA, None elsewhere (the full path copies those)."""
    if t.is_cpu:
        return -1
    return t.get_device() if t.is_cuda else None


def _dtensor_entry(v) -> tuple | None:
    """(local tensor, signature element) of a DTensor whose shard is a plain dense tensor."""
    local = v.to_local()
    if type(local) is not _Tensor:
        return None
    return local, (v.dtype, v.shape, v.placements, v.device_mesh, local.shape)


def scan_state(flat: dict) -> Scan | None:
    """The signature of ``flat``'s structure and its memory, or None when the state holds values
    the scan does not cover (see the module docstring). Costs a few attribute reads per tensor.

    The signature holds, per value: its name, then dtype, shape and device of a tensor (and the
    global shape, placements and mesh of a DTensor), or the length of a non-tensor value's bytes.
    """
    sig: list = []
    ptrs: list[int] = []
    keeps: list = []
    devices: list[int] = []
    payloads: dict[int, torch.Tensor] = {}
    tensors: list = []
    kinds: list[str] = []
    for i, (name, v) in enumerate(flat.items()):
        tp = type(v)
        if tp is _Tensor or (tp is _Parameter and type(v.data) is _Tensor):
            if HAS_CHECKPOINTABLE_TENSOR and is_checkpointable_tensor(v):
                return None  # shards of a global tensor (torch 2.14+): DCP's write items
            t, extra = v, None
            kinds.append(PLAIN)
        elif DTensor is not None and tp is DTensor:
            entry = _dtensor_entry(v)
            if entry is None:
                return None
            t, extra = entry
            kinds.append(DTENSOR)
        elif isinstance(v, _Tensor):
            return None  # ShardedTensor, subclasses: DCP's own write items, every time
        else:
            buf = payloads[i] = serialize_object(v)
            sig.append((name, buf.numel()))
            ptrs.append(buf.data_ptr() if buf.numel() else 0)
            keeps.append(buf)
            devices.append(-1)
            tensors.append(None)
            kinds.append(VALUE)
            continue
        dev = _host_or_cuda(t)
        dtype = t.dtype
        # Views whose memory is not their values (strided; a negative bit; a conjugate bit, which
        # changes nothing in a real tensor) and tensors with no memory (ZeroTensor) take the full
        # path: items.py makes their bytes.
        if dev is None or not t.is_contiguous() or t.is_neg() or (dtype.is_complex and t.is_conj()):
            return None
        ptr = t.data_ptr()
        if not ptr and t.numel():
            return None
        sig.append((name, dtype, t.shape, dev, extra))
        ptrs.append(ptr)
        keeps.append(t.untyped_storage())  # the memory itself, even if the tensor's .data is swapped
        devices.append(dev)
        tensors.append(t)
    return Scan(sig, ptrs, keeps, devices, payloads, list(flat), tensors, versions_of(tensors), kinds)


@dataclass(frozen=True)
class FilePlan:
    """One data file of a cached plan: its layout and, in file order, which scanned value each
    item comes from."""

    index: int
    device: int
    layout: FileLayout
    template: tuple[tuple[int, int, int], ...]  # per item: (flat position, nbytes, file offset)
    keys: tuple[ItemKey, ...]
    locations: Mapping[ItemKey, ItemLocation]  # read-only
    mirrors: bool = False
    mirror_of: int | None = None
    untagged: str = ""  # its name without a save tag (the request names the file without the layout module)

    def planned(self, scan: Scan) -> PlannedFile:
        """This file with the memory ``scan`` found (this checkpoint's pointers)."""
        ptrs, keeps = scan.ptrs, scan.keeps
        return PlannedFile(self.index, self.device, self.layout, self.keys,
                           [(ptrs[i], n, off) for i, n, off in self.template],
                           [keeps[i] for i, _, _ in self.template], cached=self.locations,
                           mirrors=self.mirrors, mirror_of=self.mirror_of, untagged=self.untagged)


@dataclass(frozen=True)
class StagePlan:
    """Everything a stage() derives from one structure, for one ``PlanContext``."""

    signature: list
    files: tuple[FilePlan, ...]
    skipped: frozenset  # DTensor replicas another rank writes
    elsewhere: frozenset  # plain tensors the decision gives to other ranks
    decision: frozenset | None  # the ownership decision this plan was built with
    late: tuple[int, ...] = ()  # flat positions of the skipped and elsewhere tensors
    _small: dict = field(default_factory=dict, compare=False, repr=False)  # request_copies memo

    def request_copies(self, max_bytes: int, total: int | None) -> tuple[int, tuple[int, ...]]:
        """(the size items are copied at the request up to, the flat positions of those items):
        what ``request_copy_limit`` picks among this plan's items."""
        found = self._small.get((max_bytes, total))
        if found is None:
            limit = request_copy_limit([n for fp in self.files for _, n, _ in fp.template], max_bytes, total)
            found = self._small[(max_bytes, total)] = (limit, tuple(
                i for fp in self.files for i, n, _ in fp.template if 0 < n <= limit))
        return found


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
                plans.insert(0, plan)  # most recently used first; the least is evicted
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
    same_memory = it.entry.nbytes == 0 or it.ptr == scan.ptrs[i]  # the engine skips empty items
    return it.entry.kind == "tensor" and same_memory and it.device == scan.devices[i]


def plan_stats() -> dict:
    """Process-wide counts of stage() calls that reused a cached plan, and that did not."""
    return {"hits": _hits[0], "misses": _hits[1]}


# ------------------------------------------------------------------ the guard over the items
# Detects a source tensor changed in place while a lazy checkpoint still copies it.
#
# ``stage()`` returns before the bytes are copied; a tensor changed in place before its copy ends
# would put a mix of old and new values in the checkpoint, which its checksums (computed on the
# copied bytes) cannot reveal. Every in-place change bumps a tensor's version counter (shared by
# its views and ``detach()``), so ``stage()`` records each source's counter and the save is
# *sealed* once its copies are done or ordered before later GPU work: the counters are compared
# then, and any change fails the save with the first changed tensor's name. Reading a counter is an
# attribute read per tensor (measured by ``bench``).


class VersionGuard:
    """Names, tensors and their version counters at ``stage()``, in state-dict order; and, for
    the lazily copied ones, the memory the copies read."""

    __slots__ = ("names", "tensors", "versions", "_index", "owners", "addresses")

    def __init__(self, names: list[str], tensors: list[Any], versions: list | None = None,
                 owners: list | None = None, addresses: list[int] | None = None) -> None:
        """``versions``: the counters read already (None entries are not checked); else read now.
        ``owners`` / ``addresses``: per entry, the storage (or a tensor on it) the copy reads and
        the address it reads from (0: nothing), checked by ``first_freed``."""
        self.names = names
        self.tensors = tensors
        self.versions = versions if versions is not None else versions_of(tensors)
        self._index: dict[str, int] | None = None
        self.owners = owners
        self.addresses = addresses

    def first_freed(self) -> str | None:
        """The name of the first guarded tensor whose memory is no longer its storage's (the
        storage was resized: ``untyped_storage().resize_(0)`` frees it, a resize reallocates it,
        with no version bump), so a copy may have read memory reused for something else."""
        if not self.owners:
            return None
        for name, v, owner, address in zip(self.names, self.versions, self.owners, self.addresses):
            if v is None or not address:
                continue
            storage = owner.untyped_storage() if isinstance(owner, torch.Tensor) else owner
            start = storage.data_ptr()
            if not start <= address < start + storage.nbytes():
                return name
        return None

    def first_changed(self) -> tuple[str, int, int] | None:
        """(name, version at stage, version now) of the first tensor changed since, or None."""
        for name, t, v in zip(self.names, self.tensors, self.versions):
            if v is not None:
                now = tensor_version(t)
                if now != v:
                    return name, v, now
        return None

    def changed(self, name: str) -> tuple[int, int] | None:
        """(version at stage, now) when the tensor recorded under ``name`` changed, else None."""
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        i = self._index.get(name)
        if i is None or self.versions[i] is None:
            return None
        now = tensor_version(self.tensors[i])
        return None if now == self.versions[i] else (self.versions[i], now)

    def release(self) -> None:
        """Drop the references to the tensors (the save no longer needs them)."""
        self.tensors = []
        self.versions = []
        self.names = []
        self._index = None
        self.owners = self.addresses = None


def freed_message(path: str, name: str) -> str:
    return (
        f"checkpoint {path}: the memory of tensor {name!r} was freed or reallocated (its storage "
        f"resized, e.g. untyped_storage().resize_(0)) after the save was requested and before its "
        f"copy finished, so the copy may hold other data; it was not committed (the previous "
        f"checkpoint stays). Free or resize a tensor of the state only after the save's "
        f"staging_completion (or dcp_datastates.wait_staged())."
    )


def torn_message(path: str, name: str, before: int, after: int) -> str:
    return (
        f"checkpoint {path}: tensor {name!r} was changed in place after the save was requested and "
        f"before its copy finished (into the host cache, or the file with direct writes) "
        f"(version {before} -> {after}), so the "
        f"checkpoint would mix old and new values; it was not committed (the previous checkpoint "
        f"stays). Make optimizer.step() wait with dcp_datastates.protect_optimizer(optimizer), or "
        f"wait on the save's staging_completion (or call dcp_datastates.wait_staged()) before "
        f"changing parameters or buffers in place (EMA updates, manual p.add_(...))."
    )
