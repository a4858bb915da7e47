"""DCP's save and load plans as they travel through the coordinator: their items packed.

DCP gathers every rank's local plan at the coordinator and scatters a global plan back, each
pickled: on a first save and at every load. One ``WriteItem`` or ``ReadItem`` is six to eight
Python objects, and a 70B model's state under FSDP2 on 1,024 ranks has 2.2 million chunks: about
half a gigabyte of pickle each way, and as many objects to make on the coordinator. A save plan's
flatten mapping (``planner_data``: each flat name and its path in the state dict) repeats every
name again. ``wire_save_plan`` and ``wire_load_plan`` return the same plan whose ``items`` (and a
save plan's ``planner_data``) pickle as compressed columns: the names once (shared by both), each
item as a row of integers. Unpickled, they are a plain ``list`` of DCP's items and a plain ``dict``
equal to what was sent, so every planner hook on the other side sees what DCP's pickle would have
given it. A load plan (``PackedLoadPlan``) decodes its items when they are first read: the
coordinator, whose default load planner never reads them, hands each rank's plan on as it came.
Items or a mapping that do not fit the columns (a type other than DCP's own, a value out of
range) are sent as they are, pickled by DCP as before.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from array import array
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

__all__ = ["wire_save_plan", "wire_save_plans", "wire_load_plan", "PackedLoadPlan"]

# zlib's level: the rows of one layer repeat those of the next one, which any level finds.
_LEVEL = 6
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

# An item's flags.
_HAS_OFFSET = 1  # index.offset is not None
_OFFSET_IS_CHUNK = 2  # index.offset equals tensor_data.chunk.offsets (not repeated)
_HAS_TENSOR = 4
_HAS_BYTES = 8
_TYPES = {t.value: t for t in WriteItemType}
# A read item's flags.
_DEST_OFFSET = 1  # dest_index.offset is not None
_STORAGE_OFFSET = 2  # storage_index.offset is not None
_STORAGE_OFFSET_IS_DEST = 4  # and equal to dest_index.offset (not repeated)
_STORAGE_NAME = 8  # storage_index.fqn is not dest_index.fqn (its number follows)
_LOAD_TYPES = {t.value: t for t in LoadItemType}


class _Unfit(Exception):
    """A value the columns cannot hold: the field is sent as it is."""


class _Missing(Exception):
    """A name that a frozen names table does not hold."""


def wire_save_plan(plan: SavePlan) -> SavePlan:
    """``plan`` whose items and flatten mapping travel packed when pickled (each left as it is
    where it does not fit); the same plan when there is nothing to pack."""
    plan, shared = _wire_save(plan, None)
    _release(shared)
    return plan


def wire_save_plans(plans: list[SavePlan]) -> list[SavePlan]:
    """Each plan as ``wire_save_plan`` gives it. A plan whose flatten mapping equals the last
    one's (every rank's, under FSDP) takes the last one's names and packed mapping again: the
    coordinator holds one of each, not one per rank."""
    out, shared = [], None
    for plan in plans:
        plan, shared = _wire_save(plan, shared)
        out.append(plan)
    _release(shared)
    return out


class _Shared(NamedTuple):
    """A flatten mapping, the names table numbered from it (then from its plan's items), and the
    mapping packed over them (None: the mapping does not fit)."""

    mapping: Any
    names: _Names
    wired: _WireDict | None


def _wire_save(plan: SavePlan, shared: _Shared | None) -> tuple[SavePlan, _Shared | None]:
    mapping = plan.planner_data
    if not plan.items and type(mapping) is not dict:
        return plan, shared
    if not _same_mapping(mapping, shared):
        _release(shared)
        shared = _share(mapping, plan.items)
    try:
        rows = _item_rows(plan.items, shared.names)
    except _Missing:  # a name the last plan did not have
        _release(shared)
        shared = _share(mapping, plan.items)
        rows = _item_rows(plan.items, shared.names)
    except _Unfit:
        rows = None
    changes: dict[str, Any] = {}
    if rows is not None:
        changes["items"] = _WireList(plan.items, _items_from, (shared.names, _ints(rows[0]), rows[1]))
    if shared.wired is not None:
        changes["planner_data"] = shared.wired
    return (dataclasses.replace(plan, **changes) if changes else plan), shared


def _same_mapping(mapping, shared: _Shared | None) -> bool:
    """``mapping`` equals the last plan's, which was packed (its values are paths of keys)."""
    if shared is None or shared.wired is None or type(mapping) is not dict:
        return False
    try:
        return bool(mapping == shared.mapping)
    except Exception:  # noqa: BLE001 - values whose comparison fails (a tensor): not the same
        return False


def _release(shared: _Shared | None) -> None:
    """No later plan numbers against ``shared``'s names: their index goes."""
    if shared is not None:
        shared.names.release()


def _share(mapping, items: list) -> _Shared:
    """The names of ``mapping`` (if it fits) then of ``items``, frozen, and the mapping packed."""
    names, wired = _Names(), None
    if type(mapping) is dict:
        try:
            parts = _mapping_rows(mapping, names)
            wired = _WireDict(mapping, _mapping_from, (names, _ints(parts)))
        except _Unfit:
            names = _Names()
    for item in items:
        name = getattr(getattr(item, "index", None), "fqn", None)
        if type(name) is str:
            names.number(name)
    names.freeze()
    return _Shared(mapping, names, wired)


def wire_load_plan(plan: LoadPlan) -> LoadPlan:
    """``plan`` as a ``PackedLoadPlan``: its items travel packed when pickled, and unpickled
    they are decoded when first asked for. A plan that came packed and whose items nobody
    asked for is returned as it is (it pickles as the same columns); the same plan when there
    are no items or they do not fit."""
    if isinstance(plan, PackedLoadPlan) and plan.unread:
        return plan
    wire = _pack_reads(plan.items)
    if wire is None:
        return plan
    return PackedLoadPlan._made(wire, plan.items, plan.storage_data, plan.planner_data)


def _pack_reads(items: list) -> tuple[bytes, bytes] | None:
    """The columns of ``items`` (names, rows; compressed, and kept so by the coordinator that
    hands them on); None when there are none or they do not fit."""
    if not items:
        return None
    names = _Names()
    try:
        rows = _read_rows(items, names)
    except _Unfit:
        return None
    names.freeze()
    return names.blob, _ints(rows)


class PackedLoadPlan(LoadPlan):
    """A ``LoadPlan`` whose items pickle as columns and, unpickled, are decoded when first read.

    At every load DCP gathers each rank's plan at the coordinator and scatters it back, and
    DCP's default load planners do not look at the items there: the coordinator then holds and
    sends each plan's columns as they came, and makes no ``ReadItem`` of any rank (millions at
    a thousand ranks). A planner hook that reads ``items`` gets the plain ``list`` of DCP's
    items, equal to what was sent; once read they may have changed, and a pickle packs them
    anew. Equal to a ``LoadPlan`` of the same fields."""

    # Not a dataclass of its own: LoadPlan's fields, __init__ and repr, through this property.
    @property
    def items(self) -> list:
        state = self.__dict__
        if state["_items"] is None:
            names, rows = state["_wire"]
            state["_items"] = _reads_from(_names_from(names), rows)
        state["_wire"] = None  # read: they may change
        return state["_items"]

    @items.setter
    def items(self, value: list) -> None:
        self.__dict__.update(_items=value, _wire=None)

    @property
    def unread(self) -> bool:
        """Its items were never read here (it holds their columns only, or the columns of the
        items it was made from, untouched since)."""
        return self.__dict__["_wire"] is not None

    @classmethod
    def _made(cls, wire: tuple, items: list | None, storage_data, planner_data) -> "PackedLoadPlan":
        """A plan of columns ``wire``: of ``items`` (as sent), or to decode when read (None)."""
        plan = cls.__new__(cls)
        plan.__dict__.update(_items=items, _wire=wire, storage_data=storage_data, planner_data=planner_data)
        return plan

    def __reduce__(self):
        wire = self.__dict__["_wire"] or _pack_reads(self.items)
        if wire is None:
            return LoadPlan, (self.items, self.storage_data, self.planner_data)
        return _load_plan_from, (wire, self.storage_data, self.planner_data)

    def __eq__(self, other) -> bool:
        if not isinstance(other, LoadPlan):
            return NotImplemented
        return (self.items, self.storage_data, self.planner_data) == (other.items, other.storage_data,
                                                                       other.planner_data)

    __hash__ = None  # type: ignore[assignment]


def _load_plan_from(wire: tuple, storage_data, planner_data) -> PackedLoadPlan:
    return PackedLoadPlan._made(wire, None, storage_data, planner_data)


# ------------------------------------------------------------------------- what travels
class _Wire:
    """Content of a plan (its items, its flatten mapping) pickled as ``decode(*wire)``, its
    columns: unpickled (or copied) it is the plain container again."""

    plain: type

    def __init__(self, content=(), decode=None, wire: tuple = ()) -> None:
        super().__init__(content)
        # Made from content alone (``dataclasses.asdict`` rebuilds a container by its type): no
        # columns, pickled as the plain container.
        self._wire = (decode, wire) if decode is not None else (self.plain, (self.plain(self),))

    def __reduce__(self):
        return self._wire

    def __copy__(self):
        return self.plain(self)


class _WireList(_Wire, list):
    plain = list


class _WireDict(_Wire, dict):
    plain = dict


# ------------------------------------------------------------------------------- the names
class _Names:
    """The distinct names of one plan, each numbered once; pickled compressed, unpickled as a
    tuple (one object, shared by the items and the mapping that refer to it)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.blob: bytes | None = None

    def number(self, name) -> int:
        """``name``'s number; a new name is numbered next, unless the table is frozen."""
        if type(name) is not str:
            raise _Unfit
        k = self.index.get(name)
        if k is None:
            if self.blob is not None:
                raise _Missing
            k = self.index[name] = len(self.index)
        return k

    def freeze(self) -> None:
        self.blob = zlib.compress(json.dumps(list(self.index)).encode("ascii"), _LEVEL)

    def release(self) -> None:
        """The numbering is over: only the blob travels, and a plan the coordinator scatters
        would otherwise keep its table's index (a dict of every name) until DCP drops it."""
        self.index = {}

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
def _int(v) -> int:
    if type(v) is not int or not _I64_MIN <= v <= _I64_MAX:
        raise _Unfit
    return v


def _hint(index: MetadataIndex) -> int:
    """An index hint, -1 for none (a negative hint does not fit)."""
    if index.index is None:
        return -1
    hint = _int(index.index)
    if hint < 0:
        raise _Unfit
    return hint


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
        rows.extend((k - last, item.type.value, _hint(index), flags))
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


# --------------------------------------------------------------------------- the read items
def _read_rows(items: list, names: _Names) -> array:
    """Per item: the destination name's number less the last item's, type, the two index hints
    (-1: none), flags, then as the flags say the storage name's number, the destination's and
    the storage's index offsets; then dest_offsets, storage_offsets and lengths (each its length
    and its values)."""
    rows = array("q")
    last = 0
    for item in items:
        if type(item) is not ReadItem or type(item.type) is not LoadItemType \
                or type(item.dest_index) is not MetadataIndex or type(item.storage_index) is not MetadataIndex:
            raise _Unfit
        dest, store = item.dest_index, item.storage_index
        k = names.number(dest.fqn)
        flags = (_DEST_OFFSET if dest.offset is not None else 0) | (_STORAGE_OFFSET if store.offset is not None else 0)
        if store.offset is not None and dest.offset is not None and store.offset == dest.offset:
            flags |= _STORAGE_OFFSET_IS_DEST
        if store.fqn != dest.fqn:
            flags |= _STORAGE_NAME
        rows.extend((k - last, item.type.value, _hint(dest), _hint(store), flags))
        last = k
        if flags & _STORAGE_NAME:
            rows.append(names.number(store.fqn))
        if dest.offset is not None:
            _size(dest.offset, rows)
        if store.offset is not None and not flags & _STORAGE_OFFSET_IS_DEST:
            _size(store.offset, rows)
        _size(item.dest_offsets, rows)
        _size(item.storage_offsets, rows)
        _size(item.lengths, rows)
    return rows


def _reads_from(names: tuple[str, ...], blob: bytes) -> list[ReadItem]:
    rows = _ints_from(blob).tolist()
    out: list[ReadItem] = []
    append = out.append
    Size, types = torch.Size, _LOAD_TYPES
    i, k, end = 0, 0, len(rows)
    while i < end:
        k += rows[i]
        kind, dest_hint, store_hint, flags = types[rows[i + 1]], rows[i + 2], rows[i + 3], rows[i + 4]
        i += 5
        store_name = names[k]
        if flags & _STORAGE_NAME:
            store_name = names[rows[i]]
            i += 1
        dest_offset = store_offset = None
        if flags & _DEST_OFFSET:
            n = rows[i]
            dest_offset = Size(rows[i + 1:i + 1 + n])
            i += 1 + n
        if flags & _STORAGE_OFFSET_IS_DEST:
            store_offset = dest_offset
        elif flags & _STORAGE_OFFSET:
            n = rows[i]
            store_offset = Size(rows[i + 1:i + 1 + n])
            i += 1 + n
        sizes = []
        for _ in range(3):
            n = rows[i]
            sizes.append(Size(rows[i + 1:i + 1 + n]))
            i += 1 + n
        append(ReadItem(kind, MetadataIndex(names[k], dest_offset, None if dest_hint < 0 else dest_hint),
                        sizes[0], MetadataIndex(store_name, store_offset, None if store_hint < 0 else store_hint),
                        sizes[1], sizes[2]))
    return out


# ----------------------------------------------------------------------------- the mapping
def _mapping_rows(mapping: dict, names: _Names) -> array:
    """Per entry: the name's number less the last entry's, the path's length, then per key of the
    path its length in the name's text, negative for an int key. Only a path whose keys joined by
    '.' give the name fits (DCP's flattening names them so); any other mapping is sent as it is."""
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

