"""Checking a checkpoint on disk without loading it: data-file headers against the metadata
(``validate_data_file``, ``validate_checkpoint``: no data read) and every stored piece against
its CRC32C (``verify_checkpoint``, the ``verify`` command), with the error each finding raises."""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from typing import Any, Mapping

from ..channel import LocalChannel
from ..commit import check_data_files, read_commit
from ..commit.reading import size_text
from ..errors import CheckpointFormatError, ChecksumMismatchError
from ..format.header import MAX_HEADER_BYTES, DataFileHeader, DataFileItem, parse_header
from ..format.layout import safetensors_dtype
from ..format.locations import FileInfo, ItemLocation, own_files, split_reference
from ..format.pieces import bad_pieces, piece_ranges
from ..storage import LocalStorage, file_kind, open_for_reading

__all__ = ["read_header", "validate_data_file", "validate_checkpoint", "verify_checkpoint", "VerifyReport",
           "checksum_mismatch", "item_label", "no_progress"]


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
                # parse_header raises, with the right message.
                return parse_header(prefix, size, path)
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
    if st is None:
        # Stored as raw bytes (e.g. complex128).
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
    ref = split_reference(file)
    if ref is not None:
        file = f"{file} (data file {ref[1]} of the earlier checkpoint {ref[0]}, which this incremental checkpoint refers to)"
    return ChecksumMismatchError(
        f"checkpoint {checkpoint}: checksum mismatch in {file}, {item_label(index)}, "
        f"bytes [{offset}, {offset + length}): stored crc32c {expected:#010x}, read {got:#010x}"
    )


# Bytes read per engine call when verifying (checksum pieces are at most the engine's chunk size).
_VERIFY_WINDOW_BYTES = 64 << 20


@dataclass
class VerifyReport:
    """What ``verify_checkpoint`` found: ``problems`` is empty when the checkpoint is sound.
    ``items`` counts the entries of the metadata; ``checked_items`` the stored chunks whose
    checksums were compared, ``unchecked_items`` those without checksums. ``referenced`` names,
    per file that is a reference, the earlier checkpoint holding it."""

    path: str
    items: int
    files: int
    problems: list[str]
    checked_items: int
    unchecked_items: int
    checked_bytes: int
    referenced: tuple[str, ...] = ()


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
        # lstat: a link is reported, never followed out of the folder.
        st = os.lstat(full)
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
    return f"{name}: data file {size_text(st.st_size, info.size)}{detail}"


def verify_checkpoint(path: str | os.PathLike, *, engine, progress=None, references: bool = True) -> VerifyReport:
    """Read every stored piece of a committed local checkpoint and compare its CRC32C, after
    checking each data file's presence, size and header. Every problem is collected (the first
    one does not stop the check). ``engine`` reads and checksums; ``progress(total, desc)`` is
    a context manager with ``update(nbytes)`` (as in ``convert``). An incremental save's
    references (files of the checkpoints beside it) are checked too, unless ``references`` is
    off (a node-local copy, whose references are durable files)."""
    import torch  # noqa: PLC0415 - the read buffer

    path = os.fspath(path)
    md, files = read_commit(path)
    if not references:
        files = own_files(files)
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
            # (index, expected, offset, length) of each piece.
            pieces = []
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
            channel = LocalChannel(LocalStorage(path))  # verify reads a folder of this machine (the CLI's verify command)
            for batch in _batches(pieces, window):
                ranges, checks, pos = [], [], 0
                for k, (_, expected, off, n) in enumerate(batch):
                    ranges.append((base + pos, off, n))
                    checks.append((k, off, n, expected))
                    pos += n
                try:
                    channel.read_into(engine, name, ranges, None, 0)
                except (OSError, ValueError) as exc:
                    first, last = batch[0], batch[-1]
                    problems.append(f"{name}: cannot read bytes [{first[2]}, {last[2] + last[3]}): {' '.join(str(exc).split())}")
                    bar.update(pos)
                    continue
                for k, off, n, expected, got in bad_pieces(engine, ranges, checks):
                    problems.append(str(checksum_mismatch(path, name, batch[k][0], off, n, expected, got)))
                checked_bytes += pos
                bar.update(pos)
    referenced = tuple(ref[0] for name in files if (ref := split_reference(name)) is not None)
    return VerifyReport(path, len(md.state_dict_metadata), len(files), problems, checked_items, unchecked_items,
                        checked_bytes, referenced)


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
