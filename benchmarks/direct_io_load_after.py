"""What ``direct_io=True`` costs a single save and a load right after it: ``--mib`` MiB in 64 fp32
tensors saved with ``dcp.async_save`` until durable, then loaded at once with ``dcp.load``, with
``direct_io`` off and on, interleaved; medians of ``--rounds``. Every load is compared bitwise.

    python benchmarks/direct_io_load_after.py [--mib 512] [--rounds 4] [--dir /tmp/dcpds-direct-io] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--dir", default="/tmp/dcpds-direct-io")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.manual_seed(0)
    per = args.mib * (1 << 20) // 4 // 64
    state = {f"t{i}": torch.randn(per) for i in range(64)}
    runs: dict[str, dict[str, list[float]]] = {m: {"save_s": [], "load_s": []} for m in ("off", "on")}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            path = f"{args.dir}/{mode}"
            shutil.rmtree(path, ignore_errors=True)
            t = time.perf_counter()
            writer = DataStatesWriter(path, direct_io=mode == "on")
            dcp.async_save(state, storage_writer=writer).upload_completion.result()
            runs[mode]["save_s"].append(time.perf_counter() - t)
            out = {k: torch.empty_like(v) for k, v in state.items()}
            t = time.perf_counter()
            dcp.load(out, storage_reader=DataStatesReader(path))
            runs[mode]["load_s"].append(time.perf_counter() - t)
            if not all(torch.equal(out[k], v) for k, v in state.items()):
                raise AssertionError(f"{path}: the load differs from the state saved (direct_io {mode})")
    shutil.rmtree(args.dir, ignore_errors=True)
    report = {"mib": args.mib, "rounds": args.rounds, "runs": runs,
              "medians": {m: {k: statistics.median(v) for k, v in d.items()} for m, d in runs.items()}}
    for mode, med in report["medians"].items():
        print(f"direct_io {mode}: save to durable {med['save_s']:.3f} s, load right after {med['load_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
