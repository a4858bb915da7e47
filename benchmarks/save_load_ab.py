"""Engine throughput of one build, for before/after comparisons of a change to the write path:
``dcp.save`` to a local folder (file jobs), ``dcp.async_save`` until the training loop gets
control back and until durable, ``dcp.load`` with checksums, and a save to fsspec's in-memory file
system (streaming jobs). Run it with each build's Python, alternating, and compare the medians.

    python benchmarks/save_load_ab.py --mib 1024 --runs 5 --dir /tmp/ab [--sync]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import uuid
import warnings

import fsspec
import torch
import torch.distributed.checkpoint as dcp

import dcp_datastates
from dcp_datastates import DataStatesReader, DataStatesWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/save_load_ab")
    ap.add_argument("--sync", action="store_true", help="fsync data files and the marker (the library's default); "
                    "without it the page cache is the end point, which isolates the engine's own work")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    per = args.mib * MiB // args.tensors // 4
    state = {f"t{i:03d}": torch.randn(per, generator=g) for i in range(args.tensors)}
    options = dict(host_cache_size=2 << 30, sync_files=args.sync)
    rows: dict[str, list[float]] = {}
    for k in range(args.runs + 1):
        folder = f"{args.dir}/{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=DataStatesWriter(folder, **options))
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(folder + "-a", **options))
        blocked = time.perf_counter() - t0
        resp.upload_completion.result()
        durable = time.perf_counter() - t0
        out = {n: torch.empty_like(v) for n, v in state.items()}
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=DataStatesReader(folder))
        load = time.perf_counter() - t0
        assert all(torch.equal(out[n], state[n]) for n in state)
        bucket = f"ab-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=DataStatesWriter(f"memory://{bucket}/c", **options))
        memory = time.perf_counter() - t0
        fsspec.filesystem("memory").rm(f"/{bucket}", recursive=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(folder + "-a", ignore_errors=True)
        if k:  # the first round warms up the engine and the page cache
            for n, v in (("save_s", save), ("async_blocked_s", blocked), ("async_durable_s", durable),
                         ("load_s", load), ("memory_save_s", memory)):
                rows.setdefault(n, []).append(v)
    med = {n: round(statistics.median(v), 4) for n, v in rows.items()}
    print(json.dumps({"build": dcp_datastates.__file__, "mib": args.mib, "median": med}))


if __name__ == "__main__":
    main()
