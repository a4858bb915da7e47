"""Checksum cost: CRC32C of 1 GiB (one thread) vs an engine job writing the same GiB to /dev/shm.

    python scripts/crc_cost.py
"""
import time, statistics, torch, os
import dcp_datastates._engine as E
n = 1 << 30
src = torch.randint(0, 255, (n,), dtype=torch.uint8)
eng = E.Engine(256 << 20, chunk_bytes=16 << 20, copy_threads=2, flush_threads=2)
crc, write = [], []
for i in range(5):
    t = time.perf_counter(); eng.crc32c(src.data_ptr(), n); crc.append(time.perf_counter() - t)
    path = f"/dev/shm/crc_cost_{i}.bin"
    t = time.perf_counter()
    job = eng.submit_write(path, b"", n, [(src.data_ptr(), n, 0)], False)
    job.wait_done(); write.append(time.perf_counter() - t)
    os.unlink(path)
c, w = statistics.median(crc), statistics.median(write)
print(f"CRC32C of 1 GiB, one thread: {c*1e3:.0f} ms ({n/c/1e9:.1f} GB/s)")
print(f"engine job 1 GiB -> /dev/shm (copy + pwrite + CRC, 2 copy + 2 flush threads, no fsync): {w*1e3:.0f} ms")
print(f"checksum CPU / (flush wall x 2 flush threads): {c/(w*2):.1%}")
eng.shutdown()
