"""One data file of a stage plan, and every ``ItemLocation`` the writer reports, built here only.

A ``PlannedFile`` is what the writer hands the engine for one file: the layout (header, offsets,
size), and per item in file order its key, its memory (pointer, length, file offset) and what
keeps that memory alive. It comes out of the same constructor on a plan-cache miss (laid out
from the items) and on a hit (the cached layout with this checkpoint's pointers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..layout import FileEntry, FileLayout, plan_file
from ..metadata import ItemLocation
from .items import ItemKey, SourceItem

__all__ = ["PlanContext", "PlannedFile", "planned_file", "item_location", "with_piece", "written", "moved"]


@dataclass(frozen=True)
class PlanContext:
    """What a cached stage plan is valid for, besides the state's structure."""

    rank: int
    world: int
    dedup: bool  # replicated values are written by one rank
    cuda: bool  # the engine copies from CUDA memory itself


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


def planned_file(index: int, device: int, items: list[SourceItem]) -> PlannedFile:
    """Lay out ``items`` back to back in one file (the plan-cache miss path)."""
    layout = plan_file([it.entry for it in items])
    return PlannedFile(
        index, device, layout, tuple(it.key for it in items),
        [(it.ptr, it.entry.nbytes, off) for it, off in zip(items, layout.offsets)],
        [it.keepalive for it in items], tuple(it.entry for it in items), tuple(items),
    )


# ------------------------------------------------------------------------------ item locations
def item_location(file: str, entry: FileEntry, offset: int, data_start: int, piece: int,
                  crc32c: tuple[int, ...] = (), file_size: int = 0) -> ItemLocation:
    """Where ``entry`` lives: bytes [offset, offset + nbytes) of ``file``, whose checksum grid
    starts at ``data_start`` with step ``piece``."""
    return ItemLocation(file, offset, entry.nbytes, entry.dtype, entry.shape, crc32c, data_start, piece, file_size)


def with_piece(loc: ItemLocation, piece: int) -> ItemLocation:
    """The same location on a checksum grid of step ``piece``."""
    return dataclasses.replace(loc, piece_size=piece)


def written(loc: ItemLocation, file: str, crc32c: tuple[int, ...], file_size: int) -> ItemLocation:
    """The final location once the file is durable: its real name, checksums and size."""
    return dataclasses.replace(loc, file=file, crc32c=crc32c, file_size=file_size)


def moved(loc: ItemLocation, file: str) -> ItemLocation:
    """The same bytes in a file renamed to ``file``."""
    return dataclasses.replace(loc, file=file)
