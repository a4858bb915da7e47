"""A data file copied between tiers, each checksum piece verified in memory; or followed as it is written.

``copy_verified`` copies one file: blocks are read and verified ahead of the store's writes, so
the store is kept busy; ``_copy_all`` copies several files at once. A file may be copied while
the engine still writes it (``follow``, a ``Follower`` per file): the copy reads what the
engine's ``written_prefix`` says is final and computes each piece's CRC32C as it goes; its
checksums are not known yet, so the drain takes such a copy only if every piece's CRC32C equals
the one the save recorded (``Follower.delivered``), else it copies the file again the usual way.
So the store is busy from the first chunk on instead of from the local commit on, and what is
committed durably is still exactly what was checksummed.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ..channel import channel_for
from ..config import DataStatesConfig
from ..errors import CheckpointWriteError, ChecksumMismatchError
from ..forking import ThreadPool
from ..format.layout import data_file_name, data_file_parts
from ..format.locations import split_reference
from ..format.pieces import piece_ranges
from ..runtime import get_engine
from ..storage import Storage, open_storage

log = logging.getLogger("dcp_datastates")

__all__ = ["copy_verified", "pieces_by_file", "follow", "Follower", "durable_name"]

_COPY_BLOCK = 16 << 20  # bytes read, verified and written at a time (at least one whole checksum piece)
_BLOCKS_AHEAD = 3  # blocks read and verified ahead of the one being written, per file
_FILES_AT_ONCE = 4  # data files copied in parallel (memory: files x (ahead + 1) x block)


def pieces_by_file(locations) -> dict[str, list[tuple[int, int, int, str]]]:
    """file -> sorted (offset, length, crc32c, item) of every checksum piece of ``locations``
    ({MetadataIndex: ItemLocation}: a marker's storage_data, or one rank's write results)."""
    out: dict[str, list] = {}
    for index, loc in locations.items():
        pieces = out.setdefault(loc.file, [])
        pieces.extend((off, length, crc, index.fqn) for crc, (off, length) in zip(loc.crc32c, piece_ranges(loc)))
    for pieces in out.values():
        pieces.sort()
    return out


def _blocks(size: int, pieces: list) -> list[tuple[int, int, list]]:
    """(offset, length, pieces inside) blocks covering the file in order (``size`` bytes, or up
    to the last piece's end if that is further: its read then fails as truncated): at most
    ``_COPY_BLOCK`` each unless one piece is larger, never splitting a piece (each is verified
    whole, in the block that holds it)."""
    blocks: list[tuple[int, int, list]] = []
    start, inside = 0, []

    # [start, end) in blocks of at most _COPY_BLOCK; inside goes in the first.
    def emit(end: int) -> None:
        nonlocal start, inside
        for s in range(start, end, _COPY_BLOCK):
            blocks.append((s, min(_COPY_BLOCK, end - s), inside if s == start else []))
        start, inside = end, []

    for piece in pieces:
        off, end = piece[0], piece[0] + piece[1]
        if end - start > _COPY_BLOCK and off > start:
            # What comes before this piece; inside it all ends before start + _COPY_BLOCK.
            emit(off)
        inside.append(piece)
        if end - start >= _COPY_BLOCK:
            blocks.append((start, end - start, inside))
            start, inside = end, []
    emit(max([size, start] + [p[0] + p[1] for p in inside]))
    return blocks


def copy_verified(local: Storage, name: str, out, size: int, pieces: list, engine, written=None,
                  computed: dict | None = None) -> None:
    """Copy the data file ``name`` of the local folder into the binary file object ``out``, in
    order, verifying every piece's CRC32C while its bytes are in memory (``Storage.read_into``,
    the reader's routine). A thread reads and verifies up to ``_BLOCKS_AHEAD`` blocks ahead, into
    reused buffers, while this one writes: the store's write and the local read overlap.

    Following a file still being written: ``written(end)`` returns once bytes [0, end) of it
    are final, and the pieces' CRC32Cs (None in ``pieces``) are computed into ``computed``
    ({offset: crc32c}) instead of checked."""
    blocks = _blocks(size, pieces)
    if not blocks:
        return
    where = local.where(name)
    free: queue.Queue = queue.Queue()
    for _ in range(min(_BLOCKS_AHEAD + 1, len(blocks))):
        free.put(torch.empty(max(n for _, n, _ in blocks), dtype=torch.uint8))
    ready: queue.Queue = queue.Queue()
    stop = threading.Event()

    def read_ahead() -> None:
        try:
            for off, length, inside in blocks:
                buf = free.get()
                if stop.is_set():
                    return
                if written is not None:
                    written(off + length)
                _read_verified(local, name, where, buf, off, length, inside, engine, computed)
                ready.put((buf, length))
            ready.put(None)
        except BaseException as exc:  # noqa: BLE001 - raised by the writing thread
            ready.put(exc)

    reader = threading.Thread(target=read_ahead, name="dcp-datastates-drain-read", daemon=True)
    reader.start()
    try:
        while (got := ready.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            buf, length = got
            out.write(memoryview(buf.numpy())[:length])
            free.put(buf)
    finally:
        stop.set()
        # Wakes a reader waiting for a buffer.
        free.put(None)
        reader.join()


def _read_verified(local: Storage, name: str, where: str, buf, off: int, length: int, inside: list, engine,
                   computed: dict | None = None) -> None:
    checks = [(0, p_off, p_len, crc) for p_off, p_len, crc, _item in inside if crc is not None]
    try:
        bad = channel_for(local).read_into(engine, name, [(buf.data_ptr(), off, length)], checks, 1)
    except ValueError as exc:
        # The engine's short read.
        raise CheckpointWriteError(f"{where}: {length} bytes at offset {off} could not be read (truncated): {exc}") from None
    if computed is not None:
        unknown = [(p_off, p_len) for p_off, p_len, crc, _item in inside if crc is None]
        crcs = engine.crc32c_ranges(buf.data_ptr(), [(p_off - off, p_len) for p_off, p_len in unknown])
        computed.update((p_off, c) for (p_off, _), c in zip(unknown, crcs))
    if bad:
        _, p_off, p_len, expected, got = bad
        item = next(p[3] for p in inside if p[0] == p_off)
        raise ChecksumMismatchError(
            f"{where}: checksum mismatch in item {item!r}, bytes [{p_off}, {p_off + p_len}): "
            f"stored crc32c {expected:#010x}, read {got:#010x}"
        )


def _write_durable(local: Storage, name: str, durable: Storage, durable_name: str, size: int, pieces: list, engine,
                   config, written=None, computed: dict | None = None) -> None:
    """Copy the local data file ``name`` to ``durable_name`` in the durable folder, verifying it
    (following it while it is written: see ``copy_verified``)."""
    with channel_for(durable).create_streamed(durable_name, sync=config.sync_files) as out:
        copy_verified(local, name, out, size, pieces, engine, written, computed)


def _copy_all(local: Storage, durable: Storage, sizes: dict[str, int], pieces: dict[str, list],
              renamed: dict[str, str], config: DataStatesConfig, followed: dict | None = None) -> None:
    """Copy the data files ``sizes`` ({local name: size}) to their ``renamed`` names, up to
    ``_FILES_AT_ONCE`` at a time; the first error is raised once every copy has ended. A file
    ``followed`` ({local name: Follower}) copied already, to the same name, with every piece's
    CRC32C as recorded, is not copied again."""
    engine = get_engine(config)
    followed = followed or {}
    names = [n for n in sorted(sizes)
             if not (n in followed and followed[n].delivered(renamed[n], sizes[n], pieces.get(n, [])))]
    if len(names) <= 1:
        for name in names:
            _write_durable(local, name, durable, renamed[name], sizes[name], pieces.get(name, []), engine, config)
        return
    with ThreadPoolExecutor(max_workers=min(_FILES_AT_ONCE, len(names)), thread_name_prefix="dcp-datastates-drain-file") as pool:
        futures = [pool.submit(_write_durable, local, name, durable, renamed[name], sizes[name], pieces.get(name, []),
                               engine, config) for name in names]
    for f in futures:
        f.result()


# Copies of files still being written: a thread each, up to _FILES_AT_ONCE at once (a later file waits
# for a thread; each mostly waits for the engine).
_followers = ThreadPool(max_workers=_FILES_AT_ONCE, thread_name_prefix="dcp-datastates-drain-follow")
# A follower waiting for the engine wakes this often (a failed job wakes it at once).
_FOLLOW_POLL_S = 1.0


class Follower:
    """The copy of one local data file to the durable tier, started while the engine writes it
    (its ``job``: ``written_prefix`` / ``wait_written``). ``delivered`` tells the drain whether
    the copy can stand for the file. ``from_staged``: its first read waits until the job is
    staged (the engine's copy of the sources ended), so that it never takes a core from it."""

    def __init__(self, local: Storage, name: str, job, size: int, item_locations, durable: Storage,
                 durable_name: str, config: DataStatesConfig, from_staged: bool = False) -> None:
        self.name, self.durable_name, self.size = name, durable_name, size
        self._job, self._from_staged = job, from_staged
        self._computed: dict[int, int] = {}
        self._cancelled, self._cancel_reason = threading.Event(), ""
        self._state_lock, self._copied, self._durable = threading.Lock(), False, durable
        pieces = sorted((off, length, None, key[0]) for key, loc in item_locations.items()
                        for off, length in piece_ranges(loc))
        self._future = _followers.submit(self._copy, local, pieces, config)

    def cancel(self, reason: str) -> None:
        """Stop the copy (before its next block, within ``_FOLLOW_POLL_S`` when it waits for the
        engine) and remove what it wrote, also when it had ended: the save does not use it
        (``reason``)."""
        with self._state_lock:
            self._cancel_reason = reason
            self._cancelled.set()
            copied = self._copied
        if copied:
            self._durable.remove_quietly(self.durable_name)

    def wait_ended(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until the copy ended (a cancelled one has removed
        what it wrote by then)."""
        try:
            self._future.exception(timeout=timeout)
        except Exception:  # noqa: BLE001 - still running past the wait
            pass

    def _written(self, end: int) -> None:
        while True:
            if self._cancelled.is_set():
                raise CheckpointWriteError(f"{self.name}: copy cancelled: {self._cancel_reason}")
            if self._from_staged and not self._job.wait_staged(_FOLLOW_POLL_S):
                continue
            got = self._job.wait_written(end, _FOLLOW_POLL_S)
            if got >= end:
                return
            error = self._job.error()
            if error:
                raise CheckpointWriteError(error)
            if self._job.is_done():
                raise CheckpointWriteError(f"{self.name}: {got} bytes written, {end} expected")

    def _copy(self, local: Storage, pieces: list, config: DataStatesConfig) -> None:
        durable = self._durable
        try:
            _write_durable(local, self.name, durable, self.durable_name, self.size, pieces, get_engine(config), config,
                           self._written, self._computed)
        except BaseException:
            # A partial copy is never used (the drain copies the file again).
            durable.remove_quietly(self.durable_name)
            raise
        with self._state_lock:
            # From here on, cancel() removes the file.
            self._copied = True
            cancelled = self._cancelled.is_set()
        if cancelled:
            # Cancelled after its last block: the copy is not wanted either.
            durable.remove_quietly(self.durable_name)
            raise CheckpointWriteError(f"{self.name}: copy cancelled: {self._cancel_reason}")

    def delivered(self, durable_name: str, size: int, pieces: list) -> bool:
        """True once the copy ended, to ``durable_name``, of ``size`` bytes, with each of
        ``pieces`` (offset, length, crc32c, item: what the save recorded) as computed; else the
        file is to be copied again (a warning says why when the bytes differ)."""
        try:
            self._future.result()
        except Exception as exc:  # noqa: BLE001 - the drain copies the file again, verified
            log.info("dcp_datastates: %s: the copy made while it was written did not finish (%s); copying it again",
                     self.name, exc)
            return False
        if durable_name != self.durable_name or size != self.size:
            return False
        for off, _length, crc, item in pieces:
            if self._computed.get(off) != crc:
                log.warning("dcp_datastates: %s: item %r at offset %d read while the file was written does not "
                            "match its recorded crc32c; copying the file again", self.name, item, off)
                return False
        return True


def follow(local: Storage, files: list, durable: str, tag: str | None, config: DataStatesConfig, *,
           from_staged: bool = False) -> dict[str, Follower]:
    """Start copying each named, engine-written file of ``files`` (the rank's ``FileJob``s) to
    ``durable`` under its tagged name while it is written: {local name: Follower}
    (``from_staged``: see ``Follower``). Another rank's file kept here (``mirror_of``) is not
    drained by this one."""
    store = open_storage(durable, config.storage_options)
    return {f.name: Follower(local, f.name, f.job, f.file_size, f.locations, store, durable_name(f.name, tag), config,
                             from_staged)
            for f in files if f.name is not None and hasattr(f.job, "wait_written") and f.upload is None
            and f.mirror_of is None}


def durable_name(name: str, tag: str | None) -> str:
    """The durable name of a local data file: the same, or tagged when the durable folder holds a
    commit. An incremental save's reference names a durable file of another checkpoint already:
    kept as it is."""
    if tag is None or split_reference(name) is not None:
        return name
    parts = data_file_parts(name)
    if parts is None:
        raise CheckpointWriteError(f"{name}: not a data file name of this library")
    return data_file_name(*parts, tag)
