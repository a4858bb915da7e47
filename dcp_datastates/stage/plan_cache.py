"""What ``stage()`` derives from the structure of a state dict alone, cached across checkpoints.

The checkpoints of a training run save the same structure every time: the same names, dtypes,
shapes, devices and shardings. Everything that depends only on that structure (item names and
keys, which rank writes which replicated value, the files and their safetensors headers and
offsets, the item-locations table) is computed once by the full path and reused while a
signature of the structure, recomputed at every ``stage()``, is unchanged. What is read fresh
every time is only what a checkpoint captures: each tensor's memory (pointer and storage) and the
serialized non-tensor values, whose lengths are part of the signature.

States the fast scan does not cover (non-contiguous views, tensors on devices other than CPU and
CUDA, ShardedTensor, CheckpointableTensor shards, tensor subclasses) are never cached: they take the full path every time.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..compat import is_checkpointable_tensor, versions_of
from ..layout import FileLayout, data_file_name
from ..metadata import ItemLocation
from .files import PlanContext, PlannedFile
from .items import ItemKey, SourceItem, bytes_source, serialize_object

__all__ = ["Scan", "FilePlan", "StagePlan", "scan_state", "find_plan", "build_plan", "plan_stats"]

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch builds without distributed
    DTensor = None

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_MAX_PLANS = 4  # a run may save a few structures (model, optimizer, ...) with separate writers


@dataclass
class Scan:
    """One pass over the flat state dict: the structure signature and, per value in flat order,
    the pointer to copy from and what keeps that memory alive."""

    signature: list
    ptrs: list[int]
    keeps: list
    devices: list[int]  # CUDA device index per value; -1 for host memory
    payloads: dict[int, SourceItem]  # the non-tensor values, serialized now, by flat position
    names: list[str]  # flat keys, in order
    tensors: list  # per value: the tensor the bytes come from (a DTensor's local shard); None for values
    versions: list  # per value: that tensor's version counter now (version_guard.py); None for values

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
    payloads: dict[int, SourceItem] = {}
    tensors: list = []
    for i, (name, v) in enumerate(flat.items()):
        tp = type(v)
        if tp is _Tensor or (tp is _Parameter and type(v.data) is _Tensor):
            if is_checkpointable_tensor(v):
                return None  # shards of a global tensor (torch 2.14+): DCP's write items
            t, extra = v, None
        elif DTensor is not None and tp is DTensor:
            entry = _dtensor_entry(v)
            if entry is None:
                return None
            t, extra = entry
        elif isinstance(v, _Tensor):
            return None  # ShardedTensor, subclasses: DCP's own write items, every time
        else:
            item = bytes_source((name, None), name, serialize_object(v))
            payloads[i] = item
            sig.append((name, item.entry.nbytes))
            ptrs.append(item.ptr)
            keeps.append(item.keepalive)
            devices.append(-1)
            tensors.append(None)
            continue
        dev = _host_or_cuda(t)
        if dev is None or not t.is_contiguous():
            return None
        sig.append((name, t.dtype, t.shape, dev, extra))
        ptrs.append(t.data_ptr())
        keeps.append(t.untyped_storage())  # the memory itself, even if the tensor's .data is swapped
        devices.append(dev)
        tensors.append(t)
    return Scan(sig, ptrs, keeps, devices, payloads, list(flat), tensors, versions_of(tensors))


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

    def planned(self, scan: Scan) -> PlannedFile:
        """This file with the memory ``scan`` found (this checkpoint's pointers)."""
        ptrs, keeps = scan.ptrs, scan.keeps
        return PlannedFile(self.index, self.device, self.layout, self.keys,
                           [(ptrs[i], n, off) for i, n, off in self.template],
                           [keeps[i] for i, _, _ in self.template], cached=self.locations)


@dataclass(frozen=True)
class StagePlan:
    """Everything a stage() derives from one structure, for one ``PlanContext``."""

    signature: list
    files: tuple[FilePlan, ...]
    skipped: frozenset  # DTensor replicas another rank writes
    elsewhere: frozenset  # plain tensors the decision gives to other ranks
    decision: frozenset | None  # the ownership decision this plan was built with
    late: tuple[int, ...] = ()  # flat positions of the skipped and elsewhere tensors


_plans: dict[PlanContext, list[StagePlan]] = {}
_plans_lock = threading.Lock()
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
        locations = types.MappingProxyType(dict(pf.locations(data_file_name(context.rank, pf.index), piece)))
        file_plans.append(FilePlan(pf.index, pf.device, pf.layout, tuple(template), pf.keys, locations))
    late = tuple(sorted(position[k[0]] for k in (*skipped, *elsewhere) if k[0] in position))
    plan = StagePlan(scan.signature, tuple(file_plans), frozenset(skipped), frozenset(elsewhere), decision, late)
    with _plans_lock:
        kept = [p for p in _plans.get(context, ()) if p.signature != scan.signature]
        _plans[context] = [plan] + kept[: _MAX_PLANS - 1]
    return plan


def _same_source(scan: Scan, i: int, it: SourceItem) -> bool:
    if i in scan.payloads:
        return it.entry.kind == "bytes" and it.entry.nbytes == scan.payloads[i].entry.nbytes
    same_memory = it.entry.nbytes == 0 or it.ptr == scan.ptrs[i]  # the engine skips empty items
    return it.entry.kind == "tensor" and same_memory and it.device == scan.devices[i]


def plan_stats() -> dict:
    """Process-wide counts of stage() calls that reused a cached plan, and that did not."""
    return {"hits": _hits[0], "misses": _hits[1]}
