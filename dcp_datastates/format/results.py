"""The write results a rank sends the coordinator: its chunks' locations packed as columns.

DCP gathers every rank's write results at the coordinator, pickled. One ``WriteResult`` per chunk
is several Python objects per chunk to unpickle there, and a 70B model's state under FSDP2 on
1,024 ranks has 2.2 million chunks: the coordinator would spend seconds making objects whose
fields the commit then copies into columns again. A rank instead sends one ``WriteResult``
holding a ``PackedResults``: the same fields as integer arrays (one object to unpickle per rank).
Non-tensor values stay one ``WriteResult`` each: they are few.

A chunk names its tensor by a 64-bit key of the tensor's name (``name_key``), not by the name:
the coordinator holds the names in the metadata it is committing, and maps keys to tensors for
all chunks at once. The chunk's position in its tensor (DCP's index hint) places it in the
table; its offsets, sent too, are compared with that position's (a hint may be wrong, as DCP
says). ``CommitLocations`` is the coordinator's view of all results: the commit's encoder reads
its columns (``format.packed``), anything else may read it as the usual mapping of DCP's
``MetadataIndex`` to ``ItemLocation``, expanded when first asked.
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from .locations import ItemLocation

__all__ = ["PackedResults", "CommitLocations", "pack_write_results", "name_key", "PACKED_RESULTS"]

# The index of a packed results entry: no item of a state dict has this name.
PACKED_RESULTS = MetadataIndex("\x00dcp_datastates.packed_write_results")


@functools.lru_cache(maxsize=1 << 16)
def name_key(fqn: str) -> int:
    """A tensor name's 64-bit key (signed: it fits an int64 column), the same on every host."""
    return int.from_bytes(hashlib.blake2b(fqn.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little", signed=True)


def _column(code: str):
    """A dataclass field holding an empty array of type ``code``."""
    return field(default_factory=lambda: array(code))


# The 64-bit columns sent as 32-bit ones when a rank's values fit (PackedResults.narrow).
NARROWED = ("position", "offsets", "sizes", "offset", "length")
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass
class PackedResults:
    """One rank's chunk locations, item by item in its plan's order (arrays pickle as bytes).

    ``files``: the distinct (file, data_start, piece_size, file_size) of its items, which
    ``record`` indexes; ``dtypes``: the dtype names ``dtype`` indexes. Per item: ``key`` (its
    tensor's ``name_key``), ``position`` (DCP's index hint; -1: none), ``ndim``, then ``ndim``
    values each of ``offsets`` and ``sizes``; ``offset``, ``length``; ``crc_count`` values of
    ``crcs``; ``hash64`` where ``has_hash64`` (both empty when no item has one). The 64-bit
    columns of ``NARROWED`` travel as 32-bit items when all of a rank's values fit (``narrow``):
    the bytes through the coordinator's gather, and the memory they take there, shrink by a
    quarter; readers take each column's type from its array."""

    files: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    key: array = _column("q")
    position: array = _column("q")
    ndim: array = _column("b")
    offsets: array = _column("q")
    sizes: array = _column("q")
    record: array = _column("i")
    dtype: array = _column("b")
    offset: array = _column("q")
    length: array = _column("q")
    crc_count: array = _column("i")
    crcs: array = _column("I")
    hash64: array = _column("Q")
    has_hash64: array = _column("b")

    def __len__(self) -> int:
        return len(self.key)

    def narrow(self) -> None:
        """Each column of ``NARROWED`` whose values all fit 32 bits becomes a 32-bit array."""
        for name in NARROWED:
            col = getattr(self, name)
            if col.typecode == "q" and (not col or (min(col) >= _I32_MIN and max(col) <= _I32_MAX)):
                setattr(self, name, array("i", col))

    def items(self, names: Mapping[int, str]) -> Iterator[tuple[MetadataIndex, ItemLocation]]:
        """Each chunk as DCP's index and our location (``names``: key -> tensor name; a chunk
        of a tensor not named there is left out, as the commit leaves it out)."""
        o = 0
        c = 0
        for i, key in enumerate(self.key):
            nd, n = self.ndim[i], self.crc_count[i]
            offsets, sizes = tuple(self.offsets[o:o + nd]), tuple(self.sizes[o:o + nd])
            crcs = tuple(self.crcs[c:c + n])
            o, c = o + nd, c + n
            h = self.hash64[i] if self.has_hash64 and self.has_hash64[i] else None
            fqn = names.get(key)
            if fqn is None:
                continue
            name, data_start, piece_size, file_size = self.files[self.record[i]]
            p = self.position[i]
            yield (MetadataIndex(fqn, torch.Size(offsets), None if p < 0 else p),
                   ItemLocation(name, self.offset[i], self.length[i], self.dtypes[self.dtype[i]], sizes, crcs,
                                data_start, piece_size, file_size, h))


def pack_write_results(results: list[WriteResult]) -> list[WriteResult]:
    """A rank's write results as the coordinator is sent them: its tensor chunks in one packed
    entry, its other values as they are. Results that do not fit the columns (a value out of
    range: the commit refuses it, naming the item) are sent as they are, all of them."""
    packed = PackedResults()
    out: list[WriteResult] = []
    try:
        total = _pack_into(packed, results, out)
    except (OverflowError, TypeError, ValueError):
        return results
    if len(packed):
        packed.narrow()
        out.append(WriteResult(index=PACKED_RESULTS, size_in_bytes=total, storage_data=packed))
    return out


def _pack_into(packed: PackedResults, results: list[WriteResult], others: list[WriteResult]) -> int:
    """Append each chunk's fields to ``packed`` and every other result to ``others``; the bytes."""
    records: dict[tuple, int] = {}
    dtypes: dict[str, int] = {}
    any_hash = any(r.storage_data.hash64 is not None for r in results if isinstance(r.storage_data, ItemLocation))
    total = 0
    for r in results:
        loc, index = r.storage_data, r.index
        if index.offset is None or not isinstance(loc, ItemLocation) or len(loc.shape) != len(index.offset):
            others.append(r)
            continue
        rec = (loc.file, loc.data_start, loc.piece_size, loc.file_size)
        k = records.get(rec)
        if k is None:
            k = records[rec] = len(packed.files)
            packed.files.append(rec)
        d = dtypes.get(loc.dtype)
        if d is None:
            d = dtypes[loc.dtype] = len(packed.dtypes)
            packed.dtypes.append(loc.dtype)
        packed.key.append(name_key(index.fqn))
        packed.position.append(-1 if index.index is None else index.index)
        packed.ndim.append(len(index.offset))
        packed.offsets.extend(index.offset)
        packed.sizes.extend(loc.shape)
        packed.record.append(k)
        packed.dtype.append(d)
        packed.offset.append(loc.offset)
        packed.length.append(loc.length)
        packed.crc_count.append(len(loc.crc32c))
        packed.crcs.extend(loc.crc32c)
        if any_hash:
            packed.has_hash64.append(loc.hash64 is not None)
            packed.hash64.append(0 if loc.hash64 is None else loc.hash64)
        total += loc.length
    return total


class CommitLocations(Mapping):
    """Every rank's write results at the coordinator, in rank order: ``blocks`` (the packed
    chunks), ``plain`` (results sent one by one; ``chunks_packed``: none of them is a chunk).
    As a mapping (DCP's ``MetadataIndex`` -> ``ItemLocation``, a later result for one index
    winning, as in a dict of all results) it is expanded on first use, naming tensors from
    ``md``."""

    def __init__(self, results: Iterable[list[WriteResult]], md: Metadata) -> None:
        self._sequence = [r for rank_results in results for r in rank_results]
        self.blocks = [r.storage_data for r in self._sequence if isinstance(r.storage_data, PackedResults)]
        self.plain = {r.index: r.storage_data for r in self._sequence if not isinstance(r.storage_data, PackedResults)}
        self.chunks_packed = all(index.offset is None for index in self.plain)
        self._md = md
        self._all: dict[MetadataIndex, ItemLocation] | None = None

    def result_count(self) -> int:
        """The number of results (packed chunks count one each), without expanding."""
        return sum(len(b) for b in self.blocks) + len(self.plain)

    def _expanded(self) -> dict[MetadataIndex, ItemLocation]:
        if self._all is None:
            names = {name_key(fqn): fqn for fqn, smd in self._md.state_dict_metadata.items()
                     if isinstance(smd, TensorStorageMetadata)}
            out: dict[MetadataIndex, ItemLocation] = {}
            for r in self._sequence:
                if isinstance(r.storage_data, PackedResults):
                    out.update(r.storage_data.items(names))
                else:
                    out[r.index] = r.storage_data
            self._all = out
        return self._all

    def __getitem__(self, index: MetadataIndex) -> ItemLocation:
        if self._all is None and index.offset is None and self.chunks_packed:
            # A value: never packed.
            return self.plain[index]
        return self._expanded()[index]

    def __iter__(self) -> Iterator[MetadataIndex]:
        return iter(self._expanded())

    def items(self):
        # The expanded dict's own view: a codec walks every pair without a call per item here.
        return self._expanded().items()

    def __len__(self) -> int:
        return len(self._expanded())
