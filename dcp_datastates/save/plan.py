"""The plan types: what planning a save on this rank produces, pure data.

- ``PlanContext``: what a plan is valid for besides the state's structure (the plan cache's key).
- ``RankPlan``: what ``stage()`` submits for one checkpoint on this rank: its ``PlannedFile``s
  (one data file each: layout, per item its key, memory and keep-alive), its ``HeldGroup``s and
  its version guards.
- ``StagePlan`` / ``FilePlan``: what the plan cache keeps for one structure, made again with this
  checkpoint's pointers (``FilePlan.planned``).
- ``item_location``: every ``ItemLocation`` the writer reports is built here only.

No import of the runtime, the storage or the engine (.importlinter, "the plan is pure").
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import Any, Callable

from ..format.layout import FileEntry, FileLayout, plan_file
from ..format.locations import ItemLocation
from .copy_at_request import request_copy_limit
from .items import ItemKey, SourceItem
from .ownership import DecisionKey, Mirroring
from .scan import Scan
from .version_guard import VersionGuard

__all__ = ["PlanContext", "HeldGroup", "RankPlan", "PlannedFile", "planned_file", "FilePlan", "StagePlan",
           "item_location", "with_piece"]


@dataclass(frozen=True)
class PlanContext:
    """Who this rank is and how it writes its files: what a plan (a cached one too) is valid for,
    besides the state's structure.

    - ``dedup``: replicated values are written by one rank.
    - ``cuda``: the engine copies from CUDA memory itself.
    - ``mirroring``: peer_copies: who keeps whose copies (mirrored files).
    - ``files_per_group``: host items this rank writes itself: in up to this many files
      (``split_for_writers``).
    """

    rank: int
    world: int
    dedup: bool
    cuda: bool
    mirroring: Mirroring | None = None
    files_per_group: int = 1


@dataclass
class HeldGroup:
    """Items copied now whose file is written later: ``known`` when this rank writes all of them
    (only the folder is not named yet), else DCP's plan selects them.

    peer_copies: with ``mirrors`` the keeper stages the same file (ownership.py, Mirrors);
    ``mirror_of`` is the same file as that rank's mirrored one.
    """

    items: list[SourceItem]
    known: bool
    mirrors: bool = False
    mirror_of: int | None = None


@dataclass(eq=False)
class RankPlan:
    """What ``stage()`` submits for one checkpoint on this rank.

    - ``files``: written at once, in this order (k of ``__<rank>_<k>``).
    - ``held``: staged now, written after DCP's planning.
    - ``skipped``: DTensor replicas another rank writes; ``elsewhere``: plain tensors the
      ownership decision gives to other ranks (both read only from here on: a cached plan's
      frozensets are handed on as they are).
    - ``guard``: the sources copied lazily.
    - ``late_guard``: tensors this rank may have to write later from live memory.
    - ``decision_key``: what the ownership decision is kept under.
    - ``learn``: no decision was known: learn it from this save's plan.
    - ``payloads``: fqn -> uint8 tensor: a value's bytes as serialized now.
    - ``copy_limit``: items of 1..copy_limit bytes are copied at the request (``request_copy_limit``).
    """

    files: list[PlannedFile]
    held: list[HeldGroup]
    skipped: Set
    elsewhere: Set
    guard: VersionGuard
    late_guard: VersionGuard
    decision_key: DecisionKey | None = None
    learn: bool = False
    plain_keys: frozenset = frozenset()
    _record: Callable[[int], object] | None = field(default=None, repr=False)
    payloads: dict = field(default_factory=dict)
    copy_limit: int = 0

    def remember(self, piece: int) -> None:
        """Cache this (missed) plan for the next checkpoints, on a checksum grid of step ``piece``."""
        if self._record is not None:
            self._record(piece)


@dataclass(eq=False)
class PlannedFile:
    """One data file to write: ``index`` is k of ``__<rank>_<k>``; items are in file order.

    - ``device``: CUDA device the items' memory is on; -1: host memory.
    - ``spans``: per item: (pointer, nbytes, file offset), for the engine.
    - ``keepalive``: per item: what owns that memory until the engine copied it.
    - ``entries``: the miss path's items (the hit path reuses ``cached``); ``sources``: the miss
      path's items, for the plan cache's checks.
    - ``cached``: locations of a cached plan (read-only).
    - ``mirrors``: peer_copies: the keeper stages this same file (ownership.py); ``mirror_of``:
      peer_copies: the same file as that rank's mirrored one.
    - ``untagged``: a cached plan's file name (no save tag); None: named from the rank.
    - ``_built``: (file, piece, locations) last built.
    """

    index: int
    device: int
    layout: FileLayout
    keys: tuple[ItemKey, ...]
    spans: list[tuple[int, int, int]]
    keepalive: list[Any]
    entries: tuple[FileEntry, ...] = ()
    sources: tuple[SourceItem, ...] = ()
    cached: Mapping[ItemKey, ItemLocation] | None = None
    mirrors: bool = False
    mirror_of: int | None = None
    untagged: str | None = None
    _built: tuple | None = field(default=None, repr=False)

    def locations(self, file: str, piece: int) -> Mapping[ItemKey, ItemLocation]:
        """Each item's location in ``file`` (the base name, no save tag), checksums not known yet,
        on an engine whose checksum grid step is ``piece``."""
        if self.cached is not None:
            first = next(iter(self.cached.values()), None)
            if first is None or first.piece_size == piece:
                return self.cached
            return {k: with_piece(loc, piece) for k, loc in self.cached.items()}
        if self._built is not None and self._built[:2] == (file, piece):
            # the writer's and the plan cache's tables are one
            return self._built[2]
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


# ------------------------------------------------------------------ cached plans
@dataclass(frozen=True)
class FilePlan:
    """One data file of a cached plan: its layout and, in file order, which scanned value each
    item comes from.

    - ``template``: per item: (flat position, nbytes, file offset).
    - ``locations``: read-only.
    - ``untagged``: its name without a save tag (the request names the file without the layout module).
    """

    index: int
    device: int
    layout: FileLayout
    template: tuple[tuple[int, int, int], ...]
    keys: tuple[ItemKey, ...]
    locations: Mapping[ItemKey, ItemLocation]
    mirrors: bool = False
    mirror_of: int | None = None
    untagged: str = ""

    def planned(self, scan: Scan) -> PlannedFile:
        """This file with the memory ``scan`` found (this checkpoint's pointers)."""
        ptrs, keeps = scan.ptrs, scan.keeps
        return PlannedFile(self.index, self.device, self.layout, self.keys,
                           [(ptrs[i], n, off) for i, n, off in self.template],
                           [keeps[i] for i, _, _ in self.template], cached=self.locations,
                           mirrors=self.mirrors, mirror_of=self.mirror_of, untagged=self.untagged)


@dataclass(frozen=True)
class StagePlan:
    """Everything a stage() derives from one structure, for one ``PlanContext``.

    - ``skipped``: DTensor replicas another rank writes.
    - ``elsewhere``: plain tensors the decision gives to other ranks.
    - ``decision``: the ownership decision this plan was built with.
    - ``late``: flat positions of the skipped and elsewhere tensors.
    - ``_small``: ``request_copies`` memo.
    """

    signature: list
    files: tuple[FilePlan, ...]
    skipped: frozenset
    elsewhere: frozenset
    decision: frozenset | None
    late: tuple[int, ...] = ()
    _small: dict = field(default_factory=dict, compare=False, repr=False)

    def request_copies(self, max_bytes: int, total: int | None) -> tuple[int, tuple[int, ...]]:
        """(the size items are copied at the request up to, the flat positions of those items):
        what ``request_copy_limit`` picks among this plan's items."""
        found = self._small.get((max_bytes, total))
        if found is None:
            limit = request_copy_limit([n for fp in self.files for _, n, _ in fp.template], max_bytes, total)
            found = self._small[(max_bytes, total)] = (limit, tuple(
                i for fp in self.files for i, n, _ in fp.template if 0 < n <= limit))
        return found
