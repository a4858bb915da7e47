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

import base64
import binascii
import bisect
import itertools
import json
import sys
import zlib
from array import array
from collections.abc import Iterator, Mapping
from json.encoder import encode_basestring_ascii as _json_str
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

from .layout import (
    _MAX_DIMS,
    _MAX_INT,
    _MAX_NUMEL,
    PACKED_VERSION,
    FileInfo,
    ItemLocation,
    _Check,
    _check_file,
    _check_file_name,
    _numel,
    bytes_location,
    decode_planner_data,
    decode_storage_meta,
    document_head,
    dtype_to_name,
    name_to_dtype,
)

__all__ = ["encode_packed", "decode_packed", "PackedItems", "PackedLocations"]

# Integer types a column is narrowed to, smallest first.
_INT_TYPES = (("i1", torch.int8), ("i2", torch.int16), ("i4", torch.int32), ("i8", torch.int64))
_BY_NAME = dict(_INT_TYPES)
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1


# ------------------------------------------------------------------------------- columns
def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a 1-D tensor (little-endian: the hosts torch runs on)."""
    if t.numel() == 0:
        return b""
    buf = bytearray(t.numel() * t.element_size())
    torch.frombuffer(buf, dtype=t.dtype).copy_(t)
    return bytes(buf)


def _pack(values: torch.Tensor, *, delta: bool = True) -> dict:
    """A column: int64 values, delta-coded (unless ``delta`` is off), narrowed, deflated."""
    v = values
    if delta and v.numel() > 1:
        v = torch.cat((v[:1], v[1:] - v[:-1]))
    lo, hi = (int(v.min()), int(v.max())) if v.numel() else (0, 0)
    name, dtype = next((n, d) for n, d in _INT_TYPES if torch.iinfo(d).min <= lo and hi <= torch.iinfo(d).max)
    raw = _tensor_bytes(v.to(dtype))
    return {"int": name, "delta": delta, "n": int(v.numel()), "crc32": zlib.crc32(raw),
            "data": base64.b64encode(zlib.compress(raw, 1)).decode("ascii")}


def _unpack(c: _Check, columns: Any, key: str, count: int | None = None) -> torch.Tensor:
    """Column ``key`` as int64 values, after checking its record, size and CRC32."""
    where = f"column {key!r}"
    if not isinstance(columns, dict) or not isinstance(columns.get(key), dict):
        raise c.fail(f"missing {where} of the chunk table")
    rec = columns[key]
    name = c.get(rec, "int", str, where)
    dtype = _BY_NAME.get(name)
    if dtype is None:
        raise c.fail(f"{where}: unknown integer type {name!r} (one of {', '.join(_BY_NAME)})")
    n = c.nonneg(rec, "n", where)
    if count is not None and n != count:
        raise c.fail(f"{where} holds {n} values, the table needs {count}")
    delta = c.get(rec, "delta", bool, where)
    size = n * dtype.itemsize
    try:
        packed = base64.b64decode(c.get(rec, "data", str, where), validate=True)
        inflate = zlib.decompressobj()
        raw = inflate.decompress(packed, size + 1)  # never more than the column's size
    except (binascii.Error, ValueError, zlib.error) as exc:
        raise c.fail(f"{where} is damaged ({exc})") from None
    if len(raw) != size or not inflate.eof:
        raise c.fail(f"{where} holds {len(raw)}{'+' if not inflate.eof else ''} bytes, {n} values of {name} "
                     f"are {size}")
    if zlib.crc32(raw) != c.nonneg(rec, "crc32", where):
        raise c.fail(f"{where}: checksum mismatch (the metadata file is damaged)")
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    values = torch.frombuffer(bytearray(raw), dtype=dtype).to(torch.int64)
    return torch.cumsum(values, 0) if delta else values


def _ints(values: list) -> torch.Tensor:
    """Python ints as an int64 tensor (through an array: several times faster than torch.tensor)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _as_array(t: torch.Tensor, code: str = "q") -> array:
    """A column as a Python array: indexing one value costs tens of nanoseconds, not a tensor op."""
    out = array(code)
    out.frombytes(_tensor_bytes(t.to({"q": torch.int64, "i": torch.int32}[code])))
    return out


# ------------------------------------------------------------------------------- the table
class _Table:
    """The decoded (or about to be encoded) chunk table: per tensor lists, per chunk columns."""

    def __init__(self, fqns, dtypes, requires_grad, sizes, counts, offsets, chunk_sizes, file, offset, length,
                 crc_count, crcs, hash64, has_hash64, file_names, file_infos):
        self.fqns: list[str] = fqns
        self.dtypes: list[torch.dtype] = dtypes
        self.requires_grad: list[bool] = requires_grad
        self.sizes: list[tuple[int, ...]] = sizes
        self.counts, self.offsets, self.chunk_sizes = counts, offsets, chunk_sizes  # tensors (int64)
        self.file, self.offset, self.length, self.crc_count, self.crcs = file, offset, length, crc_count, crcs
        self.hash64, self.has_hash64 = hash64, has_hash64
        self.file_names: list[str] = file_names
        self.file_infos: list[FileInfo] = file_infos

    def chunk_starts(self) -> torch.Tensor:
        """Index of each tensor's first chunk, and the total, as T + 1 values."""
        return torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(self.counts, 0)))

    def element_starts(self) -> torch.Tensor:
        """Index of each tensor's first value in ``offsets``/``chunk_sizes``, and the total."""
        ndims = torch.tensor([len(s) for s in self.sizes], dtype=torch.int64)
        return torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(self.counts * ndims, 0)))


def _first(bad: torch.Tensor, starts: torch.Tensor) -> tuple[int, int] | None:
    """(tensor, position inside its block) of the first True of ``bad``; None when all are False.
    ``starts``: each tensor's first index in the column, then the column's length."""
    if not bool(bad.any()):
        return None
    i = int(torch.nonzero(bad)[0])
    t = int(torch.searchsorted(starts, torch.tensor([i]), right=True)[0]) - 1
    return t, i - int(starts[t])


def _fail_chunk(c: _Check, table: _Table, bad: torch.Tensor, cstarts: torch.Tensor, what: str) -> None:
    """Raise for the first chunk ``bad`` marks, naming its tensor and its number."""
    hit = _first(bad, cstarts)
    if hit is not None:
        raise c.fail(f"item {table.fqns[hit[0]]!r} chunk {hit[1]}: {what}")


def _fail_value(c: _Check, table: _Table, bad: torch.Tensor, estarts: torch.Tensor, what: str) -> None:
    """Raise for the first value of ``offsets``/``sizes`` that ``bad`` marks (dimension-major)."""
    hit = _first(bad, estarts)
    if hit is not None:
        t, local = hit
        k = int(table.counts[t])
        raise c.fail(f"item {table.fqns[t]!r} chunk {local % k} (dim {local // k}): {what}")


def _check_table(c: _Check, table: _Table) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything version 1's decoder checks per chunk, over the whole table at once. Returns
    what the lookups need: each chunk's first checksum (a prefix sum of ``crc_count``, then the
    total), and per tensor whether its chunks' dim-0 offsets are sorted and its widest dim-0 size."""
    fqns, counts = table.fqns, table.counts
    T = len(fqns)
    if len(set(fqns)) != T:
        raise c.fail("a tensor is listed twice in the chunk table")
    if len(counts) != T or bool((counts < 0).any()):
        raise c.fail(f"the chunk table's counts are damaged ({len(counts)} counts for {T} tensors)")
    cstarts = table.chunk_starts()
    C = int(cstarts[-1])
    for col in ("file", "offset", "length", "crc_count"):
        if len(getattr(table, col)) != C:
            raise c.fail(f"column {col!r} holds {len(getattr(table, col))} values for {C} chunks")
    estarts = table.element_starts()
    if len(table.offsets) != int(estarts[-1]) or len(table.chunk_sizes) != int(estarts[-1]):
        raise c.fail(f"columns 'offsets'/'sizes' hold {len(table.offsets)}/{len(table.chunk_sizes)} values, the "
                     f"tensors' chunks and dimensions need {int(estarts[-1])}")
    # Chunks inside their tensor (per value: the tensor's extent in that dimension).
    dims = [d for s in table.sizes for d in s]
    per_dim = [int(k) for k, s in zip(counts.tolist(), table.sizes) for _ in s]
    limit = torch.repeat_interleave(torch.tensor(dims, dtype=torch.int64), torch.tensor(per_dim, dtype=torch.int64)) \
        if dims else torch.zeros(0, dtype=torch.int64)
    offs, sizes = table.offsets, table.chunk_sizes
    _fail_value(c, table, (offs < 0) | (sizes < 0), estarts, "a negative offset or size")
    _fail_value(c, table, (offs > limit) | (sizes > limit - offs), estarts, "the chunk exceeds the tensor's size")
    # Elements per chunk: the product of its sizes, one dimension at a time.
    tensor_of = torch.repeat_interleave(torch.arange(T), counts)
    ndim_t = torch.tensor([len(s) for s in table.sizes], dtype=torch.int64)
    k_c, nd_c = counts[tensor_of], ndim_t[tensor_of]
    pos_c = torch.arange(C) - cstarts[:-1][tensor_of]
    base_c = estarts[:-1][tensor_of] + pos_c
    numel = torch.ones(C, dtype=torch.int64)
    first = size0 = torch.zeros(C, dtype=torch.int64)  # dim 0 of each chunk (0 for a 0-d tensor)
    top = max(len(sizes) - 1, 0)
    for d in range(int(ndim_t.max()) if T and len(sizes) else 0):
        has = nd_c > d
        idx = (base_c + d * k_c).clamp_(max=top)  # unmasked gathers: cheaper than boolean selection
        dim_sizes = torch.where(has, sizes[idx], 1)
        numel *= dim_sizes
        if d == 0:
            first, size0 = torch.where(has, offs[idx], 0), torch.where(has, dim_sizes, 0)
    itemsize = torch.tensor([dt.itemsize for dt in table.dtypes], dtype=torch.int64)
    _fail_chunk(c, table, table.length != numel * itemsize[tensor_of], cstarts,
             "its stored length does not match its shape and dtype")
    covered = torch.zeros(T, dtype=torch.int64).index_add_(0, tensor_of, numel)
    covered_f = torch.zeros(T, dtype=torch.float64).index_add_(0, tensor_of, numel.to(torch.float64))
    total = torch.tensor([_numel(s) for s in table.sizes], dtype=torch.int64)
    wrong = (covered != total) | ((covered_f - total.to(torch.float64)).abs() > 0.5 * (total.to(torch.float64) + 1))
    if bool(wrong.any()):
        t = int(torch.nonzero(wrong)[0])
        raise c.fail(f"item {fqns[t]!r}: its chunks hold {int(covered[t])} elements, the tensor of size "
                     f"{list(table.sizes[t])} has {int(total[t])}")
    # Byte ranges inside their file's data region, with one checksum per piece of the grid.
    F = len(table.file_names)
    fid = table.file
    _fail_chunk(c, table, (fid < 0) | (fid >= F), cstarts, "it refers to a file the metadata does not list")
    fsize = torch.tensor([i.size for i in table.file_infos], dtype=torch.int64)[fid]
    fstart = torch.tensor([i.data_start for i in table.file_infos], dtype=torch.int64)[fid]
    fstep = torch.tensor([i.piece_size for i in table.file_infos], dtype=torch.int64)[fid]
    off, length = table.offset, table.length
    _fail_chunk(c, table, off < fstart, cstarts, "its byte range starts before the data region of its file")
    _fail_chunk(c, table, (off > fsize) | (length < 0) | (length > fsize - off), cstarts,
                "its byte range lies outside the data region of its file")
    steps = {i.piece_size for i in table.file_infos}
    step = steps.pop() if len(steps) == 1 else 0
    if step and step & (step - 1) == 0:  # one grid step, a power of two (the engine's): shifts
        shift = step.bit_length() - 1
        pieces = ((off + length - 1 - fstart) >> shift) - ((off - fstart) >> shift) + 1
    else:
        pieces = (off + length - 1 - fstart) // fstep - (off - fstart) // fstep + 1
    pieces *= length > 0
    wrong = (table.crc_count != 0) & (table.crc_count != pieces)
    if bool(wrong.any()):
        i = int(torch.nonzero(wrong)[0])
        _fail_chunk(c, table, wrong, cstarts, f"{int(table.crc_count[i])} checksums for {int(pieces[i])} pieces")
    crc_starts = torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(table.crc_count, 0)))
    if int(crc_starts[-1]) != len(table.crcs):
        raise c.fail(f"column 'crc32c' holds {len(table.crcs)} checksums, the chunks need {int(crc_starts[-1])}")
    if table.hash64 is not None and (len(table.hash64) != C or len(table.has_hash64) != C):
        raise c.fail(f"columns 'hash64'/'has_hash64' do not hold one value per chunk ({C})")
    # Sorted dim-0 offsets allow a bisection (PackedItems.narrowed).
    unsorted = torch.zeros(T, dtype=torch.int64)
    if C > 1:
        down = (tensor_of[1:] == tensor_of[:-1]) & (first[1:] < first[:-1])
        unsorted.index_add_(0, tensor_of[1:], down.to(torch.int64))
    widest = torch.zeros(T, dtype=torch.int64).scatter_reduce_(0, tensor_of, size0, "amax")
    return crc_starts, unsorted == 0, widest


def _check_shared(c: _Check, fid: torch.Tensor, start: torch.Tensor, length: torch.Tensor, names,
                  file_names: list[str]) -> None:
    """No two items share bytes of a file (``names(i)`` names item i). Sorted by file then start,
    each item must begin at or after the end of the one before it in the same file: then the ends
    increase too, and no item reaches into any earlier one."""
    keep = length > 0
    fid, start, length = fid[keep], start[keep], length[keep]
    top = int((start + length).max()) + 1 if len(start) else 1
    if len(file_names) * top < (1 << 62):
        # One sort of (file, start) packed into one key: consecutive keys of one file must lie at
        # least the earlier item's length apart, and keys of different files always do.
        keys, order = torch.sort(fid * top + start)
        bad = keys[1:] < keys[:-1] + length[order][:-1]
    else:
        order = torch.sort(start, stable=True).indices
        order = order[torch.sort(fid[order], stable=True).indices]
        bad = (fid[order][1:] == fid[order][:-1]) & (start[order][1:] < (start + length)[order][:-1])
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0]) + 1
        which = torch.nonzero(keep).flatten()[order]
        a, b = int(order[i - 1]), int(order[i])
        raise c.fail(f"items {names(int(which[i - 1]))!r} and {names(int(which[i]))!r} share bytes "
                     f"[{int(start[b])}, {int(start[a] + length[a])}) of {file_names[int(fid[b])]} (each stored item "
                     f"has bytes of its own)")


# ------------------------------------------------------------------------------- encode
def encode_packed(md: Metadata, locations: Mapping[MetadataIndex, ItemLocation],
                  c: _Check | None) -> tuple[bytes, dict[str, FileInfo]]:
    """A version 3 document of ``md`` whose items are at ``locations``, and the data files it
    lists; with ``c``, the table is checked as the decoder checks it (the commit's check)."""
    _require_little_endian(c or _Check("packed metadata"))
    files: dict[str, list[int]] = {}  # name -> [index, size, data_start, piece_size]
    check = c or _Check("packed metadata")

    def file_of(loc: ItemLocation, fqn: str, offsets) -> int:
        info = files.get(loc.file)
        if info is None:
            info = files[loc.file] = [len(files), 0, loc.data_start, loc.piece_size]
            _check_file_name(check, loc.file, loc.piece_size, f"files[{loc.file!r}]", references=True)
        elif info[2] != loc.data_start or info[3] != loc.piece_size:
            raise check.fail(f"item {fqn!r} at offset {list(offsets or [])}: its checksum grid ({loc.data_start}, "
                             f"{loc.piece_size}) is not its file's ({info[2]}, {info[3]}) in {loc.file}")
        # A file may end with items nothing references: its size is the writer's.
        end = loc.offset + loc.length
        if end > info[1] or loc.file_size > info[1]:
            info[1] = max(end, loc.file_size)
        return info[0]

    # The tensors and their chunks, in the metadata's order.
    fqns, dtypes, grads, sizes, counts, chunk_lists = [], [], [], [], [], []
    value_names: list[str] = []
    offsets: list[int] = []
    chunk_sizes: list[int] = []
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            value_names.append(fqn)
            continue
        chunks = smd.chunks
        fqns.append(fqn)
        dtypes.append(smd.properties.dtype)
        grads.append(bool(smd.properties.requires_grad))
        sizes.append(tuple(int(d) for d in smd.size))
        counts.append(len(chunks))
        chunk_lists.append(chunks)
        for d in range(len(smd.size)):
            offsets.extend([ch.offsets[d] for ch in chunks])
            chunk_sizes.extend([ch.sizes[d] for ch in chunks])
    values: list[str] = []
    value_spans: list[tuple[str, ItemLocation]] = []
    for fqn in value_names:
        loc = locations.get(MetadataIndex(fqn))
        if loc is None:
            raise check.fail(f"no write result for item {fqn!r}")
        file_of(loc, fqn, None)
        value_spans.append((fqn, loc))
        values.append(f"{_json_str(fqn)}:{_value_json(loc)}")
    # Each chunk's location, placed by the position DCP's planning gave it (the index's hint,
    # checked against the chunk's offsets): one pass over the results, no lookup per chunk.
    tensor_index = {fqn: t for t, fqn in enumerate(fqns)}
    starts = [0]
    for k in counts:
        starts.append(starts[-1] + k)
    fcol: list = [None] * starts[-1]
    ocol, lcol, ncol = [0] * starts[-1], [0] * starts[-1], [0] * starts[-1]
    crc_of: list = [()] * starts[-1]
    hashes: list = [None] * starts[-1]
    by_offsets: dict[int, dict] = {}
    for index, loc in locations.items():
        t = tensor_index.get(index.fqn)
        if t is None or index.offset is None:
            continue  # a value, or an item the metadata does not list
        chunks, p = chunk_lists[t], index.index
        if p is None or not 0 <= p < len(chunks) or chunks[p].offsets != index.offset:
            if t not in by_offsets:
                by_offsets[t] = {tuple(ch.offsets): i for i, ch in enumerate(chunks)}
            p = by_offsets[t].get(tuple(index.offset))
            if p is None:
                continue
        slot = starts[t] + p
        fcol[slot] = file_of(loc, index.fqn, index.offset)
        ocol[slot], lcol[slot], ncol[slot], crc_of[slot], hashes[slot] = (
            loc.offset, loc.length, len(loc.crc32c), loc.crc32c, loc.hash64)
    slot = fcol.index(None) if None in fcol else -1
    while slot >= 0:  # chunks sharing their offsets (empty ones) share one result: looked up
        t = bisect.bisect_right(starts, slot) - 1
        chunk_offsets = chunk_lists[t][slot - starts[t]].offsets
        loc = locations.get(MetadataIndex(fqns[t], chunk_offsets))
        if loc is None:
            raise check.fail(f"no write result for item {fqns[t]!r} at offset {list(chunk_offsets)}")
        fcol[slot] = file_of(loc, fqns[t], chunk_offsets)
        ocol[slot], lcol[slot], ncol[slot], crc_of[slot], hashes[slot] = (
            loc.offset, loc.length, len(loc.crc32c), loc.crc32c, loc.hash64)
        slot = fcol.index(None, slot) if None in fcol[slot:] else -1
    crcs = list(itertools.chain.from_iterable(crc_of))
    names = list(files)
    infos = {name: FileInfo(size=v[1], data_start=v[2], piece_size=v[3]) for name, v in files.items()}
    for name, info in infos.items():
        _check_file(check, name, info, f"files[{name!r}]", references=True)
    hash64 = has_hash = None
    if hashes.count(None) != len(hashes):
        hash64 = _ints([0 if h is None else h - (1 << 64) if h > _MAX_INT else h for h in hashes])
        has_hash = _ints([h is not None for h in hashes])
    table = _Table(fqns, dtypes, grads, sizes, _ints(counts), _ints(offsets), _ints(chunk_sizes), _ints(fcol),
                   _ints(ocol), _ints(lcol), _ints(ncol), _ints(crcs),
                   hash64, has_hash, names, [infos[n] for n in names])
    if c is not None:
        _check_table(c, table)
        _check_values_and_chunks_apart(c, table, value_spans, files)
        bad = (table.crcs < 0) | (table.crcs > _U32)
        if bool(bad.any()):
            crc_starts = torch.cumsum(table.crc_count, 0)
            ci = int(torch.searchsorted(crc_starts, torch.nonzero(bad)[:1], right=True)[0])
            _fail_chunk(c, table, torch.arange(len(table.file)) == ci, table.chunk_starts(),
                        "crc32c must be a list of 32-bit integers")
    columns = {
        "chunks": _pack(table.counts), "offsets": _pack(table.offsets), "sizes": _pack(table.chunk_sizes),
        "file": _pack(table.file), "offset": _pack(table.offset), "length": _pack(table.length),
        "crc_count": _pack(table.crc_count), "crc32c": _pack(table.crcs.to(torch.int32).to(torch.int64), delta=False),
    }
    if hash64 is not None:
        columns["hash64"] = _pack(hash64, delta=False)
        columns["has_hash64"] = _pack(has_hash)
    head = document_head(md, PACKED_VERSION, infos)
    head["tensors"] = [[f, dtype_to_name(d), g, list(s)] for f, d, g, s in zip(fqns, dtypes, grads, sizes)]
    head["columns"] = columns
    text = json.dumps(head, separators=(",", ":"))[:-1] + ',"values":{' + ",".join(values) + "}}"
    return text.encode(), infos


def _value_json(loc: ItemLocation) -> str:
    """A non-tensor value's entry, as version 1 writes it."""
    text = (f'{{"type":"bytes","file":{_json_str(loc.file)},"offset":{int(loc.offset)},"length":{int(loc.length)},'
            f'"crc32c":{list(map(int, loc.crc32c))}')
    if loc.hash64 is not None:
        text += f',"hash64":"{int(loc.hash64):016x}"'
    return text + "}"


def _check_values_and_chunks_apart(c: _Check, table: _Table, values: list[tuple[str, ItemLocation]],
                                   files: dict) -> None:
    """The values' ranges are checked as version 1 checks them; then no two items share bytes."""
    infos = dict(zip(table.file_names, table.file_infos))
    for fqn, loc in values:
        bytes_location(c, {"file": loc.file, "offset": loc.offset, "length": loc.length,
                           "crc32c": list(loc.crc32c)}, f"item {fqn!r}", infos)
    _check_items_apart(c, table, values)


def _check_items_apart(c: _Check, table: _Table, values: list[tuple[str, ItemLocation]]) -> None:
    """No two items (the table's chunks, then the values) share bytes of a file."""
    index = {name: i for i, name in enumerate(table.file_names)}
    i64 = torch.int64
    fid = torch.cat((table.file, torch.tensor([index[loc.file] for _, loc in values], dtype=i64)))
    start = torch.cat((table.offset, torch.tensor([loc.offset for _, loc in values], dtype=i64)))
    length = torch.cat((table.length, torch.tensor([loc.length for _, loc in values], dtype=i64)))
    C = len(table.offset)
    cstarts = table.chunk_starts()

    def name(i: int) -> str:
        if i >= C:
            return values[i - C][0]
        t = int(torch.searchsorted(cstarts, torch.tensor([i]), right=True)[0]) - 1
        return f"{table.fqns[t]} chunk {i - int(cstarts[t])}"

    _check_shared(c, fid, start, length, name, table.file_names)


def _require_little_endian(c: _Check) -> None:
    if sys.byteorder != "little":
        raise c.fail("packed metadata (format version 3) is read and written on little-endian hosts only")


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


class _Columns:
    """The checked table as Python arrays (one value read in tens of nanoseconds), shared by the
    two mappings DCP sees; picklable."""

    def __init__(self, table: _Table, crc_starts: torch.Tensor, sorted0: torch.Tensor, widest0: torch.Tensor):
        self.fqns = table.fqns
        self.tensor_index = {fqn: t for t, fqn in enumerate(table.fqns)}
        self.dtypes, self.requires_grad, self.sizes = table.dtypes, table.requires_grad, table.sizes
        self.dtype_names = [dtype_to_name(d) for d in table.dtypes]
        self.counts = table.counts.tolist()
        self.chunk_start = table.chunk_starts().tolist()
        self.element_start = table.element_starts().tolist()
        self.offsets, self.chunk_sizes = _as_array(table.offsets), _as_array(table.chunk_sizes)
        self.file, self.offset, self.length = _as_array(table.file, "i"), _as_array(table.offset), _as_array(table.length)
        self.crc_start, self.crcs = _as_array(crc_starts), _as_array(table.crcs)
        self.hash64 = None if table.hash64 is None else _as_array(table.hash64)
        self.has_hash64 = None if table.has_hash64 is None else _as_array(table.has_hash64, "i")
        self.file_names, self.file_infos = table.file_names, table.file_infos
        self.sorted0, self.widest0 = sorted0.tolist(), widest0.tolist()

    def dim_values(self, t: int, column: array, d: int) -> array:
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
        offs = self.offsets[base: base + nd * k].tolist()
        sizes = self.chunk_sizes[base: base + nd * k].tolist()
        make, size_of = ChunkStorageMetadata, torch.Size
        return [make(offsets=size_of(offs[p::k]), sizes=size_of(sizes[p::k]))
                for p in (range(k) if positions is None else positions)]

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

    def _span(self, t: int, first: array, lo: int, hi: int, widest: int) -> range:
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
