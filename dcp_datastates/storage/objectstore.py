"""A checkpoint folder on any fsspec file system (``s3://``, ``gs://``, ``az://``, ``memory://`` ...).

Object stores have no real folders: ``prepare`` is best effort and "the folder exists" means
"some object is under it". Small files are one PUT each (atomic, visible only once complete).

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

``storage_options`` are passed to fsspec (``endpoint_url``, ``key``, ``secret``, ``anon`` ...);
fsspec's own configuration (``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables, or
``fsspec.config.conf``) applies as well.
"""

from __future__ import annotations

import ctypes
import posixpath
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

from ..errors import CheckpointFormatError, CheckpointWriteError, IncompleteCheckpointError
from ..forking import ThreadPool, new_locks_in_child
from ..format.pieces import bad_pieces
from .base import StartedDataFile, Storage
from .paths import normalize

__all__ = ["ObjectStorage", "UPLOAD_BLOCK_SIZE", "READ_REQUEST_BYTES", "READ_CONCURRENCY"]

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


def _cause(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def _store_error(url: str, doing: str, exc: BaseException) -> OSError:
    """An OSError naming the URL and the cause (connection refused, access denied ...)."""
    err = OSError(f"{doing} {url} failed: {_cause(exc)}")
    if isinstance(exc, OSError):
        err.errno = exc.errno
    return err


class ObjectStorage(Storage):
    """``location`` is the folder as the user wrote it; ``root`` the same folder as the file
    system spells it (no protocol)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *, _fs=None, _root=None) -> None:
        self.location = normalize(url)
        if _fs is not None:
            self.fs, self.root = _fs, _root
            return
        from fsspec.core import url_to_fs  # noqa: PLC0415

        try:
            self.fs, root = url_to_fs(self.location, **dict(storage_options or {}))
        except ImportError as exc:
            raise ImportError(f"{self.location}: the fsspec implementation for this URL is not installed: {exc}") from exc
        self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"ObjectStorage({self.location!r})"

    # ------------------------------------------------------------------------------ names
    def fs_path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def where(self, name: str) -> str:
        return f"{self.location}/{name}"

    def child(self, name: str) -> "ObjectStorage":
        return ObjectStorage(self.where(name), _fs=self.fs, _root=self.fs_path(name))

    def parent(self) -> "ObjectStorage":
        return ObjectStorage(self.location.rsplit("/", 1)[0], _fs=self.fs, _root=self.root.rsplit("/", 1)[0])

    def _fresh(self, path: str) -> None:
        """Forget cached listings (s3fs and others cache them) before a check that must see the
        store as it is now."""
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: BLE001 - a cache that cannot be invalidated is no cache
            pass

    def _entries(self) -> list[dict]:
        self._fresh(self.root)
        try:
            return self.fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.location, "listing", exc) from exc

    def subfolders(self) -> list[str]:
        return [posixpath.basename(e["name"].rstrip("/")) for e in self._entries() if e.get("type") == "directory"]

    # ------------------------------------------------------------------------------ state
    def check_folder(self) -> None:
        self._fresh(self.root)
        try:
            present = bool(self.fs.exists(self.root)) and bool(self.fs.ls(self.root, detail=False))
        except (FileNotFoundError, NotADirectoryError):
            present = False
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.location, "listing", exc) from exc
        if not present:
            raise FileNotFoundError(f"no checkpoint at {self.location}: nothing is stored there")

    def has(self, name: str) -> bool:
        return self.size(name) is not None

    def sizes(self, names: Iterable[str] | None = None) -> dict[str, int]:
        out = {}
        for e in self._entries():
            if e.get("type", "file") == "file":
                out[posixpath.basename(e["name"].rstrip("/"))] = int(e.get("size") or 0)
        if names is None:
            return out
        wanted = {}
        for name in names:
            size = out.get(name)
            if size is None:
                size = self.size(name)  # listings can be partial on some stores: ask for the object itself
            if size is not None:
                wanted[name] = size
        return wanted

    def size(self, name: str) -> int | None:
        path = self.fs_path(name)
        self._fresh(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.where(name), "looking up", exc) from exc
        if info.get("type", "file") != "file":
            raise CheckpointFormatError(f"checkpoint {self.location}: data file {name} is not a regular file")
        return int(info.get("size") or 0)

    # ------------------------------------------------------------------------------ small files
    def read_small(self, name: str, *, limit: int, what: str) -> bytes:
        path = self.fs_path(name)
        self._fresh(path)
        try:
            size = int(self.fs.info(path).get("size") or 0)
            if size > limit:
                raise CheckpointFormatError(
                    f"{self.where(name)}: {size} bytes, more than the {limit}-byte limit of a metadata file "
                    f"(not a dcp_datastates checkpoint, or damaged)"
                )
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.where(name)}: no such object") from None
        except IsADirectoryError:
            raise CheckpointFormatError(f"{self.where(name)}: {what} is a folder, not a metadata file") from None
        except CheckpointFormatError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _store_error(self.where(name), "reading", exc) from exc

    def put(self, name: str, data: bytes, *, sync: bool) -> None:
        try:
            self.fs.pipe_file(self.fs_path(name), data)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointWriteError(f"writing {self.where(name)} failed: {_cause(exc)}") from exc
        self._fresh(self.fs_path(name))

    # ------------------------------------------------------------------------------ files
    def make_folder(self) -> None:
        pass  # a store's "folder" is a prefix, neither cheap to make nor listed: prepare() does it, off the training thread

    def prepare(self, *, overwrite: bool, marker: str) -> bool:
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except FileExistsError:
            pass
        except (PermissionError, NotImplementedError):
            pass  # object stores: a bucket we may not create but may write into
        except Exception as exc:  # noqa: BLE001 - any store error (connection ...), with the URL
            raise CheckpointWriteError(f"cannot create checkpoint folder {self.location}: {_cause(exc)}") from exc
        self._fresh(self.fs_path(marker))
        try:
            present = bool(self.fs.exists(self.fs_path(marker)))
        except Exception as exc:  # noqa: BLE001 - any store error, with the URL
            raise CheckpointWriteError(f"cannot check for a previous commit in {self.location}: {_cause(exc)}") from exc
        if present and not overwrite:
            raise self.exists_error()
        return present

    def names(self) -> list[str]:
        return list(self.sizes())

    def remove(self, name: str) -> None:
        self.fs.rm_file(self.fs_path(name))

    def open_read(self, name: str):
        return self.fs.open(self.fs_path(name), "rb")

    @contextmanager
    def create(self, name: str, *, sync: bool):
        # The object appears when the file object closes (multipart completed); an error inside
        # the block discards the upload.
        f = self.fs.open(self.fs_path(name), "wb")
        try:
            yield f
        except BaseException:
            _discard(self, self.fs_path(name), f)
            raise
        f.close()

    def move(self, name: str, dst: Storage, new_name: str) -> None:
        if isinstance(dst, ObjectStorage) and dst.fs is self.fs:
            self.fs.mv(self.fs_path(name), dst.fs_path(new_name))
            return
        super().move(name, dst, new_name)

    # ------------------------------------------------------------------------------ data files
    def start_data_file(self, engine, label: str, header: bytes, file_size: int, spans: list, *, sync: bool,
                        device: int, stream: int, direct_writes: bool | None = None) -> StartedDataFile:
        named: Future = Future()
        with _submit_lock:  # uploads start in the order the engine grants their jobs cache slots; each waits for its name
            job = engine.submit_stream(self.where(label), header, file_size, spans, device, stream)
            fut = _upload_pool.submit(_upload_when_named, self, named, job)

        def name_it(name: str, defer=None) -> None:
            named.set_result(name)

        return job, fut, name_it

    def read_into(self, engine, name: str, ranges: list, checks: list | None, threads: int) -> tuple | None:
        read_ranges(self, name, ranges, concurrency=max(READ_CONCURRENCY, threads))
        if not checks:
            return None
        bad = bad_pieces(engine, ranges, checks, first_only=True)
        return bad[0] if bad else None


# ---------------------------------------------------------------------------------------- writes
def _discard(store: ObjectStorage, path: str, f) -> None:
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
        store.fs.rm_file(path)
    except Exception:  # noqa: BLE001
        pass


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
            _discard(store, path, f)
        raise CheckpointWriteError(str(exc)) from None
    except BaseException as exc:
        message = f"upload of {url} failed: {_cause(exc)}"
        job.fail(message)
        if f is not None:
            _discard(store, path, f)
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
            if off < end:  # overlapping ranges (two targets of the same bytes)
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
    if request_bytes is None:  # about one request per thread, within [min, max]
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
