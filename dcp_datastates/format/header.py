"""A data file's safetensors header (8-byte length N, N bytes of JSON, then the data region),
checked with explicit bounds before anything is allocated or trusted (fuzzed: nothing but
``CheckpointFormatError`` escapes)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointFormatError
from .checks import _DuplicateKey, _no_duplicate_keys

__all__ = ["DataFileItem", "DataFileHeader", "parse_header", "MAX_HEADER_BYTES"]

# safetensors refuses headers above 100 MB; so do we, before reading them.
MAX_HEADER_BYTES = 100 * 1000 * 1000
_MAX_DIMS = 64
_MAX_INT = (1 << 63) - 1

# Bits per element of every safetensors dtype.
_DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


@dataclass(frozen=True)
class DataFileItem:
    """One tensor of a data file as its header describes it; offsets are absolute in the file.
    ``dtype`` is the safetensors spelling ("F32", "BF16", "U8" ...)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int


@dataclass(frozen=True)
class DataFileHeader:
    """A data file's header: ``header_length`` is N, the JSON length, and the data starts at
    ``data_start`` (8 + N). ``items`` are in file order; ``metadata`` is the "__metadata__"
    mapping (str -> str), {} when absent."""

    header_length: int
    data_start: int
    file_size: int
    items: tuple[DataFileItem, ...]
    metadata: dict


def _bytes_text(bits: int) -> str:
    return str(bits // 8) if bits % 8 == 0 else f"{bits // 8} and {bits % 8} bits"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(data: bytes, file_size: int | None = None, source: str = "<data file>") -> DataFileHeader:
    """Parse and check a safetensors header.

    ``data`` holds the file's first bytes: at least the 8-byte length and the JSON (the whole
    file is fine). ``file_size`` is the size of the whole file (default ``len(data)``).
    """
    if isinstance(data, memoryview):
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray)):
        raise CheckpointFormatError(f"{source}: expected bytes, got {type(data).__name__}")
    if file_size is None:
        file_size = len(data)
    if not _is_int(file_size) or file_size < len(data):
        raise CheckpointFormatError(f"{source}: file size {file_size!r} is smaller than the {len(data)} bytes given")

    def fail(what: str, tensor: str | None = None) -> CheckpointFormatError:
        where = f"{source}: tensor {tensor!r}: " if tensor is not None else f"{source}: "
        return CheckpointFormatError(where + what)

    if file_size < 8:
        raise fail(f"file is {file_size} bytes, too short for a safetensors header (8-byte length prefix)")
    if len(data) < 8:
        raise fail(f"only {len(data)} bytes given, the 8-byte header length is incomplete")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n < 2:
        raise fail(f"header length {n} is too small for a JSON object")
    if n > MAX_HEADER_BYTES:
        raise fail(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (not a safetensors file?)")
    if 8 + n > file_size:
        raise fail(f"header length {n} runs past the end of the file ({file_size} bytes): truncated or not safetensors")
    if len(data) < 8 + n:
        raise fail(f"only {len(data)} bytes given, the header needs {8 + n}")
    raw = bytes(data[8 : 8 + n])
    if raw[:1] != b"{":
        raise fail("the header does not start with '{' (not a safetensors file)")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as exc:
        raise fail(f"duplicate key {exc.args[0]!r} in the header") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        # ValueError covers UnicodeDecodeError and JSONDecodeError too.
        text = str(exc)
        raise fail(f"the header is not valid UTF-8 JSON ({text[:200]})") from None
    if not isinstance(doc, dict):
        raise fail(f"the header is a JSON {type(doc).__name__}, not an object")

    data_start = 8 + n
    data_len = file_size - data_start
    meta = doc.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise fail("__metadata__ must map strings to strings")

    items: list[DataFileItem] = []
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise fail(f"entry is a {type(entry).__name__}, not an object", name)
        for key in ("dtype", "shape", "data_offsets"):
            if key not in entry:
                raise fail(f"missing field {key!r}", name)
        extra = set(entry) - {"dtype", "shape", "data_offsets"}
        if extra:
            raise fail(f"unknown field(s) {sorted(extra)}", name)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
            raise fail(f"unknown dtype {dtype!r}", name)
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not all(_is_int(d) and 0 <= d <= _MAX_INT for d in shape)
        ):
            raise fail(f"shape {shape!r} is not a list of at most {_MAX_DIMS} non-negative integers", name)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
            raise fail(f"data_offsets {offsets!r} is not a pair of integers", name)
        begin, end = offsets
        if begin < 0 or end < begin:
            raise fail(f"data_offsets [{begin}, {end}] are not an increasing pair of non-negative offsets", name)
        if end > data_len:
            raise fail(f"data_offsets [{begin}, {end}] exceed the data region ({data_len} bytes)", name)
        numel = 1
        for d in shape:
            numel *= d
        bits = numel * _DTYPE_BITS[dtype]
        if bits % 8 or bits // 8 != end - begin:
            raise fail(
                f"shape {shape} of {dtype} needs {_bytes_text(bits)} bytes, data_offsets [{begin}, {end}] "
                f"hold {end - begin}",
                name,
            )
        items.append(DataFileItem(name, dtype, tuple(shape), data_start + begin, end - begin))

    # The tensors must tile the data region: no holes, no overlaps, nothing after the last one.
    pos = data_start
    for it in sorted(items, key=lambda i: (i.offset, i.length)):
        if it.offset != pos:
            what = "overlaps the previous tensor" if it.offset < pos else f"leaves a hole of {it.offset - pos} bytes"
            raise fail(f"data at [{it.offset - data_start}, {it.offset - data_start + it.length}) {what}", it.name)
        pos += it.length
    if pos != file_size:
        raise fail(f"{file_size - pos} bytes after the last tensor are not described by the header")
    items.sort(key=lambda i: (i.offset, i.length))
    return DataFileHeader(n, data_start, file_size, tuple(items), dict(meta))


