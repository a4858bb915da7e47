"""Save and load latency on object storage: DataStatesWriter/Reader against DCP's FsspecWriter/
FsspecReader, on an S3 API (a moto server in its own process on 127.0.0.1, s3fs as the client)
and on fsspec's in-memory file system, in the same run.

One process, one rank. The state is ``--mib`` MiB in ``--tensors`` float32/bfloat16 tensors of
mixed sizes. Each round, for each backend:

  save         dcp.save wall time (returns once the objects and the commit marker are stored)
  async-block  dcp.async_save: time until it returns control to the training loop
  async-total  dcp.async_save: until upload_completion resolves
  load         dcp.load into preallocated tensors (checksums verified for datastates)

Rounds alternate the backends; medians over ``--runs`` rounds (plus one warm-up round) are
printed, and written as JSON with ``--json``.

    python benchmarks/bench_remote.py --mib 256 --tensors 320 --runs 3 --stores s3 memory
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from dcp_datastates import DataStatesReader, DataStatesWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
logging.getLogger("werkzeug").setLevel(logging.ERROR)

MiB = 1 << 20


def make_state(total_mib: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` tensors totalling ``total_mib`` MiB: a quarter of them 4x larger than the rest,
    every fifth one bfloat16."""
    g = torch.Generator().manual_seed(0)
    weights = [4 if i % 4 == 0 else 1 for i in range(count)]
    unit = total_mib * MiB / sum(weights)
    state = {}
    for i, w in enumerate(weights):
        nbytes = int(unit * w) // 4 * 4
        if i % 5 == 4:
            state[f"layer{i:04d}.weight"] = torch.randn(nbytes // 2, generator=g).to(torch.bfloat16)
        else:
            state[f"layer{i:04d}.weight"] = torch.randn(nbytes // 4, generator=g)
    return state


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # moto keeps objects above MOTO_S3_DEFAULT_KEY_BUFFER_SIZE (5 MiB by default) in temporary
    # files and reads the whole object for every GET, ranged or not; keeping them in memory
    # makes it less of a disk benchmark (a ranged GET still costs a copy of the whole object).
    env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(4 << 30))
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the moto server did not start")


def backends(options: dict) -> dict:
    return {
        "datastates": (
            lambda url: DataStatesWriter(url, storage_options=options),
            lambda url: DataStatesReader(url, storage_options=options),
        ),
        "dcp-fsspec": (lambda url: FsspecWriter(url, **options), lambda url: FsspecReader(url, **options)),
    }


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def one_round(name, make_writer, make_reader, base: str, state: dict, target: dict, cleanup) -> dict:
    out = {}
    url = f"{base}/{name}-{uuid.uuid4().hex[:8]}"
    out["save"] = timed(lambda: dcp.save(state, storage_writer=make_writer(url)))
    out["load"] = timed(lambda: dcp.load(target, storage_reader=make_reader(url)))
    for k in list(state)[:: max(1, len(state) // 8)]:
        assert torch.equal(target[k], state[k]), (name, k)
    cleanup(url)
    url = f"{base}/{name}-{uuid.uuid4().hex[:8]}"
    t = time.perf_counter()
    resp = dcp.async_save(state, storage_writer=make_writer(url))
    out["async-block"] = time.perf_counter() - t
    fut = getattr(resp, "upload_completion", resp)
    fut.result()
    out["async-total"] = time.perf_counter() - t
    cleanup(url)
    return out


def bench_store(store: str, args, state: dict) -> dict:
    import fsspec

    proc = None
    if store == "s3":
        proc, endpoint = start_moto()
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        fs = fsspec.filesystem("s3", **options)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fs.mkdir(bucket)
        base = f"s3://{bucket}"
    else:
        options = {}
        fs = fsspec.filesystem("memory")
        base = f"memory://bench-{uuid.uuid4().hex[:8]}"

    def cleanup(url: str) -> None:
        try:
            fs.rm(url.split("://", 1)[1], recursive=True)
        except FileNotFoundError:
            pass

    target = {k: torch.empty_like(v) for k, v in state.items()}
    runs: dict[str, dict[str, list[float]]] = {}
    try:
        for r in range(args.runs + 1):  # round 0 warms up (engine, connections) and is dropped
            for name, (mw, mr) in backends(options).items():
                res = one_round(name, mw, mr, base, state, target, cleanup)
                if r == 0:
                    continue
                for k, v in res.items():
                    runs.setdefault(name, {}).setdefault(k, []).append(v)
                print(f"  [{store}] round {r} {name}: " + ", ".join(f"{k} {v:.3f}s" for k, v in res.items()), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="state size in MiB")
    p.add_argument("--tensors", type=int, default=320, help="number of tensors")
    p.add_argument("--runs", type=int, default=3, help="measured rounds (medians reported)")
    p.add_argument("--stores", nargs="+", default=["s3", "memory"], choices=["s3", "memory"])
    p.add_argument("--json", help="write the raw timings and medians here")
    args = p.parse_args()

    state = make_state(args.mib, args.tensors)
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state: {len(state)} tensors, {total / MiB:.1f} MiB; torch {torch.__version__}; {os.cpu_count()} CPUs")
    report = {"mib": total / MiB, "tensors": len(state), "runs": args.runs, "stores": {}}
    for store in args.stores:
        runs = bench_store(store, args, state)
        medians = {name: {k: statistics.median(v) for k, v in res.items()} for name, res in runs.items()}
        report["stores"][store] = {"runs": runs, "median": medians}
        print(f"\n{store}: medians of {args.runs} runs (seconds; MiB/s in parentheses)")
        cols = ["save", "async-block", "async-total", "load"]
        print(f"  {'backend':<12}" + "".join(f"{c:>22}" for c in cols))
        for name, m in medians.items():
            cells = []
            for c in cols:
                rate = f"({total / MiB / m[c]:.0f})" if c != "async-block" else ""
                cells.append(f"{m[c]:>14.3f} {rate:>7}")
            print(f"  {name:<12}" + "".join(cells))
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
