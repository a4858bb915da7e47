"""Peer copies (``peer_copies=1``) against none: what they cost the training thread and the save,
how many bytes they move, and what they give a load after a node is lost.

``--world`` gloo ranks on this machine form 2 emulated nodes (``DCPDS_NODE``, one local tier
folder each, under ``--local-dir``); the durable tier is bench_tiers.py's throttled folder
(``slowfile://``, ``--durable-mbps`` per process: each process books its own simulated device).
Every rank holds ``--mib`` MiB of its own fp32 tensors. Per mode (0 then 1), ``--runs`` async
saves into step folders, each measured on every rank: the call, the wait for staging (what the
next optimizer step waits for), the durable commit, and (mode 1) the peer copies' end; bytes sent
per rank. Then node B's tier is wiped (the node is lost and replaced) and every rank restarts:
finds the checkpoint (without peer copies ``latest_checkpoint``; with them the collective
``prepare_restart``, which pulls node B's files from node A's copies) and loads its own tensors
and those of its peer on the other node. Reported: the restart of the slowest rank (when the job
can go on), each node's own read time, and the data read from the durable tier by all ranks.

``--layout replicated``: HSDP-like instead, every rank's tensors DTensors replicated across the 2
nodes and sharded within each (rank r of node A holds the same shards as rank r of node B):
the peer copies then move no replicated byte (each keeper keeps the file it staged from its own
replica, save/ownership.py), and each rank restarts by loading its own DTensors.

    python benchmarks/bench_peers.py --world 4 --mib 128 --runs 5 --durable-mbps 200
    python benchmarks/bench_peers.py --world 4 --mib 128 --runs 5 --durable-mbps 200 --layout replicated
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tiers  # noqa: E402,F401 - registers slowfile:// (the throttled durable tier)

warnings.filterwarnings("ignore")
MiB = 1 << 20


def _node(rank: int, world: int) -> str:
    return "nodeA" if rank < world // 2 else "nodeB"


def _state_of(rank: int, mib: int, n: int = 16) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {f"rank{rank}.t{i}": torch.randn(mib * MiB // 4 // n, generator=g) for i in range(n)}


def _replicated_state(rank: int, world: int, mib: int, n: int = 16) -> dict:
    """``mib`` MiB of DTensor shards per rank on a (replicate=2, shard=world/2) mesh: the two
    ranks holding shard j (one per node) hold the same bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shards = world // 2
    mesh = init_device_mesh("cpu", (2, shards), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(rank % shards)
    cols = 1024
    rows = max(1, mib * MiB // 4 // n // cols)
    return {f"t{i}": DTensor.from_local(torch.randn(rows, cols, generator=g), mesh, [Replicate(), Shard(0)],
                                        run_check=False, shape=(rows * shards, cols), stride=(cols, 1))
            for i in range(n)}


def _empty_like(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: DTensor.from_local(torch.empty_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape,
                                  stride=v.stride()) if isinstance(v, DTensor) else torch.empty_like(v)
            for k, v in state.items()}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _timed_reader():
    from dcp_datastates import DataStatesReader

    class TimedReader(DataStatesReader):
        """Its own read time (``read_data``: the reads, without DCP's collectives around them) and
        the data files it took from the durable tier."""

        read_s = 0.0

        def read_data(self, plan, planner):
            t0 = time.perf_counter()
            fut = super().read_data(plan, planner)
            fut.wait()
            self.read_s = time.perf_counter() - t0
            return fut

        @property
        def durable_files(self) -> set:
            files = {self.storage_data[r.storage_index].file for r in self._last_plan.items}
            return {f for f in files if f not in self._local_files}

        def prepare_local_plan(self, plan):
            self._last_plan = super().prepare_local_plan(plan)
            return self._last_plan

    return TimedReader


def _rank_main(rank: int, world: int, port: int, args, out_q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DCPDS_NODE=_node(rank, world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from dcp_datastates import DataStatesWriter, latest_checkpoint, prepare_restart
    from dcp_datastates.runtime import shutdown_engine

    _TimedReader = _timed_reader()

    bench_tiers._Device.bandwidth = args.durable_mbps * 1e6
    group = dist.new_group(backend="gloo")  # the checkpoint's own group (training may use the default)
    if args.layout == "replicated":
        state = wanted = _replicated_state(rank, world, args.mib)
    else:
        state = _state_of(rank, args.mib)
        # After the loss of node B, a node-A rank loads its own tensors and those of its peer on
        # B (a resharded load reads other ranks' files).
        wanted = {**state, **_state_of((rank + world // 2) % world, args.mib)}
    nv = os.path.join(args.local_dir, _node(rank, world))
    results = {}
    for mode in (0, 1):
        rows = []
        for k in range(args.runs + 1):  # the first is a warm-up
            durable = f"slowfile://{args.durable_dir}/mode{mode}/step-{k}"
            w = DataStatesWriter(durable, local_tier=nv, peer_copies=mode, keep_local=2)
            dist.barrier(group)
            t0, m0 = time.perf_counter(), time.monotonic()
            resp = dcp.async_save(state, storage_writer=w, process_group=group)
            call = time.perf_counter() - t0
            resp.staging_completion.result()
            staged = time.perf_counter() - t0
            resp.upload_completion.result()
            durable_s = time.perf_counter() - t0
            peer_s, sent = None, 0
            if mode:
                done = w.peer_copy.result(timeout=600)
                peer_s = done["ended"] - m0
                sent = done["bytes_sent"]
            if k:
                rows.append({"call_ms": call * 1e3, "staged_ms": staged * 1e3, "durable_s": durable_s,
                             "peer_s": peer_s, "sent_mib": sent / MiB})
        dist.barrier(group)
        last = f"slowfile://{args.durable_dir}/mode{mode}/step-{args.runs}"
        if rank == world // 2:
            shutil.rmtree(os.path.join(args.local_dir, "nodeB"), ignore_errors=True)
        dist.barrier(group)
        # The restart: find the checkpoint (every rank: latest_checkpoint; with peer copies the
        # collective prepare_restart, which also pulls node B's files from node A), then load.
        out = _empty_like(wanted)
        root = f"slowfile://{args.durable_dir}/mode{mode}"
        t0 = time.perf_counter()
        if mode:
            path = prepare_restart(root, local_tier=nv, state_dict=out)
        else:
            path = latest_checkpoint(root, local_tier=nv)
        found_s = time.perf_counter() - t0
        assert path == last, (path, last)
        reader = _TimedReader(path, local_tier=nv)
        dcp.load(out, storage_reader=reader, process_group=group)
        restart_s = time.perf_counter() - t0
        durable_mib = sum(os.path.getsize(os.path.join(args.durable_dir, f"mode{mode}", f"step-{args.runs}", name))
                          for name in reader.durable_files) / MiB
        assert all(torch.equal(_local(out[k]), _local(wanted[k])) for k in wanted)
        results[mode] = {"rows": rows, "found_s": found_s, "restart_s": restart_s, "read_s": reader.read_s,
                         "durable_mib": durable_mib}
        dist.barrier(group)
    gathered = [None] * world
    dist.all_gather_object(gathered, results, group=group)
    if rank == 0:
        out_q.put(gathered)
    dist.barrier(group)
    shutdown_engine()
    dist.destroy_process_group()
    os._exit(0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mib", type=int, default=128, help="MiB of tensors per rank")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--durable-mbps", type=float, default=200.0)
    ap.add_argument("--local-dir", default=None, help="default: a temp folder in /dev/shm")
    ap.add_argument("--durable-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--layout", choices=("unique", "replicated"), default="unique",
                    help="unique: every rank's tensors its own (FSDP); replicated: HSDP-like DTensors")
    args = ap.parse_args(argv)
    args.local_dir = args.local_dir or tempfile.mkdtemp(prefix="peers-local-", dir="/dev/shm")
    args.durable_dir = args.durable_dir or tempfile.mkdtemp(prefix="peers-durable-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    gathered = q.get()
    for p in procs:
        p.join()
    report = {"args": vars(args), "modes": {}}
    print(f"{args.world} ranks as 2 nodes, {args.layout} layout, {args.mib} MiB per rank, {args.runs} saves per mode, durable "
          f"{args.durable_mbps:g} MB/s per process; save columns: medians over ranks and saves")
    print(f"{'peer_copies':>11} {'call ms':>8} {'staged ms':>9} {'durable s':>9} {'peer s':>7} {'sent MiB':>8} "
          f"{'restart s':>9} {'A reads s':>9} {'B reads s':>9} {'from durable MiB':>16}")
    for mode in (0, 1):
        rows = [row for r in gathered for row in r[mode]["rows"]]
        med = {key: statistics.median(row[key] for row in rows) if rows[0][key] is not None else None
               for key in rows[0]}
        per_rank = [r[mode] for r in gathered]
        half = args.world // 2
        med["restart_s"] = max(r["restart_s"] for r in per_rank)  # the job resumes when its last rank has
        med["found_s"] = max(r["found_s"] for r in per_rank)
        med["read_a_s"] = statistics.median(r["read_s"] for r in per_rank[:half])
        med["read_b_s"] = statistics.median(r["read_s"] for r in per_rank[half:])
        med["durable_mib"] = sum(r["durable_mib"] for r in per_rank)
        report["modes"][mode] = med
        print(f"{mode:>11} {med['call_ms']:>8.1f} {med['staged_ms']:>9.1f} {med['durable_s']:>9.3f} "
              f"{(med['peer_s'] or 0):>7.3f} {med['sent_mib']:>8.1f} {med['restart_s']:>9.3f} {med['read_a_s']:>9.3f} "
              f"{med['read_b_s']:>9.3f} {med['durable_mib']:>16.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    shutil.rmtree(args.local_dir, ignore_errors=True)
    shutil.rmtree(args.durable_dir, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
