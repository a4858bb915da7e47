"""Load cost only: dcp.load of one saved checkpoint with DataStatesReader, warm and cold,
with and without verification, at several read_threads; medians of --reps.

    python benchmarks/load_cost.py --dir /dev/shm/lc --dir /tmp/lc --threads 1,2,4 --reps 5

The checkpoint is written once per directory (bench.build_state, 1 GiB / 2,256 tensors by
default) unless it is there already (--keep reuses it across runs, e.g. to A/B two builds).
Cold loads evict the checkpoint's files first (fsync + posix_fadvise DONTNEED); not on tmpfs.
"""
import argparse
import gc
import json
import os
import statistics
import time

import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter

from bench import StateSpec, _evict, _fs_type, build_state, empty_like_state, states_equal


def _save(path: str, state: dict) -> None:
    if not os.path.exists(os.path.join(path, ".metadata")):
        dcp.save(state, storage_writer=DataStatesWriter(path, host_cache_size=(1 << 30) + (64 << 20)))


def _load_once(path: str, target: dict, cold: bool, **opts) -> tuple[float, float]:
    """Wall and CPU seconds (all threads of this process) of one load."""
    if cold:
        _evict(path)
    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    dcp.load(target, storage_reader=DataStatesReader(path, **opts))
    return time.perf_counter() - t, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", action="append", required=True)
    ap.add_argument("--threads", default="4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--size", type=int, default=1 << 30)
    ap.add_argument("--no-verify", action="store_true", help="also time verify=False")
    ap.add_argument("--json")
    args = ap.parse_args()
    state, _, _ = build_state(StateSpec(size=args.size, large=256, tiny=2000, dtypes=["float32", "float32", "bfloat16"], device="cpu"))
    target = empty_like_state(state)
    out = {"uptime": os.getloadavg()}
    for root in args.dir:
        path = os.path.join(root, "ckpt")
        _save(path, state)
        colds = [False] if _fs_type(root) == "tmpfs" else [False, True]
        for threads in [int(t) for t in args.threads.split(",")]:
            for verify in [True, False] if args.no_verify else [True]:
                for cold in colds:
                    runs = [_load_once(path, target, cold, read_threads=threads, verify=verify) for _ in range(args.reps)]
                    times, cpu = [r[0] for r in runs], [r[1] for r in runs]
                    key = f"{root} threads={threads} verify={verify} {'cold' if cold else 'warm'}"
                    out[key] = {"wall": statistics.median(times), "cpu": statistics.median(cpu)}
                    print(
                        f"{key}: median {out[key]['wall']:.3f} s (min {min(times):.3f}, max {max(times):.3f}), "
                        f"CPU {out[key]['cpu']:.3f} s",
                        flush=True,
                    )
        assert states_equal(state, target), "loaded state differs from the saved one"
    out["uptime_end"] = os.getloadavg()
    print("load average", out["uptime"], "->", out["uptime_end"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
