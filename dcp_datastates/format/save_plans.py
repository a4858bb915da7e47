"""The save plans a rank and the coordinator exchange: their items and flatten mappings packed.

DCP gathers every rank's local plan at the coordinator and scatters a global plan back, each
pickled: one ``WriteItem`` is eight Python objects, and a 70B model's state under FSDP2 on 1,024
ranks has 2.2 million of them, about half a gigabyte of pickle each way on a first save. Its
flatten mapping (``planner_data``: each flat name and its path in the state dict) repeats every
name again. ``wire_plan`` returns the same plan whose ``items`` and ``planner_data`` pickle as
compressed columns: the names once (shared by both), each item as a row of integers. Unpickled,
they are a plain ``list`` of ``WriteItem`` and a plain ``dict`` equal to what was sent, so every
planner hook on the other side sees what DCP's pickle would have given it. An item or a mapping
that does not fit the columns (a type other than DCP's own, a value out of range) is sent as it
is, pickled by DCP as before: nothing is ever sent differently from what it is.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from array import array

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType

__all__ = ["wire_plan"]

# zlib's level: the rows of one layer repeat those of the next one, which any level finds.
_LEVEL = 6
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

# An item's flags.
_HAS_OFFSET = 1  # index.offset is not None
_OFFSET_IS_CHUNK = 2  # index.offset equals tensor_data.chunk.offsets (not repeated)
_HAS_TENSOR = 4
_HAS_BYTES = 8
_TYPES = {t.value: t for t in WriteItemType}


class _Unfit(Exception):
    """A value the columns cannot hold: the field is sent as it is."""


def wire_plan(plan: SavePlan) -> SavePlan:
    """``plan`` whose items and flatten mapping travel packed when pickled (each left as it is
    where it does not fit); the same plan when there is nothing to pack."""
    if not plan.items and not isinstance(plan.planner_data, dict):
        return plan
    names = _Names()
    items = plan.items
    try:
        rows = _item_rows(items, names)
    except _Unfit:
        rows = None
    mapping = plan.planner_data
    try:
        parts = _mapping_rows(mapping, names) if type(mapping) is dict else None
    except _Unfit:
        parts = None
    if rows is None and parts is None:
        return plan
    names.freeze()
    changes = {}
    if rows is not None:
        changes["items"] = _WireItems(items, names, *rows)
    if parts is not None:
        changes["planner_data"] = _WireMapping(mapping, names, parts)
    return dataclasses.replace(plan, **changes)


# ------------------------------------------------------------------------------- the names
class _Names:
    """The distinct names of one plan, each numbered once; pickled compressed, unpickled as a
    tuple (one object, shared by the items and the mapping that refer to it)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.blob = b""

    def number(self, name) -> int:
        if type(name) is not str:
            raise _Unfit
        k = self.index.get(name)
        if k is None:
            k = self.index[name] = len(self.index)
        return k

    def freeze(self) -> None:
        self.blob = zlib.compress(json.dumps(list(self.index)).encode("ascii"), _LEVEL)

    def __reduce__(self):
        return _names_from, (self.blob,)


def _names_from(blob: bytes) -> tuple[str, ...]:
    return tuple(json.loads(zlib.decompress(blob)))


def _ints(values: array) -> bytes:
    """An int64 column as compressed bytes, 32-bit when every value fits."""
    if values and min(values) >= -(1 << 31) and max(values) < (1 << 31):
        values = array("i", values)
    return values.typecode.encode() + zlib.compress(values.tobytes(), _LEVEL)


def _ints_from(blob: bytes) -> array:
    out = array(blob[:1].decode())
    out.frombytes(zlib.decompress(blob[1:]))
    return out


# ------------------------------------------------------------------------------- the items
class _WireItems(list):
    """A plan's items; pickled as rows of integers over the shared names and a short list of the
    distinct tensor properties, unpickled as a plain list of ``WriteItem``."""

    def __init__(self, items, names: _Names, rows: array, properties: list) -> None:
        super().__init__(items)
        self._wire = (names, _ints(rows), properties)

    def __reduce__(self):
        return _items_from, self._wire


def _int(v) -> int:
    if type(v) is not int or not _I64_MIN <= v <= _I64_MAX:
        raise _Unfit
    return v


def _size(v, out: array) -> None:
    """A torch.Size as its length then its values."""
    if type(v) is not torch.Size:
        raise _Unfit
    out.append(len(v))
    out.extend(_int(x) for x in v)


def _item_rows(items: list, names: _Names) -> tuple[array, list]:
    """Per item: the name's number less the last item's, type, index hint (-1: none), flags,
    then, as the flags say, the index's offset (its length, its values), the bytes' length, and
    the tensor's properties (their number), its number of dimensions, the chunk's offsets and
    sizes and the tensor's size (as many values each)."""
    rows = array("q")
    properties: list[TensorProperties] = []
    seen: dict[tuple, int] = {}
    last = 0
    for item in items:
        if type(item) is not WriteItem or type(item.index) is not MetadataIndex or type(item.type) is not WriteItemType:
            raise _Unfit
        index, td, bd = item.index, item.tensor_data, item.bytes_io_data
        k = names.number(index.fqn)
        flags = ((_HAS_OFFSET if index.offset is not None else 0) | (_HAS_TENSOR if td is not None else 0)
                 | (_HAS_BYTES if bd is not None else 0))
        if td is not None:
            if type(td) is not TensorWriteData or type(td.chunk) is not ChunkStorageMetadata \
                    or type(td.properties) is not TensorProperties:
                raise _Unfit
            if index.offset is not None and index.offset == td.chunk.offsets:
                flags |= _OFFSET_IS_CHUNK
        hint = -1 if index.index is None else _int(index.index)
        if hint < -1:
            raise _Unfit
        rows.extend((k - last, item.type.value, hint, flags))
        last = k
        if index.offset is not None and not flags & _OFFSET_IS_CHUNK:
            _size(index.offset, rows)
        if bd is not None:
            if type(bd) is not BytesIOWriteData:
                raise _Unfit
            rows.append(_int(bd.nbytes))
        if td is not None:
            p = td.properties
            key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
            if type(p.requires_grad) is not bool or type(p.pin_memory) is not bool:
                raise _Unfit
            n = seen.get(key)
            if n is None:
                n = seen[key] = len(properties)
                properties.append(p)
            rows.append(n)
            chunk = td.chunk
            if not type(chunk.offsets) is type(chunk.sizes) is type(td.size) is torch.Size \
                    or not len(chunk.offsets) == len(chunk.sizes) == len(td.size):
                raise _Unfit
            rows.append(len(td.size))
            rows.extend(_int(x) for x in (*chunk.offsets, *chunk.sizes, *td.size))
    return rows, properties


def _items_from(names: tuple[str, ...], blob: bytes, properties: list) -> list[WriteItem]:
    rows = _ints_from(blob).tolist()
    out: list[WriteItem] = []
    append = out.append
    # Each item gets its own properties object, as DCP's pickle gives it (the class is mutable).
    args = [(p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory) for p in properties]
    Size, types = torch.Size, _TYPES
    i, k, end = 0, 0, len(rows)
    while i < end:
        k += rows[i]
        kind, hint, flags = types[rows[i + 1]], rows[i + 2], rows[i + 3]
        i += 4
        offset = bd = td = None
        if flags & _HAS_OFFSET and not flags & _OFFSET_IS_CHUNK:
            n = rows[i]
            offset = Size(rows[i + 1:i + 1 + n])
            i += 1 + n
        if flags & _HAS_BYTES:
            bd = BytesIOWriteData(rows[i])
            i += 1
        if flags & _HAS_TENSOR:
            p, n = args[rows[i]], rows[i + 1]
            a = i + 2
            b, c, i = a + n, a + 2 * n, a + 3 * n
            chunk = ChunkStorageMetadata(Size(rows[a:b]), Size(rows[b:c]))
            td = TensorWriteData(chunk, TensorProperties(*p), Size(rows[c:i]))
            if flags & _OFFSET_IS_CHUNK:
                offset = chunk.offsets
        append(WriteItem(MetadataIndex(names[k], offset, None if hint < 0 else hint), kind, bd, td))
    return out


# ----------------------------------------------------------------------------- the mapping
class _WireMapping(dict):
    """DCP's flatten mapping (flat name -> its path of keys in the state dict); pickled as the
    names' numbers and each path's split of its name, unpickled as a plain dict."""

    def __init__(self, mapping: dict, names: _Names, parts: array) -> None:
        super().__init__(mapping)
        self._wire = (names, _ints(parts))

    def __reduce__(self):
        return _mapping_from, self._wire


def _mapping_rows(mapping: dict, names: _Names) -> array:
    """Per entry: the name's number less the last entry's, the path's length, then per key of the path its length in
    the name's text, negative for an int key. Only a path whose keys joined by '.' give the name
    fits (DCP's flattening names them so); any other mapping is sent as it is."""
    rows = array("q")
    last = 0
    for name, path in mapping.items():
        if type(path) is not tuple or not path:
            raise _Unfit
        k = names.number(name)
        rows.append(k - last)
        last = k
        rows.append(len(path))
        texts = []
        for key in path:
            if type(key) is str:
                texts.append(key)
                rows.append(len(key))
            elif type(key) is int:
                text = str(key)
                texts.append(text)
                rows.append(-len(text))
            else:
                raise _Unfit
        if ".".join(texts) != name:
            raise _Unfit
    return rows


def _mapping_from(names: tuple[str, ...], blob: bytes) -> dict:
    rows = _ints_from(blob).tolist()
    out = {}
    i, k, end = 0, 0, len(rows)
    while i < end:
        k += rows[i]
        name, n = names[k], rows[i + 1]
        i += 2
        if n == 2 and rows[i] >= 0 and rows[i + 1] >= 0:  # two keys, both str: DCP's usual path
            cut = rows[i]
            out[name] = (name[:cut], name[cut + 1:])
            i += 2
            continue
        path, at = [], 0
        for length in rows[i:i + n]:
            if length < 0:
                path.append(int(name[at:at - length]))
                at -= length
            else:
                path.append(name[at:at + length])
                at += length
            at += 1  # the '.'
        i += n
        out[name] = tuple(path)
    return out

