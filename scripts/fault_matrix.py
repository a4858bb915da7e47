#!/usr/bin/env python
"""Run the multi-rank fault matrix of tests/test_fault_matrix.py and print, per case, whether every
rank raised CheckpointException naming the cause, and how long the slowest rank took to see it.

    python scripts/fault_matrix.py [--root /tmp/fault-matrix]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import fault_workers as F  # noqa: E402
from dist_harness import run_ranks  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="dcpds-faults-")
    os.makedirs(root, exist_ok=True)
    run_ranks(2, F.run_matrix, root, 1, ["sync", "async"], timeout=600)
    run_ranks(4, F.run_matrix, root, 2, ["sync", "async"], timeout=900)
    rows: dict = {}
    for w in (2, 4):
        with open(os.path.join(root, f"matrix-w{w}.json")) as f:
            for r in json.load(f):
                rows.setdefault((w, r["api"], r["kind"], r["failing_rank"]), []).append(r)

    def role(w: int, fr: int) -> str:
        return "coordinator" if fr == 0 else ("node leader" if w == 2 or fr == 2 else "member")

    print("| world | api | fault | failing rank | all ranks raised, cause named | slowest rank (s) | old checkpoint loads | next save loads |")
    print("|---|---|---|---|---|---|---|---|")
    bad = 0
    for (w, api, kind, fr), rs in sorted(rows.items()):
        ok = all(r["type"] == "CheckpointException" and r["cause_in_message"] for r in rs) and len(rs) == w
        good = ok and all(r["old_checkpoint_intact"] and r["next_save_loads"] for r in rs)
        bad += not good
        print(f"| {w} | {api} | {kind} | {fr} ({role(w, fr)}) | {'yes' if ok else 'NO'} | "
              f"{max(r['seconds'] for r in rs):.2f} | {all(r['old_checkpoint_intact'] for r in rs)} | "
              f"{all(r['next_save_loads'] for r in rs)} |")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
