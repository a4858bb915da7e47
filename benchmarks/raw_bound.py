"""The fair raw bound of a checkpoint's bytes on this machine: how fast the storage and memory
write and read the same number of bytes with no library in the way.

"Fair" means the best a careful hand-written writer could do, not one naive ``pwrite``:

* writes: from a buffer already in memory (the state is), into new files, every configuration of
  1..N threads x one shared file or one file per thread x with or without early writeback
  (``sync_file_range(SYNC_FILE_RANGE_WRITE)`` after each block, so the disk starts while later
  blocks are still being copied), each ended by an ``fsync`` of every file. The bound is the
  configuration with the lowest median.
* reads: into fresh memory (a new, never-touched buffer each time, as a restart's tensors are),
  1..N threads each reading its stripe of one file; warm (the page cache holds the file) and cold
  (the file evicted first). The bound is the best configuration.

Every configuration's samples are kept, so a report can say which one set the bound.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import statistics
import threading
import time
from typing import Callable

__all__ = ["measure_raw", "measure_sustained", "merge_raw", "write_configs", "read_threads"]

_BLOCK = 64 << 20  # bytes per pwrite (and per writeback request)
_MAX_WRITE = 1 << 30  # Linux writes at most ~2 GiB per call
_SYNC_FILE_RANGE_WRITE = 2
# O_DIRECT's alignment of buffer, offset and length (the page size covers every block device's).
_DIRECT_ALIGN = 4096

_libc = ctypes.CDLL(None, use_errno=True)
try:
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int
except AttributeError:  # not Linux: no early writeback configurations
    _sync_file_range = None


def read_threads() -> list[int]:
    """1, 2, 4 ... up to the cores of this machine (at most 8)."""
    n = min(8, os.cpu_count() or 1)
    out, t = [], 1
    while t < n:
        out.append(t)
        t *= 2
    return sorted(set(out + [n]))


def write_configs() -> list[tuple[int, int, bool]]:
    """(threads, files, early writeback) for every configuration the bound is the best of."""
    out = []
    for t in read_threads():
        for files in sorted({1, t}):
            for writeback in (False, True) if _sync_file_range is not None else (False,):
                out.append((t, files, writeback))
    return out


def _name(cfg: tuple) -> str:
    t, files, wb, direct = (*cfg, False)[:4]
    return (f"{t} thread{'s' if t > 1 else ''}, {files} file{'s' if files > 1 else ''}"
            f"{', early writeback' if wb else ''}{', O_DIRECT' if direct else ''}")


def _stripes(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (offset, length) ranges covering ``nbytes``, block-aligned."""
    per = -(-nbytes // parts)
    per = -(-per // _BLOCK) * _BLOCK
    return [(off, min(per, nbytes - off)) for off in range(0, nbytes, per)] or [(0, 0)]


def _write_range(fd: int, mv: memoryview, src_off: int, file_off: int, length: int, writeback: bool) -> None:
    done = 0
    while done < length:
        n = os.pwrite(fd, mv[src_off + done : src_off + min(length, done + _BLOCK, done + _MAX_WRITE)], file_off + done)
        if writeback and _sync_file_range(fd, file_off + done, n, _SYNC_FILE_RANGE_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "sync_file_range failed")
        done += n


def _run_threads(jobs: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs[1:]]
    for th in threads:
        th.start()
    run(jobs[0])
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


def _timed_write(folder: str, mv: memoryview, nbytes: int, cfg: tuple) -> float:
    """Seconds to write ``nbytes`` of ``mv`` as ``cfg`` says ((threads, files, early writeback[,
    O_DIRECT])), fsync included; the files removed after. O_DIRECT needs ``mv`` page-aligned;
    each stripe's last partial block goes through the page cache."""
    threads, files, writeback, direct = (*cfg, False)[:4]
    stripes = _stripes(nbytes, threads)
    paths = [os.path.join(folder, f"raw-{k}.bin") for k in range(files)]
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths]
    direct_fds = [os.open(p, os.O_WRONLY | os.O_DIRECT) for p in paths] if direct else []
    try:
        jobs = []
        for k, (off, length) in enumerate(stripes):
            # One shared file: each thread writes its stripe at its own offset; one file per
            # thread: each file holds one stripe from offset 0.
            f = 0 if files == 1 else k
            file_off = off if files == 1 else 0
            if direct:
                aligned = length - length % _DIRECT_ALIGN
                jobs.append(lambda f=f, off=off, file_off=file_off, length=length, aligned=aligned: (
                    _write_range(direct_fds[f], mv, off, file_off, aligned, False),
                    _write_range(fds[f], mv, off + aligned, file_off + aligned, length - aligned, False)))
            else:
                jobs.append(lambda f=f, off=off, file_off=file_off, length=length:
                            _write_range(fds[f], mv, off, file_off, length, writeback))
        _run_threads(jobs)
        _run_threads([lambda fd=fd: os.fsync(fd) for fd in fds])
    finally:
        for fd in fds + direct_fds:
            os.close(fd)
    took = time.perf_counter() - t0
    for p in paths:
        os.unlink(p)
    return took


def _timed_read(path: str, nbytes: int, threads: int) -> float:
    """Seconds to read ``path`` into a new, never-touched buffer with ``threads`` threads."""
    import torch

    t0 = time.perf_counter()
    buf = torch.empty(max(1, nbytes), dtype=torch.uint8)  # fresh pages: faulted in by the read
    mv = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        def read_range(off: int, length: int) -> None:
            done = 0
            while done < length:
                got = os.preadv(fd, [mv[off + done : off + min(length, done + _MAX_WRITE)]], off + done)
                if got <= 0:
                    raise OSError(f"{path}: short read at {off + done} of {nbytes}")
                done += got

        _run_threads([lambda o=o, n=n: read_range(o, n) for o, n in _stripes(nbytes, threads)])
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def measure_raw(root: str, nbytes: int, reps: int, cold: Callable[[str], bool] | None) -> dict:
    """``reps`` rounds of every write configuration and every read configuration (warm, and
    cold when ``cold(path)`` evicts the file): the samples and the bound (``summarize``)."""
    import torch

    os.makedirs(root, exist_ok=True)
    src = torch.empty(max(1, nbytes), dtype=torch.uint8)
    src.fill_(0x5A)  # the state to write is in memory already
    mv = memoryview(src.numpy())
    samples: dict[str, dict[str, list[float]]] = {}

    def add(kind: str, name: str, value: float) -> None:
        samples.setdefault(name, {"write": [], "read_warm": [], "read_cold": []})[kind].append(value)

    path = os.path.join(root, "raw-read.bin")
    try:
        for _ in range(reps):
            for cfg in write_configs():
                add("write", _name(cfg), _timed_write(root, mv, nbytes, cfg))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # what the reads read
            try:
                _write_range(fd, mv, 0, 0, nbytes, False)
                os.fsync(fd)
            finally:
                os.close(fd)
            for t in read_threads():
                name = f"read, {t} thread{'s' if t > 1 else ''}"
                add("read_warm", name, _timed_read(path, nbytes, t))
                if cold and cold(path):
                    add("read_cold", name, _timed_read(path, nbytes, t))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        del mv, src
    return summarize({"bytes": nbytes, "configs": samples})


def measure_sustained(root: str, nbytes: int, count: int, patterns: dict[str, tuple[int, int, bool]]) -> dict:
    """The sustained write bound: for each named pattern ((threads, files, early writeback[,
    O_DIRECT]), e.g. ours and DCP's), ``count`` checkpoints of ``nbytes`` written and fsynced back
    to back, each into new files (the previous one's removed, as a loop keeps the disk from
    filling). Per pattern: every checkpoint's seconds and their median; ``best`` names the fastest
    pattern. A pattern the file system refuses (O_DIRECT on tmpfs) is listed in ``unsupported``
    with the error."""
    os.makedirs(root, exist_ok=True)
    # Page-aligned (O_DIRECT needs it), the same bytes for every pattern.
    src = mmap.mmap(-1, max(1, nbytes))
    block = b"\x5a" * (1 << 20)
    for off in range(0, len(src), len(block)):
        src[off:off + len(block)] = block[:len(src) - off]
    mv = memoryview(src)
    out: dict = {"bytes": nbytes, "checkpoints": count, "patterns": {}, "unsupported": {}}
    try:
        for name, cfg in patterns.items():
            try:
                runs = [_timed_write(root, mv, nbytes, cfg) for _ in range(count)]
            except OSError as exc:
                if not (len(cfg) > 3 and cfg[3]):
                    raise
                out["unsupported"][name] = f"{_name(cfg)}: {exc}"
                continue
            out["patterns"][name] = {"config": _name(cfg), "runs_s": runs, "median_s": statistics.median(runs)}
    finally:
        mv.release()
        src.close()
    out["best"] = min(out["patterns"], key=lambda k: out["patterns"][k]["median_s"]) if out["patterns"] else None
    out["best_s"] = out["patterns"][out["best"]]["median_s"] if out["best"] else None
    return out


def merge_raw(into: dict, more: dict) -> dict:
    """``into`` with ``more``'s samples added, summarized again."""
    configs = {k: {kind: list(v) for kind, v in d.items()} for k, d in into.get("configs", {}).items()}
    for name, d in more.get("configs", {}).items():
        mine = configs.setdefault(name, {"write": [], "read_warm": [], "read_cold": []})
        for kind, values in d.items():
            mine[kind] = mine.get(kind, []) + list(values)
    return summarize({"bytes": into.get("bytes") or more.get("bytes"), "configs": configs})


def summarize(raw: dict) -> dict:
    """The bound of each kind (write, read_warm, read_cold): the lowest median over the
    configurations, which one gave it, its samples and its GB/s; and every configuration's median."""
    nbytes = raw["bytes"]
    out = {"bytes": nbytes, "configs": raw["configs"], "medians": {}}
    for kind in ("write", "read_warm", "read_cold"):
        medians = {name: statistics.median(d[kind]) for name, d in raw["configs"].items() if d.get(kind)}
        out["medians"][kind] = medians
        best = min(medians, key=medians.get) if medians else None
        out[f"{kind}_s"] = medians[best] if best else None
        out[f"{kind}_how"] = best
        out[f"{kind}_samples"] = raw["configs"][best][kind] if best else []
        out[f"{kind}_gbps"] = nbytes / medians[best] / 1e9 if best else None
    return out
