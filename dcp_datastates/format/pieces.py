"""Checksum pieces: where an item's pieces lie on the engine's grid, and their check in memory.

Checksum grid. Each data file is cut on a grid of ``piece_size`` bytes from its first data byte;
the part of an item inside one cell is a piece with its own CRC32C. The grid is the engine's
(``csrc/grid.h``: it cuts and checksums on it); ``piece_ranges`` here reads it from there.

The save records one CRC32C per piece. The engine's local read batch checks pieces itself while
they are hot (``Engine.read_into`` with checks); every other path (object-store reads, the drain,
``verify``) reads into memory and calls ``bad_pieces``, the one routine that checks bytes in
memory against their stored CRC32Cs.
"""

from __future__ import annotations

from ..native import engine_module
from .locations import ItemLocation

# The checksum grid is the engine's, computed once (piece_ranges).
_engine = engine_module()

__all__ = ["piece_ranges", "bad_pieces"]


# The checksum grid is the engine's (csrc/grid.h): it cuts and checksums on it, and these read it.
def piece_ranges(loc: ItemLocation) -> list[tuple[int, int]]:
    """(file offset, length) of each checksum piece of an item, in order."""
    return _engine.piece_ranges(loc.offset, loc.length, loc.data_start, loc.piece_size)


def bad_pieces(engine, ranges: list, checks: list, *, first_only: bool = False) -> list[tuple[int, int, int, int, int]]:
    """The pieces whose bytes do not match: ``ranges`` are the (dst_ptr, file_offset, nbytes)
    buffers read, ``checks`` the (range index, file offset, length, crc32c) pieces inside them.
    Returns (range index, offset, length, expected, got) of each bad piece (the first only
    with ``first_only``)."""
    bad = []
    for i, off, length, expected in checks:
        ptr, start, _ = ranges[i]
        got = engine.crc32c(ptr + (off - start), length)
        if got != expected:
            bad.append((i, off, length, expected, got))
            if first_only:
                break
    return bad
