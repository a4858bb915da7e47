"""The data channel of an fsspec file system: engine streaming jobs uploaded, ranged reads checked.

Writes. A data file is an engine streaming job (``Engine.submit_stream``): copy workers fill
host-cache slots on the same grid as local files and flush workers checksum them, then one
uploader thread per file takes the file's bytes in order (the engine hands out the header, each
chunk and the zeros of gaps and tail: it writes every byte of every data file, local or remote,
and the uploader only appends) and writes them to an fsspec file object opened for writing
(``fs.open(path, "wb", block_size=UPLOAD_BLOCK_SIZE)``: a multipart upload on S3/GCS/Azure),
giving each slot back as soon as its bytes are in that file object's buffer. The upload starts
with the first chunk in the cache and uses bounded memory (the host cache plus about one part
per file in flight). The object appears only when the file is closed; on any error the upload
is discarded (multipart aborted) and the job failed, so the save raises with the URL and the
cause and no commit marker is ever written. Uploads start in the order their jobs were
submitted, by a FIFO pool: the engine grants cache slots in submission order, so the earliest
unfinished job always has its uploader running, which keeps in-order consumption deadlock-free.

Reads. The byte ranges wanted from one object are cut into requests of about
``1/READ_CONCURRENCY`` of their total, between ``READ_MIN_REQUEST_BYTES`` and
``READ_REQUEST_BYTES`` (neighbouring ranges merged across gaps up to ``READ_GAP_BYTES``), fetched
with ``fs.cat_file(path, start, end)`` by parallel threads and copied into the destinations,
then every checksum piece is verified in memory (``format.pieces``).
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import CheckpointFormatError, CheckpointWriteError, IncompleteCheckpointError
from ..forking import ThreadPool, new_locks_in_child
from ..format.pieces import bad_pieces
from ..storage import ObjectStorage
from ..storage.objectstore import describe_error, discard_upload
from .base import DataChannel, StartedDataFile

__all__ = ["ObjectChannel", "read_ranges", "UPLOAD_BLOCK_SIZE", "READ_REQUEST_BYTES", "READ_CONCURRENCY"]

#: Part size of multipart uploads (S3 needs at least 5 MiB; GCS a multiple of 256 KiB).
UPLOAD_BLOCK_SIZE = 64 << 20
#: Largest and smallest ranged GET on load, and the gap two ranges may have and still share one.
READ_REQUEST_BYTES = 32 << 20
READ_MIN_REQUEST_BYTES = 8 << 20
READ_GAP_BYTES = 256 << 10
#: Ranged GETs in flight per file being read (at least the config's ``read_threads``).
READ_CONCURRENCY = 8
#: Data files uploading at once per process (more wait, in order).
UPLOAD_THREADS = 8

_upload_pool = ThreadPool(max_workers=UPLOAD_THREADS, thread_name_prefix="dcp-datastates-upload")
_submit_lock = threading.Lock()
new_locks_in_child(globals(), "_submit_lock")


def _buffer(ptr: int, nbytes: int) -> memoryview:
    """A byte view of ``nbytes`` at address ``ptr`` (no copy)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")



class ObjectChannel(DataChannel):
    storage: ObjectStorage

    def start_data_file(self, engine, label: str, header: bytes, file_size: int, spans: list, *, sync: bool,
                        device: int, stream: int, direct_writes: bool | None = None,
                        direct_io: bool = False) -> StartedDataFile:
        named: Future = Future()
        # Uploads start in the order the engine grants their jobs cache slots; each waits for its name.
        with _submit_lock:
            job = engine.submit_stream(self.storage.where(label), header, file_size, spans, device, stream)
            fut = _upload_pool.submit(_upload_when_named, self.storage, named, job)

        def name_it(name: str, defer=None) -> None:
            named.set_result(name)

        return job, fut, name_it

    def read_into(self, engine, name: str, ranges: list, checks: list | None, threads: int) -> tuple | None:
        read_ranges(self.storage, name, ranges, concurrency=max(READ_CONCURRENCY, threads))
        if not checks:
            return None
        bad = bad_pieces(engine, ranges, checks, first_only=True)
        return bad[0] if bad else None


# ---------------------------------------------------------------------------------------- writes
class _EngineFailed(Exception):
    """The engine failed the job (its message already names the URL)."""


def _upload_when_named(store: ObjectStorage, named: Future, job) -> None:
    """``_upload`` once the save names the object (``start_data_file``); nothing if the job
    fails first (its error is the save's)."""
    while True:
        try:
            name = named.result(timeout=0.05)
            break
        except FutureTimeout:
            error = job.error()
            if error:
                raise CheckpointWriteError(error) from None
    _upload(store, name, store.where(name), job)


def _upload(store: ObjectStorage, name: str, url: str, job) -> None:
    path = store.fs_path(name)
    f = None
    try:
        f = store.fs.open(path, "wb", block_size=UPLOAD_BLOCK_SIZE)
        # The engine hands out every byte in order: header, data, zeros.
        while True:
            chunk = job.next_chunk()
            if chunk is None:
                break
            off, ptr, nbytes = chunk
            try:
                f.write(_buffer(ptr, nbytes))
            finally:
                # The bytes are in the file object's buffer (or the write failed).
                job.release(off)
        error = job.error()
        if error:
            raise _EngineFailed(error)
        # Completes the multipart upload: the object appears now.
        f.close()
        f = None
    except _EngineFailed as exc:
        if f is not None:
            discard_upload(store, path, f)
        raise CheckpointWriteError(str(exc)) from None
    except BaseException as exc:
        message = f"upload of {url} failed: {describe_error(exc)}"
        job.fail(message)
        if f is not None:
            discard_upload(store, path, f)
        raise CheckpointWriteError(message) from exc


# ----------------------------------------------------------------------------------------- reads
def _requests(ranges: list[tuple[int, int, int]], request: int, gap: int) -> list[tuple[int, int, list]]:
    """(start, end, [(dst, file_offset, nbytes)]) requests covering ``ranges`` (dst, offset,
    nbytes): ranges cut at ``request`` bytes, neighbours (gap <= ``gap``) merged up to it."""
    pieces = []
    for dst, off, n in ranges:
        done = 0
        while done < n:
            k = min(request, n - done)
            pieces.append((off + done, k, dst + done))
            done += k
    pieces.sort()
    out: list[tuple[int, int, list]] = []
    for off, n, dst in pieces:
        if out:
            start, end, parts = out[-1]
            if off >= end and off - end <= gap and off + n - start <= request:
                out[-1] = (start, off + n, parts)
                parts.append((dst, off, n))
                continue
            # Overlapping ranges (two targets of the same bytes).
            if off < end:
                if off + n <= end:
                    parts.append((dst, off, n))
                    continue
        out.append((off, off + n, [(dst, off, n)]))
    return out


def read_ranges(store: ObjectStorage, name: str, ranges: list[tuple[int, int, int]], *, concurrency: int | None = None,
                request_bytes: int | None = None, gap_bytes: int | None = None) -> None:
    """Fill every (dst_ptr, file_offset, nbytes) range from object ``name`` with parallel ranged
    requests. Raises IncompleteCheckpointError when the object is missing, CheckpointFormatError
    when it is shorter than a range, OSError (with the URL) otherwise."""
    path, url = store.fs_path(name), store.where(name)
    concurrency = concurrency or READ_CONCURRENCY
    ranges = [r for r in ranges if r[2] > 0]
    # About one request per thread, within [min, max].
    if request_bytes is None:
        share = -(-sum(r[2] for r in ranges) // max(1, concurrency))
        request_bytes = min(READ_REQUEST_BYTES, max(READ_MIN_REQUEST_BYTES, -(-share // (1 << 20)) << 20))
    reqs = _requests(ranges, request_bytes, READ_GAP_BYTES if gap_bytes is None else gap_bytes)

    def fetch(req) -> None:
        start, end, parts = req
        try:
            data = store.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"incomplete checkpoint {store.location}: data file {name} is missing ({url}; the metadata lists it)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - store errors, with the URL
            raise OSError(f"reading bytes [{start}, {end}) of {url} failed: {describe_error(exc)}") from exc
        if len(data) < end - start:
            raise CheckpointFormatError(
                f"{url}: short read at offset {start + len(data)}: wanted {end - start} bytes from offset {start}, "
                f"got {len(data)} (the object is shorter than the metadata says)"
            )
        src = memoryview(data)
        for dst, off, n in parts:
            _buffer(dst, n)[:] = src[off - start : off - start + n]

    if len(reqs) <= 1 or concurrency <= 1:
        for r in reqs:
            fetch(r)
        return
    pool = ThreadPoolExecutor(max_workers=min(concurrency, len(reqs)), thread_name_prefix="dcp-datastates-read")
    try:
        futures = [pool.submit(fetch, r) for r in reqs]
        for fut in futures:
            fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
