"""The engine alone: one host buffer written to a folder through the host cache and directly
(``submit_write(..., direct=True)``), into one file and split over two, with and without the
per-piece CRC32C: time to staged and to done (fsync'ed), medians.

    python scripts/direct_write_time.py [--dir /dev/shm/dwt] [--mib 1024] [--reps 3]

No Python between submit and done: what the engine's data path costs, next to the raw bound of
``python -m dcp_datastates bench`` (which writes the same bytes without checksums).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch

from dcp_datastates.config import DataStatesConfig
from dcp_datastates.runtime.engine import get_engine

HEADER = 4096


def one(eng, folder: str, t: torch.Tensor, *, direct: bool, files: int) -> tuple[float, float]:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    nbytes = t.numel() * t.element_size()
    per = nbytes // files
    t0 = time.perf_counter()
    jobs = [eng.submit_write(os.path.join(folder, f"f{k}"), b"h" * HEADER, HEADER + per,
                             [(t.data_ptr() + k * per, per, HEADER)], True, -1, 0, direct=direct)
            for k in range(files)]
    for j in jobs:
        j.wait_staged()
    staged = time.perf_counter() - t0
    for j in jobs:
        j.wait_done()
        if j.error():
            raise RuntimeError(j.error())
    return staged, time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/dev/shm/dwt")
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    t = torch.randn(args.mib << 18)  # fp32: 4 bytes each
    eng = get_engine(DataStatesConfig(host_cache_size=(args.mib + 64) << 20))
    try:
        for crc in (True, False):
            eng.set_checksums(crc)
            for direct in (False, True):
                for files in (1, 2):
                    one(eng, args.dir, t, direct=direct, files=files)  # warm-up (the cache faults in)
                    runs = [one(eng, args.dir, t, direct=direct, files=files) for _ in range(args.reps)]
                    print(f"{'direct' if direct else 'cached'} files={files} crc32c={'on' if crc else 'off'}: "
                          f"staged {statistics.median(r[0] for r in runs):.3f} s, "
                          f"done {statistics.median(r[1] for r in runs):.3f} s")
    finally:
        eng.set_checksums(True)
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
