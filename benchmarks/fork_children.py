"""Saves while forked children live (DataLoader workers, any os.fork): what they cost the parent.

A child forked after the engine started shares the parent's memory copy-on-write. Every page
of the host cache that the parent's copies then write is first duplicated (a page fault, 4 KiB
copied, the cache's size again in memory while the child lives), unless the cache is left out
of children (MADV_DONTFORK, csrc/host_cache.cpp). This runs the same saves with no child and
with ``--children`` sleeping children forked after the first save, alternating, and reports
per save the time to durable and the parent's minor page faults, and how much the memory of the
parent and its children together (the sum of their PSS) grew over the saves.

    python benchmarks/fork_children.py --dir /tmp/dcpds-fork --size 1GiB --saves 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

ROUND = r"""
import os, resource, shutil, signal, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesWriter
folder, size, saves, children = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
n = 1612
state = {"model": {f"layers.{i // 8}.w{i % 8}": torch.randn(size // n // 4) for i in range(n)}}
cache = int(size * 1.1)

def pss(pids):  # the memory these processes really use: each shared page counted once in all
    total = 0
    for pid in pids:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                total += int(line.split()[1]) << 10
    return total

def save():
    shutil.rmtree(folder, ignore_errors=True)
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    dcp.async_save(state, storage_writer=DataStatesWriter(folder, host_cache_size=cache)).upload_completion.result()
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

save(); save()  # the engine started, its cache written once
kids = []
for _ in range(children):
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    kids.append(pid)
before = pss([os.getpid()] + kids)
rows = [save() for _ in range(saves)]
growth = pss([os.getpid()] + kids) - before
for pid in kids:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
shutil.rmtree(folder, ignore_errors=True)
print([rows, growth])
"""


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, mult in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/dcpds-fork", help="checkpoint folder (removed between saves)")
    p.add_argument("--size", default="1GiB", help="state size, 1,612 fp32 tensors")
    p.add_argument("--saves", type=int, default=4, help="saves per round after the children are forked")
    p.add_argument("--children", type=int, default=2, help="sleeping children forked in the 'children' rounds")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of each case")
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args(argv)
    size = parse_size(args.size)
    samples: dict[str, list] = {"no child": [], f"{args.children} children": []}
    for _ in range(args.rounds):
        for case, children in (("no child", 0), (f"{args.children} children", args.children)):
            out = subprocess.run([sys.executable, "-c", ROUND, args.dir, str(size), str(args.saves), str(children)],
                                 capture_output=True, text=True, check=True).stdout
            rows, growth = json.loads(out.strip().splitlines()[-1].replace("(", "[").replace(")", "]"))
            samples[case].append({"saves": rows, "pss_growth": growth})
    print(f"{args.size} in 1,612 tensors, {args.saves} saves x {args.rounds} rounds per case, folder {args.dir}")
    print("| case | durable s (median) | minor faults, first save after the fork | later saves (median) "
          "| memory of parent + children, growth over the saves (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for case, rounds in samples.items():
        durable = statistics.median(s[0] for r in rounds for s in r["saves"])
        first = statistics.median(r["saves"][0][1] for r in rounds)
        later = statistics.median(s[1] for r in rounds for s in r["saves"][1:]) if args.saves > 1 else float("nan")
        growth = statistics.median(r["pss_growth"] for r in rounds) / 2**20
        print(f"| {case} | {durable:.3f} | {first:,.0f} | {later:,.0f} | {growth:,.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "saves": args.saves, "children": args.children, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
