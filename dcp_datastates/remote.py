"""Object-store I/O: streaming uploads of data files and parallel ranged reads.

Writes. A remote data file is an engine streaming job (``Engine.submit_stream``): copy workers
fill host-cache slots on the same grid as local files and flush workers checksum them, then one
uploader thread per file takes the file's bytes in order (the engine hands out the header, each
chunk and the zeros of gaps and tail: it writes every byte of every data file, local or remote,
and the uploader only appends) and writes them to an fsspec file object
opened for writing (``fs.open(path, "wb", block_size=UPLOAD_BLOCK_SIZE)``: a multipart upload on
S3/GCS/Azure, parts of ``block_size`` bytes), giving each slot back as soon as its bytes are in
that file object's buffer. The upload starts with the first chunk in the cache and uses bounded
memory (the host cache plus about one part per file in flight). The object appears only when the
file is closed; on any error the upload is discarded (multipart aborted) and the job failed, so
the save raises with the URL and the cause and no commit marker is ever written.

Uploads are started in the order their jobs were submitted, by a FIFO pool: the engine grants
cache slots in submission order, so the earliest unfinished job always has its uploader running,
which is what keeps in-order consumption free of deadlock.

Reads. The byte ranges a rank needs from one object are cut into requests of about
``1/READ_CONCURRENCY`` of their total, between ``READ_MIN_REQUEST_BYTES`` and
``READ_REQUEST_BYTES`` (neighbouring ranges merged across gaps up to ``READ_GAP_BYTES``), fetched
with ``fs.cat_file(path, start, end)`` by ``READ_CONCURRENCY`` threads (at least the config's
``read_threads``) and copied into the destinations. In flight: at most concurrency x request
bytes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import folders
from .errors import CheckpointFormatError, CheckpointWriteError, IncompleteCheckpointError
from .folders import RemoteFolder

__all__ = ["submit_upload", "submit_data_file", "read_ranges", "UPLOAD_BLOCK_SIZE", "READ_REQUEST_BYTES", "READ_CONCURRENCY"]

#: Part size of multipart uploads (S3 needs at least 5 MiB; GCS a multiple of 256 KiB).
UPLOAD_BLOCK_SIZE = 64 << 20
#: Largest and smallest ranged GET on load, and the gap two ranges may have and still share one.
READ_REQUEST_BYTES = 32 << 20
READ_MIN_REQUEST_BYTES = 8 << 20
READ_GAP_BYTES = 256 << 10
#: Ranged GETs in flight per file being read.
READ_CONCURRENCY = 8
#: Data files uploading at once per process (more wait, in order).
UPLOAD_THREADS = 8


_upload_pool = ThreadPoolExecutor(max_workers=UPLOAD_THREADS, thread_name_prefix="dcp-datastates-upload")
_submit_lock = threading.Lock()


def _buffer(ptr: int, nbytes: int) -> memoryview:
    """A byte view of ``nbytes`` at address ``ptr`` (no copy)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


def _cause(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


# ---------------------------------------------------------------------------------------- writes
def submit_upload(
    engine,
    folder: RemoteFolder,
    name: str,
    header: bytes,
    file_size: int,
    items: list[tuple[int, int, int]],
    device: int = -1,
    stream: int = 0,
) -> tuple[Any, Future]:
    """Queue data file ``name`` of ``folder``: returns (engine job, upload future). The future
    resolves once the object is complete in the store, or raises CheckpointWriteError naming
    its URL and the cause."""
    url = folder.url_of(name)
    with _submit_lock:  # uploads start in the order the engine grants their jobs cache slots
        job = engine.submit_stream(url, header, file_size, items, device, stream)
        fut = _upload_pool.submit(_upload, folder, name, url, job)
    return job, fut


def submit_data_file(engine, folder: str, name: str, header: bytes, file_size: int, items: list, *, sync: bool,
                     remote_folder: RemoteFolder | None = None, device: int = -1, stream: int = 0,
                     unlink=None) -> tuple[Any, Future | None]:
    """Hand one data file to the engine: an upload when ``remote_folder`` is given, else a file job
    writing ``folder/name`` on a new inode (an old file there is moved aside and freed by
    ``unlink``, default at once). Returns (engine job, upload future or None)."""
    if remote_folder is not None:
        return submit_upload(engine, remote_folder, name, header, file_size, items, device, stream)
    path = os.path.join(folders.local_path(folder), name)
    folders.retire_local_file(path, unlink or _unlink_quietly)  # never write into a shared inode
    return engine.submit_write(path, header, file_size, items, sync, device, stream), None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _discard(folder: RemoteFolder, path: str, f) -> None:
    """Throw away a partly written object: abort the multipart upload where the file object
    buffers (object stores create the object only at close), else delete what was written."""
    from fsspec.spec import AbstractBufferedFile  # noqa: PLC0415

    try:
        f.discard()
    except Exception:  # noqa: BLE001 - best effort: the store may be unreachable
        pass
    if isinstance(f, AbstractBufferedFile):
        f.closed = True  # never commit from __del__
        return
    try:
        f.close()
    except Exception:  # noqa: BLE001
        pass
    try:
        folder.fs.rm_file(path)
    except Exception:  # noqa: BLE001
        pass


def _upload(folder: RemoteFolder, name: str, url: str, job) -> None:
    path = folder.join(name)
    f = None
    try:
        f = folder.fs.open(path, "wb", block_size=UPLOAD_BLOCK_SIZE)
        while True:  # the engine hands out every byte in order: header, data, zeros
            chunk = job.next_chunk()
            if chunk is None:
                break
            off, ptr, nbytes = chunk
            try:
                f.write(_buffer(ptr, nbytes))
            finally:
                job.release(off)  # the bytes are in the file object's buffer (or the write failed)
        error = job.error()
        if error:
            raise _EngineFailed(error)
        f.close()  # completes the multipart upload: the object appears now
        f = None
    except _EngineFailed as exc:
        if f is not None:
            _discard(folder, path, f)
        raise CheckpointWriteError(str(exc)) from None
    except BaseException as exc:
        message = f"upload of {url} failed: {_cause(exc)}"
        job.fail(message)
        if f is not None:
            _discard(folder, path, f)
        raise CheckpointWriteError(message) from exc


class _EngineFailed(Exception):
    """The engine failed the job (its message already names the URL)."""


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
            if off < end:  # overlapping ranges (two targets of the same bytes)
                if off + n <= end:
                    parts.append((dst, off, n))
                    continue
        out.append((off, off + n, [(dst, off, n)]))
    return out


def read_ranges(
    folder: RemoteFolder,
    name: str,
    ranges: list[tuple[int, int, int]],
    *,
    concurrency: int | None = None,
    request_bytes: int | None = None,
    gap_bytes: int | None = None,
) -> None:
    """Fill every (dst_ptr, file_offset, nbytes) range from data file ``name`` of ``folder``
    with parallel ranged requests. Raises IncompleteCheckpointError when the object is missing,
    CheckpointFormatError when it is shorter than a range, OSError (with the URL) otherwise."""
    path = folder.join(name)
    url = folder.url_of(name)
    concurrency = concurrency or READ_CONCURRENCY
    ranges = [r for r in ranges if r[2] > 0]
    if request_bytes is None:  # about one request per thread, within [min, max]
        share = -(-sum(r[2] for r in ranges) // max(1, concurrency))
        request_bytes = min(READ_REQUEST_BYTES, max(READ_MIN_REQUEST_BYTES, -(-share // (1 << 20)) << 20))
    reqs = _requests(ranges, request_bytes, READ_GAP_BYTES if gap_bytes is None else gap_bytes)

    def fetch(req) -> None:
        start, end, parts = req
        try:
            data = folder.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"incomplete checkpoint {folder.url}: data file {name} is missing ({url}; the metadata lists it)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - store errors, with the URL
            raise OSError(f"reading bytes [{start}, {end}) of {url} failed: {_cause(exc)}") from exc
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
