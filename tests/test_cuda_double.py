"""The engine's CUDA path, run against a CUDA runtime test double (tests/cuda_double/fake_cudart.cpp).

The double is built here with g++ and loaded by the engine through DCP_DATASTATES_CUDART. Its
"device memory" is host memory, so these tests hand the engine plain integer pointers with
device=0 and never need torch.cuda; its streams and events keep CUDA's ordering rules (in-order
streams on worker threads, events completing when their stream reaches them, stream waits), so
what is checked here is the engine's use of them: copies ordered after the caller's stream, one
completion event per chunk, device-side waits, errors, pinning and backpressure.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import dcp_datastates._engine as E

from engine_util import build_engine

KiB = 1 << 10
MiB = 1 << 20
HERE = Path(__file__).resolve().parent
ENV = "DCP_DATASTATES_CUDART"


# --------------------------------------------------------------------------------------------
# the double


class Fake:
    """ctypes front of the double's runtime entry points and test controls."""

    def __init__(self, path: str):
        self.path = path
        lib = self.lib = ctypes.CDLL(path)
        vp, ll, i, sz = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_size_t
        sigs = {
            "fake_count": ([ctypes.c_char_p], ll),
            "fake_live": ([ctypes.c_char_p], ll),
            "fake_set_fail": ([ctypes.c_char_p, ll, i], None),
            "fake_set_delay_us": ([ctypes.c_char_p, ll], None),
            "fake_set_device_count": ([i], None),
            "fake_reset": ([], None),
            "fake_launch_fill": ([vp, vp, i, sz, ll], i),
            "fake_stream_drain": ([vp], i),
            "cudaStreamCreateWithFlags": ([ctypes.POINTER(vp), ctypes.c_uint], i),
            "cudaStreamDestroy": ([vp], i),
            "cudaSetDevice": ([i], i),
            "cudaGetDevice": ([ctypes.POINTER(i)], i),
        }
        for name, (args, res) in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res

    def count(self, fn: str) -> int:
        return self.lib.fake_count(fn.encode())

    def counts(self, *fns: str) -> dict[str, int]:
        return {fn: self.count(fn) for fn in fns}

    def live(self, what: str) -> int:
        return self.lib.fake_live(what.encode())

    def fail(self, fn: str, after_calls: int, err: int) -> None:
        self.lib.fake_set_fail(fn.encode(), after_calls, err)

    def delay(self, fn: str, us: int) -> None:
        self.lib.fake_set_delay_us(fn.encode(), us)

    def fill(self, stream: int, a: np.ndarray, byte: int, delay_us: int = 0) -> None:
        """A "kernel" on `stream` that sets every byte of `a` to `byte` (after delay_us)."""
        assert self.lib.fake_launch_fill(stream, ptr(a), byte, a.nbytes, delay_us) == 0

    def drain(self, stream: int) -> None:
        assert self.lib.fake_stream_drain(stream) == 0

    def stream(self) -> int:
        s = ctypes.c_void_p()
        assert self.lib.cudaStreamCreateWithFlags(ctypes.byref(s), 1) == 0
        return s.value

    def destroy(self, stream: int) -> None:
        assert self.lib.cudaStreamDestroy(stream) == 0

    def set_device(self, d: int) -> None:
        assert self.lib.cudaSetDevice(d) == 0

    def get_device(self) -> int:
        d = ctypes.c_int(-1)
        assert self.lib.cudaGetDevice(ctypes.byref(d)) == 0
        return d.value


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory) -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}) to build the CUDA runtime double")
    out = tmp_path_factory.mktemp("cuda_double") / "libfake_cudart.so"
    src = HERE / "cuda_double" / "fake_cudart.cpp"
    subprocess.run(
        [cxx, "-std=c++17", "-O1", "-g", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Werror", str(src), "-o", str(out)],
        check=True,
    )
    return str(out)


@pytest.fixture
def fake(fake_lib, monkeypatch) -> Fake:
    """The double, reset, and selected for every Engine created during the test."""
    monkeypatch.setenv(ENV, fake_lib)
    f = Fake(fake_lib)
    f.lib.fake_reset()
    f.set_device(0)
    yield f
    f.lib.fake_reset()


@pytest.fixture
def make_engine(fake):
    engines = []

    def make(cache_bytes=1 * MiB, **kw) -> E.Engine:
        kw.setdefault("chunk_bytes", 64 * KiB)
        eng = build_engine(cache_bytes, **kw)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def wait(job, timeout: float = 30) -> None:
    assert job.wait_done(timeout), f"{job} did not finish"


def until(cond, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def submit(eng, path, a: np.ndarray, header: bytes = b"", **kw):
    return eng.submit_write(str(path), header, len(header) + a.nbytes, [(ptr(a), a.nbytes, len(header))], **kw)


def piece_crcs(data: bytes, data_start: int, offset: int, grid: int) -> list[int]:
    out, pos, end = [], offset, offset + len(data)
    while pos < end:
        stop = min(end, data_start + ((pos - data_start) // grid + 1) * grid)
        out.append(E.crc32c(data[pos - offset : stop - offset]))
        pos = stop
    return out


# --------------------------------------------------------------------------------------------
# mode, pinning, devices


def test_cuda_mode_and_pinned_cache_reused_across_jobs(tmp_path, fake, make_engine):
    eng = make_engine(1 * MiB)
    s = eng.stats()
    assert (s["cuda"], s["pinned"]) == (1, 1)
    assert eng.cuda_runtime == fake.path and eng.cuda_devices == 1 and eng.cuda_status == ""
    assert fake.count("cudaHostRegister") == 1
    for k in range(3):
        a = rand(300 * KiB + k, seed=k)
        job = submit(eng, tmp_path / f"f{k}.bin", a, device=0)
        wait(job)
        assert job.error() is None and (tmp_path / f"f{k}.bin").read_bytes() == a.tobytes()
    assert fake.count("cudaHostRegister") == 1 and fake.count("cudaHostUnregister") == 0
    assert fake.count("memcpy_to_pinned") == fake.count("cudaMemcpyAsync") > 0  # straight into the cache
    assert fake.count("cudaStreamCreateWithFlags") == 1  # one copy stream per device, made once
    assert eng.stats()["cache_allocations"] == 1
    eng.shutdown()
    assert fake.count("cudaHostUnregister") == 1 and eng.stats()["pinned"] == 0
    assert (fake.live("registered"), fake.live("streams"), fake.live("events")) == (0, 0, 0)


def test_pin_off_and_failed_registration_leave_the_cache_unpinned(tmp_path, fake, make_engine):
    eng = make_engine(1 * MiB, pin=False)
    assert (eng.stats()["cuda"], eng.stats()["pinned"]) == (1, 0) and fake.count("cudaHostRegister") == 0

    fake.fail("cudaHostRegister", 0, 2)
    eng = make_engine(1 * MiB)
    s = eng.stats()
    assert (s["cuda"], s["pinned"]) == (1, 0)
    assert "cudaHostRegister" in eng.cuda_status and "out of memory" in eng.cuda_status
    a = rand(200 * KiB)
    job = submit(eng, tmp_path / "unpinned.bin", a, device=0)
    wait(job)
    assert job.error() is None and (tmp_path / "unpinned.bin").read_bytes() == a.tobytes()
    assert fake.count("memcpy_to_pinned") == 0
    eng.shutdown()
    assert fake.count("cudaHostUnregister") == 0


def test_cpu_mode_without_a_usable_runtime(tmp_path, fake_lib, monkeypatch):
    a = rand(1000)
    for value, reason in [("none", f"{ENV}=none"), (str(tmp_path / "missing.so"), "missing.so")]:
        monkeypatch.setenv(ENV, value)
        eng = build_engine(1 * MiB)
        try:
            assert eng.stats()["cuda"] == 0 and eng.cuda_runtime == "" and reason in eng.cuda_status
            with pytest.raises(ValueError, match="device 0 is not supported: the engine runs in CPU mode"):
                submit(eng, tmp_path / "x.bin", a, device=0)
            job = submit(eng, tmp_path / "cpu.bin", a)  # host memory still works
            wait(job)
            assert job.error() is None and job.device == -1
            assert eng.device_wait(job, 0) is False
        finally:
            eng.shutdown()

    monkeypatch.setenv(ENV, fake_lib)
    f = Fake(fake_lib)
    f.lib.fake_reset()
    f.lib.fake_set_device_count(0)
    try:
        eng = build_engine(1 * MiB)
        assert eng.stats()["cuda"] == 0 and "sees no CUDA device" in eng.cuda_status
        eng.shutdown()
    finally:
        f.lib.fake_reset()


def test_two_devices_keep_the_callers_device(tmp_path, fake, make_engine):
    fake.lib.fake_set_device_count(2)
    eng = make_engine(1 * MiB)
    assert eng.cuda_devices == 2
    fake.set_device(1)
    s1 = fake.stream()  # a stream of device 1
    fake.set_device(0)
    try:
        for k, stream in enumerate([s1, 0]):  # 0: device 1's default stream
            a = rand(200 * KiB, seed=k)
            job = submit(eng, tmp_path / f"d1_{k}.bin", a, device=1, stream=stream)
            assert fake.get_device() == 0  # the engine set device 1 for the event and put 0 back
            wait(job)
            assert job.error() is None and job.device == 1
            assert (tmp_path / f"d1_{k}.bin").read_bytes() == a.tobytes()
        assert fake.count("cudaStreamCreateWithFlags") == 2  # s1 and the engine's stream on device 1
        with pytest.raises(ValueError, match="device 2 is out of range"):
            submit(eng, tmp_path / "d2.bin", rand(10), device=2)
        # A stream of device 1 given for device 0: CUDA refuses the event record; submit says so.
        with pytest.raises(RuntimeError, match=r"wrong\.bin: cudaEventRecord on the caller's stream .*invalid resource handle"):
            submit(eng, tmp_path / "wrong.bin", rand(10), device=0, stream=s1)
        assert not (tmp_path / "wrong.bin").exists()
    finally:
        fake.destroy(s1)


# --------------------------------------------------------------------------------------------
# ordering, events, waits


@pytest.mark.parametrize("use_default_stream", [False, True])
def test_copies_run_after_the_callers_stream_work(tmp_path, fake, make_engine, use_default_stream):
    """A slow "kernel" on the caller's stream writes the tensor just before submit: the file must
    hold what it wrote, as the copy stream waits for an event recorded on the caller's stream."""
    eng = make_engine(1 * MiB)
    stream = 0 if use_default_stream else fake.stream()
    try:
        a = np.zeros(700 * KiB + 3, dtype=np.uint8)
        fake.fill(stream, a, 0xAB, delay_us=150_000)
        job = submit(eng, tmp_path / "ordered.bin", a, header=b"hdr", device=0, stream=stream)
        wait(job)
        assert job.error() is None
        assert (tmp_path / "ordered.bin").read_bytes() == b"hdr" + b"\xab" * a.nbytes

        # Control: the same late kernel on a stream the job was not told about is not waited for.
        b = np.zeros(300 * KiB, dtype=np.uint8)
        other = fake.stream()
        fake.fill(other, b, 0xCD, delay_us=300_000)
        job = submit(eng, tmp_path / "unordered.bin", b, device=0, stream=stream)
        wait(job)
        assert (tmp_path / "unordered.bin").read_bytes() == bytes(b.nbytes)
        fake.drain(other)
        fake.destroy(other)
    finally:
        if stream:
            fake.destroy(stream)


def test_one_event_per_chunk_and_staging_enqueued_before_complete(tmp_path, fake, make_engine):
    eng = make_engine(4 * MiB)  # 64 slots: every chunk gets one at once
    fake.delay("cudaMemcpyAsync", 15_000)  # each D2H copy takes 15 ms on the copy stream
    items = [rand(1 * MiB + 100, seed=1), rand(5, seed=2), rand(200 * KiB, seed=3)]
    header = b"h" * 4096
    offs, pos = [], len(header)
    for a in items:
        offs.append(pos)
        pos += a.nbytes + 8  # small zero gaps between items
    before = fake.counts("cudaEventRecord", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaStreamWaitEvent")
    job = eng.submit_write(str(tmp_path / "ev.bin"), header, pos, [(ptr(a), a.nbytes, o) for a, o in zip(items, offs)], device=0)
    assert until(job.all_enqueued, 5)
    assert not job.is_staged()  # queued on the copy stream long before the copies complete
    wait(job)
    assert job.error() is None
    n = job.nchunks
    grid = job.piece_size()
    npieces = sum(len(piece_crcs(a.tobytes(), len(header), o, grid)) for a, o in zip(items, offs))
    after = fake.counts(*before)
    assert after["cudaEventSynchronize"] - before["cudaEventSynchronize"] == n  # one completion event per chunk
    # + the ordering event on the caller's stream + the "last copy" event for device waits
    assert after["cudaEventRecord"] - before["cudaEventRecord"] == n + 2
    assert after["cudaMemcpyAsync"] - before["cudaMemcpyAsync"] == npieces
    assert after["cudaStreamWaitEvent"] - before["cudaStreamWaitEvent"] == 1  # copy stream on the caller's
    expected = bytearray(pos)
    expected[: len(header)] = header
    for a, o in zip(items, offs):
        expected[o : o + a.nbytes] = a.tobytes()
    assert (tmp_path / "ev.bin").read_bytes() == bytes(expected)
    for crcs, a, o in zip(job.checksums(), items, offs):
        assert crcs == piece_crcs(a.tobytes(), len(header), o, grid)
    s = eng.stats()
    assert s["d2h_bytes"] == sum(a.nbytes for a in items) == s["bytes_staged"]
    assert s["chunks_staged"] == n


def test_device_wait_orders_the_callers_next_work_after_the_copies(tmp_path, fake, make_engine):
    eng = make_engine(4 * MiB)
    fake.delay("cudaMemcpyAsync", 10_000)
    s = fake.stream()
    try:
        a = rand(1 * MiB, seed=5)
        original = a.tobytes()
        job = submit(eng, tmp_path / "dw.bin", a, device=0, stream=s)
        assert until(job.all_enqueued, 5) and not job.is_staged()
        waits = fake.count("cudaStreamWaitEvent")
        assert eng.device_wait(job, s) is True  # returns at once: the GPU does the waiting
        assert fake.count("cudaStreamWaitEvent") == waits + 1
        assert not job.is_staged()
        fake.fill(s, a, 0xFF)  # "optimizer.step()": queued after the wait on the caller's stream
        wait(job)
        assert job.error() is None and (tmp_path / "dw.bin").read_bytes() == original
        fake.drain(s)
        assert a.tobytes() == b"\xff" * a.nbytes  # the step did run, after the copies
        st = eng.stats()
        assert (st["device_waits"], st["host_waits"]) == (1, 0)
        assert eng.device_wait(job, s) is True and eng.stats()["device_waits"] == 1  # staged: no wait issued

        # Control: the same step without the device wait races the copies and reaches the file.
        b = rand(1 * MiB, seed=6)
        job = submit(eng, tmp_path / "raced.bin", b, device=0, stream=s)
        fake.fill(s, b, 0xEE)
        wait(job)
        assert (tmp_path / "raced.bin").read_bytes() != rand(1 * MiB, seed=6).tobytes()
        fake.drain(s)
    finally:
        fake.destroy(s)


def test_cache_smaller_than_the_job_needs_a_host_wait(tmp_path, fake, make_engine):
    eng = make_engine(256 * KiB)  # 4 slots of 64 KiB
    fake.delay("cudaMemcpyAsync", 30_000)
    a = rand(1 * MiB + 1, seed=7)  # 17 chunks
    job = submit(eng, tmp_path / "bp.bin", a, device=0)
    assert not job.all_enqueued()  # chunks without a slot wait on the host for one
    assert eng.device_wait(job, 0) is False
    assert job.wait_staged(30)
    assert job.all_enqueued()
    assert eng.device_wait(job, 0) is True  # staged already: nothing to wait for
    wait(job)
    assert job.error() is None and (tmp_path / "bp.bin").read_bytes() == a.tobytes()
    s = eng.stats()
    assert (s["device_waits"], s["host_waits"]) == (0, 1)
    assert s["backpressure_waits"] >= 1 and s["peak_slots_used"] == 4 and s["slots_free"] == 4


# --------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "fn, after, err, text",
    [
        ("cudaMemcpyAsync", 3, 700, "cudaMemcpyAsync of .* failed: an illegal memory access was encountered"),
        ("cudaEventSynchronize", 2, 999, r"cudaEventSynchronize, device 0\) failed: unknown error \(CUDA error 999\)"),
        ("cudaStreamWaitEvent", 0, 400, "cudaStreamWaitEvent .* failed: invalid resource handle"),
    ],
)
def test_cuda_errors_fail_the_job_with_path_and_cause(tmp_path, fake, make_engine, fn, after, err, text):
    eng = make_engine(512 * KiB)
    a = rand(1 * MiB, seed=8)
    fake.fail(fn, after, err)
    path = tmp_path / "bad.bin"
    job = submit(eng, path, a, device=0)
    wait(job)
    msg = job.error()
    assert msg is not None and msg.startswith(f"{path}: "), msg
    assert re.search(text, msg), msg
    with pytest.raises(RuntimeError, match="write failed"):
        job.checksums()
    fake.fail(fn, 0, 0)  # the engine goes on working
    job = submit(eng, tmp_path / "good.bin", a, device=0)
    wait(job)
    assert job.error() is None and (tmp_path / "good.bin").read_bytes() == a.tobytes()
    s = eng.stats()
    assert s["jobs_failed"] == 1 and s["slots_free"] == s["slots_total"]


def test_submit_time_cuda_errors_raise_and_queue_nothing(tmp_path, fake, make_engine):
    eng = make_engine(1 * MiB)
    a = rand(1000)
    with pytest.raises(RuntimeError, match=r"bogus\.bin: cudaEventRecord on the caller's stream 0xdead .*invalid resource handle"):
        submit(eng, tmp_path / "bogus.bin", a, device=0, stream=0xDEAD)
    fake.fail("cudaEventRecord", 0, 2)
    with pytest.raises(RuntimeError, match=r"oom\.bin: .*out of memory \(CUDA error 2\)"):
        submit(eng, tmp_path / "oom.bin", a, device=0)
    assert eng.stats()["jobs_submitted"] == 0 and not (tmp_path / "oom.bin").exists()


def test_a_device_snapshot_with_a_null_source_queues_no_copy(fake, make_engine):
    """The request-time device-to-device copy checks every item before queueing the first copy:
    an item with bytes and no memory (a ZeroTensor) raises, and nothing reaches the stream."""
    eng = make_engine(1 * MiB)
    src, dst = rand(256), np.zeros(256, dtype=np.uint8)
    before = fake.count("cudaMemcpyAsync")
    with pytest.raises(ValueError, match=r"probe: snapshot item 1 of 16 bytes has a null source"):
        eng.snapshot(0, 0, ptr(dst), [(ptr(src), 128, 0), (0, 16, 128)], "probe")
    assert fake.count("cudaMemcpyAsync") == before and not dst.any()
    eng.snapshot(0, 0, ptr(dst), [(ptr(src), 128, 0)], "probe")  # a valid one is queued and runs
    assert fake.count("cudaMemcpyAsync") == before + 1
    assert until(lambda: dst[:128].tobytes() == src[:128].tobytes())


# --------------------------------------------------------------------------------------------
# many jobs, shutdown


def test_concurrent_device_and_host_jobs_on_a_small_cache(tmp_path, fake, make_engine):
    eng = make_engine(256 * KiB, chunk_bytes=16 * KiB, copy_threads=3, flush_threads=2)
    fake.delay("cudaMemcpyAsync", 200)
    rng = np.random.default_rng(9)
    jobs = []

    def producer(k: int) -> None:
        for j in range(8):
            arrays = [rand(int(rng.integers(1, 100 * KiB)), seed=k * 100 + j * 10 + i) for i in range(3)]
            offs, pos = [], 100
            for a in arrays:
                offs.append(pos)
                pos += a.nbytes
            device = 0 if (k + j) % 3 else -1
            job = eng.submit_write(
                str(tmp_path / f"c{k}_{j}.bin"), b"x" * 100, pos, [(ptr(a), a.nbytes, o) for a, o in zip(arrays, offs)], device=device
            )
            jobs.append((job, arrays, offs, pos))
            if device == 0 and j % 2:
                if not eng.device_wait(job, 0):
                    job.wait_staged(30)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job, arrays, offs, size in jobs:
        wait(job)
        assert job.error() is None, job.error()
        data = (Path(job.path)).read_bytes()
        assert len(data) == size
        for a, o in zip(arrays, offs):
            assert data[o : o + a.nbytes] == a.tobytes()
    s = eng.stats()
    assert s["jobs_done"] == len(jobs) and s["slots_free"] == s["slots_total"]
    assert s["d2h_bytes"] == sum(sum(a.nbytes for a in arrays) for job, arrays, _, _ in jobs if job.device == 0)


def test_shutdown_drains_device_jobs(tmp_path, fake, make_engine):
    eng = make_engine(256 * KiB)
    fake.delay("cudaMemcpyAsync", 2_000)
    arrays = [rand(500 * KiB, seed=20 + k) for k in range(4)]
    jobs = [submit(eng, tmp_path / f"s{k}.bin", a, device=0) for k, a in enumerate(arrays)]
    eng.shutdown()
    for k, (job, a) in enumerate(zip(jobs, arrays)):
        assert job.is_done() and job.error() is None
        assert (tmp_path / f"s{k}.bin").read_bytes() == a.tobytes()
    with pytest.raises(RuntimeError, match="engine is shut down"):
        submit(eng, tmp_path / "late.bin", arrays[0], device=0)
    assert eng.device_wait(jobs[0], 0) is True  # staged: no CUDA call needed any more
    assert (fake.live("streams"), fake.live("events"), fake.live("registered")) == (0, 0, 0)


# --------------------------------------------------------------------------------------------
# Python plumbing over the double: writer grouping by device, device-side wait_staged, log line


def test_engine_mode_log_line(fake, monkeypatch):
    from dcp_datastates import runtime
    from dcp_datastates.config import DataStatesConfig

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Grab(level=logging.DEBUG)
    logger = logging.getLogger("dcp_datastates")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    runtime.shutdown_engine()
    try:
        runtime.get_engine(DataStatesConfig(host_cache_size=1 * MiB))
        assert any(f"CUDA mode (runtime {fake.path}, 1 devices, host cache pinned: yes)" in r for r in records), records
        runtime.shutdown_engine()
        records.clear()
        monkeypatch.setenv(ENV, "none")
        runtime.get_engine(DataStatesConfig(host_cache_size=1 * MiB))
        assert any("dcp_datastates engine: CPU mode" in r for r in records), records
    finally:
        runtime.shutdown_engine()
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _float_tensors_on_fake_device(fake, monkeypatch, delay_us: int) -> int:
    """Float CPU tensors stand in for CUDA tensors on device 0 of the double: the writer submits
    their copies to the fake runtime with a fresh stream as the caller's current stream, and
    wait_staged() sees that stream. Returns the stream (destroy it after the test)."""
    from dcp_datastates import runtime
    from dcp_datastates.runtime import inflight as staging
    from dcp_datastates.save import items as stage_items
    from dcp_datastates.save import request as request_mod

    original = stage_items._tensor_source

    def on_device(key, name, tensor):
        item = original(key, name, tensor)
        if tensor.is_floating_point():
            item.device = 0
        return item

    s = fake.stream()
    monkeypatch.setattr(stage_items, "_tensor_source", on_device)
    monkeypatch.setattr(request_mod, "current_stream", lambda device: s)
    monkeypatch.setattr(staging, "_cuda_stream", lambda device: s)
    runtime.shutdown_engine()
    fake.delay("cudaMemcpyAsync", delay_us)
    return s


def test_async_save_of_device_tensors_through_the_writer(tmp_path, fake, monkeypatch):
    """Float CPU tensors marked as device 0 stand in for CUDA tensors: the writer submits one job
    per device with the caller's stream, and wait_staged() is a device-side wait."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter, engine_stats, runtime, wait_staged
    from dcp_datastates.runtime import inflight as staging

    from conftest import assert_state_equal, clone_state, zeros_like_state

    s = _float_tensors_on_fake_device(fake, monkeypatch, delay_us=10_000)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        for _ in range(2):
            model(torch.randn(8, 256)).sum().backward()
            opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}
        snapshot = clone_state(state)
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "ck", host_cache_size=4 * MiB, chunk_size=64 * KiB))
        assert engine_stats()["cuda"] == 1
        pending = staging.staging()
        assert len(pending) == 1 and [f.job.device for f in pending[0].files] == [-1, 0]  # host items first
        host, dev = pending[0].files
        assert until(lambda: host.job.is_staged() and dev.job.all_enqueued(), 10)
        assert not dev.job.is_staged()
        assert wait_staged() is True  # did not block: the caller's stream waits for the copies
        assert engine_stats()["device_waits"] == 1 and not dev.job.is_staged()
        # Here the "device" is the CPU, which no stream wait orders: wait on the host to change it.
        assert wait_staged(device_side=False) is True and dev.job.is_staged()
        opt.step()
        resp.upload_completion.result(timeout=60)
        files = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name != ".metadata")
        assert len(files) == 2, files
        dest = zeros_like_state(state)
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "ck"))
        assert_state_equal(snapshot["model"], dest["model"])
        assert_state_equal(snapshot["optim"]["state"], dest["optim"]["state"])
        assert dest["step"] == 2
    finally:
        runtime.shutdown_engine()
        fake.destroy(s)


def test_prefault_skips_a_pinned_cache_and_runs_on_an_unpinned_one(fake, make_engine):
    # Registration page-locks (and so faults in) every page: nothing left to prefault.
    eng = make_engine(4 * MiB)
    s = eng.stats()
    assert s["pinned"] == 1 and s["cache_prefaulted_bytes"] == s["cache_bytes"]
    assert fake.count("cudaHostRegister") == 1
    # Not pinned (off, or registration failed): the background thread faults the cache in.
    fake.fail("cudaHostRegister", 0, 2)
    for eng in (make_engine(4 * MiB, pin=False), make_engine(4 * MiB)):
        assert eng.stats()["pinned"] == 0
        assert until(lambda eng=eng: eng.stats()["cache_prefaulted_bytes"] == 4 * MiB)
    assert make_engine(4 * MiB, pin=False, prefault=False).stats()["cache_prefaulted_bytes"] == 0


def test_torn_guard_seals_at_the_device_side_wait(tmp_path, fake, monkeypatch):
    """A device-side wait_staged() orders the caller's stream after the copies, so a kernel queued
    after it (the optimizer step: it bumps the tensors' versions at launch) is fine and the
    checkpoint holds the pre-step bytes; a kernel queued before the wait is not ordered before
    the copies, and the save must fail naming the tensor."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter, runtime, wait_staged
    from dcp_datastates.runtime import inflight as staging

    from conftest import raises_through_dcp

    s = _float_tensors_on_fake_device(fake, monkeypatch, delay_us=20_000)
    try:
        state = {f"w{i}": torch.randn(64 * 1024) for i in range(4)}
        snapshot = {k: v.clone() for k, v in state.items()}
        opts = dict(host_cache_size=4 * MiB, chunk_size=64 * KiB)
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "ok", **opts))
        assert until(lambda: all(f.job.all_enqueued() for f in staging.staging()[0].files), 10)
        assert wait_staged() is True  # device-side: sealed now, nothing blocked
        for t in state.values():  # the "optimizer step": queued on the caller's stream after the wait
            fake.fill(s, t.numpy(), 0x55)
            t.add_(0.0)  # an in-place op bumps the version at launch, as on a GPU
        resp.upload_completion.result(timeout=60)
        fake.drain(s)
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "ok"))
        assert all(torch.equal(dest[k], snapshot[k]) for k in state)  # the copies ran first
        assert np.all(state["w0"].numpy().view(np.uint8) == 0x55)  # and the kernel after them

        # The same kernel queued BEFORE the wait: not ordered before the copies.
        state = {f"w{i}": torch.randn(64 * 1024) for i in range(4)}
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "torn", **opts))
        state["w2"].add_(0.0)
        fake.fill(s, state["w2"].numpy(), 0x11)
        wait_staged()
        with raises_through_dcp("tensor 'w2' was changed in place"):
            resp.upload_completion.result(timeout=60)
        fake.drain(s)
    finally:
        runtime.shutdown_engine()
        fake.destroy(s)


@pytest.mark.parametrize("copy_at_request, total", [(64 * KiB, 64 * MiB), (0, 64 * MiB), (64 * KiB, 1 * KiB)])
def test_small_tensors_are_copied_on_the_callers_stream_at_the_request(tmp_path, fake, monkeypatch, copy_at_request,
                                                                       total):
    """A small device tensor (a BatchNorm statistic) is written by a "kernel" queued before the
    save (its value the checkpoint must hold: 0x11) and by one queued right after it (the next
    forward: 0x22); neither bumps a version. The request-time copy is queued on the caller's
    stream between the two, so it reads 0x11 whatever the timing. Taking it on the host at once
    (it would read 0x00: the first kernel is still waiting) or leaving it to the engine's lazy
    copy (with copies slowed down, it reads 0x22) fails this test; so does turning it off, which
    the second case shows, or a ``copy_at_request_total_bytes`` the statistic does not fit in
    (the third)."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter, runtime

    s = _float_tensors_on_fake_device(fake, monkeypatch, delay_us=30_000)
    stats = torch.zeros(1024)  # 4 KiB: copied at the request by default
    weights = torch.randn(64 * 1024)  # 256 KiB: copied lazily
    state = {"stats": stats, "w": weights}
    try:
        fake.fill(s, stats.numpy(), 0x11, delay_us=50_000)  # the producer, still queued
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(
            tmp_path / "ck", host_cache_size=4 * MiB, chunk_size=64 * KiB, copy_at_request_max_bytes=copy_at_request,
            copy_at_request_total_bytes=total))
        fake.fill(s, stats.numpy(), 0x22)  # the next forward, queued after the request
        resp.upload_completion.result(timeout=60)
        fake.drain(s)
        dest = {"stats": torch.ones(1024), "w": torch.zeros_like(weights)}
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "ck"))
        saved = dest["stats"].numpy().view(np.uint8)
        if copy_at_request and total >= stats.nbytes:
            assert (saved == 0x11).all(), np.unique(saved)
        else:
            assert not (saved == 0x11).all()  # the lazy copy ran after the next "forward"
        assert torch.equal(dest["w"], weights)
    finally:
        runtime.shutdown_engine()
        fake.destroy(s)


def test_a_reused_side_buffer_is_never_written_while_an_earlier_copy_reads_it(tmp_path, fake, monkeypatch):
    """Side buffers of the request-time copies are reused between saves (side_buffers.copy_small_at_request). The
    first save's lazy copy out of its side buffer is slowed down; a second save requested
    meanwhile copies other values at its request. Had the first buffer been handed to the second
    request before the first job was staged, the first checkpoint would hold the second values.
    Once the first job is staged its buffer is reused (no new allocation)."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter, runtime
    from dcp_datastates.save import side_buffers as save_request

    s = _float_tensors_on_fake_device(fake, monkeypatch, delay_us=30_000)
    stats = torch.zeros(2048)  # 8 KiB each: copied at the request
    other = torch.zeros(2048)
    state = {"stats": stats, "other": other}
    monkeypatch.setattr(save_request, "_pool", type(save_request._pool)())
    options = dict(host_cache_size=4 * MiB, chunk_size=64 * KiB)
    try:
        fake.fill(s, stats.numpy(), 0x11)
        fake.fill(s, other.numpy(), 0x12)
        first = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "a", **options))
        assert not save_request._pool  # the first buffer is in use
        fake.fill(s, stats.numpy(), 0x21)  # queued after the first request's copy
        fake.fill(s, other.numpy(), 0x22)
        second = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "b", **options))
        first.upload_completion.result(timeout=60)
        second.upload_completion.result(timeout=60)
        fake.drain(s)
        for folder, want in (("a", (0x11, 0x12)), ("b", (0x21, 0x22))):
            dest = {"stats": torch.ones(2048), "other": torch.ones(2048)}
            dcp.load(dest, storage_reader=DataStatesReader(tmp_path / folder))
            got = (np.unique(dest["stats"].numpy().view(np.uint8)), np.unique(dest["other"].numpy().view(np.uint8)))
            assert [g.tolist() for g in got] == [[want[0]], [want[1]]], (folder, got)
        assert len(save_request._pool) == 1  # both given back once staged, under one layout
        kept = next(iter(save_request._pool.values()))
        third = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c", **options))
        assert not save_request._pool  # the third request took the kept buffer
        third.upload_completion.result(timeout=60)
        assert next(iter(save_request._pool.values())) is kept
    finally:
        runtime.shutdown_engine()
        fake.destroy(s)


def test_device_tensors_go_through_the_cache_after_the_callers_stream_with_direct_writes(tmp_path, fake,
                                                                                          monkeypatch):
    """``direct_writes=True`` writes host tensors straight from their memory, but never device
    tensors: their job copies through the cache on the copy stream, after an event recorded on
    the caller's stream. A slow "kernel" queued on that stream just before the save writes 0xAB
    into a device tensor; the file must hold 0xAB (written from the device memory without that
    ordering, it would hold the tensor's earlier bytes). The host tensor is written directly."""
    import numpy as np
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader, DataStatesWriter, engine_stats, runtime

    s = _float_tensors_on_fake_device(fake, monkeypatch, delay_us=5_000)
    weights = torch.randn(256 * 1024)  # 1 MiB of "device" memory: copied lazily by the engine
    counts = torch.arange(300_000, dtype=torch.int64)  # host memory: written from its own memory
    state = {"w": weights, "counts": counts}
    try:
        fake.fill(s, weights.numpy(), 0xAB, delay_us=150_000)  # the producer, still queued
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(
            tmp_path / "ck", host_cache_size=4 * MiB, chunk_size=64 * KiB, direct_writes=True))
        resp.upload_completion.result(timeout=60)
        stats = engine_stats()
        assert stats["direct_bytes"] == counts.nbytes and stats["d2h_bytes"] == weights.nbytes
        fake.drain(s)
        dest = {"w": torch.zeros_like(weights), "counts": torch.zeros_like(counts)}
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "ck"))
        assert (dest["w"].numpy().view(np.uint8) == 0xAB).all()
        assert torch.equal(dest["counts"], counts)
    finally:
        runtime.shutdown_engine()
        fake.destroy(s)
