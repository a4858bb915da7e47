"""Checksum cost: the engine writing 1 GiB with and without its per-piece CRC32C, alternating.

    python benchmarks/crc_cost.py [--dir /dev/shm] [--dir /tmp] [--reps 9] [--sync]

Each round submits the same 1 GiB (one item, random bytes) as one engine job twice, once with
checksums (as every checkpoint does) and once with them switched off (`Engine.set_checksums`,
a benchmark hook), in alternating order, and times the job from submit to done (copy into the
host cache, CRC32C, pwrite; fsync only with --sync: without it the flush time is smallest and
the share largest), in wall time and in
the process's CPU time. Medians per directory; the cost is (with - without) / without. Also prints the speed of a bare CRC32C of 1 GiB.
"""
import argparse
import os
import statistics
import time

import torch

import dcp_datastates._engine as E

GiB = 1 << 30


def timed_job(eng, path: str, src: torch.Tensor, sync: bool) -> tuple[float, float, float]:
    """(wall, CPU) seconds of one job, and the checksum's share of the flush workers' time as
    the engine measured it. CPU is the whole process's (the engine's threads: this thread only
    sleeps in wait_done), steadier than wall time on a shared machine."""
    s0 = eng.stats()
    t, cpu = time.perf_counter(), time.process_time()
    job = eng.submit_write(path, b"", src.numel(), [(src.data_ptr(), src.numel(), 0)], sync)
    job.wait_done()
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    s1 = eng.stats()
    assert job.error() is None, job.error()
    os.unlink(path)
    share = (s1["checksum_ns"] - s0["checksum_ns"]) / max(1, s1["flush_ns"] - s0["flush_ns"])
    return dt, dcpu, share


def cost_line(what: str, on: list[float], off: list[float]) -> str:
    m_on, m_off = statistics.median(on), statistics.median(off)
    return (
        f"  {what}: with CRC32C {m_on * 1e3:.0f} ms, without {m_off * 1e3:.0f} ms -> checksum cost "
        f"{(m_on - m_off) / m_off:+.1%} (with: {' '.join(f'{x * 1e3:.0f}' for x in on)}; "
        f"without: {' '.join(f'{x * 1e3:.0f}' for x in off)})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", action="append", help="where to write (repeatable; default /dev/shm and /tmp)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--sync", action="store_true", help="fsync each file, as checkpoints do by default")
    args = ap.parse_args()
    dirs = args.dir or ["/dev/shm", "/tmp"]
    src = torch.randint(0, 255, (GiB,), dtype=torch.uint8)
    eng = E.Engine(256 << 20, chunk_bytes=16 << 20, copy_threads=2, flush_threads=2)
    try:
        crc = []
        for _ in range(5):
            t = time.perf_counter()
            eng.crc32c(src.data_ptr(), GiB)
            crc.append(time.perf_counter() - t)
        c = statistics.median(crc)
        print(f"bare CRC32C of 1 GiB, one thread: {c * 1e3:.0f} ms ({GiB / c / 1e9:.1f} GB/s)")
        for d in dirs:
            path = os.path.join(d, f"crc_cost_{os.getpid()}.bin")
            timed_job(eng, path, src, args.sync)  # warm-up: first touch of the cache and the file system
            on, off = [], []
            for r in range(args.reps):
                for checks in ((True, False) if r % 2 == 0 else (False, True)):
                    eng.set_checksums(checks)
                    (on if checks else off).append(timed_job(eng, path, src, args.sync))
            eng.set_checksums(True)
            print(
                f"{d}: 1 GiB engine job (2 copy + 2 flush threads, 16 MiB slots, {'with' if args.sync else 'no'} fsync), "
                f"medians of {args.reps}:"
            )
            print(cost_line("wall", [w for w, _, _ in on], [w for w, _, _ in off]))
            print(cost_line("CPU ", [c for _, c, _ in on], [c for _, c, _ in off]))
            shares = [x for _, _, x in on]
            print(
                f"  engine's own timing (checksum ns / flush-worker ns, with CRC32C): median {statistics.median(shares):.1%} "
                f"({' '.join(f'{x:.1%}' for x in shares)})"
            )
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
