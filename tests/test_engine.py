"""Tests of the C++ engine (dcp_datastates._engine) on its own: bytes on disk, checksums, cache
reuse and backpressure, reads, fault injection, argument checks and shutdown."""

from __future__ import annotations

import errno
import os
import random
import re
import threading
import time

import numpy as np
import pytest

import dcp_datastates._engine as E

from engine_util import build_engine

KiB = 1 << 10
MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# helpers


def _crc_table() -> list[int]:
    table = []
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def py_crc32c(data: bytes, seed: int = 0) -> int:
    """Independent reference implementation (byte-wise table)."""
    c = seed ^ 0xFFFFFFFF
    for b in data:
        c = (c >> 8) ^ _TABLE[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


def rand_array(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data if a.nbytes else 0


class Layout:
    """A header followed by arrays at chosen offsets; `expected` is the file the engine must write."""

    def __init__(self, header: bytes, arrays: list[np.ndarray], gaps: list[int] | None = None, tail: int = 0):
        self.header = header
        self.arrays = arrays
        self.offsets = []
        pos = len(header)
        for i, a in enumerate(arrays):
            pos += gaps[i] if gaps else 0
            self.offsets.append(pos)
            pos += a.nbytes
        self.file_size = pos + tail
        buf = bytearray(self.file_size)
        buf[: len(header)] = header
        for a, off in zip(arrays, self.offsets):
            buf[off : off + a.nbytes] = a.tobytes()
        self.expected = bytes(buf)

    def items(self) -> list[tuple[int, int, int]]:
        return [(ptr(a), a.nbytes, off) for a, off in zip(self.arrays, self.offsets)]

    def piece_ranges(self, i: int, grid: int) -> list[tuple[int, int]]:
        start, end = self.offsets[i], self.offsets[i] + self.arrays[i].nbytes
        ds = len(self.header)
        out = []
        pos = start
        while pos < end:
            stop = min(end, ds + ((pos - ds) // grid + 1) * grid)
            out.append((pos, stop - pos))
            pos = stop
        return out


def check_file(path, layout: Layout) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) == layout.file_size
    assert data == layout.expected
    return data


def check_checksums(job, layout: Layout, data: bytes, order: list[int] | None = None) -> None:
    """job.checksums()[k] belongs to the k-th item as given (layout index order[k])."""
    crcs = job.checksums()
    order = order if order is not None else list(range(len(layout.arrays)))
    assert len(crcs) == len(order)
    grid = job.piece_size()
    for k, i in enumerate(order):
        want = [E.crc32c(data[o : o + n]) for o, n in layout.piece_ranges(i, grid)]
        assert crcs[k] == want, f"item {i}"


def wait(job, timeout: float = 20.0) -> None:
    assert job.wait_done(timeout), f"{job.path} not done after {timeout}s"


def write_checked(eng, path, layout: Layout):
    """Writes `layout` to `path` as one job; returns the job and the file's bytes, checked."""
    job = eng.submit_write(str(path), layout.header, layout.file_size, layout.items())
    wait(job)
    assert job.error() is None
    return job, check_file(path, layout)


# --------------------------------------------------------------------------------------------
# CRC32C


def test_crc32c_known_vectors():
    assert E.crc32c(b"123456789") == 0xE3069283
    assert E.crc32c(b"") == 0
    assert E.crc32c(b"", 1234) == 1234
    # RFC 3720 (iSCSI) test vectors
    assert E.crc32c(bytes(32)) == 0x8A9136AA
    assert E.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert E.crc32c(bytes(range(32))) == 0x46DD794E
    assert E.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert E._crc32c_software(b"123456789") == 0xE3069283
    assert isinstance(E.hw_crc32c(), bool)


def test_crc32c_chaining_and_buffers():
    rng = np.random.default_rng(1)
    data = rand_array(rng, 100_000).tobytes()
    whole = E.crc32c(data)
    for cut in (0, 1, 7, 8, 4095, 50_001, len(data)):
        assert E.crc32c(data[cut:], E.crc32c(data[:cut])) == whole
    assert E.crc32c(bytearray(data)) == whole
    assert E.crc32c(memoryview(data)) == whole
    assert E.crc32c(np.frombuffer(data, dtype=np.uint8)) == whole
    with pytest.raises(BufferError):
        E.crc32c(memoryview(data)[::2])
    with pytest.raises(ValueError):
        E.crc32c(b"x", -1)
    with pytest.raises(ValueError):
        E.crc32c(b"x", 1 << 32)


def test_crc32c_matches_reference_all_lengths_and_alignments():
    rng = np.random.default_rng(2)
    base = rand_array(rng, 200_000).tobytes()
    # small: against the pure-Python reference, every length and misalignment
    for n in range(0, 70):
        for shift in range(0, 9):
            piece = base[shift : shift + n]
            assert E.crc32c(piece) == py_crc32c(piece)
    # large, through every implementation this CPU runs (the 3-stream crc32 path with its 24 KiB
    # blocks, the AVX-512 folding from 1 KiB in 256-byte steps, and their tails) vs software
    impls = E.crc32c_implementations()
    assert impls[-1] == "software" and E.hw_crc32c() == (impls[0] != "software")
    sizes = (1023, 1024, 1025, 1279, 1280, 1300, 4097, 24 * KiB - 1, 24 * KiB, 24 * KiB + 9, 49_153, 131_072, 199_990)
    for n in sizes:
        for shift in (0, 3, 8):
            piece = base[shift : shift + n]
            want = E._crc32c_software(piece)
            want_seeded = E._crc32c_software(piece, 0xDEADBEEF)
            assert E.crc32c(piece) == want and E.crc32c(piece, 0xDEADBEEF) == want_seeded
            for name in impls:
                assert E._crc32c_using(name, piece) == want, (name, n, shift)
                assert E._crc32c_using(name, piece, 0xDEADBEEF) == want_seeded, (name, n, shift)
    assert E.crc32c(base[:5000]) == py_crc32c(base[:5000])
    with pytest.raises(ValueError, match="CRC32C implementation 'nope' is not available"):
        E._crc32c_using("nope", b"x")


def test_engine_crc32c_on_pointer():
    rng = np.random.default_rng(3)
    a = rand_array(rng, 3 * MiB + 5)
    eng = build_engine(1 * MiB)
    try:
        assert eng.crc32c(ptr(a), a.nbytes) == E.crc32c(a.tobytes())
        assert eng.crc32c(ptr(a) + 10, 1000, 77) == E.crc32c(a[10:1010].tobytes(), 77)
        assert eng.crc32c(0, 0) == 0
        with pytest.raises(ValueError):
            eng.crc32c(0, 10)
    finally:
        eng.shutdown()


def test_snapshot_refuses_a_null_source_or_destination_before_copying_anything():
    """The request-time copy of small items: an item with bytes but no memory (a ZeroTensor's
    pointer is 0) is an error naming it, never a copy from address 0 (which killed the process)."""
    rng = np.random.default_rng(4)
    src, dst = rand_array(rng, 64), np.zeros(128, dtype=np.uint8)
    eng = build_engine(1 * MiB)
    try:
        with pytest.raises(ValueError, match=r"probe: snapshot item 1 of 8 bytes has a null source"):
            eng.snapshot(-1, 0, ptr(dst), [(ptr(src), 64, 0), (0, 8, 64)], "probe")
        assert not dst.any()  # checked first: not even the valid item was copied
        with pytest.raises(ValueError, match=r"null destination"):
            eng.snapshot(-1, 0, 0, [(ptr(src), 64, 0)], "probe")
        eng.snapshot(-1, 0, ptr(dst), [(ptr(src), 64, 0), (0, 0, 64)], "probe")  # empty items need no memory
        assert dst[:64].tobytes() == src.tobytes()
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# construction


def test_the_engine_has_no_defaults_of_its_own():
    """Every setting comes from DataStatesConfig (runtime.py): a missing one is a TypeError."""
    from engine_util import engine_args

    for missing in engine_args():
        args = engine_args()
        del args[missing]
        with pytest.raises(TypeError, match="incompatible constructor arguments"):
            E.Engine(1 * MiB, **args)
    with pytest.raises(TypeError):
        E.Engine(1 * MiB)
    eng = E.Engine(1 * MiB, **engine_args())
    assert eng.stats()["alignment"] == 4096
    eng.shutdown()


def test_grid_binding_is_the_grid_a_job_checksums(tmp_path):
    """format.pieces.piece_ranges and the binding it calls cut exactly where a write job checksums."""
    from dcp_datastates.format.locations import ItemLocation
    from dcp_datastates.format.pieces import piece_ranges

    rng = np.random.default_rng(7)
    grid = 64 * KiB
    layout = Layout(b"H" * 100, [rand_array(rng, n) for n in (10, 3 * grid + 5, grid, 1, 0, 2 * grid)],
                    gaps=[0, 7, grid - 3, 0, 0, 11], tail=9)
    eng = build_engine(1 * MiB, chunk_bytes=grid)
    try:
        job, data = write_checked(eng, tmp_path / "f", layout)
        assert job.piece_size() == grid
        crcs = job.checksums()
        for i, (a, off) in enumerate(zip(layout.arrays, layout.offsets)):
            pieces = E.piece_ranges(off, a.nbytes, len(layout.header), grid)
            assert pieces == layout.piece_ranges(i, grid)  # the test's own grid, written independently
            assert E.piece_count(off, a.nbytes, len(layout.header), grid) == len(pieces) == len(crcs[i])
            loc = ItemLocation("f", off, a.nbytes, "uint8", (a.nbytes,), tuple(crcs[i]), len(layout.header), grid)
            assert piece_ranges(loc) == pieces
            assert [E.crc32c(data[o : o + n]) for o, n in pieces] == crcs[i]
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="piece_size must be positive"):
        E.piece_ranges(0, 1, 0, 0)
    with pytest.raises(ValueError, match="does not lie in the data region starting at 100"):
        E.piece_count(99, 1, 100, 16)


def test_an_item_gathered_from_segments_writes_and_checksums_as_one(tmp_path):
    """Items given as [(ptr, nbytes), ...] segments (a held file laid out anew from its chunks in
    the cache): the same file and the same per-piece checksums as contiguous items."""
    rng = np.random.default_rng(11)
    grid = 16 * KiB
    layout = Layout(b"H" * 300, [rand_array(rng, n) for n in (5, 3 * grid + 77, grid, 1000)], gaps=[0, 0, 0, 0])
    eng = build_engine(1 * MiB, chunk_bytes=grid)
    try:
        whole, data = write_checked(eng, tmp_path / "whole", layout)
        items = []
        for a, off in zip(layout.arrays, layout.offsets):
            cuts = sorted({0, a.nbytes, *(int(x) for x in rng.integers(1, max(a.nbytes, 2), size=4) if x < a.nbytes)})
            segments = [(ptr(a) + lo, hi - lo) for lo, hi in zip(cuts, cuts[1:])]
            items.append((segments, a.nbytes, off))
        job = eng.submit_write(str(tmp_path / "gathered"), layout.header, layout.file_size, items)
        wait(job)
        assert job.error() is None
        assert (tmp_path / "gathered").read_bytes() == data
        assert job.checksums() == whole.checksums()
        with pytest.raises(ValueError, match="source segments hold 10 bytes, the item 11"):
            eng.submit_write(str(tmp_path / "bad"), b"", 11, [([(ptr(layout.arrays[1]), 10)], 11, 0)])
        with pytest.raises(ValueError, match="source segment 0 is empty, null or wraps around"):
            eng.submit_write(str(tmp_path / "bad"), b"", 11, [([(0, 11)], 11, 0)])
    finally:
        eng.shutdown()


def test_constructor_validation_and_chunk_size():
    with pytest.raises(ValueError, match="cache_bytes"):
        build_engine(0)
    with pytest.raises(ValueError, match="alignment"):
        build_engine(1 * MiB, alignment=3000)
    for kw in ("copy_threads", "flush_threads", "read_threads"):
        with pytest.raises(ValueError, match=kw):
            build_engine(1 * MiB, **{kw: 0})
    with pytest.raises(MemoryError, match=str(1 << 50)):  # 1 PiB: more than any address space
        build_engine(1 << 50)

    eng = build_engine(1 * MiB, copy_threads=1, flush_threads=1, read_threads=1)
    s = eng.stats()
    assert s["chunk_bytes"] == 256 * KiB  # a quarter of the cache
    assert s["slots_total"] == 4 and s["slots_free"] == 4
    assert s["cache_address"] % 4096 == 0
    assert s["cache_allocations"] == 1
    assert (s["copy_threads"], s["flush_threads"], s["read_threads"]) == (1, 1, 1)
    assert s["hw_crc32c"] == int(E.hw_crc32c())
    eng.shutdown()

    eng = build_engine(10 * MiB, chunk_bytes=100_000, copy_threads=1, flush_threads=1, read_threads=1)
    assert eng.stats()["chunk_bytes"] == 98_304  # rounded down to the alignment
    assert eng.stats()["slots_total"] == (10 * MiB) // 98_304
    eng.shutdown()


# --------------------------------------------------------------------------------------------
# writing


def test_round_trip_many_tiny_and_big_items(tmp_path):
    rng = np.random.default_rng(10)
    sizes = [int(s) for s in rng.integers(1, 64, size=3000)] + [3 * MiB + 17, 1 * MiB, 5, 2 * MiB - 3]
    random.Random(0).shuffle(sizes)
    arrays = [rand_array(rng, n) for n in sizes]
    layout = Layout(b"HDR" + bytes(range(200)), arrays)
    eng = build_engine(4 * MiB, chunk_bytes=512 * KiB)
    try:
        # Items in a scrambled order: checksums come back in the order given.
        order = list(range(len(arrays)))
        random.Random(1).shuffle(order)
        all_items = layout.items()
        items = [all_items[i] for i in order]
        path = tmp_path / "__0_0.safetensors"
        job = eng.submit_write(str(path), layout.header, layout.file_size, items)
        assert job.path == str(path)
        assert job.nbytes == sum(sizes)
        data_len = layout.file_size - len(layout.header)
        assert job.nchunks == -(-data_len // (512 * KiB))
        assert job.piece_size() == 512 * KiB
        wait(job)
        assert job.error() is None and job.is_done() and job.is_staged()
        data = check_file(path, layout)
        check_checksums(job, layout, data, order)
        s = eng.stats()
        assert s["bytes_flushed"] == s["bytes_staged"] == sum(sizes)
        assert s["jobs_done"] == s["jobs_submitted"] == 1 and s["jobs_failed"] == 0
        assert s["chunks_flushed"] == job.nchunks
    finally:
        eng.shutdown()


def test_job_much_larger_than_cache_reuses_one_cache(tmp_path):
    rng = np.random.default_rng(11)
    eng = build_engine(1 * MiB, copy_threads=2, flush_threads=1)
    try:
        s0 = eng.stats()
        assert s0["chunk_bytes"] == 256 * KiB and s0["slots_total"] == 4
        for rep in range(3):
            sizes = [4 * MiB + 123, 100, 3 * MiB, 777, 1 * MiB + 1]
            arrays = [rand_array(rng, n) for n in sizes]
            layout = Layout(os.urandom(4096), arrays)
            assert layout.file_size - 4096 >= 8 * MiB
            path = tmp_path / f"big{rep}.bin"
            job = eng.submit_write(str(path), layout.header, layout.file_size, layout.items(), sync=False)
            wait(job)
            assert job.error() is None
            data = check_file(path, layout)
            check_checksums(job, layout, data)
            s = eng.stats()
            assert s["cache_allocations"] == 1
            assert s["cache_address"] == s0["cache_address"]
            assert s["slots_free"] == s["slots_total"] == 4
            assert 1 <= s["peak_slots_used"] <= 4
        assert eng.stats()["backpressure_waits"] > 0
    finally:
        eng.shutdown()


def test_piece_checksums_follow_the_grid(tmp_path):
    """An item crossing grid cells has one CRC per piece; zero-length items have none."""
    rng = np.random.default_rng(12)
    grid = 4096
    sizes = [10, 5000, 0, 4096, 3 * 4096 + 1, 1, 0, 9000]
    arrays = [rand_array(rng, n) for n in sizes]
    layout = Layout(b"x" * 100, arrays)  # data_start 100: the grid is not page aligned
    eng = build_engine(64 * KiB, chunk_bytes=grid)
    try:
        job, data = write_checked(eng, tmp_path / "grid.bin", layout)
        crcs = job.checksums()
        assert crcs[2] == [] and crcs[6] == []
        assert len(crcs[1]) == 2 and len(crcs[4]) == 4
        check_checksums(job, layout, data)
        # a reader can verify a piece of a big item without reading the whole item
        off, n = layout.piece_ranges(4, grid)[2]
        assert crcs[4][2] == E.crc32c(data[off : off + n])
    finally:
        eng.shutdown()


def test_piece_checksums_span_flush_blocks(tmp_path):
    """A slot is checksummed and written in 256 KiB blocks: pieces that start, end or lie inside
    a block, with gaps between them, still get the CRC of exactly their bytes."""
    rng = np.random.default_rng(14)
    sizes = [3, 300 * KiB, 17, 0, 256 * KiB, 1 * MiB + 5, 40, 700 * KiB]
    gaps = [0, 1000, 256 * KiB - 7, 0, 3, 0, 12345, 1]
    arrays = [rand_array(rng, n) for n in sizes]
    layout = Layout(b"h" * 777, arrays, gaps=gaps)
    eng = build_engine(8 * MiB, chunk_bytes=2 * MiB)
    try:
        job, data = write_checked(eng, tmp_path / "blocks.bin", layout)
        assert job.piece_size() == 2 * MiB
        check_checksums(job, layout, data)

        eng.set_checksums(False)  # the benchmark hook: same bytes, no checksums
        job2, data2 = write_checked(eng, tmp_path / "nocrc.bin", layout)
        assert data2 == data
        assert all(c == 0 for crcs in job2.checksums() for c in crcs)
    finally:
        eng.shutdown()


def test_gaps_zero_items_header_only_and_tail(tmp_path):
    rng = np.random.default_rng(13)
    eng = build_engine(256 * KiB, chunk_bytes=64 * KiB)
    try:
        arrays = [rand_array(rng, n) for n in (100, 0, 70_000, 3)]
        layout = Layout(b"head", arrays, gaps=[5, 0, 9999, 1], tail=0)
        path = tmp_path / "gaps.bin"
        job = eng.submit_write(str(path), layout.header, layout.file_size, layout.items())
        wait(job)
        assert job.error() is None
        data = check_file(path, layout)
        check_checksums(job, layout, data)

        # header only, with zeros up to file_size; and a zero-length item at the very end
        path2 = tmp_path / "header_only.bin"
        z = np.zeros(0, dtype=np.uint8)
        job2 = eng.submit_write(str(path2), b"H" * 50, 80, [(0, 0, 80)])
        wait(job2)
        assert job2.error() is None and job2.checksums() == [[]]
        assert path2.read_bytes() == b"H" * 50 + bytes(30)
        assert z.nbytes == 0

        path3 = tmp_path / "empty.bin"
        job3 = eng.submit_write(str(path3), b"", 0, [])
        wait(job3)
        assert job3.error() is None and path3.read_bytes() == b"" and job3.checksums() == []

        # an existing longer file is truncated
        path4 = tmp_path / "old.bin"
        path4.write_bytes(b"z" * 100_000)
        a = rand_array(rng, 10)
        job4 = eng.submit_write(str(path4), b"hh", 12, [(ptr(a), 10, 2)])
        wait(job4)
        assert path4.read_bytes() == b"hh" + a.tobytes()
    finally:
        eng.shutdown()


def test_several_jobs_in_flight(tmp_path):
    rng = np.random.default_rng(14)
    eng = build_engine(1 * MiB, chunk_bytes=128 * KiB)
    try:
        jobs = []
        for j in range(8):
            sizes = [int(s) for s in rng.integers(1, 300 * KiB, size=12)]
            layout = Layout(f"header-{j}".encode() * 10, [rand_array(rng, n) for n in sizes])
            path = tmp_path / f"__{j}_0.safetensors"
            jobs.append((path, layout, eng.submit_write(str(path), layout.header, layout.file_size, layout.items())))
        for path, layout, job in jobs:
            assert job.wait_staged(20)
            wait(job)
            assert job.error() is None
            check_checksums(job, layout, check_file(path, layout))
        s = eng.stats()
        assert s["jobs_submitted"] == s["jobs_done"] == 8
        assert s["slots_free"] == s["slots_total"]
    finally:
        eng.shutdown()


def test_submit_is_fast_for_many_items(tmp_path):
    rng = np.random.default_rng(15)
    n = 20_000
    src = rand_array(rng, n * 16)
    base = ptr(src)
    header = b"h" * 4096
    items = [(base + 16 * i, 16, 4096 + 16 * i) for i in range(n)]
    eng = build_engine(8 * MiB)
    try:
        t0 = time.perf_counter()
        job = eng.submit_write(str(tmp_path / "many.bin"), header, 4096 + 16 * n, items, sync=False)
        dt = time.perf_counter() - t0
        wait(job)
        assert job.error() is None
        assert (tmp_path / "many.bin").read_bytes() == header + src.tobytes()
        assert len(job.checksums()) == n
        assert dt < 0.1, f"submit of {n} items took {dt * 1e3:.1f} ms"
    finally:
        eng.shutdown()


def test_torch_tensor_sources(tmp_path):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1000, generator=g), torch.arange(77, dtype=torch.int64), torch.zeros(0)]
    header = b"T" * 64
    items, pos, expected = [], len(header), bytearray(header)
    for t in tensors:
        n = t.numel() * t.element_size()
        items.append((t.data_ptr() if n else 0, n, pos))
        expected += t.numpy().tobytes()
        pos += n
    eng = build_engine(1 * MiB)
    try:
        path = tmp_path / "t.bin"
        job = eng.submit_write(str(path), header, pos, items)
        wait(job)
        assert job.error() is None
        assert path.read_bytes() == bytes(expected)
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# argument checks


def test_invalid_submit_arguments(tmp_path):
    eng = build_engine(1 * MiB)
    a = np.zeros(100, dtype=np.uint8)
    p, path = ptr(a), str(tmp_path / "x.bin")
    try:
        cases = [
            ([(p, 10, 5)], 200, "item 0.*inside the header"),
            ([(p, 10, 20), (p, 10, 25)], 200, "item 1.*overlaps item 0"),
            ([(p, 10, 20), (p, 50, 100), (p, 10, 15)], 200, r"item 0 \(.*file_offset=20\) overlaps item 2 \(.*file_offset=15\)"),
            ([(p, 10, 195)], 200, "item 0.*ends at 205, past file_size 200"),
            ([(0, 10, 20)], 200, "item 0.*src_ptr is null"),
            ([(p, -1, 20)], 200, "item 0: nbytes must be >= 0"),
            ([(p, 10)], 200, "item 0 must be a tuple"),
            ([(p, "x", 20)], 200, "item 0: nbytes must be an int"),
            ([], 3, "file_size 3 is smaller than the header"),
            ([], -1, "file_size must be >= 0"),
        ]
        for items, size, pattern in cases:
            with pytest.raises(ValueError, match=pattern):
                eng.submit_write(path, b"0123456789", size, items)
        with pytest.raises(ValueError, match="device 0"):
            eng.submit_write(path, b"", 10, [(p, 10, 0)], device=0)
        with pytest.raises(ValueError, match="unknown fault kind"):
            eng.set_fault("bogus")
        assert eng.stats()["jobs_submitted"] == 0
        assert not os.path.exists(path)
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# reading


def test_read_into_round_trip_parallel(tmp_path):
    rng = np.random.default_rng(20)
    blob = rand_array(rng, 6 * MiB + 321).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(blob)
    eng = build_engine(1 * MiB, read_threads=4)  # 256 KiB pieces: the big range is split ~25 ways
    try:
        big = np.empty(6 * MiB, dtype=np.uint8)
        small = [np.empty(n, dtype=np.uint8) for n in (1, 100, 4096, 0)]
        offs = [0, 77, 5 * MiB + 3, 10]
        ranges = [(ptr(big), 321, big.nbytes)] + [(ptr(b), o, b.nbytes) for b, o in zip(small, offs)]
        eng.read_into(str(path), ranges)
        assert big.tobytes() == blob[321:]
        for b, o in zip(small, offs):
            assert b.tobytes() == blob[o : o + b.nbytes]
        assert eng.stats()["bytes_read"] == big.nbytes + sum(b.nbytes for b in small)
        eng.read_into(str(path), [])  # nothing to do
    finally:
        eng.shutdown()


def test_read_into_checks_pieces_while_reading(tmp_path):
    rng = np.random.default_rng(21)
    blob = rand_array(rng, 3 * MiB + 999).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(blob)
    eng = build_engine(1 * MiB, read_threads=4)  # 256 KiB units: several groups, each its own stream
    try:
        big = np.empty(3 * MiB, dtype=np.uint8)
        small = np.empty(500, dtype=np.uint8)
        ranges = [(ptr(small), 5, small.nbytes), (ptr(big), 999, big.nbytes)]
        step = 300 * 1024  # pieces that do not line up with the 256 KiB units
        checks = [(1, off, min(step, 999 + big.nbytes - off), 0) for off in range(999, 999 + big.nbytes, step)]
        checks = [(i, o, n, E.crc32c(blob[o : o + n])) for i, o, n, _ in checks]
        checks.append((0, 105, 100, E.crc32c(blob[105:205])))  # part of a range: the rest is unchecked
        for threads in (0, 1, 2, 4, 9):
            big[:] = 0
            assert eng.read_into(str(path), ranges, checks, threads) is None
            assert big.tobytes() == blob[999:] and small.tobytes() == blob[5:505]
        bad = list(checks)
        i, o, n, crc = bad[5]
        bad[5] = (i, o, n, crc ^ 1)
        assert eng.read_into(str(path), ranges, bad) == (1, o, n, crc ^ 1, crc)
        assert eng.read_into(str(path), ranges, None) is None  # no checks: plain reads

        with pytest.raises(ValueError, match="outside the range or overlapping"):
            eng.read_into(str(path), ranges, [(0, 0, 10, 0)])  # starts before its range
        with pytest.raises(ValueError, match="outside the range or overlapping"):
            eng.read_into(str(path), ranges, [(0, 5, 10, 0), (0, 10, 10, 0)])
        with pytest.raises(ValueError, match="names range 7 of 2"):
            eng.read_into(str(path), ranges, [(7, 5, 10, 0)])
        with pytest.raises(ValueError, match="crc32c is not 32-bit"):
            eng.read_into(str(path), ranges, [(0, 5, 10, 1 << 32)])
        with pytest.raises(ValueError, match="check 0 must be a tuple"):
            eng.read_into(str(path), ranges, [(0, 5, 10)])
    finally:
        eng.shutdown()


def test_read_into_errors(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"a" * 1000)
    buf = np.empty(2000, dtype=np.uint8)
    eng = build_engine(1 * MiB)
    try:
        with pytest.raises(ValueError) as ei:
            eng.read_into(str(path), [(ptr(buf), 900, 200)])
        assert str(ei.value) == f"{path}: short read at offset 900: wanted 200 bytes, file has 1000"
        with pytest.raises(ValueError, match="short read at offset 5000"):
            eng.read_into(str(path), [(ptr(buf), 5000, 1)])

        missing = tmp_path / "missing.bin"
        with pytest.raises(FileNotFoundError) as ei:
            eng.read_into(str(missing), [(ptr(buf), 0, 10)])
        assert ei.value.errno == errno.ENOENT
        assert str(missing) in str(ei.value)

        with pytest.raises(OSError) as ei:  # only regular files are read: a directory is refused at open
            eng.read_into(str(tmp_path), [(ptr(buf), 0, 10)])
        assert ei.value.errno == errno.EISDIR
        assert f"{tmp_path}: is a folder, not a regular file" in str(ei.value)

        with pytest.raises(ValueError, match="range 0: dst_ptr is null"):
            eng.read_into(str(path), [(0, 0, 10)])
        with pytest.raises(ValueError, match="range 1: nbytes must be >= 0"):
            eng.read_into(str(path), [(ptr(buf), 0, 1), (ptr(buf), 0, -5)])
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# faults


@pytest.mark.parametrize(
    "kind, cause",
    [
        ("eio", "pwrite of .* bytes at offset .* failed.*Input/output error \\(errno 5\\)"),
        ("enospc", "pwrite of .* bytes at offset .* failed.*No space left on device \\(errno 28\\)"),
        ("short_write", "short write"),
        ("fsync_eio", "fsync .*failed: Input/output error \\(errno 5\\)"),
    ],
)
def test_fault_kinds_fail_the_job_not_the_engine(tmp_path, kind, cause):
    rng = np.random.default_rng(30)
    eng = build_engine(512 * KiB, chunk_bytes=64 * KiB)
    try:
        layout = Layout(b"H" * 10, [rand_array(rng, n) for n in (300 * KiB, 5, 200 * KiB)])
        eng.set_fault(kind)
        path = tmp_path / f"__{kind}.safetensors"
        job = eng.submit_write(str(path), layout.header, layout.file_size, layout.items())  # raises nothing
        assert job.wait_staged(20)
        wait(job)
        err = job.error()
        assert err is not None and err.startswith(str(path) + ": ")
        assert re.search(cause, err), err
        with pytest.raises(RuntimeError, match="failed"):
            job.checksums()
        s = eng.stats()
        assert s["jobs_failed"] == 1 and s["jobs_done"] == 1
        assert s["slots_free"] == s["slots_total"]

        eng.set_fault("none")
        path2 = tmp_path / "ok.bin"
        job2 = eng.submit_write(str(path2), layout.header, layout.file_size, layout.items())
        wait(job2)
        assert job2.error() is None
        check_checksums(job2, layout, check_file(path2, layout))
    finally:
        eng.shutdown()


def test_fault_filters_by_path_and_after_bytes(tmp_path):
    rng = np.random.default_rng(31)
    eng = build_engine(512 * KiB, chunk_bytes=64 * KiB)
    try:
        layout = Layout(b"", [rand_array(rng, 1 * MiB)])
        eng.set_fault("eio", path_substring="BADFILE")
        good = eng.submit_write(str(tmp_path / "good.bin"), b"", layout.file_size, layout.items())
        bad = eng.submit_write(str(tmp_path / "BADFILE.bin"), b"", layout.file_size, layout.items())
        wait(good)
        wait(bad)
        assert good.error() is None
        check_file(tmp_path / "good.bin", layout)
        assert bad.error().startswith(str(tmp_path / "BADFILE.bin") + ": pwrite of 65536 bytes at offset ")

        eng.set_fault("enospc", after_bytes=int(1.5 * MiB))
        first = eng.submit_write(str(tmp_path / "first.bin"), b"", layout.file_size, layout.items())
        wait(first)
        assert first.error() is None  # only 1 MiB flushed since set_fault
        flushed_before = eng.stats()["bytes_flushed"]
        second = eng.submit_write(str(tmp_path / "second.bin"), b"", layout.file_size, layout.items())
        wait(second)
        assert "No space left on device" in second.error()
        # the fault armed only once 0.5 MiB of the second file had gone through (which chunk meets
        # it first depends on thread timing: a preempted flush worker may check chunk 0 last)
        assert eng.stats()["bytes_flushed"] - flushed_before >= MiB // 2
        eng.set_fault("none")
        assert eng.stats()["slots_free"] == eng.stats()["slots_total"]
    finally:
        eng.shutdown()


def test_open_failure_is_reported_on_the_job(tmp_path):
    eng = build_engine(256 * KiB)
    try:
        a = np.ones(10, dtype=np.uint8)
        path = tmp_path / "no_such_dir" / "f.bin"
        job = eng.submit_write(str(path), b"", 10, [(ptr(a), 10, 0)])
        wait(job)
        assert job.error() == f"{path}: open for writing failed: No such file or directory (errno 2)"
    finally:
        eng.shutdown()


def test_cache_wait_timeout_when_flushes_stall(tmp_path):
    """A hung device (the "stall" fault: flushes of the file wait until it is cleared or their job
    fails) releases no slot in time, so the copy worker gives up after cache_wait_timeout_s and
    the job fails instead of hanging. (A FIFO used to stall the open; the engine now refuses
    FIFOs without blocking.)"""
    stalled = tmp_path / "stalled.bin"
    rng = np.random.default_rng(40)
    eng = build_engine(16 * KiB, chunk_bytes=4096, copy_threads=1, flush_threads=1, cache_wait_timeout_s=0.2)
    try:
        eng.set_fault("stall", 0, "stalled.bin")
        a = rand_array(rng, 8 * 4096)
        job = eng.submit_write(str(stalled), b"", a.nbytes, [(ptr(a), a.nbytes, 0)])
        assert job.wait_staged(10)
        assert "host cache full for 0.2 s" in job.error()
        assert str(stalled) in job.error()
        eng.set_fault("none")
        wait(job)  # the failed job's held flushes are dropped, its slots given back
        s = eng.stats()
        assert s["slots_free"] == s["slots_total"] and s["backpressure_waits"] >= 1

        ok = tmp_path / "after.bin"
        job2 = eng.submit_write(str(ok), b"", a.nbytes, [(ptr(a), a.nbytes, 0)])
        wait(job2)
        assert job2.error() is None and ok.read_bytes() == a.tobytes()
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# shutdown


def test_shutdown_drains_and_is_idempotent(tmp_path):
    rng = np.random.default_rng(50)
    eng = build_engine(256 * KiB, flush_threads=1)
    layout = Layout(b"hdr", [rand_array(rng, n) for n in (3 * MiB, 17, 1 * MiB)])
    path = tmp_path / "drain.bin"
    job = eng.submit_write(str(path), layout.header, layout.file_size, layout.items())
    eng.shutdown()  # returns only after the pending job is written
    assert job.is_done() and job.error() is None
    check_checksums(job, layout, check_file(path, layout))
    assert eng.is_shut_down
    eng.shutdown()
    with pytest.raises(RuntimeError, match="engine is shut down"):
        eng.submit_write(str(tmp_path / "late.bin"), b"", 0, [])
    # reads still work (on the calling thread) and stats stay readable
    buf = np.empty(layout.file_size, dtype=np.uint8)
    eng.read_into(str(path), [(ptr(buf), 0, buf.nbytes)])
    assert buf.tobytes() == layout.expected
    assert eng.stats()["jobs_done"] == 1


def test_concurrent_shutdown_calls_and_job_outlives_engine(tmp_path):
    rng = np.random.default_rng(51)
    eng = build_engine(256 * KiB)
    a = rand_array(rng, 2 * MiB)
    job = eng.submit_write(str(tmp_path / "c.bin"), b"", a.nbytes, [(ptr(a), a.nbytes, 0)])
    threads = [threading.Thread(target=eng.shutdown) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert job.is_done()
    del eng  # the job keeps its own state
    assert job.error() is None and len(job.checksums()[0]) == 32  # 2 MiB on a 64 KiB grid
    assert (tmp_path / "c.bin").read_bytes() == a.tobytes()


# --------------------------------------------------------------------------------------------
# host cache prefault: the whole cache is made resident once, in the background, at start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _until(cond, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_prefault_makes_the_cache_resident_without_a_checkpoint():
    cache = 128 * MiB
    before = _rss()
    eng = build_engine(cache, chunk_bytes=8 * MiB)
    try:
        assert _until(lambda: eng.stats()["cache_prefaulted_bytes"] == cache)
        grown = _rss() - before
        assert 0.9 * cache <= grown <= cache + 32 * MiB, grown
        assert eng.stats()["bytes_staged"] == 0  # resident with no job at all
    finally:
        eng.shutdown()


def test_prefault_off_leaves_the_cache_untouched():
    cache = 128 * MiB
    before = _rss()
    eng = build_engine(cache, prefault=False)
    try:
        time.sleep(0.2)
        assert eng.stats()["cache_prefaulted_bytes"] == 0
        assert _rss() - before < 32 * MiB
    finally:
        eng.shutdown()


def test_copies_while_prefaulting_are_correct(tmp_path):
    """Jobs submitted right after start fill slots the prefault thread may still be walking: it
    must never change a byte a copy worker wrote."""
    rng = np.random.default_rng(21)
    eng = build_engine(512 * MiB, chunk_bytes=1 * MiB)
    try:
        jobs = []
        for j in range(4):
            sizes = [int(s) for s in rng.integers(1, 3 * MiB, size=24)]
            layout = Layout(b"h" * 4096, [rand_array(rng, n) for n in sizes])
            path = tmp_path / f"__{j}_0.safetensors"
            jobs.append((path, layout, eng.submit_write(str(path), layout.header, layout.file_size, layout.items())))
        for path, layout, job in jobs:
            wait(job, 60)
            assert job.error() is None
            check_checksums(job, layout, check_file(path, layout))
    finally:
        eng.shutdown()


def test_shutdown_right_after_start_does_not_wait_for_prefault():
    cache = 2048 * MiB
    for pause in (0.0, 0.05):
        eng = build_engine(cache)
        time.sleep(pause)
        t0 = time.perf_counter()
        eng.shutdown()
        took = time.perf_counter() - t0
        done = eng.stats()["cache_prefaulted_bytes"]
        assert took < 1.0, f"shutdown took {took:.3f} s"
        assert done < cache  # stopped part way: 2 GiB take seconds to fault in here
        eng.shutdown()  # still idempotent


def test_prefault_waits_while_copies_run():
    """A checkpoint that is copying does its own page faults; the prefault thread waits for it
    instead of competing for the CPU. Here the copies cannot finish (a stream nobody consumes,
    larger than the cache), so the prefault stays paused until the job fails."""
    cache, chunk = 256 * MiB, 1 * MiB
    src = np.ones(chunk, dtype=np.uint8)
    eng = build_engine(cache, chunk_bytes=chunk, cache_wait_timeout_s=60.0)
    try:
        items = [(ptr(src), chunk, 4096 + k * chunk) for k in range(300)]  # 300 chunks, 256 slots
        job = eng.submit_stream("mem://stalled", b"h" * 4096, 4096 + 300 * chunk, items)
        assert _until(lambda: eng.stats()["slots_free"] == 0)
        time.sleep(0.3)
        paused = eng.stats()["cache_prefaulted_bytes"]
        time.sleep(0.3)
        assert eng.stats()["cache_prefaulted_bytes"] == paused < cache
        job.fail("test: nobody consumes this stream")
        assert _until(lambda: eng.stats()["cache_prefaulted_bytes"] == cache)
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# abort of a file job (Ctrl-C abandoning a checkpoint in flight)


def test_fail_abandons_a_file_job_in_flight(tmp_path):
    """job.fail() on a file job whose flushes are held up (the "stall" fault) and whose copies
    wait for cache slots (4x larger than the cache): the job is done at once with that error,
    every slot is given back, nothing more is written, and the engine goes on working."""
    rng = np.random.default_rng(41)
    eng = build_engine(64 * KiB, chunk_bytes=16 * KiB, copy_threads=1, flush_threads=2, cache_wait_timeout_s=600)
    try:
        a = rand_array(rng, 256 * KiB)
        path = tmp_path / "stalled.bin"
        eng.set_fault("stall", 0, "stalled")
        job = eng.submit_write(str(path), b"H" * 64, 64 + a.nbytes, [(ptr(a), a.nbytes, 64)])
        assert not job.wait_done(0.3)  # held: flushes stalled, copies wait for slots
        assert job.bytes_done == 0 and job.error() is None
        job.fail("checkpoint abandoned: Ctrl-C")
        assert job.wait_done(5.0)  # no copy worker waits out cache_wait_timeout_s (600 s)
        assert job.error() == "checkpoint abandoned: Ctrl-C"
        assert job.bytes_done == 0
        with pytest.raises(RuntimeError, match="write failed, no checksums: checkpoint abandoned"):
            job.checksums()
        s = eng.stats()
        assert s["slots_free"] == s["slots_total"]
        assert s["jobs_failed"] == 1
        assert os.path.getsize(path) < 64 + a.nbytes  # left incomplete
        job.fail("a second reason")  # idempotent: the first error wins
        assert job.error() == "checkpoint abandoned: Ctrl-C"

        eng.set_fault("none", 0, "")
        ok = tmp_path / "after.bin"
        job2 = eng.submit_write(str(ok), b"", a.nbytes, [(ptr(a), a.nbytes, 0)])
        wait(job2)
        assert job2.error() is None and ok.read_bytes() == a.tobytes()
        assert job2.bytes_done == a.nbytes
    finally:
        eng.set_fault("none", 0, "")
        eng.shutdown()


def test_fail_after_done_marks_the_job_failed_and_leaves_the_file(tmp_path):
    rng = np.random.default_rng(42)
    eng = build_engine(64 * KiB, chunk_bytes=16 * KiB, copy_threads=1, flush_threads=1)
    try:
        a = rand_array(rng, 40 * KiB)
        job = eng.submit_write(str(tmp_path / "f.bin"), b"", a.nbytes, [(ptr(a), a.nbytes, 0)])
        wait(job)
        job.fail("too late")
        assert job.error() == "too late"  # recorded, but the file was already complete
        assert (tmp_path / "f.bin").read_bytes() == a.tobytes()
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# jobs submitted before their file is named (the request starts the copies; the folder is
# prepared off the training thread, then the file is named)


def test_unnamed_job_copies_now_and_writes_only_once_named(tmp_path):
    rng = np.random.default_rng(7)
    layout = Layout(b"HDR", [rand_array(rng, 200 * KiB), rand_array(rng, 70 * KiB)], gaps=[5, 0], tail=9)
    eng = build_engine(1 * MiB, chunk_bytes=64 * KiB)
    try:
        label = str(tmp_path / "__0_0.safetensors")
        job = eng.submit_write(label, layout.header, layout.file_size, layout.items(), named=False)
        assert job.wait_staged(20)  # the copies ran without a file
        time.sleep(0.05)
        assert not job.is_done() and os.listdir(tmp_path) == []  # nothing written yet
        final = tmp_path / "__0_0.abc123.safetensors"
        job.set_destination(str(final))
        wait(job)
        assert job.error() is None
        data = check_file(final, layout)
        check_checksums(job, layout, data)
        assert os.listdir(tmp_path) == [final.name]
        with pytest.raises(RuntimeError, match="named already"):
            job.set_destination(str(tmp_path / "again"))
        st = eng.stats()
        assert st["slots_free"] == st["slots_total"]
    finally:
        eng.shutdown()


def test_failing_an_unnamed_job_frees_its_slots_and_writes_nothing(tmp_path):
    rng = np.random.default_rng(8)
    big = Layout(b"", [rand_array(rng, 1 * MiB)])  # more than the cache: copies wait for slots
    eng = build_engine(256 * KiB, chunk_bytes=64 * KiB)
    try:
        job = eng.submit_write(str(tmp_path / "x"), big.header, big.file_size, big.items(), named=False)
        time.sleep(0.1)
        assert not job.is_staged()  # every slot is parked with the unnamed job
        job.fail("the folder could not be prepared")
        wait(job)
        assert job.error() == "the folder could not be prepared"
        assert os.listdir(tmp_path) == []
        st = eng.stats()
        assert st["slots_free"] == st["slots_total"]
        # the engine goes on: a later named job gets the slots
        ok = Layout(b"H", [rand_array(rng, 300 * KiB)])
        write_checked(eng, tmp_path / "later", ok)
    finally:
        eng.shutdown()


def test_backpressure_waits_for_the_name_then_drains(tmp_path):
    rng = np.random.default_rng(9)
    big = Layout(b"HEAD", [rand_array(rng, 1 * MiB + 123)])
    eng = build_engine(256 * KiB, chunk_bytes=64 * KiB)
    try:
        job = eng.submit_write(str(tmp_path / "label"), big.header, big.file_size, big.items(), named=False)
        time.sleep(0.1)
        assert not job.is_staged()
        threading.Timer(0.05, job.set_destination, args=(str(tmp_path / "f"),)).start()
        wait(job)
        assert job.error() is None
        check_file(tmp_path / "f", big)
    finally:
        eng.shutdown()


def test_a_named_job_writes_its_parked_chunks_ahead_of_chunks_queued_meanwhile(tmp_path):
    """One flush worker. B is submitted unnamed (its chunks parked), then A's chunk stalls the
    worker and C's chunk queues behind it; B is named. Its parked chunks go back to the head of
    the flush queue: once A is let through (the stall moves on to C), B is written in full while
    C waits. Put back behind C, as they once were, B would wait for C, and a named file's written
    prefix (what the drain copies) for whatever was queued before it was named."""
    rng = np.random.default_rng(11)
    eng = build_engine(1 * MiB, chunk_bytes=16 * KiB, copy_threads=1, flush_threads=1, cache_wait_timeout_s=600)
    b = Layout(b"B" * 32, [rand_array(rng, 64 * KiB)])
    one = Layout(b"", [rand_array(rng, 16 * KiB)])
    try:
        eng.set_fault("stall", 0, "XSTALLA")
        job_b = eng.submit_write(str(tmp_path / "b-label"), b.header, b.file_size, b.items(), named=False)
        assert job_b.wait_staged(20)
        job_a = eng.submit_write(str(tmp_path / "XSTALLA"), one.header, one.file_size, one.items())
        job_c = eng.submit_write(str(tmp_path / "XSTALLC"), one.header, one.file_size, one.items())
        assert job_a.wait_staged(20) and job_c.wait_staged(20)
        time.sleep(0.2)  # the worker parks B's chunks and stalls in A's
        assert job_a.written_prefix == 0 and not job_b.is_done()
        job_b.set_destination(str(tmp_path / "b"))
        eng.set_fault("stall", 0, "XSTALLC")  # A goes through; C's chunk stalls the worker
        wait(job_a)
        wait(job_b, 10)  # behind C, B would wait for C's stall
        assert job_b.error() is None and job_c.written_prefix == 0 and not job_c.is_done()
        check_file(tmp_path / "b", b)
        eng.set_fault("none", 0, "")
        wait(job_c)
        check_file(tmp_path / "XSTALLC", one)
    finally:
        eng.set_fault("none", 0, "")
        eng.shutdown()


def test_shutdown_fails_a_job_never_named(tmp_path):
    rng = np.random.default_rng(10)
    big = Layout(b"", [rand_array(rng, 1 * MiB)])
    eng = build_engine(256 * KiB, chunk_bytes=64 * KiB)
    job = eng.submit_write(str(tmp_path / "never"), big.header, big.file_size, big.items(), named=False)
    time.sleep(0.05)
    eng.shutdown()  # must not wait for a name forever
    assert job.is_done()
    assert "the engine shut down before the file was named" in job.error()
    assert os.listdir(tmp_path) == []


# written_prefix: what the local tier's drain may copy while the engine still writes a file


def _expected_file(header: bytes, file_size: int, items: list) -> bytes:
    out = bytearray(file_size)
    out[: len(header)] = header
    for a, off in items:
        out[off: off + a.nbytes] = a.tobytes()
    return bytes(out)


def test_written_prefix_stops_at_the_first_chunk_not_written(tmp_path):
    """Flushes stall after 5 chunks (the "stall" fault, one flush worker): the prefix is the
    header plus those 5 chunks, and the file holds exactly the final bytes there; nothing is
    written while the job waits for its name; a failed job wakes a waiter at once."""
    rng = np.random.default_rng(50)
    eng = build_engine(64 * KiB, chunk_bytes=16 * KiB, copy_threads=1, flush_threads=1, cache_wait_timeout_s=600)
    try:
        a = rand_array(rng, 256 * KiB)
        header = b"H" * 64
        size = 64 + a.nbytes
        path = tmp_path / "stalled.bin"
        eng.set_fault("stall", 5 * 16 * KiB, "stalled")
        job = eng.submit_write(str(path), header, size, [(ptr(a), a.nbytes, 64)], named=False)
        assert job.wait_written(1, 0.2) == 0 and job.written_prefix == 0  # unnamed: its chunks are parked
        job.set_destination(str(path))
        assert job.wait_written(64 + 5 * 16 * KiB, 20) == 64 + 5 * 16 * KiB  # (a loaded machine: up to 20 s)
        prefix = job.wait_written(size, 0.3)  # the 6th chunk's flush stalls: no further
        assert prefix == 64 + 5 * 16 * KiB == job.written_prefix
        assert path.read_bytes()[:prefix] == _expected_file(header, size, [(a, 64)])[:prefix]
        eng.set_fault("none", 0, "")
        assert job.wait_written(size, 10) == size
        wait(job)
        assert job.written_prefix == size and path.read_bytes() == _expected_file(header, size, [(a, 64)])

        eng.set_fault("stall", 0, "failing")
        failing = tmp_path / "failing.bin"
        job2 = eng.submit_write(str(failing), header, size, [(ptr(a), a.nbytes, 64)])
        threading.Timer(0.2, job2.fail, ("abandoned",)).start()
        t0 = time.monotonic()
        assert job2.wait_written(size, 30) < size  # woken by the failure, not the timeout
        assert time.monotonic() - t0 < 5 and job2.error() == "abandoned"
    finally:
        eng.set_fault("none", 0, "")
        eng.shutdown()


def test_written_prefix_never_covers_bytes_still_to_be_written(tmp_path):
    """Two flush workers write chunks out of order; a reader polling the prefix finds the final
    bytes (header, items, the zeros between them) everywhere below it, at every step."""
    rng = np.random.default_rng(51)
    eng = build_engine(256 * KiB, chunk_bytes=4 * KiB, copy_threads=2, flush_threads=2)
    try:
        header = b"h" * 100
        items, off = [], 100
        for _ in range(300):
            a = rand_array(rng, int(rng.integers(1, 40)) * 256)
            off += int(rng.integers(0, 3)) * 512  # gaps of zeros between some items
            items.append((a, off))
            off += a.nbytes
        size = off + 1000  # a zero tail, set by the final truncate
        expected = _expected_file(header, size, items)
        for attempt in range(4):  # the workers' interleaving differs from run to run
            path = tmp_path / f"racing-{attempt}.bin"
            job = eng.submit_write(str(path), header, size, [(ptr(a), a.nbytes, o) for a, o in items])
            seen = []
            while True:
                p = job.written_prefix
                if p:
                    with open(path, "rb") as f:
                        got = f.read(p)
                    assert got == expected[:p], f"prefix {p}: bytes below it differ from the final file"
                    seen.append(p)
                if p == size:
                    break
                job.wait_written(p + 1, 10)
            wait(job)
            assert job.error() is None and seen == sorted(seen)
    finally:
        eng.shutdown()


def test_crc32c_ranges_match_one_call_per_range():
    rng = np.random.default_rng(52)
    eng = build_engine(64 * KiB)
    try:
        a = rand_array(rng, 10_000)
        ranges = [(0, 100), (100, 9900), (5, 0), (9_999, 1)]
        expected = [E.crc32c(a[o:o + n].tobytes()) for o, n in ranges]
        assert eng.crc32c_ranges(ptr(a), ranges) == expected
        assert eng.crc32c_ranges(ptr(a), []) == []
        with pytest.raises(ValueError, match="offsets and lengths must be >= 0"):
            eng.crc32c_ranges(ptr(a), [(0, -1)])
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------------------------
# sources that go away while they are read (csrc/fault_guard.h)

_libc = __import__("ctypes").CDLL(None, use_errno=True)
_libc.mmap.restype = __import__("ctypes").c_void_p
_libc.mmap.argtypes = [__import__("ctypes").c_void_p, __import__("ctypes").c_size_t, __import__("ctypes").c_int,
                       __import__("ctypes").c_int, __import__("ctypes").c_int, __import__("ctypes").c_long]
_libc.munmap.argtypes = [__import__("ctypes").c_void_p, __import__("ctypes").c_size_t]


def _mapped(nbytes: int) -> int:
    """Anonymous memory of our own, filled, that the test can unmap under the engine."""
    import ctypes

    addr = _libc.mmap(None, nbytes, 0x1 | 0x2, 0x02 | 0x20, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    ctypes.memset(addr, 0x5A, nbytes)
    return addr


@pytest.mark.parametrize("direct", [False, True], ids=["through the cache", "direct write"])
def test_a_source_unmapped_before_its_copy_fails_the_job_not_the_process(tmp_path, direct):
    """The state's memory freed and returned to the system (a storage resized to 0, a truncated
    mmap) while the copies wait for room in the cache (flushes held): the read faults on the
    guarded range, the job fails naming the file and the cause, and the engine goes on."""
    size = 8 * MiB
    src = _mapped(size)
    eng = build_engine(1 * MiB, chunk_bytes=256 * 1024)
    path = tmp_path / "gone.bin"
    try:
        eng.set_fault("stall", 0, str(path))  # the first chunks fill the cache; the rest wait
        job = eng.submit_write(str(path), b"", size, [(src, size, 0)], direct=direct)
        time.sleep(0.2)
        assert _libc.munmap(src, size) == 0
        eng.set_fault("none", 0, "")
        wait(job)
        error = job.error() or ""
        assert re.search(r"gone\.bin: the source memory of file bytes \[\d+, \d+\) was unmapped while it was "
                         r"copied: a tensor of the state was freed or resized", error), error
        assert error.count("gone.bin") == 1, error
        ok = tmp_path / "after.bin"  # the engine still works
        a = np.arange(1000, dtype=np.uint8)
        job2 = eng.submit_write(str(ok), b"", a.nbytes, [(ptr(a), a.nbytes, 0)])
        wait(job2)
        assert job2.error() is None and ok.read_bytes() == a.tobytes()
    finally:
        eng.set_fault("none", 0, "")
        eng.shutdown()


_OTHER_FAULT = """
import ctypes, sys
import dcp_datastates._engine as E
sys.path.insert(0, sys.argv[1])
from engine_util import build_engine
eng = build_engine(1 << 20)  # the fault guard is installed
print("READY", flush=True)
ctypes.string_at(8)  # a fault outside any guarded read: the process must still die of it
print("SURVIVED", flush=True)
"""


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_fault_outside_the_engines_reads_still_ends_the_process(tmp_path, faulthandler):
    """The guard takes only faults on the range a copy worker is reading: any other goes to the
    handler installed before (Python's faulthandler, which prints the traceback) or the default
    action, and the process dies of SIGSEGV as it would have without the engine."""
    import subprocess
    import sys

    script = tmp_path / "fault.py"
    script.write_text(_OTHER_FAULT)
    args = [sys.executable, *(["-X", "faulthandler"] if faulthandler else []), str(script), os.path.dirname(__file__)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert "READY" in res.stdout and "SURVIVED" not in res.stdout, res.stdout + res.stderr
    assert res.returncode == -11, (res.returncode, res.stderr)
    assert ("Fatal Python error: Segmentation fault" in res.stderr) == faulthandler, res.stderr
