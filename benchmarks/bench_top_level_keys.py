"""What a state dict with many top-level keys costs in dcp.async_save, against the same tensors
passed nested under one key (as trainers do: {"model": ..., "optim": ...}).

DCP wraps every top-level value of the state dict in its own per-key logging context inside
async_save; that cost is paid on the training thread, whatever the storage writer.

    python benchmarks/bench_top_level_keys.py [--keys 1612] [--reps 7]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import DataStatesWriter


def call_ms(state: dict, make_writer, root: str, reps: int) -> float:
    """Median time of the dcp.async_save call itself (what the training thread pays), in ms."""
    times = []
    for i in range(reps + 1):  # one warm-up
        path = os.path.join(root, f"c{i}")
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=make_writer(path))
        dt = time.perf_counter() - t0
        fut = getattr(resp, "upload_completion", resp)
        fut.result()
        shutil.rmtree(path, ignore_errors=True)
        if i:
            times.append(dt)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=1612)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process
    logging.getLogger("dcp_datastates").setLevel(logging.WARNING)
    flat = {f"layer{i}.weight": torch.randn(64) for i in range(args.keys)}
    nested = {"model": flat}
    root = tempfile.mkdtemp(prefix="dcpds-keys-")
    try:
        rows = []
        for name, make in (("DataStatesWriter", lambda p: DataStatesWriter(p, sync_files=False)),
                           ("FileSystemWriter (DefaultStager)", lambda p: FileSystemWriter(p, sync_files=False))):
            top = call_ms(flat, make, root, args.reps)
            one = call_ms(nested, make, root, args.reps)
            rows.append((name, top, one))
        print(f"dcp.async_save call, {args.keys} tensors of 64 floats, median of {args.reps} (ms):")
        print(f"{'writer':<34} {'top-level keys':>15} {'nested':>8} {'difference':>11}")
        for name, top, one in rows:
            print(f"{name:<34} {top:>15.1f} {one:>8.1f} {top - one:>11.1f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
