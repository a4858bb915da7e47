"""Tests of the engine's streaming mode (Engine.submit_stream): chunks handed to one consumer in
file order, checksums, in-order slot grants (no deadlock with a tiny cache), failures and
timeouts, and that it mixes with ordinary file jobs."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import numpy as np
import pytest

import dcp_datastates._engine as E

from engine_util import build_engine

KiB = 1 << 10
CHUNK = 4 * KiB  # the smallest grid (the alignment): many chunks from little data


def _engine(slots: int, copy_threads: int = 2, flush_threads: int = 2, **kw) -> E.Engine:
    eng = build_engine(slots * CHUNK, chunk_bytes=CHUNK, copy_threads=copy_threads, flush_threads=flush_threads, **kw)
    assert eng.stats()["slots_total"] == slots
    return eng


class _Layout:
    """A header, then arrays at increasing offsets (optional gaps), then an optional tail."""

    def __init__(self, rng: np.random.Generator, sizes: list[int], header_len: int = 4096, gaps=None, tail: int = 0):
        self.header = bytes(rng.integers(0, 256, size=header_len, dtype=np.uint8))
        self.arrays = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]
        self.offsets = []
        pos = header_len
        for i, a in enumerate(self.arrays):
            pos += gaps[i] if gaps else 0
            self.offsets.append(pos)
            pos += a.nbytes
        self.file_size = pos + tail
        buf = bytearray(self.file_size)
        buf[:header_len] = self.header
        for a, off in zip(self.arrays, self.offsets):
            buf[off : off + a.nbytes] = a.tobytes()
        self.expected = bytes(buf)

    def items(self):
        return [(a.ctypes.data if a.nbytes else 0, a.nbytes, off) for a, off in zip(self.arrays, self.offsets)]


def _consume(job, header: bytes, file_size: int, delay: float = 0.0, out: dict | None = None,
             taken: bytes = b"") -> bytes:
    """The consumer a remote uploader runs: it only appends what the engine hands out (header,
    data chunks, zeros), releasing each piece; every byte must come, in order, exactly once.
    ``taken``: the bytes the test already took from this job."""
    data = bytearray(taken)
    offsets = []
    while True:
        c = job.next_chunk(timeout=30)
        if c is None:
            break
        off, ptr, n = c
        offsets.append(off)
        assert off == len(data), "the pieces must come back to back, in file order"
        data += bytes((ctypes.c_char * n).from_address(ptr))
        if delay:
            time.sleep(delay * random.random())
        job.release(off)
    if job.error() is None:
        assert len(data) == file_size and data[: len(header)] == header
    if out is not None:
        out["offsets"] = offsets
    return bytes(data)


def _crcs(data: bytes, lay: _Layout, grid: int) -> list[list[int]]:
    start = len(lay.header)
    out = []
    for a, off in zip(lay.arrays, lay.offsets):
        pieces, pos, end = [], off, off + a.nbytes
        while pos < end:
            stop = min(end, start + ((pos - start) // grid + 1) * grid)
            pieces.append(E.crc32c(data[pos:stop]))
            pos = stop
        out.append(pieces)
    return out


def test_stream_round_trip_bytes_checksums_and_counters(tmp_path):
    rng = np.random.default_rng(0)
    eng = _engine(8)
    try:
        lay = _Layout(rng, [1, 5000, 0, 3 * CHUNK + 17, 100, CHUNK], header_len=4096 + 88, gaps=[0, 3, 0, 700, 0, 1], tail=9)
        job = eng.submit_stream("memory://x/file", lay.header, lay.file_size, lay.items())
        assert job.is_stream and job.path == "memory://x/file"
        info = {}
        data = _consume(job, lay.header, lay.file_size, out=info)
        assert data == lay.expected
        # Byte for byte what a file job of the same layout writes: one side makes every byte.
        local = eng.submit_write(str(tmp_path / "same"), lay.header, lay.file_size, lay.items(), False)
        assert local.wait_done(10) and local.error() is None
        assert (tmp_path / "same").read_bytes() == data
        assert info["offsets"] == sorted(info["offsets"])
        assert job.wait_done(10) and job.error() is None
        assert job.checksums() == _crcs(data, lay, job.piece_size())
        s = eng.stats()
        assert s["slots_free"] == s["slots_total"]
        assert s["jobs_done"] == 2 and s["jobs_failed"] == 0  # the stream and the file job
        assert s["bytes_flushed"] == 2 * sum(a.nbytes for a in lay.arrays)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_in_order_consumption_never_deadlocks_with_a_tiny_cache(slots):
    """50 chunks through 2-4 slots with 2 copy threads: chunk k always gets a slot before any
    later chunk, so the consumer (which waits for chunks in order) always progresses."""
    rng = np.random.default_rng(slots)
    eng = _engine(slots, copy_threads=2, flush_threads=2, cache_wait_timeout_s=20.0)
    try:
        for _ in range(3):
            sizes = [int(x) for x in rng.integers(1, 3 * CHUNK, size=30)]
            lay = _Layout(rng, sizes)
            job = eng.submit_stream("s3://b/f", lay.header, lay.file_size, lay.items())
            assert job.nchunks >= 20
            data = _consume(job, lay.header, lay.file_size, delay=0.002)
            assert data == lay.expected
            assert job.wait_done(10) and job.error() is None
        big = _Layout(rng, [50 * CHUNK])
        job = eng.submit_stream("s3://b/big", big.header, big.file_size, big.items())
        assert job.nchunks == 50
        assert _consume(job, big.header, big.file_size, delay=0.001) == big.expected
        assert job.wait_done(10) and job.error() is None
        assert eng.stats()["peak_slots_used"] <= slots
    finally:
        eng.shutdown()


def test_concurrent_stream_and_file_jobs_share_a_tiny_cache(tmp_path):
    """Several streams (one consumer thread each, started in submission order) and file jobs
    interleaved through 3 slots."""
    rng = np.random.default_rng(7)
    eng = _engine(3, cache_wait_timeout_s=30.0)
    try:
        jobs, threads, results = [], [], {}
        for k in range(6):
            lay = _Layout(rng, [int(x) for x in rng.integers(1, 4 * CHUNK, size=12)])
            if k % 3 == 2:
                path = str(tmp_path / f"f{k}")
                jobs.append((k, lay, eng.submit_write(path, lay.header, lay.file_size, lay.items(), False)))
                continue
            job = eng.submit_stream(f"s3://b/{k}", lay.header, lay.file_size, lay.items())
            jobs.append((k, lay, job))

            def run(job=job, lay=lay, k=k):
                results[k] = _consume(job, lay.header, lay.file_size, delay=0.002)

            t = threading.Thread(target=run)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        for k, lay, job in jobs:
            assert job.wait_done(20) and job.error() is None, job.error()
            if job.is_stream:
                assert results[k] == lay.expected
            else:
                assert (tmp_path / f"f{k}").read_bytes() == lay.expected
        s = eng.stats()
        assert s["slots_free"] == s["slots_total"] == 3
    finally:
        eng.shutdown()


def test_consumer_fail_releases_every_slot_and_reports_the_message():
    rng = np.random.default_rng(3)
    eng = _engine(4)
    try:
        lay = _Layout(rng, [20 * CHUNK])
        job = eng.submit_stream("s3://b/f", lay.header, lay.file_size, lay.items())
        taken = [job.next_chunk(10) for _ in range(3)]
        assert all(taken) and taken[0][0] == 0 and taken[0][2] == len(lay.header)  # the header, no slot
        assert [t[0] for t in taken[1:]] == [len(lay.header), len(lay.header) + CHUNK]
        assert job.chunks_held() == 2
        job.release(taken[0][0])
        job.release(taken[1][0])
        assert job.chunks_held() == 1
        job.fail("upload of s3://b/f failed: connection reset")
        assert job.chunks_held() == 0
        assert job.next_chunk(1) is None
        assert job.wait_done(10)
        assert "connection reset" in job.error()
        job.fail("a second error")  # the first error wins
        assert "connection reset" in job.error()
        with pytest.raises(RuntimeError, match="connection reset"):
            job.checksums()
        with pytest.raises(ValueError, match="release"):
            job.release(taken[2][0])  # already given back by fail()
        s = eng.stats()
        assert s["slots_free"] == s["slots_total"] and s["jobs_failed"] == 1
        # The engine goes on: a new stream works.
        job2 = eng.submit_stream("s3://b/g", lay.header, lay.file_size, lay.items())
        assert _consume(job2, lay.header, lay.file_size) == lay.expected
        assert job2.wait_done(10) and job2.error() is None
    finally:
        eng.shutdown()


def test_next_chunk_timeout_while_an_earlier_stream_holds_the_cache():
    rng = np.random.default_rng(4)
    eng = _engine(2)
    try:
        first = _Layout(rng, [4 * CHUNK])
        second = _Layout(rng, [2 * CHUNK])
        j1 = eng.submit_stream("s3://b/1", first.header, first.file_size, first.items())
        j2 = eng.submit_stream("s3://b/2", second.header, second.file_size, second.items())
        off, ptr, n = j2.next_chunk(timeout=0.2)  # its header needs no slot
        head = bytes((ctypes.c_char * n).from_address(ptr))
        assert off == 0 and head == second.header
        j2.release(0)
        with pytest.raises(TimeoutError, match="s3://b/2"):
            j2.next_chunk(timeout=0.2)  # j1 holds both slots until its consumer runs
        assert _consume(j1, first.header, first.file_size) == first.expected
        assert _consume(j2, second.header, second.file_size, taken=head) == second.expected
        assert j1.wait_done(10) and j2.wait_done(10)
    finally:
        eng.shutdown()


def test_cache_wait_timeout_fails_an_unconsumed_stream_and_frees_the_cache():
    rng = np.random.default_rng(5)
    eng = _engine(2, cache_wait_timeout_s=0.3)
    try:
        lay = _Layout(rng, [6 * CHUNK])
        job = eng.submit_stream("s3://b/slow", lay.header, lay.file_size, lay.items())
        assert job.wait_done(10)  # nobody consumed: the third chunk timed out, the ready ones dropped
        assert "host cache full" in job.error() and "s3://b/slow" in job.error()
        assert job.next_chunk(1) is None
        s = eng.stats()
        assert s["slots_free"] == s["slots_total"]
    finally:
        eng.shutdown()


def test_empty_stream_and_argument_errors(tmp_path):
    eng = _engine(4)
    try:
        job = eng.submit_stream("memory://e", b"H" * 16, 40, [])
        assert _consume(job, b"H" * 16, 40) == b"H" * 16 + bytes(24)  # header and zeros, from the engine
        assert job.next_chunk(5) is None
        assert job.wait_done(5) and job.error() is None and job.checksums() == []
        rng = np.random.default_rng(6)
        lay = _Layout(rng, [100])
        with pytest.raises(ValueError, match="past file_size"):
            eng.submit_stream("memory://bad", lay.header, lay.file_size - 1, lay.items())
        job = eng.submit_stream("memory://r", lay.header, lay.file_size, lay.items())
        with pytest.raises(ValueError, match="release"):
            job.release(12345)  # never handed out
        c = job.next_chunk(5)
        with pytest.raises(ValueError, match="timeout"):
            job.next_chunk(-1)
        job.release(c[0])
        head = lay.header
        assert _consume(job, head, lay.file_size, taken=head) == lay.expected
        assert job.next_chunk(5) is None and job.wait_done(5)
        plain = eng.submit_write(str(tmp_path / "p"), lay.header, lay.file_size, lay.items(), False)
        assert not plain.is_stream
        with pytest.raises(TypeError, match="submit_stream"):
            plain.next_chunk()
        assert plain.wait_done(5)
    finally:
        eng.shutdown()


def test_shutdown_while_a_stream_is_consumed_and_job_keeps_engine_alive():
    rng = np.random.default_rng(8)
    eng = _engine(2)
    lay = _Layout(rng, [12 * CHUNK])
    job = eng.submit_stream("s3://b/f", lay.header, lay.file_size, lay.items())
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("data", _consume(job, lay.header, lay.file_size, delay=0.01)))
    t.start()
    eng.shutdown()  # drains: waits for the consumer to free slots for the remaining chunks
    t.join(30)
    assert result["data"] == lay.expected
    del eng  # the job still holds the engine (and its cache) alive
    assert job.wait_done(5) and job.error() is None
    assert len(job.checksums()) == 1


# --------------------------------------------------------------------------------------------
# device sources, against the CUDA runtime test double of test_cuda_double.py


from test_cuda_double import fake, fake_lib, make_engine  # noqa: E402,F401,F811 - fixtures


def test_device_stream_ordered_after_callers_stream_through_a_tiny_cache(fake, make_engine):  # noqa: F811 - fixtures
    """Device sources: copies wait for the caller's stream (a slow "kernel" writes the data just
    before submit), chunks come through 4 slots in file order, checksums match."""
    eng = make_engine(4 * 16 * KiB, chunk_bytes=16 * KiB, copy_threads=2, flush_threads=2)
    assert eng.stats()["slots_total"] == 4
    stream = fake.stream()
    try:
        a = np.zeros(40 * 16 * KiB + 5, dtype=np.uint8)
        fake.fill(stream, a, 0x5A, delay_us=100_000)
        header = b"h" * 4096
        job = eng.submit_stream("gs://b/dev", header, len(header) + a.nbytes, [(a.ctypes.data, a.nbytes, len(header))], 0, stream)
        try:
            data = _consume(job, header, len(header) + a.nbytes, delay=0.001)
        except BaseException:
            job.fail("test failed")  # never leave slots held (the engine's shutdown would wait)
            raise
        assert job.device == 0 and job.nchunks == 41
        assert data == header + b"\x5a" * a.nbytes
        assert job.wait_done(10) and job.error() is None
        grid = job.piece_size()
        want = [E.crc32c(data[p : min(p + grid, len(data))]) for p in range(len(header), len(data), grid)]
        assert job.checksums() == [want]
        assert fake.count("cudaMemcpyAsync") >= 41
    finally:
        fake.drain(stream)
        fake.destroy(stream)


def test_device_copy_error_mid_stream_ends_the_consumer_and_frees_the_cache(fake, make_engine):  # noqa: F811 - fixtures
    eng = make_engine(4 * 16 * KiB, chunk_bytes=16 * KiB)
    a = np.random.default_rng(9).integers(0, 256, size=30 * 16 * KiB, dtype=np.uint8)
    fake.fail("cudaMemcpyAsync", 5, 700)
    job = eng.submit_stream("s3://b/dev-bad", b"", a.nbytes, [(a.ctypes.data, a.nbytes, 0)], 0, 0)
    taken = 0
    while (c := job.next_chunk(10)) is not None:
        taken += 1
        job.release(c[0])
    assert taken <= 5
    assert job.wait_done(10)
    assert job.error().startswith("s3://b/dev-bad: ") and "illegal memory access" in job.error()
    s = eng.stats()
    assert s["slots_free"] == s["slots_total"] and s["jobs_failed"] == 1
