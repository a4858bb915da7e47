"""Integrity of a checkpoint on disk: every check of what a save left, and its message, written once.
Everything that reads a checkpoint (the reader, ``validate_checkpoint``, ``verify``, the CLI, the
commit protocol before it writes a marker) comes here; this module never imports ``commit``.

- ``read_commit``: the commit marker, read safely (no symlink, FIFO or device; size bounded) and
  decoded, with the one message for each way a folder is not a checkpoint.
- ``open_for_reading`` / ``file_kind`` / ``not_regular_error``: opening any checkpoint file.
- ``parse_header`` / ``read_header``: a data file's safetensors header (8-byte length N, N bytes
  of JSON, then the data region), checked with explicit bounds before anything is allocated or
  trusted (fuzzed: nothing but ``CheckpointFormatError`` escapes).
- ``check_data_files`` / ``file_size_error``: each data file the metadata lists exists as a
  regular file with the recorded size (load, commit, convert, ``validate_checkpoint``).
- ``checksum_mismatch``: the error for a piece whose CRC32C differs (the reader, ``verify``).
- ``validate_data_file`` / ``validate_checkpoint``: headers against the metadata, no data read.
- ``verify_checkpoint``: every stored piece's CRC32C, every problem collected
  (``dcp-datastates verify``).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any, Mapping

from torch.distributed.checkpoint.metadata import Metadata

from . import folders
from .checkpoint_format import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    STEP_NUMBER,
    FileInfo,
    ItemLocation,
    _DuplicateKey,
    _no_duplicate_keys,
    decode_metadata,
    piece_ranges,
    rank_marker_name,
    safetensors_dtype,
)
from .errors import CheckpointFormatError, ChecksumMismatchError, IncompleteCheckpointError

__all__ = [
    "read_commit",
    "open_for_reading",
    "file_kind",
    "not_regular_error",
    "DataFileItem",
    "DataFileHeader",
    "parse_header",
    "read_header",
    "validate_data_file",
    "validate_checkpoint",
    "check_data_files",
    "file_size_error",
    "checksum_mismatch",
    "item_label",
    "verify_checkpoint",
    "VerifyReport",
    "no_progress",
    "MAX_HEADER_BYTES",
]

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


# Reads of checkpoint files: never through a symlink, never blocking on a FIFO.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages ("a symbolic link", "a FIFO" ...)."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def not_regular_error(where: str, what: str, full: str, mode: int) -> CheckpointFormatError:
    detail = ""
    if stat.S_ISLNK(mode):
        try:
            detail = f" to {os.readlink(full)!r}"
        except OSError:
            pass
        detail += "; checkpoint files are read only from inside the folder, never through a link (copy it with `cp -L`)"
    return CheckpointFormatError(f"checkpoint {where}: {what} is {file_kind(mode)}{detail}, not a regular file")


def open_for_reading(full: str) -> int:
    """A descriptor of the regular file ``full``, opened without following a symlink or
    blocking on a FIFO. Raises CheckpointFormatError for anything that is not a regular file."""
    try:
        fd = os.open(full, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise not_regular_error(os.path.dirname(full), os.path.basename(full), full, os.lstat(full).st_mode) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_regular_error(os.path.dirname(full), os.path.basename(full), full, st.st_mode)
    os.set_blocking(fd, True)
    return fd


def _read_marker(path: str, marker: str) -> bytes:
    """The marker's bytes: a regular file inside the folder (no symlink, FIFO or device), read
    with its size checked first."""
    try:
        fd = os.open(marker, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise not_regular_error(path, METADATA_NAME, marker, os.lstat(marker).st_mode) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode):
                raise CheckpointFormatError(f"{marker}: the commit marker is a folder, not a metadata file")
            raise not_regular_error(path, f"the commit marker {METADATA_NAME}", marker, st.st_mode)
        if st.st_size > MAX_METADATA_BYTES:
            raise CheckpointFormatError(
                f"{marker}: {st.st_size} bytes, more than the {MAX_METADATA_BYTES}-byte limit of a metadata file "
                f"(not a dcp_datastates checkpoint, or damaged)"
            )
        chunks, left = [], st.st_size + 1  # one byte more: notices a file that grew meanwhile
        while left > 0:
            chunk = os.read(fd, min(left, 64 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        raw = b"".join(chunks)
        if len(raw) > st.st_size:
            raise CheckpointFormatError(f"{marker}: the commit marker changed while it was read (a save is running?)")
        return raw
    finally:
        os.close(fd)


def _looks_like_stock_dcp(raw: bytes) -> bool:
    """DCP's FileSystemWriter pickles its Metadata (protocol 2+ starts with 0x80); never unpickled."""
    return raw[:1] == b"\x80"


def _stock_dcp_error(path: str, marker: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{marker}: {path} is a stock DCP checkpoint (pickled .metadata, .distcp data files), not one written by "
        f"DataStatesWriter; load it with torch.distributed.checkpoint.FileSystemReader, or convert it with "
        f"torch.distributed.checkpoint.format_utils.dcp_to_torch_save (both unpickle it: only for checkpoints "
        f"you trust); nothing of it was unpickled here"
    )


def _committed_subfolders(path: str) -> list[str]:
    """Names of the folders directly under ``path`` that hold a commit marker, by step number."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    found = [
        n for n in names
        if os.path.isdir(os.path.join(path, n)) and os.path.isfile(os.path.join(path, n, METADATA_NAME))
    ]

    def step(name: str) -> tuple:
        m = STEP_NUMBER.search(name)
        return (0, int(m.group(1))) if m else (1, 0)

    return sorted(found, key=step)


def _missing_marker_error(path: str, name: str = METADATA_NAME) -> IncompleteCheckpointError:
    runs = _committed_subfolders(path)
    if runs:
        shown = ", ".join(runs[-5:]) + (f" (and {len(runs) - 5} older)" if len(runs) > 5 else "")
        return IncompleteCheckpointError(
            f"incomplete checkpoint {path}: this is a folder of checkpoints, not a checkpoint: it holds the "
            f"committed checkpoint folder(s) {shown}; load one of them, e.g. the newest with "
            f"dcp_datastates.latest_checkpoint({path!r})"
        )
    return IncompleteCheckpointError(
        f"incomplete checkpoint {path}: there is no {name} commit marker "
        f"(the save did not finish or is still running)"
    )


def read_commit(path: str | os.PathLike, *, storage_options: dict | None = None,
                rank: int | None = None, name: str | None = None) -> tuple[Metadata, dict[str, FileInfo]]:
    """Read and decode the commit marker of ``path`` (a folder or a URL; ``rank``: that rank's
    rank-local marker; ``name``: another file of the same format, e.g. ``PENDING_NAME``): the one
    place that maps "no folder", "no marker", "a folder of checkpoints", "a stock DCP checkpoint"
    and "marker is not a regular file" to clear errors. Returns DCP's ``Metadata`` and the
    per-file table."""
    name = name or (METADATA_NAME if rank is None else rank_marker_name(rank))
    if folders.is_remote(path):
        folder = folders.remote_folder(os.fspath(path), storage_options)
        raw = folder.read_marker(name)  # maps "nothing stored" and "no marker" itself
        where = folder.url_of(name)
        if _looks_like_stock_dcp(raw):
            raise _stock_dcp_error(folder.url, where)
        return decode_metadata(raw, where)
    path = folders.local_path(path)
    marker = os.path.join(path, name)
    try:
        raw = _read_marker(path, marker)
    except (FileNotFoundError, NotADirectoryError):
        if not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path}: the folder does not exist") from None
        if not os.path.isdir(path):
            raise NotADirectoryError(f"no checkpoint at {path}: it is a file, not a checkpoint folder") from None
        raise _missing_marker_error(path, name) from None
    except IsADirectoryError:
        raise CheckpointFormatError(f"{marker}: the commit marker is a folder, not a metadata file") from None
    if _looks_like_stock_dcp(raw):
        raise _stock_dcp_error(path, marker)
    return decode_metadata(raw, marker)


@dataclass(frozen=True)
class DataFileItem:
    """One tensor of a data file as its header describes it; offsets are absolute in the file."""

    name: str
    dtype: str  # the safetensors spelling ("F32", "BF16", "U8" ...)
    shape: tuple[int, ...]
    offset: int
    length: int


@dataclass(frozen=True)
class DataFileHeader:
    header_length: int  # N, the JSON length
    data_start: int  # 8 + N
    file_size: int
    items: tuple[DataFileItem, ...]  # in file order
    metadata: dict  # the "__metadata__" mapping (str -> str), {} when absent


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
    except (ValueError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError and JSONDecodeError too
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


def read_header(path: str | os.PathLike) -> DataFileHeader:
    """Read and check a data file's header with bounded reads (never more than the file holds,
    never more than ``MAX_HEADER_BYTES``)."""
    path = os.fspath(path)
    try:
        # No symlink followed, no FIFO blocked on, only a regular file (else CheckpointFormatError).
        with os.fdopen(open_for_reading(path), "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                return parse_header(prefix, max(size, len(prefix)), path)
            (n,) = struct.unpack("<Q", prefix)
            if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
                return parse_header(prefix, size, path)  # raises with the right message
            body = f.read(n)
    except IsADirectoryError:
        raise CheckpointFormatError(f"{path}: is a folder, not a data file") from None
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read the data file: {exc.strerror or exc}") from exc
    return parse_header(prefix + body, max(size, 8 + len(body)), path)


def _check_expected(path: str, items: list[DataFileItem], expected: Mapping[str, Any]) -> None:
    by_name = {it.name: it for it in items}
    for name, want in expected.items():
        got = by_name.get(name)
        if got is None:
            raise CheckpointFormatError(f"{path}: tensor {name!r}: expected but missing from the header")
        fields = want.__dict__ if isinstance(want, DataFileItem) else dict(want)
        for key in ("dtype", "shape", "offset", "length"):
            if key not in fields or fields[key] is None:
                continue
            w = tuple(fields[key]) if key == "shape" else fields[key]
            g = getattr(got, key)
            if w != g:
                raise CheckpointFormatError(f"{path}: tensor {name!r}: {key} is {g!r} in the header, expected {w!r}")


def _cross_check(path: str, items: list[DataFileItem]) -> None:
    """Does safetensors' own reader agree with us?"""
    try:
        from safetensors import safe_open  # noqa: PLC0415 - optional dependency at this point
    except ImportError:
        return
    try:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            for it in items:
                if it.name not in keys:
                    raise CheckpointFormatError(f"{path}: tensor {it.name!r}: safetensors does not list it")
                sl = f.get_slice(it.name)
                if sl.get_dtype() != it.dtype or tuple(sl.get_shape()) != it.shape:
                    raise CheckpointFormatError(
                        f"{path}: tensor {it.name!r}: safetensors reads {sl.get_dtype()} {list(sl.get_shape())}, "
                        f"the header parser {it.dtype} {list(it.shape)}"
                    )
    except CheckpointFormatError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointFormatError(f"{path}: safetensors refuses the file: {exc}") from exc


def validate_data_file(
    path: str | os.PathLike,
    expected: Mapping[str, Any] | None = None,
    *,
    cross_check: bool = False,
) -> list[DataFileItem]:
    """Check a data file's safetensors header and return its items in file order.

    Args:
        path: the data file.
        expected: optional ``{tensor name: {"dtype", "shape", "offset", "length"}}`` (any subset
            of the keys, or ``DataFileItem`` values): each named tensor must be in the header
            with those values (``offset`` absolute in the file, ``dtype`` in safetensors
            spelling). Tensors the header holds beyond these are allowed.
        cross_check: also open the file with ``safetensors.safe_open`` and compare.

    Raises:
        CheckpointFormatError naming the file (and tensor) for any problem.
    """
    path = os.fspath(path)
    header = read_header(path)
    items = list(header.items)
    if expected:
        _check_expected(path, items, expected)
    if cross_check:
        _cross_check(path, items)
    return items


def _header_dtype_ok(loc: ItemLocation, item: DataFileItem, is_bytes: bool) -> bool:
    if is_bytes:
        return item.dtype == "U8" and item.shape == (loc.length,)
    st = safetensors_dtype(loc.dtype)
    if st is None:  # stored as raw bytes (e.g. complex128)
        return item.dtype == "U8" and item.shape == (loc.length,)
    return item.dtype == st and item.shape == tuple(loc.shape)


def validate_checkpoint(path: str | os.PathLike, *, cross_check: bool = False) -> dict[str, list[DataFileItem]]:
    """Check a committed checkpoint without reading tensor data: the marker decodes, every data
    file it lists exists with the recorded size, each file's header is sound, starts its data
    where the metadata says, and holds every item the metadata places in it, with a matching
    byte range, dtype and shape. Checksums are not verified here (the reader does that).

    Returns {data file name: its items}. Raises IncompleteCheckpointError (no marker, missing or
    short data file) or CheckpointFormatError (anything malformed or inconsistent).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # noqa: PLC0415

    path = os.fspath(path)
    md, files = read_commit(path)
    check_data_files(path, files)
    out: dict[str, list[DataFileItem]] = {}
    for name, info in files.items():
        full = os.path.join(path, name)
        header = read_header(full)
        if header.data_start != info.data_start:
            raise CheckpointFormatError(
                f"{full}: data starts at byte {header.data_start}, the metadata says {info.data_start}"
            )
        out[name] = list(header.items)
        if cross_check:
            _cross_check(full, out[name])
    # Every item of the metadata must be exactly one header entry of its file.
    ranges: dict[str, dict[tuple[int, int], list[DataFileItem]]] = {}
    for name, items in out.items():
        table = ranges.setdefault(name, {})
        for it in items:
            table.setdefault((it.offset, it.length), []).append(it)
    for index, loc in md.storage_data.items():
        is_bytes = isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
        cands = ranges.get(loc.file, {}).get((loc.offset, loc.length), [])
        if not any(_header_dtype_ok(loc, c, is_bytes) for c in cands):
            what = f"item {index.fqn!r}" + (f" chunk at {list(index.offset)}" if index.offset is not None else "")
            found = ", ".join(f"{c.name!r} {c.dtype} {list(c.shape)}" for c in cands) or "nothing"
            raise CheckpointFormatError(
                f"{os.path.join(path, loc.file)}: {what} should be bytes [{loc.offset}, {loc.offset + loc.length}) "
                f"of {loc.dtype} {list(loc.shape)}; the header has {found} there"
            )
    return out


# --------------------------------------------------------------------- data files: present, sized
def file_size_error(where: str, name: str, size: int | None, expected: int, *,
                    location: str | None = None) -> IncompleteCheckpointError | None:
    """The error for data file ``name`` of checkpoint ``where`` found with ``size`` bytes (None:
    missing) where the metadata records ``expected``; None when they agree."""
    if size is None:
        seen = f"{location}; " if location else ""
        return IncompleteCheckpointError(
            f"incomplete checkpoint {where}: data file {name} is missing ({seen}the metadata lists it)"
        )
    if size != expected:
        return IncompleteCheckpointError(f"incomplete checkpoint {where}: data file {name} {_size_text(size, expected)}")
    return None


def _size_text(size: int, expected: int) -> str:
    return f"is {size} bytes, the metadata expects {expected} ({'truncated' if size < expected else 'replaced or appended to'})"


def check_data_files(path: str | os.PathLike, files: dict[str, FileInfo], *, storage_options: dict | None = None) -> None:
    """Every data file in ``files`` exists as a regular file inside the folder (not a symlink,
    FIFO or device) with the recorded size; one listing for remote folders."""
    if folders.is_remote(path):
        folder = folders.remote_folder(os.fspath(path), storage_options)
        where, sizes = folder.url, folder.sizes()
    else:
        where, sizes = folders.local_path(path), {}
        for name in files:
            full = os.path.join(where, name)
            try:
                st = os.lstat(full)  # lstat: a symlink is refused, not followed
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise not_regular_error(where, f"data file {name}", full, st.st_mode)
            sizes[name] = st.st_size
    for name, info in files.items():
        error = file_size_error(where, name, sizes.get(name), info.size)
        if error is not None:
            raise error


# ------------------------------------------------------------------------------------ checksums
def item_label(index) -> str:
    """How messages name a stored item (a ``MetadataIndex``): its name, and its chunk's offsets
    when it is a shard."""
    if index.offset is None:
        return f"item {index.fqn!r}"
    return f"item {index.fqn!r} (chunk offsets {list(index.offset)})"


def checksum_mismatch(checkpoint: str, file: str, index, offset: int, length: int, expected: int,
                      got: int) -> ChecksumMismatchError:
    """The error for bytes [offset, offset + length) of ``file`` whose CRC32C is not the stored one."""
    return ChecksumMismatchError(
        f"checkpoint {checkpoint}: checksum mismatch in {file}, {item_label(index)}, "
        f"bytes [{offset}, {offset + length}): stored crc32c {expected:#010x}, read {got:#010x}"
    )


# Bytes read per engine call when verifying (checksum pieces are at most the engine's chunk size).
_VERIFY_WINDOW_BYTES = 64 << 20


@dataclass
class VerifyReport:
    """What ``verify_checkpoint`` found: ``problems`` is empty when the checkpoint is sound."""

    path: str
    items: int  # entries of the metadata
    files: int
    problems: list[str]
    checked_items: int  # stored chunks whose checksums were compared
    unchecked_items: int  # stored chunks without checksums
    checked_bytes: int


def _header_problems(full: str, name: str, info: FileInfo, locs: list) -> list[str]:
    """The data file's header is sound, starts the data where the metadata says, and lists
    every item the metadata places in the file at its recorded bytes."""
    try:
        header = read_header(full)
    except CheckpointFormatError as exc:
        text = " ".join(str(exc).split())
        return [f"{name}: header damaged ({text.removeprefix(full + ': ')})"]
    if header.data_start != info.data_start:
        return [f"{name}: header damaged (data starts at byte {header.data_start}, the metadata says {info.data_start})"]
    spans = {(it.offset, it.length) for it in header.items}
    unlisted = [(label, loc) for label, loc in locs if (loc.offset, loc.length) not in spans]
    problems = [f"{name}: header does not list {label} at bytes [{loc.offset}, {loc.offset + loc.length})"
                for label, loc in unlisted[:10]]
    if len(unlisted) > 10:
        problems.append(f"{name}: header does not list {len(unlisted) - 10} more item(s)")
    return problems


def _file_problem(path: str, name: str, info: FileInfo, locs: list) -> str | None:
    """Why data file ``name`` cannot be read for verification (missing, not a regular file,
    wrong size), or None."""
    full = os.path.join(path, name)
    try:
        st = os.lstat(full)  # a link is reported, never followed out of the folder
    except FileNotFoundError:
        return f"{name}: data file is missing ({len(locs)} items cannot be read)"
    if not stat.S_ISREG(st.st_mode):
        return f"{name}: data file is {file_kind(st.st_mode)}, not a regular file (not read)"
    if st.st_size == info.size:
        return None
    lost = [label for label, loc in locs if loc.offset + loc.length > st.st_size]
    detail = ""
    if st.st_size < info.size and lost:
        detail = f"; past the end: {', '.join(lost[:5])}" + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
    return f"{name}: data file {_size_text(st.st_size, info.size)}{detail}"


def verify_checkpoint(path: str | os.PathLike, *, engine, progress=None) -> VerifyReport:
    """Read every stored piece of a committed local checkpoint and compare its CRC32C, after
    checking each data file's presence, size and header. Every problem is collected (the first
    one does not stop the check). ``engine`` reads and checksums; ``progress(total, desc)`` is
    a context manager with ``update(nbytes)`` (as in ``convert``)."""
    import torch  # noqa: PLC0415 - the read buffer

    path = os.fspath(path)
    md, files = read_commit(path)
    problems: list[str] = []
    by_file: dict[str, list] = {}
    for index, loc in md.storage_data.items():
        by_file.setdefault(loc.file, []).append((index, item_label(index), loc))
    readable = []
    for name, info in files.items():
        locs = [(label, loc) for _, label, loc in by_file.get(name, [])]
        problem = _file_problem(path, name, info, locs)
        if problem is None:
            problems += _header_problems(os.path.join(path, name), name, info, locs)
            readable.append(name)
        else:
            problems.append(problem)

    total = sum(loc.length for name in readable for _, _, loc in by_file.get(name, []))
    checked_items = unchecked_items = checked_bytes = 0
    with (progress or no_progress)(total, "verify") as bar:
        for name in readable:
            full = os.path.join(path, name)
            pieces = []  # (index, expected, offset, length)
            for index, _, loc in sorted(by_file.get(name, []), key=lambda x: x[2].offset):
                if not loc.crc32c:
                    unchecked_items += 1 if loc.length else 0
                    bar.update(loc.length)
                    continue
                checked_items += 1
                pieces += [(index, expected, off, n) for expected, (off, n) in zip(loc.crc32c, piece_ranges(loc))]
            window = max([_VERIFY_WINDOW_BYTES] + [p[3] for p in pieces])
            buf = torch.empty(window if pieces else 0, dtype=torch.uint8)
            base = buf.data_ptr()
            for batch in _batches(pieces, window):
                ranges, pos = [], 0
                for _, _, off, n in batch:
                    ranges.append((base + pos, off, n))
                    pos += n
                try:
                    engine.read_into(full, ranges)
                except (OSError, ValueError) as exc:
                    first, last = batch[0], batch[-1]
                    problems.append(f"{name}: cannot read bytes [{first[2]}, {last[2] + last[3]}): {' '.join(str(exc).split())}")
                    bar.update(pos)
                    continue
                pos = 0
                for index, expected, off, n in batch:
                    got = engine.crc32c(base + pos, n)
                    pos += n
                    if got != expected:
                        problems.append(str(checksum_mismatch(path, name, index, off, n, expected, got)))
                checked_bytes += pos
                bar.update(pos)
    return VerifyReport(path, len(md.state_dict_metadata), len(files), problems, checked_items, unchecked_items,
                        checked_bytes)


def no_progress(total: int, desc: str) -> "_NoBar":
    """A progress bar that shows nothing (tools take a ``progress(total, desc)`` factory)."""
    return _NoBar()


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int) -> None:
        pass


def _batches(pieces: list, window: int):
    """Consecutive pieces, at most ``window`` bytes per batch (a larger piece alone)."""
    batch, size = [], 0
    for p in pieces:
        if batch and size + p[3] > window:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += p[3]
    if batch:
        yield batch
