"""The ``.metadata`` commit marker: a JSON document (never a pickle) that DCP's ``Metadata`` is
encoded into and decoded from, with every item's file, offset, length, dtype, shape and checksums.

Decoding validates everything it reads, so a damaged or foreign file raises
``CheckpointFormatError`` naming the file and the field instead of crashing or allocating
absurd sizes later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .errors import CheckpointFormatError
from .layout import FORMAT_NAME, dtype_to_name, name_to_dtype

__all__ = ["ItemLocation", "FileInfo", "encode_metadata", "decode_metadata", "FORMAT_VERSION", "METADATA_NAME"]

FORMAT_VERSION = 1
METADATA_NAME = ".metadata"
# Upper bounds that keep a corrupted file from driving huge allocations.
_MAX_DIMS = 64
_MAX_NUMEL = 1 << 50


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item (a tensor chunk or a bytes value) lives. This is the ``storage_data``
    of DCP's ``WriteResult`` and of the decoded ``Metadata``."""

    file: str
    offset: int  # absolute byte offset in the file
    length: int
    dtype: str  # our dtype name ("uint8" for bytes items)
    shape: tuple[int, ...]  # the stored chunk's shape
    crc32c: tuple[int, ...]  # one per piece of the file's checksum grid; () when not computed
    data_start: int  # first data byte of the file (the grid origin)
    piece_size: int  # grid step of the checksums


@dataclass(frozen=True)
class FileInfo:
    size: int
    data_start: int
    piece_size: int


# --------------------------------------------------------------------------------------- encode
def encode_metadata(md: Metadata, locations: dict[MetadataIndex, ItemLocation]) -> bytes:
    files: dict[str, dict] = {}
    items: dict[str, Any] = {}

    def place(index: MetadataIndex) -> dict:
        loc = locations.get(index)
        if loc is None:
            raise CheckpointFormatError(f"no write result for item {index.fqn!r} at offset {index.offset}")
        info = files.setdefault(loc.file, {"size": 0, "data_start": loc.data_start, "piece_size": loc.piece_size})
        info["size"] = max(info["size"], loc.offset + loc.length)
        return {"file": loc.file, "offset": loc.offset, "length": loc.length, "crc32c": list(loc.crc32c)}

    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            items[fqn] = {"type": "bytes", **place(MetadataIndex(fqn))}
            continue
        props = smd.properties
        chunks = []
        for chunk in smd.chunks:
            entry = {"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)}
            entry.update(place(MetadataIndex(fqn, chunk.offsets)))
            chunks.append(entry)
        items[fqn] = {
            "type": "tensor",
            "dtype": dtype_to_name(props.dtype),
            "requires_grad": bool(props.requires_grad),
            "size": list(smd.size),
            "chunks": chunks,
        }
    storage_meta = None
    if md.storage_meta is not None:
        sm = md.storage_meta
        storage_meta = {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        }
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dcp_version": md.version,
        "storage_meta": storage_meta,
        "planner_data": _jsonable_planner_data(md.planner_data),
        "files": files,
        "items": items,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _jsonable_planner_data(data: Any) -> Any:
    """DefaultSavePlanner's planner_data maps flat keys to object paths (tuples of str/int)."""
    if isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
        for k, v in data.items()
    ):
        return {k: list(v) for k, v in data.items()}
    return None


# --------------------------------------------------------------------------------------- decode
class _Check:
    """Small typed accessors that raise CheckpointFormatError naming the source and field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.source}: {what}")

    def get(self, obj: dict, key: str, typ: type | tuple, where: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(f"missing field {key!r} in {where}")
        value = obj[key]
        if isinstance(value, bool) and typ is int or not isinstance(value, typ):
            raise self.fail(f"field {key!r} in {where} should be {_tname(typ)}, found {type(value).__name__}")
        return value

    def nonneg(self, obj: dict, key: str, where: str) -> int:
        value = self.get(obj, key, int, where)
        if value < 0:
            raise self.fail(f"field {key!r} in {where} is negative ({value})")
        return value

    def dims(self, obj: dict, key: str, where: str) -> tuple[int, ...]:
        value = self.get(obj, key, list, where)
        if len(value) > _MAX_DIMS or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise self.fail(f"field {key!r} in {where} is not a list of non-negative integers")
        return tuple(value)


def _tname(typ: type | tuple) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


def decode_metadata(raw: bytes, source: str) -> tuple[Metadata, dict[str, FileInfo]]:
    """Parse and validate a ``.metadata`` document. ``source`` names it in error messages."""
    c = _Check(source)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise c.fail(f"not a dcp_datastates metadata file (invalid JSON: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise c.fail("not a dcp_datastates metadata file (missing format marker)")
    version = c.get(doc, "version", int, "the document")
    if version != FORMAT_VERSION:
        raise c.fail(
            f"unknown format version {version}; this dcp_datastates reads version {FORMAT_VERSION} "
            f"(upgrade dcp_datastates to load newer checkpoints)"
        )
    files: dict[str, FileInfo] = {}
    for name, info in c.get(doc, "files", dict, "the document").items():
        where = f"files[{name!r}]"
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise c.fail(f"{where}: file names must be plain names inside the checkpoint folder")
        files[name] = FileInfo(
            size=c.nonneg(info, "size", where),
            data_start=c.nonneg(info, "data_start", where),
            piece_size=c.nonneg(info, "piece_size", where),
        )
        if files[name].piece_size == 0:
            raise c.fail(f"{where}: piece_size must be positive")

    def location(entry: dict, where: str, dtype: str, shape: tuple[int, ...]) -> ItemLocation:
        fname = c.get(entry, "file", str, where)
        if fname not in files:
            raise c.fail(f"{where} refers to file {fname!r}, which the metadata does not list")
        info = files[fname]
        offset, length = c.nonneg(entry, "offset", where), c.nonneg(entry, "length", where)
        if offset < info.data_start or offset + length > info.size:
            raise c.fail(
                f"{where}: byte range [{offset}, {offset + length}) lies outside the data region "
                f"[{info.data_start}, {info.size}) of {fname}"
            )
        crcs = c.get(entry, "crc32c", list, where)
        if not all(isinstance(x, int) and 0 <= x < (1 << 32) for x in crcs):
            raise c.fail(f"{where}: crc32c must be a list of 32-bit integers")
        if crcs and len(crcs) != _piece_count(offset, length, info):
            raise c.fail(f"{where}: {len(crcs)} checksums for {_piece_count(offset, length, info)} pieces")
        return ItemLocation(fname, offset, length, dtype, shape, tuple(crcs), info.data_start, info.piece_size)

    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, ItemLocation] = {}
    for fqn, item in c.get(doc, "items", dict, "the document").items():
        where = f"item {fqn!r}"
        kind = c.get(item, "type", str, where)
        if kind == "bytes":
            state[fqn] = BytesStorageMetadata()
            loc = location(item, where, "uint8", ())
            storage[MetadataIndex(fqn)] = ItemLocation(**{**loc.__dict__, "shape": (loc.length,)})
            continue
        if kind != "tensor":
            raise c.fail(f"{where}: unknown item type {kind!r}")
        try:
            dtype = name_to_dtype(c.get(item, "dtype", str, where))
        except ValueError as exc:
            raise c.fail(f"{where}: {exc}") from None
        size = c.dims(item, "size", where)
        itemsize = torch.empty((), dtype=dtype).element_size()
        chunks = []
        for i, chunk in enumerate(c.get(item, "chunks", list, where)):
            cwhere = f"{where} chunk {i}"
            offsets, sizes = c.dims(chunk, "offsets", cwhere), c.dims(chunk, "sizes", cwhere)
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise c.fail(f"{cwhere}: rank of offsets/sizes does not match the tensor's {len(size)} dims")
            if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise c.fail(f"{cwhere}: chunk {list(offsets)}+{list(sizes)} exceeds the tensor size {list(size)}")
            numel = 1
            for s in sizes:
                numel *= s
            if numel > _MAX_NUMEL:
                raise c.fail(f"{cwhere}: absurd number of elements {numel}")
            loc = location(chunk, cwhere, dtype_to_name(dtype), sizes)
            if loc.length != numel * itemsize:
                raise c.fail(
                    f"{cwhere}: stored length {loc.length} bytes does not match shape {list(sizes)} of "
                    f"{dtype_to_name(dtype)} ({numel * itemsize} bytes)"
                )
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            storage[MetadataIndex(fqn, offsets, i)] = loc
        props = TensorProperties(dtype=dtype, requires_grad=bool(item.get("requires_grad", False)))
        state[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)

    planner_data = doc.get("planner_data")
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise c.fail("planner_data must be a mapping")
        planner_data = {k: tuple(v) for k, v in planner_data.items() if isinstance(v, list)}
    sm = doc.get("storage_meta")
    storage_meta = None
    if isinstance(sm, dict):
        storage_meta = StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"),
            save_id=sm.get("save_id"),
            load_id=sm.get("load_id"),
            modules=list(sm.get("modules") or []),
        )
    md = Metadata(
        state_dict_metadata=state,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=storage_meta,
        version=doc.get("dcp_version"),
    )
    return md, files


def _piece_count(offset: int, length: int, info: FileInfo) -> int:
    if length == 0:
        return 0
    first = (offset - info.data_start) // info.piece_size
    last = (offset + length - 1 - info.data_start) // info.piece_size
    return last - first + 1


def piece_ranges(loc: ItemLocation) -> list[tuple[int, int]]:
    """(file offset, length) of each checksum piece of an item, in order."""
    out = []
    pos, end = loc.offset, loc.offset + loc.length
    while pos < end:
        grid_end = loc.data_start + ((pos - loc.data_start) // loc.piece_size + 1) * loc.piece_size
        stop = min(grid_end, end)
        out.append((pos, stop - pos))
        pos = stop
    return out
