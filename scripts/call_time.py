"""Time of the ``dcp.async_save`` call on the training thread, steady state (engine started, plan
cached): wall and the calling thread's CPU time per call, medians.

    python scripts/call_time.py [--tensors 1612] [--mib 1024] [--calls 7] [--profile]

The state is ``--mib`` MiB of fp32 in ``--tensors`` tensors nested under ``model`` (as a model's
state dict is), plus one non-tensor value. Each checkpoint is waited for and deleted before the
next call, so every call sees an idle engine. ``--profile`` prints a cProfile of one more call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=1612)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--calls", type=int, default=7)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    per = args.mib * (1 << 20) // args.tensors // 4
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layers.{i // 8}.w{i % 8}": torch.randn(per, generator=g) for i in range(args.tensors)},
             "step": 3}
    root = tempfile.mkdtemp(prefix="call_time_")
    try:
        def one(name: str) -> tuple[float, float]:
            writer = DataStatesWriter(f"{root}/{name}")
            t0, c0 = time.perf_counter(), time.thread_time()
            resp = dcp.async_save(state, storage_writer=writer)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            resp.upload_completion.result()
            shutil.rmtree(f"{root}/{name}")
            return wall * 1e3, cpu * 1e3

        for k in range(3):  # engine started, plan cached
            one(f"warm-{k}")
        samples = [one(f"c-{k}") for k in range(args.calls)]
        walls, cpus = [w for w, _ in samples], [c for _, c in samples]
        out = {"tensors": args.tensors, "mib": args.mib, "wall_ms": [round(w, 2) for w in walls],
               "wall_ms_median": round(statistics.median(walls), 2), "cpu_ms_median": round(statistics.median(cpus), 2)}
        print(out)
        if args.profile:
            prof = cProfile.Profile()
            writer = DataStatesWriter(f"{root}/profiled")
            prof.enable()
            resp = dcp.async_save(state, storage_writer=writer)
            prof.disable()
            resp.upload_completion.result()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
