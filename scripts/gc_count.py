"""Run a Python script and report the full (generation 2) collections of Python's cyclic GC it
went through: how many and their total time. A full collection walks every tracked object of
the process while holding the GIL, so whichever thread triggers it stalls every other Python
thread; moving work between threads moves these collections around without removing them.

    python scripts/gc_count.py SCRIPT [ARGS...]
    python scripts/gc_count.py benchmarks/save_load_ab.py --mib 1024 --tensors 1612 --runs 5 --sync
"""

from __future__ import annotations

import gc
import runpy
import sys
import time


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    count, total, started = 0, 0.0, [0.0]

    def on_collect(phase: str, info: dict) -> None:
        nonlocal count, total
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            count += 1
            total += time.perf_counter() - started[0]

    gc.callbacks.append(on_collect)
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        gc.callbacks.remove(on_collect)
        print(f"full GC collections: {count}, {total:.3f} s in all")


if __name__ == "__main__":
    main()
