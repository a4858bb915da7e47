"""How much Python work a save runs off the training thread, per save: the user-mode CPU time of
every Python thread except the caller's (DCP's save thread, our watchers, folder and drain
threads; the engine's C++ threads are not Python threads and are left out), and the full
(generation 2) collections of the cyclic GC, on any thread.

Python threads run bytecode only while holding the GIL, so their user CPU is an upper bound of the
GIL they hold (it also counts C code that runs with the GIL released, such as a CRC32C); kernel
time (writes, fsync) is left out. Every method saves the same state, in this process, back to back
(each save durable before the next), medians over ``--saves``:

* ``datastates``: ``dcp.async_save`` + DataStatesWriter;
* ``dcp-async``: ``dcp.async_save`` + FileSystemWriter (DCP's default staging);
* ``dcp-async-stager``: the same with ``DefaultStager`` (a staging thread).

    python scripts/gil_time.py [--tensors 1612] [--mib 256] [--saves 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter

_TICK = os.sysconf("SC_CLK_TCK")


def _utime(tid: int) -> float | None:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) / _TICK  # utime (field 14 of stat; 12th after the name)


class PythonThreadsCpu:
    """Samples the user CPU of every Python thread but the caller's every few milliseconds (threads
    come and go: DCP makes an executor per save); the total is the sum of each thread's last value
    less its value when first seen (or at the start)."""

    def __init__(self, interval: float = 0.003) -> None:
        self.interval = interval
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._stop = threading.Event()
        self._me = threading.get_native_id()

    def _sample(self) -> None:
        for t in threading.enumerate():
            tid = t.native_id
            if tid is None or tid in (self._me, self._sampler_id):
                continue
            u = _utime(tid)
            if u is None:
                continue
            self.first.setdefault(tid, u)
            self.last[tid] = u

    def _run(self) -> None:
        self._sampler_id = threading.get_native_id()
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> "PythonThreadsCpu":
        self._sampler_id = -1
        self._sample()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join()
        self._sample()

    @property
    def seconds(self) -> float:
        return sum(self.last[t] - self.first[t] for t in self.last)


def _state(tensors: int, mib: int) -> dict:
    per = max(1, (mib << 20) // 4 // tensors)
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layers.{i // 8}.w{i % 8}": torch.randn(per, generator=g) for i in range(tensors)}, "step": 1}


def _save(method: str, state: dict, path: str):
    if method == "datastates":
        return dcp.async_save(state, storage_writer=DataStatesWriter(path))
    from torch.distributed.checkpoint import FileSystemWriter

    if method == "dcp-async":
        return dcp.async_save(state, storage_writer=FileSystemWriter(path))
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from dcp_datastates.compat import default_stager_reusable

    if "stager" not in _stagers or not default_stager_reusable():  # reused, as the bench does
        _stagers["stager"] = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                          use_async_staging=True, use_non_blocking_copy=False))
    return dcp.async_save(state, storage_writer=FileSystemWriter(path), async_stager=_stagers["stager"])


_stagers: dict = {}


def _wait(resp) -> None:
    fut = getattr(resp, "upload_completion", resp)
    fut.result()


def measure(method: str, state: dict, root: str, saves: int) -> dict:
    full: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                full.append(time.perf_counter() - started[0])

    cpu, collections, durable = [], [], []
    for k in range(saves + 1):  # the first save warms up (engine, caches, imports)
        path = os.path.join(root, f"{method}-{k}")
        full.clear()
        gc.callbacks.append(on_gc)
        try:
            with PythonThreadsCpu() as meter:
                t0 = time.perf_counter()
                _wait(_save(method, state, path))
                took = time.perf_counter() - t0
                time.sleep(0.3)  # what the save leaves to run after it resolved (GC pause end, cleanup)
        finally:
            gc.callbacks.remove(on_gc)
        shutil.rmtree(path, ignore_errors=True)
        if k:
            cpu.append(meter.seconds)
            collections.append((len(full), sum(full)))
            durable.append(took)
    return {
        "background_python_user_cpu_s": statistics.median(cpu),
        "samples": cpu,
        "full_collections_per_save": statistics.median(c for c, _ in collections),
        "full_collection_s_per_save": statistics.median(s for _, s in collections),
        "durable_s": statistics.median(durable),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=1612)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--saves", type=int, default=7)
    p.add_argument("--methods", default="datastates,dcp-async,dcp-async-stager")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    state = _state(args.tensors, args.mib)
    root = args.dir or tempfile.mkdtemp(prefix="gil_time_")
    report = {"tensors": args.tensors, "mib": args.mib, "saves": args.saves, "cpus": os.cpu_count(), "methods": {}}
    print(f"{args.tensors} tensors, {args.mib} MiB; medians of {args.saves} saves, each durable before the next")
    print(f"{'method':<18} {'bg Python user CPU ms':>22} {'full GCs':>9} {'full GC ms':>11} {'durable s':>10}")
    for method in args.methods.split(","):
        r = report["methods"][method] = measure(method, state, root, args.saves)
        print(f"{method:<18} {r['background_python_user_cpu_s'] * 1e3:>22.0f} {r['full_collections_per_save']:>9.0f} "
              f"{r['full_collection_s_per_save'] * 1e3:>11.0f} {r['durable_s']:>10.2f}")
    shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
