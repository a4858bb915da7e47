#!/usr/bin/env python
"""Cost of decoding non-tensor values with the restricted unpickler on load (docs/security.md).

    python benchmarks/measure_value_decode.py [--values 2000] [--repeat 5]

Saves a checkpoint holding N small non-tensor values (what a flattened optimizer's param_groups,
lr schedulers and train state look like) plus a few large BytesIO values, then times dcp.load of
only those values: trusted (stock DCP: one unrestricted decode), the default with DCP's planner
(restricted check, then DCP's own decode) and the default with DataStatesLoadPlanner (one
restricted decode). Prints the best of --repeat runs of each.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
import warnings

import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesWriter


def state(n: int) -> dict:
    small = {f"v{i}": {"lr": 1e-3 * i, "betas": (0.9, 0.95), "eps": 1e-8, "params": list(range(8)), "foreach": None}
             for i in range(n)}
    big = {f"blob{i}": io.BytesIO(bytes(4 << 20)) for i in range(4)}
    return {"small": small, "big": big}


def empty(n: int) -> dict:
    return {"small": {f"v{i}": {k: None for k in ("lr", "betas", "eps", "params", "foreach")} for i in range(n)},
            "big": {f"blob{i}": None for i in range(4)}}


def timed(path: str, n: int, repeat: int, planner, trusted: bool) -> float:
    best = float("inf")
    for _ in range(repeat):
        dest = empty(n)
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=DataStatesReader(path, trusted=trusted),
                 planner=planner() if planner else None, no_dist=True)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", type=int, default=2000, help="small values (each a dict of 5 flattened into 5 items)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as d:
        dcp.save(state(args.values), storage_writer=DataStatesWriter(d), no_dist=True)
        items = args.values * 5 + 4
        print(f"{items} non-tensor items ({args.values * 5} small, 4 x 4 MiB BytesIO), best of {args.repeat}:")
        timed(d, args.values, 1, None, True)  # warm-up
        base = None
        for label, planner, trusted in (
            ("trusted=True, DCP planner (stock DCP behaviour)", None, True),
            ("default, DCP planner (restricted check + DCP decode)", None, False),
            ("trusted=True, DataStatesLoadPlanner", DataStatesLoadPlanner, True),
            ("default, DataStatesLoadPlanner (one restricted decode)", DataStatesLoadPlanner, False),
        ):
            t = timed(d, args.values, args.repeat, planner, trusted)
            base = base or t
            print(f"  {label:58s} {t * 1e3:8.1f} ms  ({t / base:4.2f}x, {t / items * 1e6:6.1f} us/item)")


if __name__ == "__main__":
    main()
