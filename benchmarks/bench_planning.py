"""Planning + commit time per checkpoint at several world sizes (CPU ranks, gloo).

Each rank holds many tiny tensors (DTensor shards and replicated plain tensors), so a checkpoint
is dominated by planning (local plans gathered, global plan scattered) and commit (write results
gathered, metadata written), not by bytes. Compared per world size, in the same run:

  datastates      DataStatesWriter + DataStatesSavePlanner (plan caching, stage-time dedup,
                  hierarchical consolidation)
  dcp             FileSystemWriter + DefaultSavePlanner()
  dcp-cached      FileSystemWriter + DefaultSavePlanner(enable_plan_caching=True)

Reported on rank 0: planning time (set_up_planner to finish_plan), commit time (finish_plan to
the end of the save: write phase gather + finish), for the first checkpoint and the median of
the steady state.

    python benchmarks/bench_planning.py --worlds 2 4 8 16 --items 1000 --saves 6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dcp_datastates import DataStatesSavePlanner, DataStatesWriter


def timed(planner_cls):
    """A planner subclass that records when planning starts and ends."""

    class Timed(planner_cls):
        marks: dict = {}

        def set_up_planner(self, *a, **k):
            Timed.marks["start"] = time.perf_counter()
            return super().set_up_planner(*a, **k)

        def finish_plan(self, plan):
            out = super().finish_plan(plan)
            Timed.marks["planned"] = time.perf_counter()
            return out

    Timed.__name__ = planner_cls.__name__
    return Timed


def build_state(world: int, items: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(items):
        full = torch.randn(world * 2, 4, generator=g)
        if i % 5 == 4:
            state[f"rep.{i}"] = full  # plain tensor, replicated on every rank
        else:
            state[f"shard.{i}"] = distribute_tensor(full, mesh, [Shard(0)])
    state["step"] = 1
    return state


def worker(rank, world, port, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = build_state(world, args.items)
    results = {}
    for method in ("datastates", "dcp", "dcp-cached"):
        if method == "datastates":
            planner_cls = timed(DataStatesSavePlanner)
        else:
            planner_cls = timed(DefaultSavePlanner)
        plan_s, commit_s = [], []
        for k in range(args.saves):
            path = os.path.join(out_dir, f"w{world}-{method}-{k}")
            if method == "datastates":
                writer, planner = DataStatesWriter(path, sync_files=False), planner_cls(cache_key=f"bench{world}")
            else:
                writer = FileSystemWriter(path, sync_files=False)
                planner = planner_cls(enable_plan_caching=(method == "dcp-cached"))
            dist.barrier()
            if method == "datastates":
                dcp.async_save(state, storage_writer=writer, planner=planner).upload_completion.result()
            else:
                dcp.save(state, storage_writer=writer, planner=planner)
            end = time.perf_counter()
            marks = planner_cls.marks
            plan_s.append(marks["planned"] - marks["start"])
            commit_s.append(end - marks["planned"])
        results[method] = {
            "first_plan_ms": plan_s[0] * 1e3,
            "first_commit_ms": commit_s[0] * 1e3,
            "steady_plan_ms": statistics.median(plan_s[1:]) * 1e3,
            "steady_commit_ms": statistics.median(commit_s[1:]) * 1e3,
        }
    if rank == 0:
        with open(os.path.join(out_dir, f"result-{world}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--items", type=int, default=1000, help="tensors per rank")
    p.add_argument("--saves", type=int, default=6, help="checkpoints per method (first + steady state)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp folder in /dev/shm)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    table = {}
    for world in args.worlds:
        with tempfile.TemporaryDirectory(dir=base) as out_dir:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.start_processes(worker, args=(world, port, args, out_dir), nprocs=world, start_method="spawn")
            with open(os.path.join(out_dir, f"result-{world}.json")) as f:
                table[world] = json.load(f)
        print(f"world {world}: " + json.dumps(table[world]), flush=True)
    print(f"\n{'ranks':>5} {'method':<11} {'plan first':>11} {'plan steady':>12} {'commit first':>13} {'commit steady':>14}  (ms, rank 0)")
    for world, res in table.items():
        for method, r in res.items():
            print(
                f"{world:>5} {method:<11} {r['first_plan_ms']:>11.1f} {r['steady_plan_ms']:>12.1f} "
                f"{r['first_commit_ms']:>13.1f} {r['steady_commit_ms']:>14.1f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"items_per_rank": args.items, "saves": args.saves, "results": table}, f, indent=1)


if __name__ == "__main__":
    main()
