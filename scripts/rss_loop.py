"""Does a training loop that checkpoints back to back keep its memory? The bench's loop of
20,000 tiny tensors showed its per-checkpoint RSS peak rising over 6 checkpoints; this runs the
same kind of loop longer and prints, per checkpoint, the process's RSS at the request and the
number of live Python objects, so growth that settles (the allocator's arenas warming up) can be
told from growth that does not (a leak).

Each iteration: wait for the previous checkpoint to be durable (one in flight), remove the one
before it, ``dcp.async_save`` the state with ``DataStatesWriter``, a short matmul phase,
``wait_staged()``, change a non-tensor value (the optimizer step's stand-in).

    python scripts/rss_loop.py [--tensors 20000] [--checkpoints 45] [--host-cache 128MiB]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter, wait_staged


def rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def main(argv=None) -> list[tuple[int, int]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=20000, help="tensors in the state (100 of them large)")
    p.add_argument("--checkpoints", type=int, default=45)
    p.add_argument("--host-cache", default="128MiB")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    large = min(100, args.tensors // 2)
    state = {"model": {f"l{i}.w": torch.randn(16) for i in range(args.tensors - large)},
             "big": {f"b{i}": torch.randn(160_000) for i in range(large)}, "extra": {"step": 0}}
    a = torch.randn(512, 512)
    root = tempfile.mkdtemp(prefix="rss_loop_")
    rows, paths, pending = [], [], None
    try:
        for i in range(args.checkpoints):
            if pending is not None:
                pending.upload_completion.result()
            while len(paths) > 1:
                shutil.rmtree(paths.pop(0), ignore_errors=True)
            paths.append(os.path.join(root, f"c{i}"))
            pending = dcp.async_save(state, storage_writer=DataStatesWriter(paths[-1], host_cache_size=args.host_cache))
            for _ in range(10):
                a @ a
            wait_staged()
            state["extra"]["step"] = i + 1
            rows.append((rss_mib(), len(gc.get_objects())))
            print(f"checkpoint {i:3d}: RSS {rows[-1][0]} MiB, {rows[-1][1]} Python objects", flush=True)
        pending.upload_completion.result()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
