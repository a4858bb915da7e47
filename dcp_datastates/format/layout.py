"""The checkpoint format, stated once: data-file names, byte offsets and the safetensors header
of each data file (the layout), the checksum grid, and the ``.metadata`` commit marker.

Data files. Each rank's data file is a valid safetensors file: an 8-byte little-endian header
length, a JSON header, then the items back to back (safetensors rejects holes between tensors).
The header is padded with spaces so the data region starts on a 4 KiB boundary. The C++ engine
receives the offsets computed here and never computes a layout of its own; it writes every byte
(header, data, zeros) of every data file, local or remote.

Checksum grid. Each data file is cut on a grid of ``piece_size`` bytes from its first data byte;
the part of an item inside one cell is a piece with its own CRC32C. The grid is the engine's
(``csrc/grid.h``: it cuts and checksums on it); ``piece_ranges`` here reads it from there.

Commit marker. ``.metadata`` is a JSON document (never a pickle) that DCP's ``Metadata`` is
encoded into and decoded from, with every item's file, offset, length, dtype, shape and
checksums. Decoding validates everything it reads, so a damaged or foreign file raises
``CheckpointFormatError`` naming the file and the field instead of crashing or allocating absurd
sizes later.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
import uuid
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps's own string encoder (C)
from typing import Any, NamedTuple

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

from ..errors import CheckpointFormatError
from ..native import engine_module

_engine = engine_module()  # the checksum grid is the engine's, computed once (piece_ranges)

__all__ = [
    # data files
    "FileEntry", "FileLayout", "plan_file", "data_file_name", "data_file_parts", "dtype_to_name", "name_to_dtype", "safetensors_dtype",
    "DATA_ALIGNMENT", "FORMAT_NAME",
    # the checksum grid
    "piece_ranges",
    # the commit marker
    "ItemLocation", "FileInfo", "encode_items", "parse_document", "decode_items", "document_head", "bytes_location",
    "decode_planner_data", "decode_storage_meta", "FORMAT_VERSION", "PACKED_VERSION", "METADATA_NAME",
    "REFERENCES_VERSION", "reference_name", "split_reference", "own_files",
    "MAX_METADATA_BYTES", "STEP_NUMBER", "rank_marker_name", "PENDING_NAME",
]



# =========================================================================== data files
FORMAT_NAME = "dcp_datastates"
DATA_ALIGNMENT = 4096

# torch dtype <-> the name we record in our metadata (stable, independent of torch's repr).
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
        "complex64", "complex128",
    )
    if hasattr(torch, name)
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

# The safetensors spelling of each dtype it supports. Others are stored as raw U8 bytes (shape
# [nbytes]); our metadata keeps their real dtype and shape.
_SAFETENSORS = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64",
}


def dtype_to_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be checkpointed by dcp_datastates") from None


def name_to_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r} in checkpoint metadata") from None


def safetensors_dtype(name: str) -> str | None:
    return _SAFETENSORS.get(name)


def data_file_name(rank: int, index: int = 0, tag: str | None = None) -> str:
    """Name of a rank's data file, relative to the checkpoint folder. ``tag`` (a save's id) makes
    the names of a save into a folder that holds a committed checkpoint differ from that one's."""
    return f"__{rank}_{index}.safetensors" if tag is None else f"__{rank}_{index}.{tag}.safetensors"


_DATA_FILE_NAME = re.compile(r"^__(\d+)_(\d+)(?:\.[0-9a-f]+)?\.safetensors$")


def new_tag() -> str:
    """The file-name tag of a save into a folder that already holds a commit (its files get new
    names, so the old checkpoint stays whole until the new one is committed)."""
    return uuid.uuid4().hex[:12]


def data_file_parts(name: str) -> tuple[int, int] | None:
    """(rank, index) of a ``data_file_name``; None for any other name."""
    m = _DATA_FILE_NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class FileEntry:
    """One item to place in a data file. ``kind`` is "tensor" or "bytes"."""

    name: str
    kind: str
    dtype: str  # our dtype name; "uint8" for bytes items
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileLayout:
    header: bytes  # 8-byte length + JSON + padding; the data region starts at len(header)
    offsets: tuple[int, ...]  # absolute file offset of each entry, in entry order
    file_size: int

    @property
    def data_start(self) -> int:
        return len(self.header)


def plan_file(entries: list[FileEntry], file_metadata: dict[str, str] | None = None) -> FileLayout:
    """Lay out entries back to back after a safetensors header, in the order given."""
    header: dict[str, object] = {}
    meta = {"format": FORMAT_NAME}
    meta.update(file_metadata or {})
    raw_dtypes: dict[str, list] = {}
    begin = 0
    rel: list[int] = []
    for e in entries:
        st = safetensors_dtype(e.dtype) if e.kind == "tensor" else "U8"
        shape = list(e.shape)
        if st is None:  # e.g. complex128: raw bytes in the file, real dtype in our metadata
            st, shape = "U8", [e.nbytes]
            raw_dtypes[e.name] = [e.dtype, list(e.shape)]
        if e.kind == "bytes":
            shape = [e.nbytes]
        header[e.name] = {"dtype": st, "shape": shape, "data_offsets": [begin, begin + e.nbytes]}
        rel.append(begin)
        begin += e.nbytes
    if raw_dtypes:
        meta["raw_dtypes"] = json.dumps(raw_dtypes, separators=(",", ":"))
    header["__metadata__"] = meta
    body = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces (allowed by the format) so the data region is 4 KiB aligned.
    pad = -(8 + len(body)) % DATA_ALIGNMENT
    body += b" " * pad
    head = struct.pack("<Q", len(body)) + body
    start = len(head)
    return FileLayout(header=head, offsets=tuple(start + r for r in rel), file_size=start + begin)


# ==================================================================== the commit marker
FORMAT_VERSION = 1
# A commit whose items refer to data files of earlier checkpoints under the same root
# (incremental saves): its document says version 2, so a reader that does not follow references
# (dcp_datastates before them) refuses it by name instead of looking for those files here.
REFERENCES_VERSION = 2
# Chunk tables as packed columns (format/packed.py): what a commit of many chunks writes.
PACKED_VERSION = 3
_READABLE_VERSIONS = (FORMAT_VERSION, REFERENCES_VERSION, PACKED_VERSION)
METADATA_NAME = ".metadata"
# Several ranks with a local tier: the metadata of a checkpoint committed on the nodes' local tiers
# and not yet on the durable one (tiers/local_tier.py); never read by DCP.
PENDING_NAME = ".pending.metadata"
# A marker this large is not one (a million chunks encode to ~200 MB): refuse before reading it.
MAX_METADATA_BYTES = 1 << 30
# The step number of a checkpoint folder's name: its last run of digits (``step-100``, ``ckpt_7``).
STEP_NUMBER = re.compile(r"(\d+)(?!.*\d)")
# Upper bounds that keep a corrupted file from driving huge allocations.
_MAX_DIMS = 64
_MAX_NUMEL = 1 << 50
# Byte offsets, lengths and sizes are 63-bit (they become off_t and int64 in the engine and torch).
_MAX_INT = (1 << 63) - 1
# Pairwise chunk-overlap checks are quadratic: done up to this many chunks of one tensor (the
# volume check that always runs already proves full coverage when there is no overlap).
_MAX_OVERLAP_CHECK = 256


class ItemLocation(NamedTuple):
    """Where one saved item (a tensor chunk or a bytes value) lives. This is the ``storage_data``
    of DCP's ``WriteResult`` and of the decoded ``Metadata``. Immutable (shared with cached
    plans); a named tuple because one is built per item of every save and every load: 0.5 us,
    against 2-4 us for a frozen dataclass (whose ``__init__`` sets each field through
    ``object.__setattr__``)."""

    file: str
    offset: int  # absolute byte offset in the file
    length: int
    dtype: str  # our dtype name ("uint8" for bytes items)
    shape: tuple[int, ...]  # the stored chunk's shape
    crc32c: tuple[int, ...]  # one per piece of the file's checksum grid; () when not computed
    data_start: int  # first data byte of the file (the grid origin)
    piece_size: int  # grid step of the checksums
    file_size: int = 0  # size of the whole data file (written, or as the metadata records it; 0: not known)
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


# --------------------------------------------------------------------------------------- encode
def encode_items(md: Metadata, locations: dict[MetadataIndex, ItemLocation],
                 c: _Check | None) -> tuple[bytes, dict[str, FileInfo]]:
    """A version 1 or 2 document (one JSON object per item and chunk) and the data files it lists;
    with ``c``, every item is checked as it is placed (``format.metadata.encode_commit``)."""
    return _encode(md, locations, c)


def _encode(md: Metadata, locations: dict[MetadataIndex, ItemLocation],
            c: _Check | None) -> tuple[bytes, dict[str, FileInfo]]:
    """(the document, its files), in one pass over the items; with ``c``, every item is checked
    as it is placed. This runs once per item of every commit (20,000 items: every microsecond
    per item is 20 ms of time to durable).

    The items are written as JSON text directly (3-4x faster than building dicts for
    ``json.dumps``): names through the json module's own string encoder, numbers from
    ``torch.Size`` and ``int`` (whose ``str`` is JSON), nothing else."""
    files: dict[str, list[int]] = {}  # name -> [size, data_start, piece_size]
    file_json: dict[str, str] = {}  # name -> the name as a JSON string
    spans: dict[str, list[tuple[int, int]]] = {}  # name -> (start, end) of each item's bytes
    items: list[str] = []
    # Looked up by (fqn, offset), MetadataIndex's own equality (its ``index`` hint is not
    # compared): a MetadataIndex built per item only to look it up costs ~2.5 us more.
    find = {(index.fqn, index.offset): loc for index, loc in locations.items()}.get
    dims_json: dict = {}  # the JSON text of each distinct shape and offset (a model repeats a few)

    def ints(dims) -> str:
        try:
            return dims_json[dims]
        except KeyError:
            text = dims_json[dims] = _int_list(dims)
            return text
        except TypeError:  # not hashable (a list)
            return _int_list(dims)

    def where(fqn: str, offsets) -> tuple[str, int]:
        """The item's location fields as JSON text, and its stored length; files and spans
        updated; checked against its file."""
        loc = find((fqn, offsets))
        if loc is None:
            raise CheckpointFormatError(f"no write result for item {fqn!r} at offset {offsets}")
        info = files.get(loc.file)
        if info is None:
            info = files[loc.file] = [0, loc.data_start, loc.piece_size]
            file_json[loc.file] = _json_str(loc.file)
            if c is not None:
                _check_file_name(c, loc.file, loc.piece_size, f"files[{loc.file!r}]", references=True)
        elif c is not None and (info[1] != loc.data_start or info[2] != loc.piece_size):
            raise c.fail(f"{_item_where(fqn, offsets)}: its checksum grid ({loc.data_start}, {loc.piece_size}) "
                         f"is not its file's ({info[1]}, {info[2]}) in {loc.file}")
        offset, length, crcs = int(loc.offset), int(loc.length), loc.crc32c
        # A file may end with items nothing references (a value DCP's planner took from another
        # rank): its size is the writer's, not the end of the last referenced item.
        end = offset + length
        if end > info[0] or loc.file_size > info[0]:
            info[0] = max(end, int(loc.file_size))
        if c is not None:
            if offset < info[1]:
                raise c.fail(f"{_item_where(fqn, offsets)}: byte range [{offset}, {end}) starts before the data "
                             f"region of {loc.file} (at {info[1]})")
            _check_crcs(c, _item_where, (fqn, offsets), offset, length, crcs, info[1], info[2])
            if length:
                spans.setdefault(loc.file, []).append((offset, end))
        text = (f'"file":{file_json[loc.file]},"offset":{offset},"length":{length},'
                f'"crc32c":{list(map(int, crcs))}')
        if loc.hash64 is not None:
            text += f',"hash64":"{int(loc.hash64):016x}"'
        return text, length

    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            items.append(f'{_json_str(fqn)}:{{"type":"bytes",{where(fqn, None)[0]}}}')
            continue
        props, size = smd.properties, smd.size
        name = dtype_to_name(props.dtype)
        chunks: list[str] = []
        covered = 0
        for i, chunk in enumerate(smd.chunks):
            offsets, sizes = chunk.offsets, chunk.sizes
            text, length = where(fqn, offsets)
            chunks.append(f'{{"offsets":{ints(offsets)},"sizes":{ints(sizes)},{text}}}')
            if c is not None:
                numel = _numel(sizes)
                covered += numel
                cwhere = f"item {fqn!r} chunk {i}"
                _check_chunk_bounds(c, cwhere, offsets, sizes, size)
                _check_chunk_length(c, cwhere, length, sizes, numel * props.dtype.itemsize, name)
        if c is not None:
            _check_covered(c, f"item {fqn!r}", covered, size, _numel(size))
        items.append(f'{_json_str(fqn)}:{{"type":"tensor","dtype":"{name}",'
                     f'"requires_grad":{"true" if props.requires_grad else "false"},"size":{ints(size)},'
                     f'"chunks":[{",".join(chunks)}]}}')
    infos = {name: FileInfo(size=v[0], data_start=v[1], piece_size=v[2]) for name, v in files.items()}
    if c is not None:
        for name, info in infos.items():
            _check_file(c, name, info, f"files[{name!r}]", references=True)
        _check_spans(c, spans, lambda fname, start, end: _raise_shared(
            c, ((index.fqn, loc) for index, loc in locations.items()), fname, start, end))
    version = REFERENCES_VERSION if any(name.startswith("../") for name in files) else FORMAT_VERSION
    head = document_head(md, version, infos)
    text = json.dumps(head, separators=(",", ":"))[:-1] + ',"items":{' + ",".join(items) + "}}"
    return text.encode(), infos


def document_head(md: Metadata, version: int, files: dict[str, FileInfo]) -> dict:
    """The fields every version's document starts with: format, version, DCP's metadata fields
    and the data files; the codec of the version adds its items."""
    storage_meta = None
    if md.storage_meta is not None:
        sm = md.storage_meta
        storage_meta = {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        }
    return {
        "format": FORMAT_NAME,
        "version": version,
        "dcp_version": md.version,
        "storage_meta": storage_meta,
        "planner_data": _jsonable_planner_data(md.planner_data),
        "files": {name: {"size": v.size, "data_start": v.data_start, "piece_size": v.piece_size}
                  for name, v in files.items()},
    }


def _int_list(dims) -> str:
    """A ``torch.Size`` (or tuple) of ints as a JSON array."""
    return str(list(map(int, dims)))


def _item_where(fqn: str, offsets) -> str:
    if offsets is None:
        return f"item {fqn!r}"
    return f"item {fqn!r} at offset {list(offsets)}"


def _jsonable_planner_data(data: Any) -> Any:
    """DefaultSavePlanner's planner_data, which maps flat keys to object paths (tuples of str and
    int; ``json.dumps`` writes them as arrays), or None for anything else. The types are gathered
    in C loops and each distinct one checked once (20,000 keys: ~5 ms, against ~70 ms for a check
    per entry)."""
    if not isinstance(data, dict):
        return None
    paths = data.values()
    if (all(issubclass(t, str) for t in set(map(type, data)))
            and all(issubclass(t, (tuple, list)) for t in set(map(type, paths)))
            and all(issubclass(t, (str, int)) for t in set(map(type, itertools.chain.from_iterable(paths))))):
        return data
    return None


# --------------------------------------------------------------------------------------- decode
class _Check:
    """Small typed accessors that raise CheckpointFormatError naming the source and field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.source}: {what}")

    # Each accessor first tries the common case with exact-type tests (JSON gives exactly int,
    # list, dict, str), and only otherwise runs the full checks that name what is wrong: decoding
    # a large checkpoint's metadata is on every load's critical path.
    def get(self, obj: dict, key: str, typ: type | tuple, where: str) -> Any:
        value = obj.get(key) if type(obj) is dict else None
        if type(value) is typ:
            return value
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(f"missing field {key!r} in {where}")
        value = obj[key]
        if isinstance(value, bool) and typ is int or not isinstance(value, typ):
            raise self.fail(f"field {key!r} in {where} should be {_tname(typ)}, found {type(value).__name__}")
        return value

    def nonneg(self, obj: dict, key: str, where: str) -> int:
        value = obj.get(key) if type(obj) is dict else None
        if type(value) is int and 0 <= value <= _MAX_INT:
            return value
        value = self.get(obj, key, int, where)
        if value < 0:
            raise self.fail(f"field {key!r} in {where} is negative ({value})")
        if value > _MAX_INT:
            raise self.fail(f"field {key!r} in {where} is out of range ({value} > 2**63 - 1)")
        return value

    def dims(self, obj: dict, key: str, where: str) -> tuple[int, ...]:
        value = obj.get(key) if type(obj) is dict else None
        if type(value) is list and len(value) <= _MAX_DIMS and _all_dims(value):
            return tuple(value)
        value = self.get(obj, key, list, where)
        if len(value) > _MAX_DIMS or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_INT for v in value
        ):
            raise self.fail(
                f"field {key!r} in {where} is not a list of at most {_MAX_DIMS} non-negative 63-bit integers"
            )
        return tuple(value)

    def optional_str(self, obj: dict, key: str, where: str) -> str | None:
        value = obj.get(key)
        if value is not None and not isinstance(value, str):
            raise self.fail(f"field {key!r} in {where} should be a string or null, found {type(value).__name__}")
        return value


def _all_dims(values: list) -> bool:
    """Every value an exact int in [0, 2**63) (a plain loop: faster than all() on short lists)."""
    for v in values:
        if type(v) is not int or v < 0 or v > _MAX_INT:
            return False
    return True


def _all_crcs(values: list) -> bool:
    for v in values:
        if type(v) is not int or v < 0 or v > 0xFFFFFFFF:
            return False
    return True


def _tname(typ: type | tuple) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


def parse_document(raw: bytes, c: _Check) -> tuple[dict, int, dict[str, FileInfo]]:
    """The parsed ``.metadata`` document, its format version and its data files, checked: JSON
    (no duplicate keys), this library's format marker, a version this release reads, and every
    file's entry. The items are decoded by the codec of the version (``format.metadata``)."""
    if not isinstance(raw, (bytes, bytearray, memoryview, str)):
        raise c.fail(f"metadata must be bytes, got {type(raw).__name__}")
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    if not raw:
        raise c.fail("empty metadata file (truncated or never written)")
    try:
        doc = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as exc:
        raise c.fail(f"duplicate key {exc.args[0]!r} in a JSON object (corrupted metadata)") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integer literals.
        raise c.fail(f"not a dcp_datastates metadata file (invalid JSON: {_short(exc)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise c.fail("not a dcp_datastates metadata file (missing format marker)")
    version = c.get(doc, "version", int, "the document")
    if version not in _READABLE_VERSIONS:
        raise c.fail(
            f"unknown format version {version}; this dcp_datastates reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))} (upgrade dcp_datastates to load newer checkpoints)"
        )
    files: dict[str, FileInfo] = {}
    for name, info in c.get(doc, "files", dict, "the document").items():
        where = f"files[{name!r}]"
        files[name] = FileInfo(
            size=c.nonneg(info, "size", where),
            data_start=c.nonneg(info, "data_start", where),
            piece_size=c.nonneg(info, "piece_size", where),
        )
        _check_file(c, name, files[name], where, references=version >= REFERENCES_VERSION)
    return doc, version, files


def decode_items(doc: dict, c: _Check, files: dict[str, FileInfo]) -> Metadata:
    """DCP's ``Metadata`` of a version 1 or 2 document (one JSON object per item and chunk)."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, ItemLocation] = {}
    for fqn, item in c.get(doc, "items", dict, "the document").items():
        where = f"item {fqn!r}"
        kind = c.get(item, "type", str, where)
        if kind == "tensor":
            _decode_tensor(c, fqn, item, where, files, state, storage)
        elif kind == "bytes":
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = bytes_location(c, item, where, files)
        else:
            raise c.fail(f"{where}: unknown item type {kind!r}")
    _check_no_shared_bytes(c, storage)
    return Metadata(state_dict_metadata=state, planner_data=decode_planner_data(c, doc), storage_data=storage,
                    storage_meta=decode_storage_meta(c, doc), version=c.optional_str(doc, "dcp_version", "the document"))


def bytes_location(c: _Check, item: dict, where: str, files: dict[str, FileInfo]) -> ItemLocation:
    """The location of a non-tensor value (its bytes are stored as a uint8 vector)."""
    loc = _location(c, item, where, files, "uint8", ())
    return loc._replace(shape=(loc.length,))


def decode_planner_data(c: _Check, doc: dict) -> Any:
    planner_data = doc.get("planner_data")
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise c.fail("planner_data must be a mapping")
        for k, v in planner_data.items():
            if not isinstance(v, list) or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v):
                raise c.fail(f"planner_data[{k!r}] must be a list of strings and integers (an object path)")
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    return planner_data


def decode_storage_meta(c: _Check, doc: dict) -> StorageMeta | None:
    sm = doc.get("storage_meta")
    if sm is None:
        return None
    if not isinstance(sm, dict):
        raise c.fail(f"storage_meta must be a mapping or null, found {type(sm).__name__}")
    modules = sm.get("modules") or []
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise c.fail("storage_meta.modules must be a list of strings")
    return StorageMeta(
        checkpoint_id=c.optional_str(sm, "checkpoint_id", "storage_meta"),
        save_id=c.optional_str(sm, "save_id", "storage_meta"),
        load_id=c.optional_str(sm, "load_id", "storage_meta"),
        modules=list(modules),
    )


def _check_no_shared_bytes(c: _Check, storage: dict[MetadataIndex, ItemLocation]) -> None:
    """No two items share bytes of a file. Without this, chunks that tile a huge tensor could
    all point at the same small range, and a file of a few bytes would claim terabytes (the
    sizes a load allocates are checked against the files on disk, which this makes sufficient)."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for loc in storage.values():
        if loc.length:
            spans = by_file.get(loc.file)
            if spans is None:
                spans = by_file[loc.file] = []
            spans.append((loc.offset, loc.offset + loc.length))
    _check_spans(c, by_file, lambda fname, start, end: _raise_shared(
        c, ((index.fqn, loc) for index, loc in storage.items()), fname, start, end))


def _check_spans(c: _Check, by_file: dict[str, list[tuple[int, int]]], on_shared) -> None:
    """``on_shared(file, start, end)`` raises for the first range two items' bytes share."""
    for fname, spans in by_file.items():
        spans.sort()  # plain tuples: the fast path of a large checkpoint's decode
        prev_end = 0
        for start, end in spans:
            if start < prev_end:
                on_shared(fname, start, prev_end)
            prev_end = end


def _raise_shared(c: _Check, placed, fname: str, start: int, prev_end: int) -> None:
    """Name the two items behind a shared byte range, from ``placed`` (fqn, location) pairs
    (only on failure: a second scan)."""
    owners = [fqn for fqn, loc in placed
              if loc.file == fname and loc.length and loc.offset < prev_end and start < loc.offset + loc.length]
    a, b = (owners + ["?", "?"])[:2]
    raise c.fail(f"items {a!r} and {b!r} share bytes [{start}, {prev_end}) of {fname} (each stored item has bytes of its own)")


def _check_chunk_bounds(c: _Check, where: str, offsets, sizes, size) -> None:
    if len(offsets) != len(size) or len(sizes) != len(size):
        raise c.fail(f"{where}: rank of offsets/sizes does not match the tensor's {len(size)} dims")
    for o, s, d in zip(offsets, sizes, size):  # a plain loop: no generator per chunk
        if o + s > d:
            break
    else:
        return
    raise c.fail(f"{where}: chunk {list(offsets)}+{list(sizes)} exceeds the tensor size {list(size)}")


def _check_chunk_length(c: _Check, where: str, length: int, sizes, nbytes: int, dtype_name: str) -> None:
    if length != nbytes:
        raise c.fail(f"{where}: stored length {length} bytes does not match shape {list(sizes)} of {dtype_name} "
                     f"({nbytes} bytes)")


def _check_covered(c: _Check, where: str, covered: int, size, total: int) -> None:
    # DCP's save planners only commit plans whose chunks tile the tensor exactly; anything
    # else would leave parts of a destination silently unloaded.
    if covered != total:
        raise c.fail(f"{where}: its chunks hold {covered} elements, the tensor of size {list(size)} has {total}")


def _check_file(c: _Check, name: str, info: FileInfo, where: str, *, references: bool = False) -> None:
    """What a data file's entry must satisfy (the decoder's and the commit's check)."""
    _check_file_name(c, name, info.piece_size, where, references=references)
    if info.data_start > info.size:
        raise c.fail(f"{where}: data_start {info.data_start} lies past the file size {info.size}")


def _plain_name(name: str) -> bool:
    return not ("/" in name or "\\" in name or "\x00" in name or name in ("", ".", "..", METADATA_NAME))


def _check_file_name(c: _Check, name: str, piece_size: int, where: str, *, references: bool = False) -> None:
    ref = split_reference(name)
    if ref is not None and references:
        if not (_plain_name(ref[0]) and _plain_name(ref[1])):
            raise c.fail(f"{where}: a reference must name a data file of a checkpoint folder beside this one "
                         f"(../<folder>/<file>, two plain names)")
    elif not _plain_name(name):
        raise c.fail(f"{where}: file names must be plain names inside the checkpoint folder")
    if piece_size == 0:
        raise c.fail(f"{where}: piece_size must be positive")


def _check_range(c: _Check, where: str, fname: str, offset: int, length: int, crcs, info: FileInfo) -> None:
    """An item's bytes lie in its file's data region, with one 32-bit checksum per piece."""
    if offset < info.data_start or offset + length > info.size:
        raise c.fail(
            f"{where}: byte range [{offset}, {offset + length}) lies outside the data region "
            f"[{info.data_start}, {info.size}) of {fname}"
        )
    _check_crcs(c, str, (where,), offset, length, crcs, info.data_start, info.piece_size)


def _check_crcs(c: _Check, where, where_args: tuple, offset: int, length: int, crcs, data_start: int,
                piece_size: int) -> None:
    """One 32-bit checksum per piece of the grid that the item's range covers. The message's
    place is ``where(*where_args)``, built only on failure."""
    if not _all_crcs(crcs) and not all(isinstance(x, int) and 0 <= x < (1 << 32) for x in crcs):
        raise c.fail(f"{where(*where_args)}: crc32c must be a list of 32-bit integers")
    if crcs:
        try:
            count = _engine.piece_count(offset, length, data_start, piece_size)
        except (TypeError, ValueError, OverflowError) as exc:  # beyond 64-bit offsets, a bad grid
            raise c.fail(f"{where(*where_args)}: byte range [{offset}, {offset + length}) cannot be checksummed: "
                         f"{exc}") from None
        if len(crcs) != count:
            raise c.fail(f"{where(*where_args)}: {len(crcs)} checksums for {count} pieces")


def _location(c: _Check, entry: dict, where: str, files: dict[str, FileInfo], dtype: str, shape: tuple[int, ...]) -> ItemLocation:
    fname = c.get(entry, "file", str, where)
    info = files.get(fname)
    if info is None:
        raise c.fail(f"{where} refers to file {fname!r}, which the metadata does not list")
    offset, length = c.nonneg(entry, "offset", where), c.nonneg(entry, "length", where)
    crcs = c.get(entry, "crc32c", list, where)
    _check_range(c, where, fname, offset, length, crcs, info)
    digest = entry.get("hash64")
    if digest is not None:
        if type(digest) is not str or len(digest) != 16 or not _HEX.fullmatch(digest):
            raise c.fail(f"field 'hash64' in {where} should be 16 hex digits, found {digest!r}")
        digest = int(digest, 16)
    # With its file's recorded size: a commit re-encoding these locations (the drain's) records the
    # file as it is, also where the items it references end before the file does.
    return ItemLocation(fname, offset, length, dtype, shape, tuple(crcs), info.data_start, info.piece_size, info.size,
                        digest)


_HEX = re.compile(r"[0-9a-f]{16}")


def _decode_tensor(
    c: _Check,
    fqn: str,
    item: dict,
    where: str,
    files: dict[str, FileInfo],
    state: dict[str, Any],
    storage: dict[MetadataIndex, ItemLocation],
) -> None:
    try:
        dtype = name_to_dtype(c.get(item, "dtype", str, where))
    except ValueError as exc:
        raise c.fail(f"{where}: {exc}") from None
    size = c.dims(item, "size", where)
    total = _numel(size)
    if total > _MAX_NUMEL:
        raise c.fail(f"{where}: absurd number of elements {total} for size {list(size)}")
    requires_grad = item.get("requires_grad", False)
    if not isinstance(requires_grad, bool):
        raise c.fail(f"field 'requires_grad' in {where} should be bool, found {type(requires_grad).__name__}")
    itemsize = dtype.itemsize
    name = dtype_to_name(dtype)
    chunks = []
    covered = 0
    for i, chunk in enumerate(c.get(item, "chunks", list, where)):
        cwhere = f"{where} chunk {i}"
        offsets, sizes = c.dims(chunk, "offsets", cwhere), c.dims(chunk, "sizes", cwhere)
        _check_chunk_bounds(c, cwhere, offsets, sizes, size)
        numel = _numel(sizes)
        if numel > _MAX_NUMEL:
            raise c.fail(f"{cwhere}: absurd number of elements {numel}")
        covered += numel
        loc = _location(c, chunk, cwhere, files, name, sizes)
        _check_chunk_length(c, cwhere, loc.length, sizes, numel * itemsize, name)
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        storage[MetadataIndex(fqn, offsets, i)] = loc
    _check_covered(c, where, covered, size, total)
    if 1 < len(chunks) <= _MAX_OVERLAP_CHECK:
        for a in range(len(chunks)):
            for b in range(a + 1, len(chunks)):
                if _overlap(chunks[a], chunks[b]):
                    raise c.fail(f"{where}: chunks {a} and {b} overlap")
    props = TensorProperties(dtype=dtype, requires_grad=requires_grad)
    state[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)  # in C; a duplicate shows as a shorter dict
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
        if n == 0:
            return 0
    return n


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    if _numel(tuple(a.sizes)) == 0 or _numel(tuple(b.sizes)) == 0:
        return False
    return all(
        ao < bo + bs and bo < ao + as_
        for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


# The checksum grid is the engine's (csrc/grid.h): it cuts and checksums on it, and these read it.
def piece_ranges(loc: ItemLocation) -> list[tuple[int, int]]:
    """(file offset, length) of each checksum piece of an item, in order."""
    return _engine.piece_ranges(loc.offset, loc.length, loc.data_start, loc.piece_size)


def rank_marker_name(rank: int) -> str:
    """The commit marker of one rank's rank-local save (``use_collectives=False``)."""
    return f"__{rank}{METADATA_NAME}"
