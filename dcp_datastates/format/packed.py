"""The ``.metadata`` codec at scale (format version 3): the chunk table as packed columns.

Versions 1 and 2 spend one JSON object per chunk: about 150 bytes, and tens of microseconds to
decode into DCP's objects. A 70B model's state under FSDP2 on 1,024 ranks has about 2.2 million
chunks, which every rank would decode at every restart. Version 3 keeps the document JSON (the
head, the data files, the non-tensor values as in version 1, one short entry per tensor) and
stores the chunk table as columns of integers. Each column is delta-coded, narrowed to the
smallest integer type that holds it, deflated and base64-encoded, with a CRC32 of its bytes: a
regular sharding (every rank's file laid out alike) packs to a few bytes per chunk, the checksums
of the pieces dominate.

Decoding checks the whole table with vectorised torch operations, as the version 1 decoder checks
each chunk: ranges inside their file's data region, one checksum per piece of the grid, chunks
inside their tensor and holding its number of elements, lengths matching shapes, no two items
sharing bytes. DCP's objects are then made per tensor when first asked for (``PackedItems``,
``PackedLocations``): a rank that loads a few tensors, or asks for the chunks near its own
(``PackedItems.narrowed``), never builds the others'.

The columns, in chunk order (tensors in document order, each tensor's chunks in DCP's order):
``chunks`` (per tensor: its number of chunks), ``offsets`` and ``sizes`` (per tensor, dimension
by dimension: every chunk's offset in dim 0, then in dim 1 ...), ``file`` (index into the
document's files), ``offset``, ``length``, ``crc_count`` (0: not computed), ``crc32c`` (the
pieces' checksums back to back), and ``hash64`` with ``has_hash64`` when hashes were recorded.
"""
from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .checks import _MAX_DIMS, _MAX_INT, _MAX_NUMEL, _Check
from .chunk_table import (
    _READ_ONLY,
    _U32,
    _U64,
    _check_items_apart,
    _check_table,
    _memory_at,
    _require_little_endian,
    _Table,
    _unpack,
)
from .document import PACKED_VERSION, decode_planner_data, decode_storage_meta
from .items_codec import _numel, bytes_location
from .layout import dtype_to_name, name_to_dtype
from .locations import FileInfo, ItemLocation


# ------------------------------------------------------------------------------- decode
def decode_packed(doc: dict, c: _Check, files: dict[str, FileInfo]) -> Metadata:
    """DCP's ``Metadata`` of a version 3 document whose data files ``files`` are already checked:
    the table is checked whole, DCP's objects are made when asked for."""
    _require_little_endian(c)
    entries = c.get(doc, "tensors", list, "the document")
    fqns, dtypes, grads, sizes = [], [], [], []
    for i, entry in enumerate(entries):
        where = f"tensors[{i}]"
        if type(entry) is not list or len(entry) != 4 or type(entry[0]) is not str or type(entry[1]) is not str \
                or type(entry[2]) is not bool or type(entry[3]) is not list:
            raise c.fail(f"{where} should be [name, dtype, requires_grad, size]")
        fqn, dname, grad, size = entry
        try:
            dtype = name_to_dtype(dname)
        except ValueError as exc:
            raise c.fail(f"item {fqn!r}: {exc}") from None
        if len(size) > _MAX_DIMS or not all(type(d) is int and 0 <= d <= _MAX_INT for d in size):
            raise c.fail(f"item {fqn!r}: size is not a list of at most {_MAX_DIMS} non-negative 63-bit integers")
        if _numel(size) > _MAX_NUMEL:
            raise c.fail(f"item {fqn!r}: absurd number of elements {_numel(size)} for size {size}")
        fqns.append(fqn)
        dtypes.append(dtype)
        grads.append(grad)
        sizes.append(tuple(size))
    columns = c.get(doc, "columns", dict, "the document")
    counts = _unpack(c, columns, "chunks", len(fqns))
    n_chunks = int(counts.clamp(min=0).sum())
    n_values = sum(int(k) * len(s) for k, s in zip(counts.clamp(min=0).tolist(), sizes))
    hashed = "hash64" in columns
    table = _Table(
        fqns, dtypes, grads, sizes, counts,
        _unpack(c, columns, "offsets", n_values), _unpack(c, columns, "sizes", n_values),
        _unpack(c, columns, "file", n_chunks), _unpack(c, columns, "offset", n_chunks),
        _unpack(c, columns, "length", n_chunks), _unpack(c, columns, "crc_count", n_chunks),
        _unpack(c, columns, "crc32c") & _U32,
        _unpack(c, columns, "hash64", n_chunks) if hashed else None,
        _unpack(c, columns, "has_hash64", n_chunks) if hashed else None,
        list(files), list(files.values()),
    )
    derived = _check_table(c, table)
    values: dict[str, ItemLocation] = {}
    for fqn, item in c.get(doc, "values", dict, "the document").items():
        where = f"item {fqn!r}"
        if c.get(item, "type", str, where) != "bytes":
            raise c.fail(f"{where}: unknown item type {item.get('type')!r}")
        values[fqn] = bytes_location(c, item, where, files)
    if set(values) & set(fqns):
        raise c.fail(f"item {sorted(set(values) & set(fqns))[0]!r} is both a tensor and a value")
    _check_items_apart(c, table, list(values.items()))
    columns_kept = _Columns(table, *derived)
    return Metadata(
        state_dict_metadata=PackedItems(columns_kept, values),
        planner_data=decode_planner_data(c, doc),
        storage_data=PackedLocations(columns_kept, values, files),
        storage_meta=decode_storage_meta(c, doc),
        version=c.optional_str(doc, "dcp_version", "the document"),
    )


def unpack_items(tensors: list, values: list, columns: dict) -> "PackedItems":
    """The items ``format.packed_encode.pack_items`` packed, as a ``PackedItems`` whose objects
    are made when asked for (no locations: the metadata DCP sends every rank after a save)."""
    c = _Check("the checkpoint's metadata as sent by the coordinator")
    fqns = [t[0] for t in tensors]
    sizes = [tuple(t[3]) for t in tensors]
    counts = _unpack(c, columns, "chunks", len(fqns))
    n_values = sum(k * len(s) for k, s in zip(counts.tolist(), sizes))
    none = torch.zeros(0, dtype=torch.int64)
    table = _Table(fqns, [name_to_dtype(t[1]) for t in tensors], [t[2] for t in tensors], sizes, counts,
                   _unpack(c, columns, "offsets", n_values), _unpack(c, columns, "sizes", n_values),
                   none, none, none, none, none, None, None, [], [])
    # No bisection: every chunk is a candidate.
    unsorted = torch.zeros(len(fqns), dtype=torch.bool)
    return PackedItems(_Columns(table, torch.zeros(1, dtype=torch.int64), unsorted, torch.zeros(len(fqns), dtype=torch.int64)),
                       dict.fromkeys(values))


class _Columns:
    """The checked table as flat views of its columns (one value read in tens of nanoseconds,
    no copy), shared by the two mappings DCP sees; picklable (as arrays)."""

    _VIEWS = ("offsets", "chunk_sizes", "file", "offset", "length", "crc_start", "crcs", "hash64", "has_hash64")

    def __init__(self, table: _Table, crc_starts: torch.Tensor, sorted0: torch.Tensor, widest0: torch.Tensor):
        self.fqns = table.fqns
        self.tensor_index = {fqn: t for t, fqn in enumerate(table.fqns)}
        self.dtypes, self.requires_grad, self.sizes = table.dtypes, table.requires_grad, table.sizes
        self.dtype_names = [dtype_to_name(d) for d in table.dtypes]
        self.counts = table.counts.tolist()
        self.chunk_start = table.chunk_starts().tolist()
        self.element_start = table.element_starts().tolist()
        # The memory the views read.
        self._memory: list[torch.Tensor] = []
        self.offsets, self.chunk_sizes = self._flat(table.offsets), self._flat(table.chunk_sizes)
        self.file, self.offset, self.length = self._flat(table.file), self._flat(table.offset), self._flat(table.length)
        self.crc_start, self.crcs = self._flat(crc_starts), self._flat(table.crcs)
        self.hash64 = None if table.hash64 is None else self._flat(table.hash64)
        self.has_hash64 = None if table.has_hash64 is None else self._flat(table.has_hash64)
        self.file_names, self.file_infos = table.file_names, table.file_infos
        self.sorted0, self.widest0 = sorted0.tolist(), widest0.tolist()

    def _flat(self, t: torch.Tensor) -> memoryview:
        """An int64 column as a flat view of its memory, kept alive with this object."""
        column = t.to(torch.int64).contiguous()
        self._memory.append(column)
        if column.numel() == 0:
            return memoryview(b"").cast("q")
        return _memory_at(column.data_ptr(), column.numel() * 8, _READ_ONLY).cast("q")

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k != "_memory"}
        for name in self._VIEWS:
            if state.get(name) is not None:
                state[name] = array("q", state[name].tobytes())
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _memory=[])

    def dim_values(self, t: int, column, d: int):
        """Every chunk's value in dimension ``d`` of tensor ``t`` (``offsets`` or ``chunk_sizes``)."""
        k, base = self.counts[t], self.element_start[t]
        return column[base + d * k: base + (d + 1) * k]

    def box(self, t: int, p: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, sizes) of chunk ``p`` of tensor ``t``."""
        k, base, nd = self.counts[t], self.element_start[t], len(self.sizes[t])
        idx = range(base + p, base + nd * k, k)
        return tuple(self.offsets[i] for i in idx), tuple(self.chunk_sizes[i] for i in idx)

    def chunks(self, t: int, positions=None) -> list[ChunkStorageMetadata]:
        """DCP's chunk objects of tensor ``t`` (all, or those at ``positions``)."""
        k, base, nd = self.counts[t], self.element_start[t], len(self.sizes[t])
        make, size_of = ChunkStorageMetadata, torch.Size
        if positions is not None:
            # A few chunks: read where they are.
            offs, sizes, dims = self.offsets, self.chunk_sizes, range(base, base + nd * k, k)
            return [make(offsets=size_of([offs[i + p] for i in dims]), sizes=size_of([sizes[i + p] for i in dims]))
                    for p in positions]
        # Dimension-major columns turned chunk by chunk with zip; one Python call per object.
        offs = self.offsets[base: base + nd * k].tolist()
        sizes = self.chunk_sizes[base: base + nd * k].tolist()
        if nd == 0:
            return [make(offsets=size_of(), sizes=size_of()) for _ in range(k)]
        return list(map(make, map(size_of, zip(*[offs[d * k:(d + 1) * k] for d in range(nd)])),
                        map(size_of, zip(*[sizes[d * k:(d + 1) * k] for d in range(nd)]))))

    def metadata(self, t: int, chunks: list[ChunkStorageMetadata]) -> TensorStorageMetadata:
        props = TensorProperties(dtype=self.dtypes[t], requires_grad=self.requires_grad[t])
        return TensorStorageMetadata(properties=props, size=torch.Size(self.sizes[t]), chunks=chunks)

    def location(self, t: int, p: int) -> ItemLocation:
        ci = self.chunk_start[t] + p
        f = self.file[ci]
        info = self.file_infos[f]
        digest = None
        if self.hash64 is not None and self.has_hash64[ci]:
            digest = self.hash64[ci] & _U64
        crcs = tuple(self.crcs[self.crc_start[ci]: self.crc_start[ci + 1]])
        return ItemLocation(self.file_names[f], self.offset[ci], self.length[ci], self.dtype_names[t],
                            self.box(t, p)[1], crcs, info.data_start, info.piece_size, info.size, digest)

    def find(self, t: int, offsets) -> int | None:
        """Position of the chunk of tensor ``t`` at ``offsets``; None when there is none."""
        want = tuple(int(o) for o in offsets)
        if len(want) != len(self.sizes[t]):
            return None
        if not want:
            return 0 if self.counts[t] else None
        first = self.dim_values(t, self.offsets, 0)
        span = self._span(t, first, want[0], want[0] + 1, 1)
        return next((p for p in span if first[p] == want[0] and self.box(t, p)[0] == want), None)

    def near(self, t: int, lo: int, hi: int) -> list[int]:
        """Positions of the non-empty chunks of tensor ``t`` whose extent in dimension 0 meets
        [lo, hi) (the only ones that can overlap a box with that extent)."""
        first = self.dim_values(t, self.offsets, 0)
        sizes0 = self.dim_values(t, self.chunk_sizes, 0)
        span = self._span(t, first, lo, hi, self.widest0[t])
        return [p for p in span if first[p] < hi and lo < first[p] + sizes0[p]]

    def _span(self, t: int, first, lo: int, hi: int, widest: int) -> range:
        """The positions whose dim-0 offset lies in (lo - widest, hi): a bisection when the offsets
        are sorted (DCP's order for the shardings it makes), every position otherwise."""
        if not self.sorted0[t]:
            return range(len(first))
        return range(bisect.bisect_right(first, lo - widest), bisect.bisect_left(first, hi))


class PackedItems(Mapping):
    """``Metadata.state_dict_metadata`` of a version 3 document: DCP's storage metadata of an item,
    made when first asked for and kept."""

    def __init__(self, columns: _Columns, values: dict[str, ItemLocation]):
        self._columns = columns
        self._values = values
        self._made: dict[str, Any] = {}

    def __getitem__(self, fqn: str):
        made = self._made.get(fqn)
        if made is not None:
            return made
        t = self._columns.tensor_index.get(fqn)
        if t is None:
            if fqn not in self._values:
                raise KeyError(fqn)
            made = BytesStorageMetadata()
        else:
            made = self._columns.metadata(t, self._columns.chunks(t))
        self._made[fqn] = made
        return made

    def __iter__(self) -> Iterator[str]:
        yield from self._columns.fqns
        yield from self._values

    def __len__(self) -> int:
        return len(self._columns.fqns) + len(self._values)

    def __contains__(self, fqn) -> bool:
        return fqn in self._columns.tensor_index or fqn in self._values

    def described(self, fqn: str):
        """The storage metadata of ``fqn`` without its chunks (kind, dtype, size: what a check of
        the destination needs); None when the checkpoint has no such item."""
        t = self._columns.tensor_index.get(fqn)
        if t is None:
            return BytesStorageMetadata() if fqn in self._values else None
        return self._columns.metadata(t, [])

    def narrowed(self, fqn: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]):
        """(storage metadata of ``fqn`` listing only the chunks that may overlap ``boxes`` (a rank's
        own chunks: (offsets, sizes)), their positions among all the chunks); None for a value or
        a 0-d tensor. DCP's resharding then compares a rank's chunks with these few, not all."""
        t = self._columns.tensor_index.get(fqn)
        if t is None or not self._columns.sizes[t]:
            return None
        positions: set[int] = set()
        for offsets, sizes in boxes:
            positions.update(self._columns.near(t, offsets[0], offsets[0] + sizes[0]))
        keep = sorted(positions)
        return self._columns.metadata(t, self._columns.chunks(t, keep)), keep


class PackedLocations(Mapping):
    """``Metadata.storage_data`` of a version 3 document: MetadataIndex -> ItemLocation, made per
    lookup (DCP's read items carry the chunk's position: one comparison finds it), plus the data
    files (``files``) as the reader keeps them."""

    def __init__(self, columns: _Columns, values: dict[str, ItemLocation], files: dict[str, FileInfo]):
        self._columns = columns
        self._values = values
        self.files = files
        self.format_version = PACKED_VERSION

    def __getitem__(self, index: MetadataIndex) -> ItemLocation:
        cols = self._columns
        if index.offset is None:
            return self._values[index.fqn]
        t = cols.tensor_index.get(index.fqn)
        if t is None:
            raise KeyError(index)
        p = index.index
        if p is None or not 0 <= p < cols.counts[t] or cols.box(t, p)[0] != tuple(index.offset):
            p = cols.find(t, index.offset)
            if p is None:
                raise KeyError(index)
        return cols.location(t, p)

    def __iter__(self) -> Iterator[MetadataIndex]:
        cols = self._columns
        for fqn in self._values:
            yield MetadataIndex(fqn)
        for t, fqn in enumerate(cols.fqns):
            for p, chunk in enumerate(cols.chunks(t)):
                yield MetadataIndex(fqn, chunk.offsets, p)

    def __len__(self) -> int:
        return self._columns.chunk_start[-1] + len(self._values)

