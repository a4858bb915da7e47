"""Incremental saves against full saves: bytes written and time per save at 0 / 50 / 95 % of the
state frozen, the cost of hashing, and the load time of an incremental checkpoint against a full
one of the same state.

The state is ``--mib`` MiB of fp32 tensors (``--tensors`` of them); a fraction of them is frozen
(never changes), the others change before every save (one in-place ``add_``, outside the timed
part). Each configuration saves into a root of its own: one first save (full for both modes: the
incremental one has no base yet), then ``--runs`` timed saves, each ``dcp.async_save`` then
``upload_completion`` (durable: fsync'ed data files, then the commit). Reported per save, medians:
the call (training thread), time to durable (and its maximum: the saves that hash every tensor,
see docs/how-it-works.md, "Incremental saves"), bytes of data files the save wrote itself. Then the
newest checkpoint is loaded ``--runs`` times (page cache dropped where the machine allows it, else
warm, as printed), bitwise checked.

    python benchmarks/bench_incremental.py --mib 512 --tensors 64 --runs 9 --dir /tmp/dcpds-inc
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.native import engine_module

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MiB = 1 << 20


def make_state(mib: int, count: int) -> dict[str, torch.Tensor]:
    per = mib * MiB // count // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(count)}


def own_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_mode(state, frozen_names, root, incremental: bool, runs: int, cache: int) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    changing = [t for n, t in state.items() if n not in frozen_names]
    calls, durables, written = [], [], []
    for step in range(runs + 1):
        for t in changing:
            t.add_(1.0)
        path = os.path.join(root, f"step-{step}")
        writer = DataStatesWriter(path, incremental=incremental, host_cache_size=cache)
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=writer)
        t1 = time.perf_counter()
        resp.upload_completion.result()
        t2 = time.perf_counter()
        if step:  # the first save has no base: full in both modes
            calls.append((t1 - t0) * 1e3)
            durables.append(t2 - t0)
            written.append(own_bytes(path))
    last = os.path.join(root, f"step-{runs}")
    loads, cold = [], True
    for _ in range(runs):
        out = {n: torch.empty_like(t) for n, t in state.items()}
        cold = drop_caches() and cold
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=DataStatesReader(last))
        loads.append(time.perf_counter() - t0)
        assert all(torch.equal(out[n], state[n]) for n in state), "load differs from the saved state"
    return {"call_ms": statistics.median(calls), "durable_s": statistics.median(durables), "durable_max_s": max(durables),
            "written_mib": statistics.median(written) / MiB, "load_s": statistics.median(loads), "cold_load": cold}


def hash_cost(mib: int) -> float:
    """Seconds per GiB of XXH64 over host memory (one thread, as each held file hashes)."""
    t = torch.randint(0, 255, (mib * MiB,), dtype=torch.uint8)
    engine = engine_module()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        engine.hash64_segments([[(t.data_ptr(), t.numel())]])
        best = min(best, time.perf_counter() - t0)
    return best * (1 << 30) / (mib * MiB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/dcpds-inc")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cache = 3 * args.mib * MiB  # the held bytes (the whole state) fit in half of it
    state = make_state(args.mib, args.tensors)
    names = list(state)
    rows = []
    for frozen in (0.0, 0.5, 0.95):
        frozen_names = set(names[: round(frozen * len(names))])
        for incremental in (False, True):
            r = run_mode(state, frozen_names, os.path.join(args.dir, f"f{int(frozen * 100)}-{int(incremental)}"),
                         incremental, args.runs, cache)
            r.update(frozen=frozen, mode="incremental" if incremental else "full")
            rows.append(r)
            print(f"frozen {frozen:4.0%}  {r['mode']:<11}  call {r['call_ms']:7.1f} ms  durable {r['durable_s']:6.3f} s  "
                  f"(max {r['durable_max_s']:6.3f} s)  written {r['written_mib']:7.1f} MiB  load {r['load_s']:6.3f} s{'' if r['cold_load'] else ' (warm)'}",
                  flush=True)
    per_gib = hash_cost(min(1024, args.mib))
    print(f"XXH64 over host memory: {per_gib:.3f} s per GiB (one thread)")
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/bench_incremental.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "json"),
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                "date": time.strftime("%Y-%m-%d"), "rows": rows, "hash_s_per_gib": per_gib}, f, indent=1)


if __name__ == "__main__":
    main()
