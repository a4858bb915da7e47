"""Time to durable of lazy saves into ONE folder, each replacing the last (the "latest"
checkpoint pattern), against saves into a new folder each time; a pause between saves stands for
the training steps between checkpoints. Each replacing save's commit frees the replaced data
files; this measures whether ``upload_completion`` waits for that.

    python benchmarks/overwrite_folder.py --dir /tmp/owb --saves 5 --pause 3 [--json out.json]

State: bench.build_state (1 GiB in 2,256 tensors by default). Prints each save's seconds from
the ``async_save`` call to ``upload_completion``, and the medians (the first save of each series,
into an empty folder, is left out of the median).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter
from dcp_datastates.config import parse_size

from bench import StateSpec, build_state


def _series(state: dict, folder_of, saves: int, pause: float) -> list[float]:
    out = []
    for i in range(saves):
        t = time.perf_counter()
        dcp.async_save(state, storage_writer=DataStatesWriter(folder_of(i))).upload_completion.result()
        out.append(time.perf_counter() - t)
        time.sleep(pause)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--tensors", type=int, default=2256)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--pause", type=float, default=3.0, help="seconds between saves")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    large = min(256, args.tensors)
    state, nbytes, count = build_state(StateSpec(parse_size(args.size, name="--size"), large, args.tensors - large,
                                                 ["float32", "float32", "bfloat16"], "cpu"))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    series = {
        "one folder, replaced": _series(state, lambda i: os.path.join(args.dir, "latest"), args.saves, args.pause),
        "a new folder each": _series(state, lambda i: os.path.join(args.dir, f"step-{i}"), args.saves, args.pause),
    }
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"{nbytes / 2**20:.0f} MiB in {count} tensors, {args.saves} saves {args.pause} s apart, into {args.dir}")
    for name, secs in series.items():
        print(f"  {name:22s} " + " ".join(f"{s:.3f}" for s in secs) + f"   median (2nd on) {statistics.median(secs[1:]):.3f} s")
    report = {"bytes": nbytes, "tensors": count, "pause_s": args.pause, "seconds": series}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
