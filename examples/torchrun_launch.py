"""Launching an example's ranks with torchrun on this machine (the demos run three launches: a
reference run, a run killed with SIGKILL mid-training, and its resume)."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun(nproc: int, script: str, *args: str, expect_ok: bool = True) -> None:
    """Run ``script`` on ``nproc`` local ranks. ``expect_ok=False``: the run must end by the
    SIGKILL it simulates (torchrun's failure report of it is kept out of the way)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    print("$ torchrun " + " ".join(cmd[4:]), flush=True)
    # One thread per rank, said explicitly so torchrun does not warn that it chose it.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if expect_ok:
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0:
            raise SystemExit(f"torchrun failed with exit code {rc}")
        return
    run = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    if run.returncode == 0:
        raise SystemExit("the run that should have been killed finished normally")
    if "exitcode  : -9" not in run.stderr and "Signal 9" not in run.stderr:
        sys.stderr.write(run.stderr)
        raise SystemExit(f"torchrun failed with exit code {run.returncode}, not from the SIGKILL")
    print("torchrun: the ranks were killed with SIGKILL, as intended (its failure report is not shown)", flush=True)
