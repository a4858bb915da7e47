"""Run PyTorch's own DCP tests twice, with stock DCP storage and with ours in its place.

PyTorch's test files are read from a PyTorch source tree (they are never copied into this
repository); pick the tree's commit to match the installed torch (a newer test may use names
the installed release lacks: such a test fails in both runs). ``FileSystemWriter`` and
``FileSystemReader`` are replaced in every interpreter the tests start (``dcp_subst.py``); a test
that passes stock and fails substituted is ours to look at.

    python scripts/upstream_dcp/run.py --pytorch-src ~/src/pytorch [--force-gpu-tests] \\
        test_file_system_checkpoint_cpu.py test_compatibility.py e2e/test_e2e_save_and_load.py

Needs ``expecttest`` (``pip install expecttest``). Results: docs/torch-versions.md, "PyTorch's own
DCP tests".
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed|skipped|error).*?) in [\d.]+s")


def run(test: Path, mode: str, force_gpu: bool, timeout: int, extra: list[str]) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(test.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("UPSTREAM_DCP_STORAGE", None)
    if mode == "datastates":
        env["UPSTREAM_DCP_STORAGE"] = "datastates"
    if force_gpu:
        env["UPSTREAM_DCP_FORCE_GPU_TESTS"] = "1"
    with tempfile.TemporaryDirectory() as cwd:  # the tests write beside themselves at times
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", str(test), *extra],
                               cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            out = r.stdout + r.stderr
        except subprocess.TimeoutExpired as exc:
            return f"timed out after {timeout} s", str(exc.stdout or "")
    lines = out.splitlines()
    summary = next((m.group(1) for line in reversed(lines) if (m := SUMMARY.match(line))), "no summary")
    failed = "\n".join(line for line in lines if line.startswith(("FAILED", "ERROR")))
    return summary, failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pytorch-src", required=True, type=Path, help="a PyTorch source tree (its test/ folder is read)")
    p.add_argument("--mode", choices=["stock", "datastates", "both"], default="both")
    p.add_argument("--force-gpu-tests", action="store_true", help="run tests gated by skip_if_lt_x_gpu on CPU/gloo")
    p.add_argument("--timeout", type=int, default=900, help="seconds per file and mode")
    p.add_argument("tests", nargs="+", help="paths under test/distributed/checkpoint/")
    args, extra = p.parse_known_args(argv)
    base = args.pytorch_src / "test" / "distributed" / "checkpoint"
    modes = ["stock", "datastates"] if args.mode == "both" else [args.mode]
    differ = 0
    for name in args.tests:
        results = {m: run(base / name, m, args.force_gpu_tests, args.timeout, extra) for m in modes}
        for m, (summary, failed) in results.items():
            print(f"{name} [{m}]: {summary}")
            if failed:
                print("  " + failed.replace("\n", "\n  "))
        if len(results) == 2 and results["stock"][1] != results["datastates"][1]:
            differ += 1
            print(f"{name}: the failures differ between stock and substituted storage")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
