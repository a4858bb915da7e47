"""Where a saved item lies: its data file, byte range and checksum pieces, or another checkpoint's.

An item's location (``ItemLocation``) names its data file, its bytes in that file and one CRC32C
per checksum piece; an incremental save names a data file of an earlier checkpoint under the same
root instead (a reference, ``reference_name``). Where an item's checksum pieces lie on its file's grid is ``format.pieces``'s
(``piece_ranges``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

__all__ = ["ItemLocation", "moved", "all_written", "FileInfo", "reference_name", "split_reference", "own_files"]

K = TypeVar("K")


class ItemLocation(NamedTuple):
    """Where one saved item (a tensor chunk or a bytes value) lives. This is the ``storage_data``
    of DCP's ``WriteResult`` and of the decoded ``Metadata``. Immutable (shared with cached
    plans); a named tuple because one is built per item of every save and every load, several
    times faster than a frozen dataclass (whose ``__init__`` sets each field through
    ``object.__setattr__``)."""

    file: str
    #: Absolute byte offset in the file.
    offset: int
    length: int
    #: Our dtype name ("uint8" for bytes items).
    dtype: str
    #: The stored chunk's shape.
    shape: tuple[int, ...]
    #: One per piece of the file's checksum grid; () when not computed.
    crc32c: tuple[int, ...]
    #: First data byte of the file (the grid origin).
    data_start: int
    #: Grid step of the checksums.
    piece_size: int
    #: Size of the whole data file (written, or as the metadata records it; 0: not known).
    file_size: int = 0
    # XXH64 (seed 0) of the item's bytes, recorded by incremental saves (save/incremental.py)
    # to find unchanged items next time; None when not computed.
    hash64: int | None = None


def moved(loc: "ItemLocation", file: str, *, crc32c: tuple[int, ...] | None = None,
          file_size: int | None = None) -> "ItemLocation":
    """The same bytes in a file renamed to ``file`` (with its checksums and size, when given)."""
    # Built directly: _replace costs several times more, once per item of a checkpoint.
    return ItemLocation(file, loc.offset, loc.length, loc.dtype, loc.shape, loc.crc32c if crc32c is None else crc32c,
                        loc.data_start, loc.piece_size, loc.file_size if file_size is None else file_size,
                        loc.hash64)


def all_written(locations: Mapping[K, ItemLocation], keys: Sequence[K], file: str, crcs, file_size: int
                ) -> dict[K, ItemLocation]:
    """The final locations of a durable file's items: ``keys`` (in file order) looked up in
    ``locations``, each ``moved`` to ``file`` with its checksums (``crcs``, one sequence per
    item) and the file's size; one call per file, not per item."""
    return {k: ItemLocation(file, loc.offset, loc.length, loc.dtype, loc.shape, tuple(c), loc.data_start,
                            loc.piece_size, file_size, loc.hash64)
            for k, c in zip(keys, crcs) for loc in (locations[k],)}


# References. An item of an incremental save whose bytes are unchanged since an earlier committed
# checkpoint under the same root is not written again: its location names that checkpoint's data
# file as ``../<checkpoint folder>/<data file>``. Exactly that form and nothing else: one level up
# to the root, one folder down, two plain names; the decoder refuses any other path, so a
# metadata file can never make a load read outside the root.
def reference_name(checkpoint: str, file: str) -> str:
    """The name, in a checkpoint's metadata, of data file ``file`` of sibling checkpoint folder
    ``checkpoint`` (both plain names)."""
    return f"../{checkpoint}/{file}"


def split_reference(name: str) -> tuple[str, str] | None:
    """(checkpoint folder, file) of a reference name; None for a file of the checkpoint itself."""
    if not name.startswith("../"):
        return None
    folder, _, file = name[3:].partition("/")
    return folder, file


def own_files(files: dict) -> dict:
    """The entries of ``files`` (keyed by the names a metadata lists) that are files of the
    checkpoint itself, not references."""
    return {name: v for name, v in files.items() if split_reference(name) is None}


@dataclass(frozen=True)
class FileInfo:
    size: int
    data_start: int
    piece_size: int
