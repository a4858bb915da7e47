"""``dcp-datastates bench``: DataStates against DCP, torch.save and the physical limit.

Every method checkpoints the same state, in this process and this run, and is measured the same
way (medians of ``--reps`` repetitions):

* stall: the time the training thread spends on a checkpoint: inside the save call, plus the wait
  before the next optimizer step after a stand-in compute phase (a matmul loop on the training
  thread, ``--compute-ms``). At most one checkpoint is in flight: the wait for the previous one to
  be durable, at the next request, is reported beside it (``upload wait``).
* training-thread time per checkpoint (``train``): the call + the wait before the next step + the
  wait at the next request, every moment the training thread gives to one checkpoint.
* durable: from the request until the checkpoint is durable and committed (``upload_completion``
  for the DCP methods; the call itself for the synchronous ones), measured with nothing else
  running, each a single save: it starts ``RECURRING`` times the last one's duration after that
  one ended (saves that follow each other closer recur: ours then writes past the page cache,
  ``dcp_datastates.save.rhythm``; the training loop above measures that regime). Durable means fsync'ed for every method: where a peer does not fsync
  (torch_checkpointing, torchsnapshot), the bench fsyncs its files and folders once the peer says
  the checkpoint is complete, and counts that pass in its durable time.
* load: into preallocated tensors of the same structure, every first load compared bitwise with
  the saved state; warm (right after the save: the page
  cache holds the files) and cold (the checkpoint's files evicted with posix_fadvise, or the
  whole page cache dropped with ``--cold drop_caches``; not on tmpfs, which is the page cache).
* memory: resident set size sampled in a thread over ``--mem-ckpts`` back-to-back checkpoints.
* raw: the fair bound of the same number of bytes (raw_bound.py): the best of 1-N threads and
  files, with and without early writeback, fsync included; reads into fresh memory with 1-N
  threads, warm and cold: what the storage and memory of this machine allow.
* slowdown: matmuls per second in the compute phase against the idle rate.
* stage cost: ``DataStatesWriter.stage()`` and the whole ``dcp.async_save`` call on
  ``--stage-tensors`` tiny tensors (wall, CPU, and with Python's cyclic GC paused).

The table also checks the project's targets for DataStates (benchmarks/results/history-benchmarks.md,
"Targets") and says how busy other processes kept the machine (it may be shared: busy neighbours
skew every number).

Methods: ``datastates`` (DataStatesWriter / DataStatesReader), ``dcp-save`` (``dcp.save`` with
FileSystemWriter), ``dcp-async`` (``dcp.async_save`` with FileSystemWriter, DCP's default
blocking staging), ``dcp-async-stager`` (the same with DCP's ``DefaultStager`` staging in a
background thread), ``torch-save`` (``torch.save`` + fsync / ``torch.load``),
``torch-checkpointing`` (its ``CheckpointManager`` with asynchronous save) and ``torchsnapshot``
(``Snapshot.async_take`` / ``Snapshot.restore``) when installed (``pip install .[bench]``).

    python -m dcp_datastates bench [--size 1GiB] [--dir /tmp/dcpds-bench] [--json out.json] [--png chart.png]
    python -m dcp_datastates bench --from-json out.json [--png chart.png]   # print a saved run again
    python -m dcp_datastates bench --loop [--steps 12] [--runs 3] ...        # a training loop (bench_loop.py)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import io
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["main"]

GiB = 1 << 30
MiB = 1 << 20

METHODS = ("datastates", "dcp-save", "dcp-async", "dcp-async-stager", "torch-save", "torch-checkpointing", "torchsnapshot")
# Asked for by name only (--methods): the plan-caching planners, ours and DCP's own, for states of
# many tensors, where DCP's per-item planning is most of the time to durable.
PLANNER_METHODS = ("datastates-planner", "dcp-async-cached")
# DataStatesConfig engine options for the datastates method (--engine of end_to_end.py and of
# `bench --loop` sets them; the engine is process-wide, so one set per process).
ENGINE_OPTIONS: dict[str, Any] = {}
# Loaded by file path (`dcp-datastates bench`) or as __main__, this module is also the `bench` that
# its siblings import (bench_loop.py, end_to_end.py): one copy, one ENGINE_OPTIONS.
sys.modules.setdefault("bench", sys.modules[__name__])
# Peer libraries: measured when importable, else reported as not available (with the reason).
PEERS = ("torch-checkpointing", "torchsnapshot")
# What each method is, for the table legend and the JSON.
METHOD_HELP = {
    "datastates": "dcp.async_save + DataStatesWriter (lazy staging, engine copy/flush threads); dcp.load + DataStatesReader",
    "dcp-save": "dcp.save + FileSystemWriter (synchronous); dcp.load + FileSystemReader",
    "dcp-async": "dcp.async_save + FileSystemWriter, DCP's default staging (blocking copy in the call); dcp.load + FileSystemReader",
    "dcp-async-stager": "dcp.async_save + FileSystemWriter + DefaultStager(StagingOptions(async staging)); dcp.load + FileSystemReader",
    "datastates-planner": "datastates with planner=DataStatesSavePlanner() (plan caching, dtype-aware); dcp.load + DataStatesReader",
    "dcp-async-cached": "dcp-async with planner=DefaultSavePlanner(enable_plan_caching=True); dcp.load + FileSystemReader",
    "torch-save": "torch.save to one file + flush + fsync; torch.load, then copy into the targets",
    "torch-checkpointing": "torch_checkpointing.CheckpointManager (async save: staging thread + writer process; `with manager.lock()` "
    "before the step); manager.load(into=...). It does not fsync: the bench fsyncs its files once the save's future resolves, "
    "counted in durable",
    "torchsnapshot": "torchsnapshot.Snapshot.async_take(path, app_state={'state': StateDict(state)}) (stages in the call, writes in a "
    "background thread), then .wait(); Snapshot(path).restore(app_state). It does not fsync: the bench fsyncs its files once "
    ".wait() returns, counted in durable. CPU tensors it does not batch (>= its 128 MiB slab threshold) are written from the "
    "live tensors after the call, so then the step waits for .wait()",
}
_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp64": "float64",
    "float64": "float64",
    "int64": "int64",
    "int32": "int32",
    "uint8": "uint8",
}


# ------------------------------------------------------------------------------------ helpers
def _human(nbytes: float) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover


def parse_engine_options(text: str) -> dict[str, Any]:
    """``copy_threads=1,flush_threads=1,direct_writes=false`` -> DataStatesConfig options
    (integers, true / false / null, else the string)."""
    words = {"true": True, "false": False, "null": None}
    out: dict[str, Any] = {}
    for option in filter(None, text.split(",")):
        key, _, value = option.partition("=")
        value = value.strip()
        out[key.strip()] = int(value) if value.isdigit() else words.get(value.lower(), value)
    return out


def default_host_cache(size: int) -> int:
    """The datastates method's host cache for a state of ``size`` bytes: the state plus 64 MiB,
    rounded up to 64 MiB (one checkpoint fits whole)."""
    return (size + 2 * 64 * MiB - 1) // (64 * MiB) * (64 * MiB)


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _fs_type(path: str) -> str:
    """File system type of the mount holding ``path`` (longest matching mount point)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _drop_caches() -> str | None:
    """Drop the whole page cache (sync first; needs root). None when it worked, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"


def _evict(path: str) -> None:
    """Evict the files under ``path`` (a file or a folder) from the page cache: fsync each, then
    posix_fadvise(DONTNEED). Needs no privilege and leaves other processes' cached files alone
    (the machine may be shared); a no-op on tmpfs, whose pages are the storage."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _s, fs in os.walk(path) for f in fs]
    for name in files:
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Cold:
    """How loads are made cold: ``fadvise`` (evict the checkpoint's files), ``drop_caches``
    (echo 3 > /proc/sys/vm/drop_caches, the whole machine) or None (warm only)."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode

    def __bool__(self) -> bool:
        return self.mode is not None

    def __call__(self, path: str) -> bool:
        if self.mode == "fadvise":
            _evict(path)
            return True
        if self.mode == "drop_caches":
            return _drop_caches() is None
        return False


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS so one method's garbage does not count for the next."""
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _machine_info(dirs: list[str]) -> dict:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_bytes": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernel": platform.release(),
        "filesystems": {d: _fs_type(d) for d in dirs},
    }


class _CpuMeter:
    """CPU time used by other processes while a measurement ran (this machine may be shared:
    a busy neighbour skews every number, so the report says how busy it was)."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self.start = self._snap()

    def _snap(self) -> tuple[float, float, float]:
        t = self._psutil.cpu_times()
        busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
        c = self._me.cpu_times()
        own = c.user + c.system + c.children_user + c.children_system
        for child in self._me.children(recursive=True):
            with contextlib.suppress(Exception):
                cc = child.cpu_times()
                own += cc.user + cc.system
        return time.monotonic(), busy, own

    def other_cores(self) -> float:
        """Average number of cores other processes kept busy since construction."""
        t1, busy1, own1 = self._snap()
        t0, busy0, own0 = self.start
        wall = max(1e-9, t1 - t0)
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall)


class _RssSampler:
    """Samples this process's RSS (and, optionally, its children's) every ``interval`` seconds."""

    def __init__(self, interval: float = 0.005, children: bool = False) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._children = children
        self._stop = threading.Event()
        self.samples: list[tuple[float, int, int]] = []  # (time, rss, children rss)
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _child_rss(self) -> int:
        total = 0
        for c in self._proc.children(recursive=True):
            with contextlib.suppress(Exception):
                total += c.memory_info().rss
        return total

    def _run(self) -> None:
        n = 0
        child = 0
        while not self._stop.is_set():
            rss = self._proc.memory_info().rss
            if self._children and n % 10 == 0:
                child = self._child_rss()
            self.samples.append((time.perf_counter(), rss, child))
            n += 1
            self._stop.wait(self._interval)

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def now(self) -> int:
        return self._proc.memory_info().rss

    def peak_between(self, t0: float, t1: float) -> int:
        values = [r for t, r, _ in self.samples if t0 <= t <= t1]
        return max(values) if values else 0

    @property
    def peak(self) -> int:
        return max((r for _, r, _ in self.samples), default=0)

    @property
    def peak_children(self) -> int:
        return max((c for _, _, c in self.samples), default=0)


# -------------------------------------------------------------------------------------- state
@dataclasses.dataclass
class StateSpec:
    size: int  # total tensor bytes asked for
    large: int
    tiny: int
    dtypes: list[str]
    device: str
    seed: int = 0


def parse_dtypes(text: str) -> list[str]:
    out = []
    for part in text.split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name not in _DTYPES:
            raise ValueError(f"--dtypes: unknown dtype {part!r}; known: {', '.join(sorted(_DTYPES))}")
        out.append(_DTYPES[name])
    if not out:
        raise ValueError("--dtypes: give at least one dtype, e.g. fp32,bf16")
    return out


def build_state(spec: StateSpec) -> tuple[dict, int, int]:
    """A model-like nested state dict: ``spec.large`` large tensors (2-D, sizes varied around the
    mean, dtypes cycled through ``spec.dtypes``) and ``spec.tiny`` tiny ones (biases, norms, Adam
    step counters), plus a few non-tensor values. The bytes are random (not compressible, and
    not zero pages). Returns (state, tensor bytes, tensor count)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    block = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)
    device = torch.device(spec.device)

    def fill(t: torch.Tensor) -> torch.Tensor:
        flat = t.view(-1).view(torch.uint8) if t.numel() else t
        n = flat.numel()
        done = min(n, block.numel())
        flat[:done].copy_(block[:done])
        while done < n:  # doubling copies: few calls per tensor
            k = min(done, n - done)
            flat[done : done + k].copy_(flat[:k])
            done += k
        return t

    tiny_shapes = [(1,), (4,), (16,), (64,), (256,), ()]
    tiny_dtypes = [torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.int64]
    tiny: dict[str, torch.Tensor] = {}
    tiny_bytes = 0
    for i in range(spec.tiny):
        k = i % len(tiny_shapes)
        t = torch.empty(tiny_shapes[k], dtype=tiny_dtypes[k])
        fill(t)
        tiny[f"layers.{i // 8}.small{i % 8}"] = t
        tiny_bytes += t.numel() * t.element_size()

    large: dict[str, torch.Tensor] = {}
    budget = max(0, spec.size - tiny_bytes)
    large_bytes = 0
    if spec.large:
        # Sizes vary between 0.5x and 1.5x of the mean, deterministically, and add up to the budget.
        weights = [0.5 + ((i * 37) % 11) / 10.0 for i in range(spec.large)]
        scale = budget / sum(weights)
        cols = 512
        for i in range(spec.large):
            dtype = getattr(torch, spec.dtypes[i % len(spec.dtypes)])
            esize = torch.empty((), dtype=dtype).element_size()
            numel = max(cols, int(weights[i] * scale) // esize)
            rows = max(1, numel // cols)
            t = torch.empty((rows, cols), dtype=dtype)
            fill(t)
            large[f"layers.{i}.weight"] = t
            large_bytes += t.numel() * t.element_size()
    model = {**large, **tiny}
    if device.type != "cpu":
        model = {k: v.to(device) for k, v in model.items()}
    state = {
        "model": model,
        "extra": {"step": 0, "lr": 3e-4, "note": "dcp_datastates bench"},
    }
    return state, large_bytes + tiny_bytes, len(model)


def flatten(state: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _placeholder(v: Any) -> Any:
    """What a load target holds in place of the non-tensor value ``v``: a value of the same type
    (0, "", ...; lists and tuples element by element, as DCP walks them), else None."""
    if isinstance(v, (list, tuple)):
        return type(v)(_placeholder(x) for x in v)
    if isinstance(v, dict):
        return {k: _placeholder(x) for k, x in v.items()}
    return type(v)() if isinstance(v, (int, float, str)) else None


def empty_like_state(state: dict) -> dict:
    """Preallocated load targets: the same structure, fresh tensors (contents garbage), and the
    non-tensor values replaced by placeholders of the same type (``_placeholder``)."""
    import torch

    out: dict = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = empty_like_state(v)
        elif isinstance(v, torch.Tensor):
            t = torch.empty_like(v)
            if t.device.type == "cpu" and t.numel():
                t.view(-1).view(torch.uint8).fill_(0)  # fault the pages in: loads must not pay for it
            out[k] = t
        else:
            out[k] = _placeholder(v)
    return out


def scrub_state(state: dict) -> None:
    """Overwrite load targets before a load: every tensor byte 0xA5, every other value the
    placeholder ``empty_like_state`` gives, so only what the load itself wrote can match."""
    import torch

    for k, v in state.items():
        if isinstance(v, dict):
            scrub_state(v)
        elif isinstance(v, torch.Tensor):
            if v.numel():
                v.view(-1).view(torch.uint8).fill_(0xA5)
        else:
            state[k] = _placeholder(v)


def states_equal(a: dict, b: dict, skip: tuple[str, ...] = ("extra.step",)) -> bool:
    """Bitwise comparison of every tensor (NaN-safe: compares bytes) and every other value but
    ``skip`` (the step counter moves on between a synchronous method's last save and the load)."""
    import torch

    fa, fb = flatten(a), flatten(b)
    if fa.keys() != fb.keys():
        return False
    for k, va in fa.items():
        if k in skip:
            continue
        vb = fb[k]
        if isinstance(va, torch.Tensor):
            if not isinstance(vb, torch.Tensor) or va.shape != vb.shape or va.dtype != vb.dtype:
                return False
            if va.numel() and not torch.equal(va.reshape(-1).view(torch.uint8).cpu(), vb.reshape(-1).view(torch.uint8).cpu()):
                return False
        elif va != vb:
            return False
    return True


# ------------------------------------------------------------------------------- compute phase
class Compute:
    """The stand-in for forward + backward: matrix multiplications on the training thread for
    ``ms`` milliseconds (a fixed window, so every method gets the same time to stage in the
    background). How many multiplications fit in the window, against the best rate measured with
    nothing else running, tells how much the checkpoint's background work slowed training."""

    def __init__(self, ms: float, device: str) -> None:
        import torch

        self.device = torch.device(device)
        n = 2048 if self.device.type == "cuda" else 256
        self.a = torch.randn(n, n, device=self.device)
        self.b = torch.randn(n, n, device=self.device)
        self.out = torch.empty_like(self.a)
        self.ms = ms
        self.idle_rate = 0.0  # multiplications per second, the best seen when idle
        if ms > 0:
            self._mm()
            for _ in range(5):
                self.calibrate(0.05)

    def _mm(self) -> None:
        import torch

        torch.mm(self.a, self.b, out=self.out)  # same inputs every time: no drift into denormals
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _window(self, seconds: float) -> tuple[float, int]:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        count = 0
        while True:
            self._mm()
            count += 1
            now = time.perf_counter()
            if now >= deadline:
                return now - t0, count

    def calibrate(self, seconds: float = 0.1) -> None:
        """Measure the rate with nothing checkpointing; keep the best (least disturbed) one."""
        if self.ms > 0:
            elapsed, count = self._window(seconds)
            self.idle_rate = max(self.idle_rate, count / elapsed)

    @property
    def idle_s(self) -> float:
        return self.ms / 1e3

    def __call__(self) -> tuple[float, int]:
        """One compute phase: (seconds, multiplications done)."""
        if self.ms <= 0:
            return 0.0, 0
        return self._window(self.ms / 1e3)


# ------------------------------------------------------------------------------------ methods
class _Pending:
    """One checkpoint in flight: ``durable`` resolves when it is durable and committed, and
    ``durable_at`` holds that moment (perf_counter), set by the thread that completed it."""

    def __init__(self, t_request: float, durable: Future | None, staged: Callable[[], None] | None = None) -> None:
        self.t_request = t_request
        self.durable = durable
        self.staged = staged
        self.durable_at: float | None = None
        if durable is None:
            self.durable_at = time.perf_counter()
        else:
            durable.add_done_callback(self._done)

    def _done(self, _f) -> None:
        self.durable_at = time.perf_counter()

    def wait_staged(self) -> None:
        if self.staged is not None:
            self.staged()

    def wait_durable(self) -> None:
        if self.durable is not None:
            self.durable.result()
            while self.durable_at is None:  # the callback runs right after the result is set
                time.sleep(0.0001)

    @property
    def durable_s(self) -> float:
        assert self.durable_at is not None
        return self.durable_at - self.t_request


def fsync_tree(path: str) -> float:
    """fsync every file under ``path``, then every folder (deepest first, ``path`` included, and
    its parent: the entry naming it), for peers that never fsync. Returns the seconds it took."""
    t0 = time.perf_counter()
    dirs = []
    for dirpath, _dirs, files in os.walk(path):
        dirs.append(dirpath)
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    dirs.append(os.path.dirname(os.path.abspath(path)))
    for d in sorted(dirs[:-1], key=lambda x: x.count(os.sep), reverse=True) + dirs[-1:]:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _durable_after(complete: Callable[[], Any], path: str | None, fsync_times: list[float]) -> Future:
    """A future that resolves once ``complete()`` (the peer's own wait) has returned and the
    files under ``path`` have been fsync'ed (``fsync_tree``), in a thread of its own: the peer says
    when it is done, the bench makes it durable. The fsync pass's seconds go to ``fsync_times``.
    ``path`` None: no fsync pass (the page-cache group of ``bench --loop``: nobody fsyncs)."""
    fut: Future = Future()

    def run() -> None:
        try:
            complete()
            if path is not None:
                fsync_times.append(fsync_tree(path))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(exc)
        else:
            fut.set_result(None)

    threading.Thread(target=run, name="bench-fsync", daemon=True).start()
    return fut


class Method:
    name = ""
    synchronous = False  # durable when the save call returns
    gc_probe = False  # also time loads with the cyclic GC paused (evidence for a proposed fix)
    has_children = False
    host_cache = 0  # bytes of staging memory this method keeps for its lifetime
    # The method whose files this one writes too, read by the same reader: its loads are shared
    # (one load of this method's files still checks them).
    loads_like: str | None = None
    # True: every checkpoint fsync'ed before it counts as done (by the method, or by the bench for
    # a peer that never fsyncs). False (`bench --loop`'s page-cache group): nobody fsyncs.
    durable = True

    def planner(self):
        """The save planner passed to DCP (None: DCP's DefaultSavePlanner())."""
        return None

    def setup(self, state: dict, root: str) -> None:
        self.root = root

    def save(self, state: dict, path: str) -> _Pending:
        raise NotImplementedError

    def load(self, targets: dict, path: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def extra_results(self) -> dict:
        """Method-specific measurements over the whole run, merged into its results."""
        return {}


class DataStatesMethod(Method):
    name = "datastates"
    gc_probe = True

    def __init__(self, host_cache: int) -> None:
        self._cache_request = host_cache

    def setup(self, state, root):
        super().setup(state, root)
        from dcp_datastates.config import DataStatesConfig
        from dcp_datastates.runtime import engine_stats, get_engine

        self.config = DataStatesConfig(**{"host_cache_size": self._cache_request, "sync_files": self.durable, **ENGINE_OPTIONS})
        get_engine(self.config)  # first use creates the process-wide engine with this cache
        self.host_cache = int(engine_stats().get("cache_bytes", 0))
        self._stats0 = engine_stats()

    def extra_results(self) -> dict:
        # The checksum's share of the flush workers' time over every save of the run (the
        # engine times both per 256 KiB block; issue target: under 5 %).
        from dcp_datastates.runtime import engine_stats

        now = engine_stats()
        flush = now.get("flush_ns", 0) - self._stats0.get("flush_ns", 0)
        crc = now.get("checksum_ns", 0) - self._stats0.get("checksum_ns", 0)
        return {"flush_s": flush / 1e9, "checksum_s": crc / 1e9, "checksum_share": crc / flush if flush else None}

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp

        from dcp_datastates import DataStatesWriter, wait_staged

        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, config=self.config), planner=self.planner())
        return _Pending(t0, resp.upload_completion, lambda: wait_staged())

    def load(self, targets, path):
        import torch.distributed.checkpoint as dcp

        from dcp_datastates import DataStatesReader

        dcp.load(targets, storage_reader=DataStatesReader(path, config=self.config))


class DataStatesPlannerMethod(DataStatesMethod):
    name = "datastates-planner"
    gc_probe = False
    loads_like = "datastates"

    def planner(self):
        from dcp_datastates import DataStatesSavePlanner

        return DataStatesSavePlanner(cache_key="bench")


class DcpSaveMethod(Method):
    name = "dcp-save"
    synchronous = True

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        t0 = time.perf_counter()
        dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=self.durable))
        return _Pending(t0, None)

    def load(self, targets, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        dcp.load(targets, storage_reader=FileSystemReader(path))


class DcpAsyncMethod(DcpSaveMethod):
    name = "dcp-async"
    synchronous = False
    loads_like = "dcp-save"  # the files FileSystemWriter writes, read by FileSystemReader

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        t0 = time.perf_counter()
        out = dcp.async_save(state, storage_writer=FileSystemWriter(path, sync_files=self.durable), planner=self.planner())
        upload = getattr(out, "upload_completion", out)
        staged = getattr(out, "staging_completion", None)
        return _Pending(t0, upload, (lambda: staged.result()) if staged is not None else None)


class DcpAsyncCachedMethod(DcpAsyncMethod):
    name = "dcp-async-cached"

    def planner(self):
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        return DefaultSavePlanner(enable_plan_caching=True)


class DcpAsyncStagerMethod(DcpSaveMethod):
    name = "dcp-async-stager"
    synchronous = False
    loads_like = "dcp-save"  # the files FileSystemWriter writes, read by FileSystemReader

    def setup(self, state, root):
        super().setup(state, root)
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = any(t.is_cuda for t in flatten(state).values() if isinstance(t, torch.Tensor))
        # On CPU DCP allows asynchronous staging (a background thread copying into CPU tensors it
        # caches and reuses) but neither pinned memory nor non-blocking copies (both need an
        # accelerator); shared memory is for the process-based checkpointer only.
        self.options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
        self.stager = DefaultStager(self.options)

    def save(self, state, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.staging import DefaultStager

        from dcp_datastates.compat import default_stager_reusable

        if not default_stager_reusable():  # torch 2.11-2.12 close a DefaultStager after one stage
            self.stager = DefaultStager(self.options)
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=FileSystemWriter(path, sync_files=self.durable), async_stager=self.stager)
        return _Pending(t0, resp.upload_completion, lambda: resp.staging_completion.result())

    def close(self):
        self.stager.close()


class TorchSaveMethod(Method):
    name = "torch-save"
    synchronous = True

    def save(self, state, path):
        import torch

        t0 = time.perf_counter()
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
        return _Pending(t0, None)

    def load(self, targets, path):
        import torch

        device = next((t.device for t in flatten(targets).values() if isinstance(t, torch.Tensor)), "cpu")
        loaded = torch.load(os.path.join(path, "state.pt"), map_location=device, weights_only=True)
        _copy_into(targets, loaded)


def _copy_into(dst: dict, src: dict) -> None:
    import torch

    for k, v in src.items():
        if isinstance(v, dict):
            _copy_into(dst[k], v)
        elif isinstance(v, torch.Tensor) and isinstance(dst.get(k), torch.Tensor):
            dst[k].copy_(v)
        else:
            dst[k] = v


class TorchCheckpointingMethod(Method):
    name = "torch-checkpointing"
    has_children = True

    def setup(self, state, root):
        super().setup(state, root)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        cfg = CheckpointManager.Config.with_async_save()
        # Its default O_DIRECT writes fail with EINVAL on ext4 here (unaligned lengths through a
        # buffered file object); buffered I/O is what works on both file systems.
        cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
        self.manager = cfg.build()
        self.fsync_times: list[float] = []

    def extra_results(self) -> dict:
        return {"fsync_pass_s": _median(self.fsync_times), "fsync_by": "bench (the library does not fsync)"}

    @staticmethod
    def _key(dotted: str) -> str:
        # Its item keys name files: letters, digits, '-' and '_' only.
        return dotted.replace("_", "_u").replace(".", "__")

    def save(self, state, path):
        flat = {self._key(k): v for k, v in flatten(state).items()}
        t0 = time.perf_counter()
        fut = self.manager.save(path, flat)

        def staged():
            with self.manager.lock():  # what guards optimizer.step() with this library
                pass

        # It never fsyncs: durable = its future resolved + the bench's fsync pass over its files.
        return _Pending(t0, _durable_after(fut.result, path if self.durable else None, self.fsync_times), staged)

    def load(self, targets, path):
        flat = flatten(targets)
        names = {self._key(k): k for k in flat}
        got = self.manager.load(path, into={self._key(k): v for k, v in flat.items()})
        for k, v in got.items():  # non-tensor values come back in the mapping
            if not hasattr(v, "data_ptr"):
                _assign_flat(targets, names[k], v)

    def close(self):
        self.manager.close()


def _assign_flat(state: dict, dotted: str, value: Any) -> None:
    node = state
    parts = dotted.split(".")
    for i in range(len(parts) - 1):
        head = parts[i]
        if head in node and isinstance(node[head], dict):
            node = node[head]
        else:  # keys containing dots: the rest is one key
            node[".".join(parts[i:])] = value
            return
    node[parts[-1]] = value


class TorchSnapshotMethod(Method):
    """torchsnapshot 0.1.0 as its documentation runs it: ``Snapshot.async_take(path, app_state)``,
    ``.wait()`` before the next snapshot, ``Snapshot(path).restore(app_state)``, with
    ``StateDict`` wrapping a plain state dict, ``replicated`` and the storage options at their
    defaults. Its ``FSStoragePlugin`` writes through aiofiles and never fsyncs; the bench fsyncs
    the snapshot's files and folders once ``.wait()`` returned, counted in the durable time.

    ``async_take`` returns once every write request is staged; it copies the CPU tensors it
    batches into slabs (those under its 128 MiB slab threshold), but ``TensorBufferStager.
    _should_copy_cpu_tensor`` compares the entry's serializer (a str) with an Enum member, so a
    CPU tensor it does not batch is never copied: it is written from the live tensor after the
    call returns, and an optimizer step before ``.wait()`` would tear the snapshot. With such
    tensors in the state the step waits for ``.wait()`` (the only guard the library offers),
    counted in the training thread's time; without them, nothing waits before the step."""

    name = "torchsnapshot"

    def setup(self, state, root):
        super().setup(state, root)
        import torch
        from torchsnapshot.knobs import get_slab_size_threshold_bytes

        threshold = get_slab_size_threshold_bytes()
        self.live = [
            k
            for k, v in flatten(state).items()
            if isinstance(v, torch.Tensor) and not v.is_cuda and v.numel() * v.element_size() >= threshold
        ]
        self.slab_threshold = threshold
        self.fsync_times: list[float] = []

    def extra_results(self) -> dict:
        return {
            "fsync_pass_s": _median(self.fsync_times),
            "fsync_by": "bench (the library does not fsync)",
            "slab_threshold_bytes": self.slab_threshold,
            "tensors_written_live": len(self.live),
            "step_guard": (
                f"PendingSnapshot.wait(): {len(self.live)} CPU tensors >= the {_human(self.slab_threshold)} slab threshold "
                "are written from the live tensors after async_take returns"
                if self.live
                else "none: async_take copied every tensor before returning"
            ),
        }

    def save(self, state, path):
        from torchsnapshot import Snapshot, StateDict

        t0 = time.perf_counter()
        pending = Snapshot.async_take(path, app_state={"state": StateDict(state)})
        return _Pending(t0, _durable_after(pending.wait, path if self.durable else None, self.fsync_times), pending.wait if self.live else None)

    def load(self, targets, path):
        from torchsnapshot import Snapshot, StateDict

        app = StateDict(targets)  # a copy of the top level: its load_state_dict() updates the copy
        Snapshot(path).restore({"state": app})
        _copy_back(targets, app.data)


def _copy_back(dst: dict, src: dict) -> None:
    """Put what a load produced into ``dst``: tensors restored in place (the same objects) are
    left alone, other tensors copied into ``dst``'s, every other value assigned."""
    import torch

    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            if v is not dst[k]:
                _copy_back(dst[k], v)
        elif isinstance(v, torch.Tensor) and isinstance(dst.get(k), torch.Tensor):
            if v is not dst[k]:
                dst[k].copy_(v)
        else:
            dst[k] = v


def _peer_unavailable(name: str) -> str | None:
    """None when the peer library ``name`` imports, else the reason (reported, not raised)."""
    try:
        if name == "torch-checkpointing":
            import torch_checkpointing  # noqa: F401
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig  # noqa: F401
        elif name == "torchsnapshot":
            from torchsnapshot import Snapshot, StateDict  # noqa: F401
            from torchsnapshot.knobs import get_slab_size_threshold_bytes  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not measurable here"
        how = {
            "torch-checkpointing": "`pip install --no-deps torch-checkpointing==0.1.1` adds it",
            "torchsnapshot": "`pip install torchsnapshot==0.1.0` adds it",
        }[name]
        state = "is not installed" if isinstance(exc, ModuleNotFoundError) else "does not import"
        return f"{name.replace('-', '_')} {state} ({type(exc).__name__}: {exc}); {how} (or `pip install .[bench]`)"
    return None


def make_method(name: str, host_cache: int, durable: bool = True) -> Method:
    """The method ``name``; ``durable`` False: one that fsyncs nothing (``Method.durable``)."""
    method = {
        "datastates": lambda: DataStatesMethod(host_cache),
        "dcp-save": DcpSaveMethod,
        "dcp-async": DcpAsyncMethod,
        "dcp-async-stager": DcpAsyncStagerMethod,
        "datastates-planner": lambda: DataStatesPlannerMethod(host_cache),
        "dcp-async-cached": DcpAsyncCachedMethod,
        "torch-save": TorchSaveMethod,
        "torch-checkpointing": TorchCheckpointingMethod,
        "torchsnapshot": TorchSnapshotMethod,
    }[name]()
    method.durable = durable
    return method


# ------------------------------------------------------------------------------- measurements
def _load_sibling(name: str):
    """A module of this folder (bench.py is loaded by file path, so its folder is not on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"dcp_datastates_bench_{name}", os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


raw_bound = _load_sibling("raw_bound")


def measure_raw(root: str, nbytes: int, reps: int, cold: _Cold | None) -> dict:
    """The fair raw bound of ``nbytes`` (raw_bound.py): the best of 1-N threads and files, with
    and without early writeback, fsync included; reads into fresh memory, warm and cold."""
    try:
        return raw_bound.measure_raw(root, nbytes, reps, cold)
    finally:
        _malloc_trim()


def _merge_raw(into: dict, more: dict) -> None:
    """Add ``more``'s samples to ``into`` and recompute the bound."""
    into.update(raw_bound.merge_raw(into, more))


def run_method(
    method: Method, state: dict, targets: dict, root: str, args, compute: Compute, model_bytes: int, cold: _Cold, load_reps: int, shared_load: bool = False
) -> dict:
    """Measures one method: the training loop (stall, upload wait, memory), durable saves with
    nothing else running, warm and cold loads. Checkpoint folders are removed as soon as they
    are not needed (a checkpoint on /dev/shm is memory)."""
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    _malloc_trim()
    res: dict[str, Any] = {"available": True, "description": METHOD_HELP[method.name]}
    meter = _CpuMeter()
    t_method = time.perf_counter()
    counter = [0]

    def new_path() -> str:
        counter[0] += 1
        return os.path.join(root, f"ckpt-{counter[0]:03d}")

    def remove(path: str | None) -> None:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    # ---- training loop: back-to-back checkpoints, one compute phase apart, RSS sampled.
    sampler = _RssSampler(children=method.has_children)
    baseline = sampler.now()
    n_loop = max(args.mem_ckpts, args.reps + 1)
    calls, step_waits, upload_waits, comp_s, comp_n, durable_loop, windows = [], [], [], [], [], [], []
    paths: list[str] = []
    with sampler:
        t_setup = time.perf_counter()
        method.setup(state, root)
        res["setup_s"] = time.perf_counter() - t_setup
        pending: _Pending | None = None
        for i in range(n_loop):
            t_begin = time.perf_counter()
            if pending is not None:
                pending.wait_durable()  # at most one checkpoint in flight
                durable_loop.append(pending.durable_s)
            upload_waits.append(time.perf_counter() - t_begin)
            while len(paths) > 1:  # keep the last committed checkpoint only (bounds /dev/shm use)
                remove(paths.pop(0))
            path = new_path()
            paths.append(path)
            t0 = time.perf_counter()
            pending = method.save(state, path)
            calls.append(time.perf_counter() - t0)
            seconds, count = compute()  # forward + backward
            comp_s.append(seconds)
            comp_n.append(count)
            t1 = time.perf_counter()
            pending.wait_staged()  # what protect_optimizer / the method's guard does
            step_waits.append(time.perf_counter() - t1)
            state["extra"]["step"] = i + 1  # the optimizer step (stand-in: nothing heavy)
            windows.append(t_begin)
        t_end = time.perf_counter()
        pending.wait_durable()
        durable_loop.append(pending.durable_s)
        last_wait = time.perf_counter() - t_end
        windows.append(time.perf_counter())
    # Per-checkpoint peak RSS: from its request to the next request (the last: until durable).
    per_ckpt_peak = [sampler.peak_between(windows[k], windows[k + 1]) for k in range(n_loop)]
    res["loop_checkpoints"] = n_loop
    stalls = [c + w for c, w in zip(calls, step_waits)]
    # Checkpoint 1 carries one-time costs (engine threads, first touch of a cache, a writer
    # process): reported as first_stall_s, left out of the medians.
    res["first_stall_s"] = stalls[0]
    res["call_s"] = _median(calls[1:])
    res["step_wait_s"] = _median(step_waits[1:])
    res["stall_s"] = _median(stalls[1:])
    # The wait at request k+1 is for checkpoint k.
    after = upload_waits[2:] + [last_wait]
    res["upload_wait_s"] = _median(after)
    res["stall_with_upload_wait_s"] = _median([st + u for st, u in zip(stalls[1:], after)])
    res["compute_s"] = _median(comp_s[1:])
    res["compute_rate"] = sum(comp_n[1:]) / sum(comp_s[1:]) if sum(comp_s[1:]) > 0 else None
    res["durable_in_loop_s"] = _median(durable_loop[1:])
    res["stall_samples"] = stalls
    res["upload_wait_samples"] = upload_waits[1:] + [last_wait]
    res["memory"] = {
        "model_bytes": model_bytes,
        "host_cache_bytes": method.host_cache,
        "rss_baseline": baseline,
        "rss_peak": max(sampler.peak, baseline),
        "rss_overhead": max(sampler.peak, baseline) - baseline,
        "per_checkpoint_peak": per_ckpt_peak,
        "children_rss_peak": sampler.peak_children if method.has_children else None,
        "samples": len(sampler.samples),
    }
    if len(per_ckpt_peak) >= 3:
        growth = max(per_ckpt_peak[2:]) - per_ckpt_peak[1]
        res["memory"]["growth_after_second"] = growth
        res["memory"]["flat_from_second"] = growth <= max(16 * MiB, model_bytes // 50)
    budget = method.host_cache + model_bytes // 10
    res["memory"]["within_cache_plus_10pct"] = res["memory"]["rss_overhead"] <= budget
    compute.calibrate()  # idle again: refresh the reference rate

    # ---- durable: request -> durable and committed, with nothing else running. A synchronous
    # method's loop checkpoints already were exactly that (nothing overlaps its call).
    if method.synchronous:
        durables = durable_loop[1:]
        last_path = paths.pop()
    else:
        # The loop's checkpoints are not read again: removed first, so the first durable save
        # writes where they were instead of into memory no checkpoint touched yet (on /dev/shm
        # of this VM, 1 GiB of never-used pages cost ~1.4 s of kernel time: one sample in five).
        while paths:
            remove(paths.pop(0))
        last_path = None
        durables = []
        for _ in range(args.reps):
            remove(last_path)
            if durables:
                from dcp_datastates.save.rhythm import RECURRING

                time.sleep(RECURRING * durables[-1])
            last_path = new_path()
            p = method.save(state, last_path)
            p.wait_staged()
            p.wait_durable()
            durables.append(p.durable_s)
    while paths:
        remove(paths.pop(0))
    res["durable_s"] = _median(durables)
    res["durable_samples"] = durables

    # ---- load: warm (right after the save), then cold (the checkpoint's pages evicted). Every
    # load goes into targets scrubbed beforehand (nothing left from an earlier load can pass for
    # it) and is compared bitwise with the saved state afterwards, both outside the timing.
    checks: list[bool] = []

    def checked_load(pause_gc: bool = False) -> float:
        scrub_state(targets)
        was = gc.isenabled()
        if pause_gc:
            gc.disable()
        try:
            t0 = time.perf_counter()
            method.load(targets, last_path)
            elapsed = time.perf_counter() - t0
        finally:
            if pause_gc and was:
                gc.enable()
        checks.append(states_equal(state, targets))
        return elapsed

    warm, colds = [], []
    for _ in range(max(1, load_reps)):
        warm.append(checked_load())
    if cold and not shared_load:
        for _ in range(load_reps):
            if not cold(last_path):
                break
            colds.append(checked_load())
    if method.gc_probe and not shared_load:
        # The same loads with Python's cyclic GC paused around them: what a collection triggered
        # by the load's own allocations (metadata, read items) costs. Evidence, not a method.
        for key, make_cold in (("load_warm_gc_paused_s", False), ("load_cold_gc_paused_s", True)):
            if make_cold and not cold:
                continue
            samples = []
            for _ in range(max(1, load_reps)):
                if make_cold and not cold(last_path):
                    break
                samples.append(checked_load(pause_gc=True))
            res[key] = _median(samples)
    res["load_verified"] = bool(checks) and all(checks)
    res["load_checks"] = len(checks)
    res["load_checks_failed"] = checks.count(False)
    res["load_warm_s"] = _median(warm)
    res["load_cold_s"] = _median(colds) if colds else None
    res["load_warm_samples"] = warm
    res["load_cold_samples"] = colds
    res["disk_bytes"] = _tree_bytes(last_path)
    res.update(method.extra_results())
    method.close()
    remove(last_path)
    shutil.rmtree(root, ignore_errors=True)
    res["other_processes_cores"] = meter.other_cores()
    res["method_wall_s"] = time.perf_counter() - t_method
    return res


def _tree_bytes(path: str | None) -> int:
    total = 0
    if path and os.path.isdir(path):
        for dirpath, _dirs, files in os.walk(path):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(dirpath, f))
    return total


def measure_version_guard(tensors: list, reps: int) -> dict:
    """The torn-state guard's share of a save: recording every source tensor's version counter
    at stage() and comparing them at the seal (both on the training thread at worst)."""
    from dcp_datastates.save.version_guard import VersionGuard

    names = [f"t{i}" for i in range(len(tensors))]
    record, check = [], []
    for _ in range(max(3, reps)):
        t0 = time.perf_counter()
        guard = VersionGuard(names, tensors)
        t1 = time.perf_counter()
        assert guard.first_changed() is None
        record.append(t1 - t0)
        check.append(time.perf_counter() - t1)
    return {"guard_record_s": _median(record), "guard_check_s": _median(check),
            "guard_us_per_tensor": (_median(record) + _median(check)) / max(1, len(tensors)) * 1e6}


def measure_stage_cost(root: str, count: int, reps: int, profile: bool, config) -> dict:
    """``DataStatesWriter.stage()`` and the whole ``dcp.async_save`` call on ``count`` tiny
    tensors: the per-tensor cost on the training thread. Wall time and the thread's CPU time
    (which a busy neighbour does not inflate), and stage() once more with Python's cyclic GC
    paused around the call (what a collection triggered by stage()'s allocations costs)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    # Nested, as model and optimizer state dicts are: DCP's async_save does per-top-level-key
    # work of its own (Stateful checks, logging), measured separately on a flat dict below.
    tensors = {f"t{i}": torch.full((16,), float(i)) for i in range(count)}
    state = {"model": tensors}
    out: dict[str, Any] = {"tensors": count, "gc_tracked_objects": len(gc.get_objects())}
    path = os.path.join(root, "stage-cost")

    def stage_once(pause_gc: bool) -> tuple[float, float]:
        shutil.rmtree(path, ignore_errors=True)
        w = DataStatesWriter(path, config=config)
        was = gc.isenabled()
        if pause_gc:
            gc.disable()
        try:
            c0, t0 = time.thread_time(), time.perf_counter()
            fut = w.stage(state)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        finally:
            if was:
                gc.enable()
        fut.result()
        staged = w._pending.pop()  # stage() alone starts the file; let it finish
        for f in staged.files:
            f.job.wait_done(None)
        staged.finished.set()  # no DCP save follows this stage(): release its path
        return wall, cpu

    from dcp_datastates.save.plan_cache import plan_stats

    n = max(3, reps)
    before = plan_stats()
    plain = [stage_once(False) for _ in range(n)]
    paused = [stage_once(True) for _ in range(n)]
    call_s, durable_s, flat_call_s = [], [], []
    for _ in range(n):
        shutil.rmtree(path, ignore_errors=True)
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, config=config))
        call_s.append(time.perf_counter() - t0)
        resp.upload_completion.result()
        durable_s.append(time.perf_counter() - t0)
    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    resp = dcp.async_save(tensors, storage_writer=DataStatesWriter(path, config=config))
    flat_call_s.append(time.perf_counter() - t0)
    resp.upload_completion.result()
    out["async_save_call_flat_dict_s"] = flat_call_s[0]
    out["stage_s"] = _median([w for w, _ in plain])
    out["stage_cpu_s"] = _median([c for _, c in plain])
    out["stage_gc_paused_s"] = _median([w for w, _ in paused])
    out["stage_gc_paused_cpu_s"] = _median([c for _, c in paused])
    out["stage_samples"] = plain
    # The first stage() of a structure builds its plan (a miss); later ones reuse it (hits).
    after = plan_stats()
    out["stage_plan_hits"] = after["hits"] - before["hits"]
    out["stage_plan_misses"] = after["misses"] - before["misses"]
    out["async_save_call_s"] = _median(call_s)
    out["async_save_durable_s"] = _median(durable_s)
    out["stage_us_per_tensor"] = out["stage_s"] / count * 1e6
    out.update(measure_version_guard(list(tensors.values()), reps))
    if profile:
        import cProfile
        import pstats

        shutil.rmtree(path, ignore_errors=True)
        w = DataStatesWriter(path, config=config)
        prof = cProfile.Profile()
        prof.enable()
        fut = w.stage(state)
        prof.disable()
        fut.result()
        staged = w._pending.pop()
        for f in staged.files:
            f.job.wait_done(None)
        staged.finished.set()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        out["profile"] = text.getvalue()
    shutil.rmtree(path, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------- report
def _fmt(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    if v is None:
        return "-"
    x = v * scale
    if x != 0 and abs(x) < 10 ** -digits:
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def _fmt_ratio(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 0.01:
        return f"{v:.4f}x"
    return f"{v:.2f}x"


def add_ratios(run: dict) -> None:
    methods = run["methods"]
    raw = run["raw"]
    base = methods.get("dcp-save", {})
    for m in methods.values():
        if not m.get("available"):
            continue
        m["stall_vs_dcp_save"] = _ratio(m.get("stall_s"), base.get("stall_s"))
        m["durable_vs_dcp_save"] = _ratio(m.get("durable_s"), base.get("durable_s"))
        m["load_warm_vs_dcp_save"] = _ratio(m.get("load_warm_s"), base.get("load_warm_s"))
        m["load_cold_vs_dcp_save"] = _ratio(m.get("load_cold_s"), base.get("load_cold_s"))
        m["durable_vs_raw"] = _ratio(m.get("durable_s"), raw.get("write_s"))
        m["load_warm_vs_raw"] = _ratio(m.get("load_warm_s"), raw.get("read_warm_s"))
        m["load_cold_vs_raw"] = _ratio(m.get("load_cold_s"), raw.get("read_cold_s"))
        # How much slower the compute phase ran while this method checkpointed (1.0: not at all).
        m["compute_slowdown"] = _ratio(run.get("compute_idle_rate"), m.get("compute_rate"))


def evaluate_targets(run: dict) -> list[dict]:
    """The project's targets for DataStates on this run: each with the measured value and met/not."""
    m = run["methods"]
    ds = m.get("datastates", {})
    if not ds.get("available"):
        return []
    save, stager, dasync = m.get("dcp-save", {}), m.get("dcp-async-stager", {}), m.get("dcp-async", {})
    raw = run["raw"]
    out: list[dict] = []

    def add(name: str, value: float | None, limit: float | None, smaller_is_met: bool = True, unit: str = "x") -> None:
        if value is None or limit is None:
            out.append({"target": name, "value": value, "limit": limit, "met": None})
            return
        met = value <= limit if smaller_is_met else value >= limit
        out.append({"target": name, "value": value, "limit": limit, "met": bool(met), "unit": unit})

    add("stall < 1% of dcp.save", _ratio(ds.get("stall_s"), save.get("stall_s")), 0.01)
    add("stall below DCP DefaultStager's", _ratio(ds.get("stall_s"), stager.get("stall_s")), 1.0)
    add("durable within 1.2x of the raw write bound", _ratio(ds.get("durable_s"), raw.get("write_s")), 1.2)
    add("durable never slower than dcp.async_save (default staging)", _ratio(ds.get("durable_s"), dasync.get("durable_s")), 1.0)
    add("durable never slower than dcp.async_save (DefaultStager)", _ratio(ds.get("durable_s"), stager.get("durable_s")), 1.0)
    add("warm load within 1.3x of the raw read bound", _ratio(ds.get("load_warm_s"), raw.get("read_warm_s")), 1.3)
    if ds.get("load_cold_s") is not None:
        add("cold load within 1.3x of the raw read bound", _ratio(ds.get("load_cold_s"), raw.get("read_cold_s")), 1.3)
    add("warm load at least 3x faster than dcp.load", _ratio(save.get("load_warm_s"), ds.get("load_warm_s")), 3.0, False)
    if ds.get("load_cold_s") is not None:
        add("cold load at least 3x faster than dcp.load", _ratio(save.get("load_cold_s"), ds.get("load_cold_s")), 3.0, False)
    mem = ds["memory"]
    budget = mem["host_cache_bytes"] + mem["model_bytes"] // 10
    add("peak RSS over the loop <= baseline + host cache + 10% of the model", _ratio(mem["rss_overhead"], budget), 1.0)
    out.append({"target": "RSS flat from the 2nd checkpoint on", "value": mem.get("growth_after_second"), "limit": None, "met": mem.get("flat_from_second"), "unit": "bytes"})
    return out


def format_targets(targets: list[dict]) -> list[str]:
    lines = []
    for t in targets:
        v = t["value"]
        if t.get("unit") == "bytes":
            shown = f"growth {_human(v)}" if v is not None else "-"
        else:
            shown = f"{v:.3g}x (limit {t['limit']:.3g}x)" if v is not None and t["limit"] is not None else "-"
        verdict = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        lines.append(f"  [{verdict:>7}] {t['target']}: {shown}")
    return lines


def format_run(run: dict) -> str:
    lines = []
    raw = run["raw"]
    lines.append(
        f"== {run['dir']} ({run['filesystem']}): {_human(run['state_bytes'])} in {run['tensors']} tensors; "
        f"compute phase {run['compute_idle_s'] * 1e3:.0f} ms; reps {run['reps']}; cold loads: {run['cold_loads']}"
    )
    lines.append(
        f"   raw bound: write+fsync {_fmt(raw['write_s'])} s ({_fmt(raw['write_gbps'])} GB/s), "
        f"read warm {_fmt(raw['read_warm_s'], digits=3)} s ({_fmt(raw['read_warm_gbps'])} GB/s), "
        f"read cold {_fmt(raw['read_cold_s'], digits=3)} s ({_fmt(raw['read_cold_gbps'])} GB/s)"
    )
    if raw.get("write_how"):
        lines.append(f"   (best of {len(raw['medians']['write'])} write configurations: {raw['write_how']}; "
                     f"reads into fresh memory: warm {raw.get('read_warm_how')}, cold {raw.get('read_cold_how') or '-'})")
    busy = run.get("other_processes_cores")
    if busy is not None:
        warn = "  << the machine was shared: numbers are noisy" if busy > 0.2 else ""
        lines.append(
            f"   other processes kept {busy:.2f} of {os.cpu_count()} cores busy during this run "
            f"(load average {run['loadavg_start'][0]:.1f} -> {run['loadavg_end'][0]:.1f}){warn}"
        )
    head = (
        f"{'method':<20} {'call ms':>8} {'stall ms':>9} {'vs save':>8} {'upl.wait':>8} {'train ms':>9} {'slowdn':>7} "
        f"{'durable s':>9} {'vs raw':>7} {'vs save':>7} {'load s':>7} {'vs raw':>7} {'vs load':>7} "
        f"{'cold s':>7} {'vs raw':>7} {'vs load':>7} {'peak-base':>10} {'flat':>5}"
    )
    lines.append(head)
    lines.append("-" * len(head))
    for name, m in run["methods"].items():
        if not m.get("available"):
            lines.append(f"{name:<20} n/a: {m.get('reason', '')}")
            continue
        mem = m["memory"]
        flat = mem.get("flat_from_second")
        lines.append(
            f"{name:<20} {_fmt(m.get('call_s'), 1e3, 1):>8} {_fmt(m['stall_s'], 1e3, 1):>9} {_fmt_ratio(m.get('stall_vs_dcp_save')):>8} "
            f"{_fmt(m['upload_wait_s'], 1e3, 0):>8} {_fmt(m.get('stall_with_upload_wait_s'), 1e3, 1):>9} "
            f"{_fmt_ratio(m.get('compute_slowdown')):>7} "
            f"{_fmt(m['durable_s'], digits=3):>9} {_fmt_ratio(m.get('durable_vs_raw')):>7} {_fmt_ratio(m.get('durable_vs_dcp_save')):>7} "
            f"{_fmt(m['load_warm_s'], digits=3):>7} {_fmt_ratio(m.get('load_warm_vs_raw')):>7} {_fmt_ratio(m.get('load_warm_vs_dcp_save')):>7} "
            f"{_fmt(m['load_cold_s'], digits=3):>7} {_fmt_ratio(m.get('load_cold_vs_raw')):>7} {_fmt_ratio(m.get('load_cold_vs_dcp_save')):>7} "
            f"{_human(mem['rss_overhead']):>10} {('yes' if flat else 'no') if flat is not None else '-':>5}"
        )
    targets = run.get("targets") or []
    if targets:
        lines.append("")
        lines.append("targets (datastates):")
        lines.extend(format_targets(targets))
    lines.append("")
    lines.append("memory (RSS, this process): model bytes, host cache, baseline before the first checkpoint, peak over the loop")
    for name, m in run["methods"].items():
        if not m.get("available"):
            continue
        mem = m["memory"]
        extra = f", writer process peak {_human(mem['children_rss_peak'])}" if mem.get("children_rss_peak") else ""
        checks = m.get("load_checks")
        checked = f" ({checks - m.get('load_checks_failed', 0)} of {checks} loads)" if checks else ""
        lines.append(
            f"  {name:<20} model {_human(mem['model_bytes'])}, cache {_human(mem['host_cache_bytes'])}, "
            f"baseline {_human(mem['rss_baseline'])}, peak {_human(mem['rss_peak'])} (+{_human(mem['rss_overhead'])}), "
            f"growth after 2nd {_human(mem.get('growth_after_second', 0))}{extra}; first stall {m['first_stall_s'] * 1e3:.0f} ms; "
            f"load bitwise equal: {m.get('load_verified')}{checked}"
        )
        if m.get("load_warm_gc_paused_s") is not None:
            cold_part = (
                f", cold {m['load_cold_gc_paused_s']:.3f} s" if m.get("load_cold_gc_paused_s") is not None else ""
            )
            lines.append(f"  {'':<20} loads with the cyclic GC paused: warm {m['load_warm_gc_paused_s']:.3f} s{cold_part}")
        if m.get("fsync_by"):
            lines.append(
                f"  {'':<20} no fsync of its own: durable includes the bench's fsync pass over its files "
                f"({_fmt(m.get('fsync_pass_s'), digits=3)} s median)"
            )
        if m.get("step_guard"):
            lines.append(f"  {'':<20} wait before the step: {m['step_guard']}")
        if m.get("checksum_share") is not None:
            lines.append(
                f"  {'':<20} CRC32C: {m['checksum_s']:.3f} s of the flush workers' {m['flush_s']:.3f} s over all saves "
                f"({m['checksum_share']:.1%})"
            )
    return "\n".join(lines)


def format_report(report: dict) -> str:
    out = []
    for run in report["runs"]:
        out.append(format_run(run))
        out.append("")
    sc = report.get("stage_cost")
    if sc:
        out.append(
            f"stage cost, {sc['tensors']} tiny tensors: DataStatesWriter.stage() {sc['stage_s'] * 1e3:.1f} ms wall, "
            f"{sc['stage_cpu_s'] * 1e3:.1f} ms CPU ({sc['stage_us_per_tensor']:.1f} us/tensor, of which the torn-state "
            f"guard {sc.get('guard_us_per_tensor', 0):.2f} us: record {sc.get('guard_record_s', 0) * 1e3:.2f} ms + "
            f"check {sc.get('guard_check_s', 0) * 1e3:.2f} ms); with the GC paused "
            f"{sc['stage_gc_paused_s'] * 1e3:.1f} ms wall, {sc['stage_gc_paused_cpu_s'] * 1e3:.1f} ms CPU; "
            f"whole dcp.async_save call {sc['async_save_call_s'] * 1e3:.1f} ms (the same tensors as {sc['tensors']} top-level keys: "
            f"{sc['async_save_call_flat_dict_s'] * 1e3:.0f} ms); request -> durable {sc['async_save_durable_s']:.2f} s"
        )
        if "stage_plan_hits" in sc:
            out.append(
                f"  first stage() of the structure (lays it out, caches the plan) {sc['stage_samples'][0][0] * 1e3:.1f} ms; "
                f"plan cache over the stage() calls: {sc['stage_plan_hits']} hits, {sc['stage_plan_misses']} misses"
            )
        verdict = "met" if sc["stage_s"] < 0.2 else "NOT met"
        out.append(f"  [{verdict:>7}] {sc['tensors']} tiny tensors stage in under 0.2 s: {sc['stage_s']:.3f} s")
        if sc.get("profile"):
            out.append(sc["profile"])
    out.append(
        "call = time in the save call; stall = call + wait before the next optimizer step; 'vs save' columns divide by dcp.save; "
        "'vs raw' by the best raw pwrite+fsync / preadv of the same bytes (1-N threads and files, early writeback; reads into fresh memory); upl.wait = wait for the previous checkpoint "
        "at the next request (one compute phase apart); train = the training thread's time per checkpoint: call + wait before "
        "the step + wait at the next request (medians of the sums); durable = fsync'ed (the bench fsyncs for peers that do not); "
        "slowdn = idle matmul rate / the rate during the compute phase; peak-base = peak RSS "
        "minus RSS before the first checkpoint; flat = no growth from the 2nd checkpoint on."
    )
    out.append(f"page cache: {report['page_cache']}")
    return "\n".join(out)


def write_png(report: dict, path: str) -> str | None:
    """A chart of stall, durable and load per method and directory; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"matplotlib is not importable ({type(exc).__name__}: {exc}); `pip install matplotlib` to get --png"
    runs = report["runs"]
    metrics = [
        ("stall_s", "training stall per checkpoint (ms, log)", 1e3, True, None),
        ("durable_s", "request -> durable (s)", 1.0, False, "write_s"),
        ("load_warm_s", "load, warm page cache (s)", 1.0, False, "read_warm_s"),
        ("load_cold_s", "load, cold (s)", 1.0, False, "read_cold_s"),
    ]
    if not any(m.get("load_cold_s") for run in runs for m in run["methods"].values() if m.get("available")):
        metrics = metrics[:3]
    fig, axes = plt.subplots(len(runs), len(metrics), figsize=(3.6 * len(metrics), 2.9 * len(runs)), squeeze=False)
    colors = {
        "datastates": "#1f77b4",
        "dcp-save": "#7f7f7f",
        "dcp-async": "#bcbd22",
        "dcp-async-stager": "#ff7f0e",
        "datastates-planner": "#17becf",
        "dcp-async-cached": "#e377c2",
        "torch-save": "#9467bd",
        "torch-checkpointing": "#2ca02c",
        "torchsnapshot": "#d62728",
    }
    for r, run in enumerate(runs):
        names = [n for n, m in run["methods"].items() if m.get("available")]
        for c, (key, title, scale, log, raw_key) in enumerate(metrics):
            ax = axes[r][c]
            vals = [(run["methods"][n].get(key) or 0) * scale for n in names]
            ax.bar(range(len(names)), vals, color=[colors.get(n, "#333333") for n in names])
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=40, ha="right", fontsize=7)
            ax.tick_params(axis="y", labelsize=7)
            if log and any(v > 0 for v in vals):
                ax.set_yscale("log")
            if not any(v > 0 for v in vals):
                ax.set_yticks([])
                ax.text(0.5, 0.5, "n/a (tmpfs: the files are the page cache)" if run.get("filesystem") == "tmpfs" else "n/a",
                        transform=ax.transAxes, ha="center", va="center", fontsize=7)  # fmt: skip
            if raw_key and run["raw"].get(raw_key):
                ax.axhline(run["raw"][raw_key] * scale, color="red", linestyle="--", linewidth=1, label="raw bound")
                ax.legend(fontsize=6, loc="upper left")
            ax.set_title(f"{title}\n{run['dir']} ({run['filesystem']})", fontsize=8)
    fig.suptitle(
        f"dcp_datastates bench: {_human(runs[0]['state_bytes'])}, {runs[0]['tensors']} tensors, "
        f"{report['machine']['cpus']} CPUs, medians of {runs[0]['reps']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dcp-datastates bench",
        description="Checkpoint stall, durable time, load time and memory: DataStates vs DCP, torch.save, "
        "torch_checkpointing, torchsnapshot and the raw storage bound, measured side by side in one run.",
    )
    p.add_argument("--size", default="1GiB", help="total tensor bytes of the state (default 1GiB)")
    p.add_argument(
        "--tensors",
        type=int,
        default=2256,
        help="number of tensors (default 2256); unless --tiny is given, min(256, tensors // 2) are large, the rest tiny",
    )
    p.add_argument("--tiny", type=int, default=None, help="how many of --tensors are tiny (1-256 elements)")
    p.add_argument("--dtypes", default="fp32,fp32,bf16", help="dtypes the large tensors cycle through (default fp32,fp32,bf16)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the state lives (default cpu)")
    p.add_argument(
        "--dir",
        action="append",
        default=None,
        help="checkpoint directory (default /tmp/dcpds-bench); repeat to run on several, e.g. --dir /tmp/b --dir /dev/shm/b",
    )
    p.add_argument("--reps", type=int, default=5, help="repetitions per measurement; medians are reported (default 5)")
    p.add_argument("--mem-ckpts", type=int, default=10, help="back-to-back checkpoints in the training loop (default 10)")
    p.add_argument("--load-reps", type=int, default=3, help="warm loads, and cold loads, per method (default 3)")
    p.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="compute phase between a request and the next optimizer step (default 500 ms per GiB of state, 10..2000 ms)",
    )
    p.add_argument("--host-cache", default=None, help="DataStates host cache (default: the state size + 64 MiB, rounded)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)} (default: all of them), or {', '.join(PLANNER_METHODS)}")
    p.add_argument("--no-raw", action="store_true", help="skip the raw pwrite/preadv bound")
    p.add_argument(
        "--cold",
        choices=("fadvise", "drop_caches", "no"),
        default="fadvise",
        help="cold loads: evict the checkpoint's files with posix_fadvise (default; touches nothing else), "
        "drop the whole page cache (root), or warm loads only; never on tmpfs",
    )
    p.add_argument("--stage-tensors", type=int, default=20000, help="tiny tensors for the stage() cost measurement (0: skip)")
    p.add_argument("--profile", action="store_true", help="print a cProfile of DataStatesWriter.stage() on the tiny tensors")
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    p.add_argument("--png", default=None, help="write a chart (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--from-json", default=None, metavar="FILE", help="measure nothing: print the table (and --png) of an earlier --json")
    p.add_argument("--loop", action="store_true", help="a real training loop instead (benchmarks/bench_loop.py): every other "
                   "argument goes to it; its options follow")
    p.epilog = _load_sibling("bench_loop")._parser().format_help()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    return p


def _write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (0 ok, 1 failure, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--loop" in argv:
        return int(_load_sibling("bench_loop").main([a for a in argv if a != "--loop"]) or 0)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.from_json:
        try:
            with open(args.from_json) as f:
                report = json.load(f)
            print(format_report(report))
        except (OSError, ValueError, KeyError) as exc:
            print(f"dcp-datastates bench: error: --from-json {args.from_json}: {exc}", file=sys.stderr)
            return 1
        if args.png:
            why = write_png(report, args.png)
            if why:
                print(f"dcp-datastates bench: --png: {why}", file=sys.stderr)
        return 0
    from dcp_datastates.config import parse_size

    try:
        size = parse_size(args.size, name="--size")
        dtypes = parse_dtypes(args.dtypes)
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in methods if m not in METHODS + PLANNER_METHODS]
        if unknown:
            raise ValueError(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(METHODS + PLANNER_METHODS)}")
        if args.tensors < 1 or args.reps < 1 or args.mem_ckpts < 1 or args.load_reps < 1:
            raise ValueError("--tensors, --reps, --mem-ckpts and --load-reps must be at least 1")
        tiny = args.tiny if args.tiny is not None else args.tensors - min(256, max(1, args.tensors // 2))
        if not 0 <= tiny <= args.tensors:
            raise ValueError(f"--tiny must be between 0 and --tensors ({args.tensors}), got {tiny}")
        host_cache = parse_size(args.host_cache, name="--host-cache") if args.host_cache else default_host_cache(size)
    except ValueError as exc:
        print(f"dcp-datastates bench: error: {exc}", file=sys.stderr)
        return 2

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "dcp-datastates bench: error: --device cuda asked for, but CUDA is not available here "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); run without --device "
            "or on a GPU machine (see also benchmarks/gpu_bench.py)",
            file=sys.stderr,
        )
        return 2

    dirs = args.dir or ["/tmp/dcpds-bench"]
    log = (lambda *_a: None) if args.quiet else (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    compute_ms = args.compute_ms if args.compute_ms is not None else min(2000.0, max(10.0, 500.0 * size / GiB))

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.checkpoint")

    drop_note = _drop_caches() if args.cold == "drop_caches" else None
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": argv,
        "machine": _machine_info(dirs),
        "config": {
            "size": size,
            "tensors": args.tensors,
            "tiny": tiny,
            "dtypes": dtypes,
            "device": args.device,
            "reps": args.reps,
            "mem_ckpts": args.mem_ckpts,
            "compute_ms": compute_ms,
            "host_cache_request": host_cache,
            "methods": methods,
        },
        "methods_help": {m: METHOD_HELP[m] for m in methods},
        "runs": [],
    }
    in_progress: dict[str, Any] | None = None
    try:
        log(f"building the state: {_human(size)}, {args.tensors} tensors ({tiny} tiny) on {args.device}")
        spec = StateSpec(size=size, large=args.tensors - tiny, tiny=tiny, dtypes=dtypes, device=args.device)
        state, model_bytes, ntensors = build_state(spec)
        targets = empty_like_state(state)
        compute = Compute(compute_ms, args.device)
        log(f"compute phase: {compute_ms:.0f} ms of matmuls ({compute.idle_rate:.0f}/s idle)")
        missing = {name: _peer_unavailable(name) for name in methods if name in PEERS}
        cold_used: str | None = None
        for d in dirs:
            fs = _fs_type(os.path.dirname(d.rstrip("/")) or "/")
            mode = None if args.cold == "no" or fs == "tmpfs" else args.cold
            if mode == "drop_caches" and drop_note is not None:
                mode = None
            cold = _Cold(mode)
            cold_used = cold_used or mode
            run: dict[str, Any] = {
                "dir": d,
                "filesystem": fs,
                "state_bytes": model_bytes,
                "tensors": ntensors,
                "reps": args.reps,
                "compute_idle_s": compute.idle_s,
                "cold_loads": (
                    f"yes ({'checkpoint files evicted with fsync + posix_fadvise(DONTNEED)' if mode == 'fadvise' else 'echo 3 > /proc/sys/vm/drop_caches'} before each)"
                    if mode
                    else ("no: tmpfs lives in the page cache" if fs == "tmpfs" else f"no ({drop_note or '--cold no'})")
                ),
                "methods": {},
            }
            in_progress = run
            os.makedirs(d, exist_ok=True)
            meter = _CpuMeter()
            run["loadavg_start"] = os.getloadavg()
            if args.no_raw:
                run["raw"] = {"write_s": None, "read_warm_s": None, "read_cold_s": None, "write_gbps": None, "read_warm_gbps": None, "read_cold_gbps": None}
            else:
                log(f"{d}: raw bound")
                run["raw"] = measure_raw(os.path.join(d, "raw"), model_bytes, args.reps, cold)
            for name in methods:
                if missing.get(name):
                    run["methods"][name] = {"available": False, "reason": missing[name]}
                    log(f"{d}: {name} skipped: {missing[name]}")
                    continue
                if not args.no_raw:  # one more raw sample beside each method: the machine drifts
                    _merge_raw(run["raw"], measure_raw(os.path.join(d, "raw"), model_bytes, 1, cold))
                log(f"{d}: {name}")
                method = make_method(name, host_cache)
                shared = method.loads_like if run["methods"].get(method.loads_like or "", {}).get("available") else None
                try:
                    run["methods"][name] = res = run_method(
                        method, state, targets, os.path.join(d, name), args, compute, model_bytes, cold, 1 if shared else args.load_reps, bool(shared)
                    )
                    if shared:
                        base = run["methods"][shared]
                        res["load_shared_with"] = shared
                        for key in ("load_warm_s", "load_cold_s", "load_warm_samples", "load_cold_samples"):
                            res[key] = base[key]
                except Exception as exc:  # noqa: BLE001 - one method failing must not hide the others
                    run["methods"][name] = {"available": False, "reason": f"failed: {type(exc).__name__}: {exc}"}
                    log(f"{d}: {name} failed: {exc}")
                    with contextlib.suppress(Exception):
                        method.close()
            run["compute_idle_rate"] = compute.idle_rate
            add_ratios(run)
            run["targets"] = evaluate_targets(run)
            run["loadavg_end"] = os.getloadavg()
            run["other_processes_cores"] = meter.other_cores()
            report["runs"].append(run)
            in_progress = None
            shutil.rmtree(os.path.join(d, "raw"), ignore_errors=True)
        if args.stage_tensors > 0 and "datastates" in methods:
            log(f"stage cost: {args.stage_tensors} tiny tensors")
            from dcp_datastates.config import DataStatesConfig

            report["stage_cost"] = measure_stage_cost(
                dirs[0], args.stage_tensors, min(args.reps, 3), args.profile, DataStatesConfig(host_cache_size=host_cache)
            )
        report["page_cache"] = {
            "fadvise": "warm loads read right after the save (files in the page cache); cold loads after evicting "
            "the checkpoint's files (fsync + posix_fadvise DONTNEED), which leaves the rest of the machine's cache alone",
            "drop_caches": "warm loads read right after the save; cold loads after sync + echo 3 > /proc/sys/vm/drop_caches",
        }.get(cold_used or "", f"not dropped ({drop_note or 'tmpfs only, or --cold no'}): every load read from the page cache")
    except KeyboardInterrupt:
        print("dcp-datastates bench: interrupted", file=sys.stderr)
        if args.json:
            # A run cut short by its time limit (`timeout -s INT`) still leaves what it measured.
            if in_progress is not None:
                report["runs"].append({**in_progress, "interrupted": True})
            _write_json(args.json, report)
            log(f"wrote {args.json} (interrupted: the methods measured so far)")
        return 130
    except Exception as exc:  # noqa: BLE001
        print(f"dcp-datastates bench: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1

    print(format_report(report))
    status = 0
    if args.json:
        _write_json(args.json, report)
        log(f"wrote {args.json}")
    if args.png:
        why = write_png(report, args.png)
        if why:
            print(f"dcp-datastates bench: --png: {why}", file=sys.stderr)
        else:
            log(f"wrote {args.png}")
    failed = [f"{run['dir']}:{n}" for run in report["runs"] for n, m in run["methods"].items() if str(m.get("reason", "")).startswith("failed")]
    if failed:
        print(f"dcp-datastates bench: methods that failed: {', '.join(failed)}", file=sys.stderr)
        status = 1
    return status
if __name__ == "__main__":
    sys.exit(main())
