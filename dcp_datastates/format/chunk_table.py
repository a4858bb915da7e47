"""The packed chunk table of format version 3: its columns' codec and its checks.

A column is a run of int64 values: delta-coded (or not), narrowed to the smallest integer type
that holds it, deflated, base64-encoded, with a CRC32 of its bytes (``_pack`` / ``_unpack``).
The checks of the whole table (``_check_table``, ``_check_shared``) run in the engine
(csrc/chunk_table.cpp) over the columns' memory; this module words the first failure, naming the
item and chunk. The encoder (``format.packed_encode``) and the decoder (``format.packed``) share
all of it.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import json
import sys
import zlib
from array import array
from typing import Any

import torch

from ..native import engine_module
from .checks import _Check
from .locations import FileInfo, ItemLocation

# The engine runs the table checks (csrc/chunk_table.cpp).
_engine = engine_module()

# Integer types a column is narrowed to, smallest first.
_INT_TYPES = (("i1", torch.int8), ("i2", torch.int16), ("i4", torch.int32), ("i8", torch.int64))
_BY_NAME = dict(_INT_TYPES)
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1


# ------------------------------------------------------------------------------- columns
# Values delta-coded at a time by _pack: its temporaries stay this small whatever the column's size
# (a commit at scale packs columns of millions of values).
_PACK_BLOCK = 1 << 20


def _coded(values: torch.Tensor, a: int, b: int, delta: bool) -> torch.Tensor:
    """Values ``a:b`` of the column, delta-coded when ``delta`` (each minus the one before it;
    the first value as it is), as int64 (a narrower column's differences may not fit its type)."""
    block = values[a:b]
    if not delta:
        return block
    out = block.to(torch.int64, copy=True)
    if a == 0:
        out[1:] -= values[:b - 1]
    else:
        out -= values[a - 1:b - 1]
    return out


def _pack(values: torch.Tensor, *, delta: bool = True, level: int = 1) -> dict:
    """A column: integer values, delta-coded (unless ``delta`` is off), narrowed, deflated (at
    ``level`` 0, stored as deflate's raw blocks: checksums and hashes do not compress)."""
    n = values.numel()
    blocks = [(a, min(a + _PACK_BLOCK, n)) for a in range(0, n, _PACK_BLOCK)]
    bounds = [(int(x.min()), int(x.max())) for x in (_coded(values, a, b, delta) for a, b in blocks)]
    lo, hi = min((m for m, _ in bounds), default=0), max((m for _, m in bounds), default=0)
    name, dtype = next((n, d) for n, d in _INT_TYPES if torch.iinfo(d).min <= lo and hi <= torch.iinfo(d).max)
    if not delta and values.dtype == dtype and values.is_contiguous():
        narrow = values
    else:
        narrow = torch.empty(n, dtype=dtype)
        for a, b in blocks:
            narrow[a:b] = _coded(values, a, b, delta)
    raw = _view(narrow) if n else b""
    return {"int": name, "delta": delta, "n": n, "crc32": zlib.crc32(raw),
            "data": base64.b64encode(zlib.compress(raw, level)).decode("ascii")}


def _columns_json(columns: dict[str, dict]) -> list[str]:
    """``json.dumps(columns)`` of ``_pack``'s columns (compact separators) as parts to join: the
    same text, with each column's data a part as it is (base64 needs no escape, and a commit's
    columns hold tens of megabytes of it that the encoder would scan and copy)."""
    parts = ["{"]
    for name, rec in columns.items():
        fields = {k: v for k, v in rec.items() if k != "data"}
        if list(rec)[-1] != "data":
            raise ValueError(f"column {name!r}: its data must be its last field")
        if len(parts) > 1:
            parts.append(",")
        parts += [f"{json.dumps(name)}:{json.dumps(fields, separators=(',', ':'))[:-1]},\"data\":\"", rec["data"], "\"}"]
    return parts + ["}"]


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
        # Never more than the column's size (the one byte more shows a column that is too long).
        raw = inflate.decompress(packed, size + 1)
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


def _ints(values) -> torch.Tensor:
    """Python ints (a list, or an ``array("q")`` taken as it is) as an int64 tensor (through an
    array: several times faster than torch.tensor)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    held = values if isinstance(values, array) and values.typecode == "q" else array("q", values)
    return torch.frombuffer(held, dtype=torch.int64)


# ------------------------------------------------------------------------------- the table
class _Table:
    """The decoded (or about to be encoded) chunk table: per tensor lists, per chunk columns."""

    def __init__(self, fqns, dtypes, requires_grad, sizes, counts, offsets, chunk_sizes, file, offset, length,
                 crc_count, crcs, hash64, has_hash64, file_names, file_infos):
        self.fqns: list[str] = fqns
        self.dtypes: list[torch.dtype] = dtypes
        self.requires_grad: list[bool] = requires_grad
        self.sizes: list[tuple[int, ...]] = sizes
        # counts, offsets and chunk_sizes, and the chunk columns, are integer tensors: the
        # decoder's int64, the encoder's each of the narrowest type that holds it.
        self.counts, self.offsets, self.chunk_sizes = counts, offsets, chunk_sizes
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


# The ctypes item of each integer dtype the engine reads (csrc/chunk_table.h, In): a view names
# its item type.
_C_ITEMS = {torch.int8: ctypes.c_int8, torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64}


def _view(t: torch.Tensor):
    """The memory of a contiguous tensor as a buffer of its items (no copy); the tensor must
    outlive its use. An integer tensor's view names its item type (the engine reads every width);
    any other is seen as bytes."""
    if t.numel() == 0:
        return bytearray()
    item = _C_ITEMS.get(t.dtype)
    if item is None:
        return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return (item * t.numel()).from_address(t.data_ptr())


def _checksum_view(t: torch.Tensor):
    """The memory of a contiguous int32 tensor as unsigned 32-bit items: checksums, which the
    engine writes as such (the tensor holds their bit patterns)."""
    if t.dtype != torch.int32 or not t.is_contiguous():
        raise ValueError(f"checksums are held in a contiguous int32 tensor, not {t.dtype}")
    if t.numel() == 0:
        return memoryview(bytearray()).cast("I")
    return (ctypes.c_uint32 * t.numel()).from_address(t.data_ptr())


# A read-only memoryview of memory that something else owns (the C API's; a tensor's here).
_memory_at = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_at.restype, _memory_at.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
#: The C API's PyBUF_READ flag.
_READ_ONLY = 0x100


def _integers(t: torch.Tensor) -> torch.Tensor:
    """A column as the engine reads it: integers of any width as they are (no copy of a narrow
    column), anything else as int64."""
    if t.dtype not in _C_ITEMS:
        t = t.to(torch.int64)
    return t.contiguous()


def _alike(*columns: torch.Tensor) -> list[torch.Tensor]:
    """Columns the engine's table check reads together, of one item type: as they are when all
    are int32 (or all int64), else all as int64 (a table past 32 bits somewhere: rare)."""
    types = {c.dtype for c in columns if c.numel()}
    if types == {torch.int32}:
        return [c.to(torch.int32).contiguous() for c in columns]
    return [c.to(torch.int64).contiguous() for c in columns]


# What each failure the engine reports says (csrc/chunk_table.h).
_TABLE_FAILURES = {
    "negative": "a negative offset or size",
    "exceeds": "the chunk exceeds the tensor's size",
    "length": "its stored length does not match its shape and dtype",
    "file": "it refers to a file the metadata does not list",
    "before": "its byte range starts before the data region of its file",
    "outside": "its byte range lies outside the data region of its file",
}


def _check_table(c: _Check, table: _Table) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything version 1's decoder checks per chunk, over the whole table at once (the
    engine's ``check_chunk_table``: one pass per check, no temporaries). Returns what the
    lookups need: each chunk's first checksum (a prefix sum of ``crc_count``, then the total),
    and per tensor whether its chunks' dim-0 offsets are sorted and its widest dim-0 size."""
    fqns, counts = table.fqns, table.counts
    T = len(fqns)
    if len(set(fqns)) != T:
        raise c.fail("a tensor is listed twice in the chunk table")
    if len(counts) != T or bool((counts < 0).any()):
        raise c.fail(f"the chunk table's counts are damaged ({len(counts)} counts for {T} tensors)")
    ndims = [len(s) for s in table.sizes]
    C = int(counts.sum())
    for col in ("file", "offset", "length", "crc_count"):
        if len(getattr(table, col)) != C:
            raise c.fail(f"column {col!r} holds {len(getattr(table, col))} values for {C} chunks")
    n_values = sum(k * d for k, d in zip(counts.tolist(), ndims))
    if len(table.offsets) != n_values or len(table.chunk_sizes) != n_values:
        raise c.fail(f"columns 'offsets'/'sizes' hold {len(table.offsets)}/{len(table.chunk_sizes)} values, the "
                     f"tensors' chunks and dimensions need {n_values}")
    inputs = [_integers(counts), _ints(ndims), _ints([dt.itemsize for dt in table.dtypes]),
              _ints([d for s in table.sizes for d in s]), *_alike(table.offsets, table.chunk_sizes),
              *_alike(table.file, table.offset, table.length, table.crc_count),
              _ints([i.size for i in table.file_infos]), _ints([i.data_start for i in table.file_infos]),
              _ints([i.piece_size for i in table.file_infos])]
    crc_starts, sorted0, widest = (torch.empty(C + 1, dtype=torch.int64), torch.empty(T, dtype=torch.int64),
                                   torch.empty(T, dtype=torch.int64))
    failed = _engine.check_chunk_table(*map(_view, inputs), _view(crc_starts), _view(sorted0), _view(widest))
    if failed is not None:
        kind, t, chunk, dim, a, b = failed
        if kind == "covered":
            raise c.fail(f"item {fqns[t]!r}: its chunks hold {a} elements, the tensor of size "
                         f"{list(table.sizes[t])} has {b}")
        where = f"item {fqns[t]!r} chunk {chunk}" + (f" (dim {dim})" if dim >= 0 else "")
        raise c.fail(f"{where}: " + (f"{a} checksums for {b} pieces" if kind == "checksums" else _TABLE_FAILURES[kind]))
    if int(crc_starts[-1]) != len(table.crcs):
        raise c.fail(f"column 'crc32c' holds {len(table.crcs)} checksums, the chunks need {int(crc_starts[-1])}")
    if table.hash64 is not None and (len(table.hash64) != C or len(table.has_hash64) != C):
        raise c.fail(f"columns 'hash64'/'has_hash64' do not hold one value per chunk ({C})")
    return crc_starts, sorted0 == 1, widest


def _check_shared(c: _Check, fid: torch.Tensor, start: torch.Tensor, length: torch.Tensor, names,
                  file_names: list[str], ordered: int = -1) -> None:
    """No two items share bytes of a file (``names(i)`` names item i): the engine's
    ``find_shared_bytes``, one pass when each file's items come in order, a sort otherwise."""
    fid, start, length = _integers(fid), _integers(start), _integers(length)
    shared = _engine.find_shared_bytes(_view(fid), _view(start), _view(length), len(file_names), ordered)
    if shared is not None:
        a, b = shared
        raise c.fail(f"items {names(a)!r} and {names(b)!r} share bytes [{int(start[b])}, {int(start[a] + length[a])}) "
                     f"of {file_names[int(fid[b])]} (each stored item has bytes of its own)")


def _check_items_apart(c: _Check, table: _Table, values: list[tuple[str, ItemLocation]]) -> None:
    """No two items (the table's chunks, then the values) share bytes of a file: the chunks among
    themselves, then the values with each other and with the chunks of their files (never a copy
    of the table's columns: millions of values each, at scale)."""
    C = len(table.offset)
    cstarts = table.chunk_starts()

    def chunk_name(i: int) -> str:
        t = int(torch.searchsorted(cstarts, torch.tensor([i]), right=True)[0]) - 1
        return f"{table.fqns[t]} chunk {i - int(cstarts[t])}"

    _check_shared(c, table.file, table.offset, table.length, chunk_name, table.file_names, ordered=C)
    if not values:
        return
    index = {name: i for i, name in enumerate(table.file_names)}
    i64 = torch.int64
    value_files = torch.tensor([index[loc.file] for _, loc in values], dtype=table.file.dtype)
    near = torch.nonzero(torch.isin(table.file, value_files)).flatten()
    fid = torch.cat((table.file[near].to(i64), value_files.to(i64)))
    start = torch.cat((table.offset[near].to(i64), torch.tensor([loc.offset for _, loc in values], dtype=i64)))
    length = torch.cat((table.length[near].to(i64), torch.tensor([loc.length for _, loc in values], dtype=i64)))

    def name(i: int) -> str:
        return chunk_name(int(near[i])) if i < len(near) else values[i - len(near)][0]

    _check_shared(c, fid, start, length, name, table.file_names, ordered=len(near))


def _require_little_endian(c: _Check) -> None:
    if sys.byteorder != "little":
        raise c.fail("packed metadata (format version 3) is read and written on little-endian hosts only")


