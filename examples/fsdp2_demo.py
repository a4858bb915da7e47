"""Kill and resume an FSDP2 run, and show that it continues with the same losses.

Runs examples/fsdp2_train.py with torchrun three times on CPU (gloo):
  1. uninterrupted, for reference losses;
  2. checkpointing lazily every k steps and killed with SIGKILL mid-run;
  3. resumed from the newest complete checkpoint (latest_checkpoint) to the end.
Then compares the resumed run's losses with the reference, step by step.

    python examples/fsdp2_demo.py [--nproc 2] [--steps 16] [--ckpt-every 4] [--kill-at-step 11]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torchrun_launch import torchrun as launch  # noqa: E402


def torchrun(nproc: int, *args: str, expect_ok: bool = True) -> None:
    launch(nproc, os.path.join(HERE, "fsdp2_train.py"), *args, expect_ok=expect_ok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--kill-at-step", type=int, default=11)
    p.add_argument("--out", default="ckpt_fsdp2")
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    work = tempfile.mkdtemp(prefix="fsdp2-demo-")
    common = ["--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every)]

    print("\n== 1. uninterrupted reference run ==", flush=True)
    torchrun(args.nproc, *common, "--out", os.path.join(work, "reference"), "--losses", os.path.join(work, "ref.json"))
    print(f"\n== 2. run checkpointing every {args.ckpt_every} steps, killed at step {args.kill_at_step} ==", flush=True)
    torchrun(args.nproc, *common, "--out", args.out, "--kill-at-step", str(args.kill_at_step), expect_ok=False)
    print("\n== 3. resumed from the newest complete checkpoint ==", flush=True)
    torchrun(args.nproc, *common, "--out", args.out, "--resume", "--losses", os.path.join(work, "resumed.json"))

    with open(os.path.join(work, "ref.json")) as f:
        ref = json.load(f)
    with open(os.path.join(work, "resumed.json")) as f:
        resumed = json.load(f)
    print(f"\n{'step':>5} {'reference':>12} {'resumed':>12}")
    worst = 0.0
    for step in sorted(resumed, key=int):
        a, b = ref[step], resumed[step]
        worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
        print(f"{int(step):>5} {a:>12.6f} {b:>12.6f}")
    same = worst <= 1e-6 or math.isclose(worst, 0.0)
    print(f"\nresumed run matches the uninterrupted one: {same} (largest relative difference {worst:.2e})")
    shutil.rmtree(work, ignore_errors=True)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
