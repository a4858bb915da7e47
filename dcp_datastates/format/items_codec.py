"""The ``.metadata`` codec of format versions 1 and 2: one JSON object per item and chunk.

A commit below ``format.metadata.PACK_FROM_CHUNKS`` chunks is written this way (version 2 when
it refers to data files of earlier checkpoints); any tool reads it. Both directions check every
value with ``format.checks``; the document's head is ``format.document``'s.
"""

from __future__ import annotations

import json
import re
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

from ..errors import CheckpointFormatError
from ..native import engine_module
from .checks import _MAX_NUMEL, _MAX_OVERLAP_CHECK, _Check, _check_file, _check_file_name
from .document import FORMAT_VERSION, REFERENCES_VERSION, decode_planner_data, decode_storage_meta, document_head
from .layout import DTYPE_NAMES, dtype_to_name, name_to_dtype
from .locations import FileInfo, ItemLocation

# The checksum grid is the engine's (_check_crcs counts its pieces).
_engine = engine_module()

__all__ = ["encode_items", "decode_items", "bytes_location"]


# --------------------------------------------------------------------------------------- encode
def encode_items(md: Metadata, locations: dict[MetadataIndex, ItemLocation],
                 c: _Check | None) -> tuple[bytes, dict[str, FileInfo]]:
    """A version 1 or 2 document (one JSON object per item and chunk) and the data files it lists;
    with ``c``, every item is checked as it is placed (``format.metadata.encode_commit``)."""
    return _encode(md, locations, c)


def _encode(md: Metadata, locations: dict[MetadataIndex, ItemLocation],
            c: _Check | None) -> tuple[bytes, dict[str, FileInfo]]:
    """(the document, its files), in one pass over the items; with ``c``, every item is checked
    as it is placed. This runs once per item of every commit, so any cost per item is multiplied
    by the item count in the time to durable.

    The items are written as JSON text directly (several times faster than building dicts for
    ``json.dumps``): names through the json module's own string encoder, numbers from
    ``torch.Size`` and ``int`` (whose ``str`` is JSON), nothing else."""
    # File name -> [size, data_start, piece_size].
    files: dict[str, list[int]] = {}
    # File name -> the name as a JSON string.
    file_json: dict[str, str] = {}
    # File name -> (start, end) of each item's bytes.
    spans: dict[str, list[tuple[int, int]]] = {}
    items: list[str] = []
    # Looked up by (fqn, offset), MetadataIndex's own equality (its ``index`` hint is not
    # compared): a MetadataIndex built per item only to look it up costs more than the lookup.
    find = {(index.fqn, index.offset): loc for index, loc in locations.items()}.get
    # The JSON text of each distinct shape and offset (a model repeats a few).
    dims_json: dict = {}

    def ints(dims) -> str:
        try:
            return dims_json[dims]
        except KeyError:
            text = dims_json[dims] = _int_list(dims)
            return text
        except TypeError:
            # Not hashable (a list).
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
        # dtype_to_name raises, naming the dtype, for a dtype that has no name.
        name = DTYPE_NAMES.get(props.dtype) or dtype_to_name(props.dtype)
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


def _int_list(dims) -> str:
    """A ``torch.Size`` (or tuple) of ints as a JSON array."""
    return str(list(map(int, dims)))


def _item_where(fqn: str, offsets) -> str:
    if offsets is None:
        return f"item {fqn!r}"
    return f"item {fqn!r} at offset {list(offsets)}"


# --------------------------------------------------------------------------------------- decode
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


# ---------------------------------------------------------------- the checks of each chunk
# Version 1/2 decoding and encoding check every chunk with these, one call per chunk: they live
# with the codec, not in ``format.checks``, so that a chunk is checked without leaving the module.

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
        # Plain tuples: the fast path of a large checkpoint's decode.
        spans.sort()
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
    # A plain loop: no generator per chunk.
    for o, s, d in zip(offsets, sizes, size):
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


def _check_range(c: _Check, where: str, fname: str, offset: int, length: int, crcs, info: FileInfo) -> None:
    """An item's bytes lie in its file's data region, with one 32-bit checksum per piece."""
    if offset < info.data_start or offset + length > info.size:
        raise c.fail(
            f"{where}: byte range [{offset}, {offset + length}) lies outside the data region "
            f"[{info.data_start}, {info.size}) of {fname}"
        )
    _check_crcs(c, str, (where,), offset, length, crcs, info.data_start, info.piece_size)


def _all_crcs(values: list) -> bool:
    """Every value a 32-bit checksum (the fast path of ``_check_crcs``)."""
    for v in values:
        if type(v) is not int or v < 0 or v > 0xFFFFFFFF:
            return False
    return True


def _check_crcs(c: _Check, where, where_args: tuple, offset: int, length: int, crcs, data_start: int,
                piece_size: int) -> None:
    """One 32-bit checksum per piece of the grid that the item's range covers. The message's
    place is ``where(*where_args)``, built only on failure."""
    if not _all_crcs(crcs) and not all(isinstance(x, int) and 0 <= x < (1 << 32) for x in crcs):
        raise c.fail(f"{where(*where_args)}: crc32c must be a list of 32-bit integers")
    if crcs:
        try:
            count = _engine.piece_count(offset, length, data_start, piece_size)
        except (TypeError, ValueError, OverflowError) as exc:
            # Offsets beyond 64 bits, or a bad grid.
            raise c.fail(f"{where(*where_args)}: byte range [{offset}, {offset + length}) cannot be checksummed: "
                         f"{exc}") from None
        if len(crcs) != count:
            raise c.fail(f"{where(*where_args)}: {len(crcs)} checksums for {count} pieces")
