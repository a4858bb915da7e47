"""Checksum pieces: the one routine that checks bytes in memory against their stored CRC32Cs.

Each item's bytes are cut into pieces on the file's checksum grid (``layout.piece_ranges``);
the save records one CRC32C per piece. The engine's local read batch checks pieces itself while
they are hot (``Engine.read_into`` with checks); every other path (object-store reads, the drain,
``verify``) reads into memory and calls ``bad_pieces``.
"""

from __future__ import annotations

__all__ = ["bad_pieces"]


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
