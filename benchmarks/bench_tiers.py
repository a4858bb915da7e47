"""Multi-level checkpoints: time to the local commit and to the durable commit, against the
single-tier writer, DCP and torch.save writing straight to the same slow durable storage; and
restart (load) time from each tier.

The durable tier is a throttled directory: an fsspec file system (protocol ``slowfile://``) over
a local folder whose reads and writes are served by one simulated device of ``--durable-mbps``
MB/s shared by every file (each transfer books its turn on the device and lasts at least
bytes/bandwidth; ranged reads go through the same file objects), standing for a contended
parallel file system or object store. The local tier
is ``--local-dir`` (default /dev/shm, memory-backed: the speed of a node-local NVMe or tmpfs).
Everyone writes the durable tier through the same file system, DCP through its FsspecWriter.

One process, one rank. Each round runs every method once, in turn; the medians of ``--runs``
rounds (after one warm-up round) are printed, and written as JSON with ``--json``.

    python benchmarks/bench_tiers.py --mib 512 --runs 3 --durable-mbps 200 [--follow-from first-chunk]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.tiers import local_tier as tiers

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1 << 20


class _Device:
    """One simulated storage device: transfers are served one after another at ``bandwidth``."""

    bandwidth = 200e6  # bytes/s, set from --durable-mbps
    _lock = threading.Lock()
    _free_at = 0.0

    @classmethod
    def reserve(cls, nbytes: int) -> float:
        """Book the device for ``nbytes``: the time the transfer ends."""
        with cls._lock:
            start = max(time.monotonic(), cls._free_at)
            cls._free_at = start + nbytes / cls.bandwidth
            return cls._free_at

    @staticmethod
    def wait(done: float) -> None:
        time.sleep(max(0.0, done - time.monotonic()))


class _Throttled:
    """A file object whose reads and writes go through the simulated device."""

    def __init__(self, f) -> None:
        self._f = f

    # The device is booked first and the real I/O runs meanwhile: a call takes the longer of the
    # two, as on a real device of that bandwidth.
    def write(self, data) -> int:
        done = _Device.reserve(len(memoryview(data).cast("B")))
        n = self._f.write(data)
        _Device.wait(done)
        return n

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        _Device.wait(_Device.reserve(len(data)))
        return data

    def readinto(self, b) -> int:
        n = self._f.readinto(b)
        _Device.wait(_Device.reserve(n or 0))
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


class SlowFileSystem(LocalFileSystem):
    protocol = "slowfile"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("slowfile://"):
            path = path[len("slowfile://"):]
        return LocalFileSystem._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        return _Throttled(super()._open(path, mode, **kwargs))



fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)


def make_state(total_mib: int, count: int) -> dict:
    g = torch.Generator().manual_seed(0)
    per = total_mib * MiB // count // 4
    return {f"layer{i:03d}.weight": torch.randn(per, generator=g) for i in range(count)}


def zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _timed_async(state, writer, planner=None) -> tuple[float, float, float | None, float]:
    """(training blocked, staged, local commit, durable commit) seconds of one async save;
    "staged": its ``staging_completion`` (the state may change from then on: a training loop's
    next ``optimizer.step()`` waits until then)."""
    local = getattr(writer, "local_commit", None)
    t0 = time.perf_counter()
    marks = {}
    if local is not None:
        local.add_done_callback(lambda f: marks.setdefault("local", time.perf_counter()))
    resp = dcp.async_save(state, storage_writer=writer)
    blocked = time.perf_counter() - t0
    staging = getattr(resp, "staging_completion", None)
    if staging is not None:
        staging.add_done_callback(lambda f: marks.setdefault("staged", time.perf_counter()))
    fut = getattr(resp, "upload_completion", resp)
    fut.result()
    durable = time.perf_counter() - t0
    staged = marks.get("staged", t0 + blocked) - t0
    return blocked, staged, (marks["local"] - t0 if "local" in marks else None), durable


def one_round(state: dict, root: str, local_tier: str, k: int) -> dict:
    slow = f"slowfile://{root}"
    out: dict[str, float] = {}
    # (a) two tiers: local commit, then drained to the slow durable tier
    w = DataStatesWriter(f"{slow}/tiered/step-{k}", local_tier=local_tier, keep_local=1)
    (out["tiered.blocked"], out["tiered.staged"], out["tiered.local_commit"],
     out["tiered.durable_commit"]) = _timed_async(state, w)
    # (b) our single-tier writer straight to the durable tier
    out["single.blocked"], out["single.staged"], _, out["single.durable_commit"] = _timed_async(
        state, DataStatesWriter(f"{slow}/single/step-{k}"))
    # (c) DCP, synchronous, FsspecWriter to the durable tier
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=FsspecWriter(f"{slow}/dcp/step-{k}", sync_files=False))
    out["dcp_save.durable_commit"] = time.perf_counter() - t0
    # (d) DCP async_save (its default stager: a full host copy first), FsspecWriter
    out["dcp_async.blocked"], out["dcp_async.staged"], _, out["dcp_async.durable_commit"] = _timed_async(
        state, FsspecWriter(f"{slow}/dcp_async/step-{k}", sync_files=False))
    # (e) torch.save to the durable tier
    fs = SlowFileSystem()
    fs.makedirs(f"{root}/torch_save", exist_ok=True)
    t0 = time.perf_counter()
    with fs.open(f"{root}/torch_save/step-{k}.pt", "wb") as f:
        torch.save(state, f)
    out["torch_save.durable_commit"] = time.perf_counter() - t0
    # Restarts: from the local tier, from the durable tier, DCP from the durable tier.
    for name, reader in (
        ("load.local_tier", DataStatesReader(f"{slow}/tiered/step-{k}", local_tier=local_tier)),
        ("load.durable_tier", DataStatesReader(f"{slow}/tiered/step-{k}")),
        ("load.dcp_durable", FsspecReader(f"{slow}/dcp/step-{k}")),
    ):
        target = zeros_like(state)
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=reader)
        out[name] = time.perf_counter() - t0
        assert all(torch.equal(target[n], state[n]) for n in state), name
    # Free the space; the local copy goes with its durable copy (else the next save's drain_pending
    # would find it undrained and drain it again, inside the timing).
    shutil.rmtree(tiers.local_copy(local_tier, f"{slow}/tiered/step-{k}"), ignore_errors=True)
    for sub in ("tiered", "single", "dcp", "dcp_async"):
        shutil.rmtree(os.path.join(root, sub, f"step-{k}"), ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="state size in MiB")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--durable-mbps", type=float, default=200.0, help="bandwidth of the durable tier, MB/s")
    ap.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--durable-dir", default=None, help="folder under the throttled durable tier (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--follow-from", choices=("auto", "first-chunk", "staged"), default="auto",
                    help="when one process's copies to the durable tier start reading: auto (first chunk where "
                         "the machine has cores to spare, else the end of staging: tiers/layered.py), or forced")
    args = ap.parse_args()
    if args.follow_from != "auto":
        from dcp_datastates.tiers import layered

        layered._cores_to_spare = lambda config: args.follow_from == "first-chunk"
    _Device.bandwidth = args.durable_mbps * 1e6
    state = make_state(args.mib, args.tensors)
    root = tempfile.mkdtemp(prefix="bench_tiers_durable_", dir=args.durable_dir)
    local_tier = tempfile.mkdtemp(prefix="bench_tiers_local_", dir=args.local_dir)
    rows: dict[str, list[float]] = {}
    try:
        for k in range(args.runs + 1):
            result = one_round(state, root, local_tier, k)
            if k == 0:
                continue  # warm-up: engine start, first-structure planning
            for name, v in result.items():
                rows.setdefault(name, []).append(v)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(local_tier, ignore_errors=True)
    med = {n: statistics.median(v) for n, v in rows.items()}
    ideal = args.mib * MiB / _Device.bandwidth
    print(f"state {args.mib} MiB in {args.tensors} tensors; durable tier {args.durable_mbps:g} MB/s "
          f"(one full write: {ideal:.2f} s); local tier {args.local_dir}; medians of {args.runs} runs")
    base = med["dcp_save.durable_commit"]
    for n, v in med.items():
        print(f"  {n:28s} {v:8.3f} s   {v / base:6.2f} x DCP save")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_s": med, "runs_s": rows}, f, indent=1)


if __name__ == "__main__":
    main()
