"""Issue 26's scale table: how DataStates' costs grow with the number of tensors and the bytes.

For every (tensors, size) pair: the call of ``dcp.async_save`` (the training thread's time in it),
the Python work the save runs off the training thread (user CPU of every other Python thread: an
upper bound of the GIL they hold, see gil_time.py), full collections of the cyclic GC, time to
durable (request -> ``upload_completion``, fsync'ed), and a warm load (into preallocated tensors,
every one compared bitwise). Medians of ``--saves`` saves after one warm-up save, each durable
before the next; the per-tensor columns divide the non-data part by the tensor count.

    python scripts/scale_table.py [--tensors 100,1612,10000,20000] [--sizes 256MiB,1GiB,4GiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.config import parse_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gil_time import PythonThreadsCpu  # noqa: E402 - a sibling script


def _state(tensors: int, nbytes: int) -> dict:
    per = max(1, nbytes // 4 // tensors)
    return {"model": {f"layers.{i // 8}.w{i % 8}": torch.full((per,), float(i)) for i in range(tensors)}, "step": 1}


def measure(tensors: int, nbytes: int, saves: int, root: str) -> dict:
    state = _state(tensors, nbytes)
    calls, durables, cpus, fulls = [], [], [], []
    n_full = [0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            n_full[0] += 1

    path = None
    for k in range(saves + 1):
        path = os.path.join(root, f"ckpt-{k}")
        n_full[0] = 0
        gc.callbacks.append(on_gc)
        try:
            with PythonThreadsCpu() as meter:
                t0 = time.perf_counter()
                resp = dcp.async_save(state, storage_writer=DataStatesWriter(path))
                t1 = time.perf_counter()
                resp.upload_completion.result()
                t2 = time.perf_counter()
                del resp
                time.sleep(0.3)  # the save's pause of the GC ends 0.25 s after the commit
        finally:
            gc.callbacks.remove(on_gc)
        if k:
            calls.append(t1 - t0)
            durables.append(t2 - t0)
            cpus.append(meter.seconds)
            fulls.append(n_full[0])
        if k < saves:
            shutil.rmtree(path, ignore_errors=True)
    dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": None}
    loads = []
    for _ in range(3):
        for t in dest["model"].values():
            t.zero_()
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=DataStatesReader(path))
        loads.append(time.perf_counter() - t0)
        assert all(torch.equal(dest["model"][k], v) for k, v in state["model"].items()), "load differs"
    shutil.rmtree(path, ignore_errors=True)
    return {
        "tensors": tensors, "bytes": nbytes,
        "call_s": statistics.median(calls), "durable_s": statistics.median(durables),
        "background_python_cpu_s": statistics.median(cpus), "full_gcs": statistics.median(fulls),
        "load_warm_s": statistics.median(loads),
        "samples": {"call": calls, "durable": durables, "cpu": cpus, "load": loads},
    }


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", default="100,1612,10000,20000")
    p.add_argument("--sizes", default="256MiB,1GiB,4GiB")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--dir", default="/tmp/dcpds-scale")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = []
    root = tempfile.mkdtemp(prefix="scale_", dir=os.makedirs(args.dir, exist_ok=True) or args.dir)
    print(f"{'tensors':>8} {'size':>7} {'call ms':>8} {'us/tensor':>9} {'bg CPU ms':>10} {'full GCs':>8} "
          f"{'durable s':>9} {'GB/s':>6} {'load s':>7} {'GB/s':>6}", flush=True)
    try:
        for size in args.sizes.split(","):
            nbytes = parse_size(size)
            for tensors in (int(t) for t in args.tensors.split(",")):
                r = measure(tensors, nbytes, args.saves, root)
                r["size"] = size
                rows.append(r)
                print(f"{tensors:>8} {size:>7} {r['call_s'] * 1e3:>8.1f} {r['call_s'] / tensors * 1e6:>9.2f} "
                      f"{r['background_python_cpu_s'] * 1e3:>10.0f} {r['full_gcs']:>8.0f} {r['durable_s']:>9.3f} "
                      f"{nbytes / r['durable_s'] / 1e9:>6.2f} {r['load_warm_s']:>7.3f} {nbytes / r['load_warm_s'] / 1e9:>6.2f}",
                      flush=True)
                gc.collect()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "saves": args.saves, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
