"""Direct writes: host memory written to its data files with no copy into the host cache.

Where the checkpoint folder is memory-backed (tmpfs, ramfs) the engine writes each chunk from the
tensors' own memory (``direct_writes``, default: on there only), and a rank's host items are
spread over one file per flush thread (each file system takes one writer per file at a time).
These tests check that such a file is the same file, with the same checksums, as one written
through the cache; that the job is staged only once its sources were read (written), so the lazy
guarantee is the same; that faults, aborts and unnamed jobs behave as for cached jobs; and that
the flush workers spread over files.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_datastates._engine as E
from dcp_datastates import DataStatesConfig, DataStatesReader, DataStatesWriter, engine_stats, start_engine
from dcp_datastates.runtime.engine import current_engine
from dcp_datastates.save.file_groups import SPLIT_MIN_BYTES, split_for_writers

from conftest import assert_state_equal, clone_state, raises_through_dcp, zeros_like_state
from engine_util import build_engine

KiB, MiB = 1 << 10, 1 << 20


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def submit(eng, path, a: np.ndarray, **kw):
    """One job writing ``a`` as the whole file ``path`` (no header)."""
    return eng.submit_write(str(path), b"", a.nbytes, [(ptr(a), a.nbytes, 0)], **kw)


@pytest.fixture
def shm_path():
    """A fresh folder on a memory-backed file system (/dev/shm), removed afterwards."""
    if not os.path.isdir("/dev/shm") or not E.memory_backed("/dev/shm"):
        pytest.skip("no memory-backed /dev/shm here")
    path = f"/dev/shm/dcpds-test-{uuid.uuid4().hex}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# the engine


def _layout(seed: int):
    """A header, items with gaps between them (one empty, one segmented from two buffers, one
    spanning several chunks) and a zero tail: (header, items, file_size, expected bytes)."""
    a, b, c, d1, d2 = rand(100, seed), rand(300 * KiB + 7, seed + 1), rand(3, seed + 2), rand(5000, seed + 3), \
        rand(70 * KiB, seed + 4)
    header = b"HEAD" * 9
    offsets = [len(header) + 5, len(header) + 5 + 100 + 999, 0, 0]
    offsets[2] = offsets[1] + b.nbytes + 1
    offsets[3] = offsets[2] + c.nbytes
    size = offsets[3] + d1.nbytes + d2.nbytes + 4096
    items = [(ptr(a), a.nbytes, offsets[0]), (ptr(b), b.nbytes, offsets[1]), (0, 0, offsets[2]),
             (ptr(c), c.nbytes, offsets[2]), ([(ptr(d1), d1.nbytes), (ptr(d2), d2.nbytes)], d1.nbytes + d2.nbytes,
                                              offsets[3])]
    expected = bytearray(size)
    expected[:len(header)] = header
    for arr, off in ((a, offsets[0]), (b, offsets[1]), (c, offsets[2])):
        expected[off:off + arr.nbytes] = arr.tobytes()
    expected[offsets[3]:offsets[3] + d1.nbytes + d2.nbytes] = d1.tobytes() + d2.tobytes()
    return header, items, size, bytes(expected), (a, b, c, d1, d2)


def test_a_direct_job_writes_the_file_and_checksums_a_cached_job_writes(tmp_path):
    eng = build_engine(256 * KiB, chunk_bytes=64 * KiB)
    try:
        header, items, size, expected, keep = _layout(1)
        jobs = {}
        for direct in (False, True):
            path = tmp_path / f"direct-{direct}.bin"
            before = eng.stats()
            job = eng.submit_write(str(path), header, size, items, direct=direct)
            assert job.wait_done(20) and job.error() is None
            after = eng.stats()
            assert path.read_bytes() == expected
            moved = sum(n for _, n, _ in items)
            # Only the cached job went through the cache; the direct one wrote from the sources.
            assert after["bytes_staged"] - before["bytes_staged"] == (0 if direct else moved)
            assert after["direct_bytes"] - before["direct_bytes"] == (moved if direct else 0)
            assert after["slots_free"] == after["slots_total"]
            jobs[direct] = job
        assert jobs[True].checksums() == jobs[False].checksums()
        assert len(jobs[True].checksums()[1]) > 1  # the large item has several grid pieces
        assert keep  # the sources stay alive until here
    finally:
        eng.shutdown()


def test_a_direct_job_is_staged_only_once_its_sources_are_written(tmp_path):
    """The sources are read by the flush workers: until every chunk is written the job is not
    staged (the training thread must not change them yet). A cached job with room in the cache
    is staged while its flushes are held; the direct one is not."""
    eng = build_engine(4 * MiB, chunk_bytes=64 * KiB)
    try:
        a = rand(1 * MiB, 2)
        eng.set_fault("stall", 0, "held")
        cached = submit(eng, tmp_path / "held-cached.bin", a)
        direct = submit(eng, tmp_path / "held-direct.bin", a, direct=True)
        assert cached.wait_staged(20) and not cached.is_done()
        assert not direct.wait_staged(0.3) and direct.bytes_done == 0
        eng.set_fault("none", 0, "")
        assert direct.wait_staged(20) and direct.wait_done(20) and direct.error() is None
        assert cached.wait_done(20) and cached.error() is None
        assert (tmp_path / "held-direct.bin").read_bytes() == a.tobytes()
    finally:
        eng.set_fault("none", 0, "")
        eng.shutdown()


def test_a_direct_job_needs_host_sources(tmp_path):
    eng = build_engine(256 * KiB)
    try:
        a = rand(10, 3)
        with pytest.raises(ValueError, match=r"dev\.bin: a direct write needs host sources, got CUDA device 0"):
            submit(eng, tmp_path / "dev.bin", a, device=0, direct=True)
        assert not (tmp_path / "dev.bin").exists()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kind, cause", [("eio", "Input/output error"), ("enospc", "No space left on device"),
                                         ("fsync_eio", "fsync of")])
def test_a_direct_job_reports_write_faults_and_the_engine_goes_on(tmp_path, kind, cause):
    eng = build_engine(256 * KiB, chunk_bytes=64 * KiB)
    try:
        a = rand(200 * KiB, 4)
        eng.set_fault(kind, 0, "bad")
        job = submit(eng, tmp_path / "bad.bin", a, direct=True)
        assert job.wait_done(20) and job.wait_staged(0)  # a failed job reaches both
        assert "bad.bin" in job.error() and cause in job.error()
        eng.set_fault("none", 0, "")
        job = submit(eng, tmp_path / "good.bin", a, direct=True)
        assert job.wait_done(20) and job.error() is None
        assert (tmp_path / "good.bin").read_bytes() == a.tobytes()
    finally:
        eng.set_fault("none", 0, "")
        eng.shutdown()


def test_failing_a_stalled_direct_job_ends_it_at_once(tmp_path):
    eng = build_engine(256 * KiB, chunk_bytes=16 * KiB, flush_threads=2)
    try:
        a = rand(512 * KiB, 5)
        eng.set_fault("stall", 0, "stalled")
        job = submit(eng, tmp_path / "stalled.bin", a, direct=True)
        assert not job.wait_done(0.3)
        job.fail("checkpoint abandoned")
        assert job.wait_done(5) and job.wait_staged(0)
        assert job.error() == "checkpoint abandoned" and job.bytes_done == 0
        assert os.path.getsize(tmp_path / "stalled.bin") < a.nbytes
    finally:
        eng.set_fault("none", 0, "")
        eng.shutdown()


def test_an_unnamed_direct_job_writes_nothing_until_named(tmp_path):
    eng = build_engine(256 * KiB, chunk_bytes=64 * KiB)
    try:
        header, items, size, expected, keep = _layout(6)
        job = eng.submit_write(str(tmp_path / "label"), header, size, items, named=False, direct=True)
        assert not job.wait_staged(0.2)  # nothing read yet: the sources are read as the file is written
        assert os.listdir(tmp_path) == []
        job.set_destination(str(tmp_path / "named.bin"))
        assert job.wait_done(20) and job.error() is None
        assert (tmp_path / "named.bin").read_bytes() == expected

        failed = eng.submit_write(str(tmp_path / "never"), header, size, items, named=False, direct=True)
        failed.fail("folder could not be prepared")
        assert failed.wait_done(5) and failed.error() == "folder could not be prepared"
        assert sorted(os.listdir(tmp_path)) == ["named.bin"]
        assert keep
    finally:
        eng.shutdown()


def test_a_flush_worker_takes_a_file_no_other_worker_is_writing(tmp_path):
    """Two flush workers, both held by the stall fault: one on a one-chunk file ("x-hold"), one on
    the first chunk of a long file ("x-first"); then a third file is queued behind the long
    file's other chunks. Released from the short file, the worker must take the third file, not
    join the long file another worker writes (a plain FIFO over chunks would hand it the long
    file's next chunk, whose writes its inode lock serializes with the other's anyway)."""
    eng = build_engine(4 * MiB, chunk_bytes=64 * KiB, flush_threads=2)
    try:
        h, a, b = rand(1000, 6), rand(1 * MiB, 7), rand(512 * KiB, 8)
        eng.set_fault("stall", 0, "x-")
        hold = submit(eng, tmp_path / "x-hold.bin", h, direct=True)
        first = submit(eng, tmp_path / "x-first.bin", a, direct=True)
        time.sleep(0.2)  # both workers are in their stall loops
        second = submit(eng, tmp_path / "second.bin", b, direct=True)
        eng.set_fault("stall", 0, "x-first")  # the short file's worker goes on
        assert hold.wait_done(20) and hold.error() is None
        assert second.wait_done(20) and second.error() is None
        assert not first.is_done() and first.bytes_done == 0
        assert (tmp_path / "second.bin").read_bytes() == b.tobytes()
        eng.set_fault("none", 0, "")
        assert first.wait_done(20) and first.error() is None
        assert (tmp_path / "x-first.bin").read_bytes() == a.tobytes()
    finally:
        eng.set_fault("none", 0, "")
        eng.shutdown()


def test_memory_backed_asks_the_nearest_existing_folder(tmp_path, shm_path):
    assert E.memory_backed("/dev/shm")
    assert E.memory_backed(os.path.join(shm_path, "not", "made", "yet"))
    on_tmp = E.memory_backed(str(tmp_path))
    assert E.memory_backed(str(tmp_path / "a" / "b")) == on_tmp
    assert E.memory_backed("/proc") is False  # procfs: not a place files are written to


def test_a_storage_keeps_one_channel_that_asks_the_file_system_once(tmp_path, monkeypatch):
    """``channel_for`` gives the same channel for the same storage, so whether its folder is
    memory-backed (a statfs) is asked once per storage, not at every file a save starts."""
    from dcp_datastates.channel import channel_for
    from dcp_datastates.channel import local as local_channel
    from dcp_datastates.storage import LocalStorage

    asked, real = [], local_channel.engine_module()

    class Counting:
        def memory_backed(self, path):
            asked.append(path)
            return real.memory_backed(path)

    monkeypatch.setattr(local_channel, "engine_module", lambda: Counting())
    storage = LocalStorage(str(tmp_path))
    channel = channel_for(storage)
    assert channel_for(storage) is channel and channel.storage is storage
    for _ in range(3):
        assert channel_for(storage).writes_direct(None) == real.memory_backed(str(tmp_path))
    assert asked == [str(tmp_path)]
    assert channel_for(storage).writes_direct(True) is True and channel_for(storage).writes_direct(False) is False
    other = LocalStorage(str(tmp_path))  # another storage object: its own channel
    assert channel_for(other) is not channel


# --------------------------------------------------------------------------------------------
# the planner: one file per flush thread


class _Item:
    def __init__(self, nbytes: int, device: int = -1):
        self.device = device
        self.entry = type("Entry", (), {"nbytes": nbytes})()


def test_split_for_writers_cuts_in_order_into_parts_of_about_equal_bytes():
    items = [_Item(n) for n in (40 << 20, 10 << 20, 10 << 20, 20 << 20, 1, 30 << 20)]
    parts = split_for_writers(items, 2)
    assert [it for part in parts for it in part] == items  # every item once, in order
    sizes = [sum(it.entry.nbytes for it in part) for part in parts]
    assert len(parts) == 2 and abs(sizes[0] - sizes[1]) <= 40 << 20
    assert split_for_writers(items, 1) == [items]
    # Not below SPLIT_MIN_BYTES a file: a small state stays in one.
    small = [_Item(SPLIT_MIN_BYTES // 4) for _ in range(6)]
    assert split_for_writers(small, 4) == [small]
    # Device items are never split (their job copies through the cache in one stream order).
    dev = [_Item(SPLIT_MIN_BYTES, device=0) for _ in range(4)]
    assert split_for_writers(dev, 2) == [dev]
    assert split_for_writers([], 2) == []


def test_direct_writes_option_is_checked():
    assert DataStatesConfig().direct_writes is None
    assert DataStatesConfig(direct_writes=True).direct_writes is True
    with pytest.raises(ValueError, match="direct_writes: expected true, false or null, got 'yes'"):
        DataStatesConfig(direct_writes="yes")


# --------------------------------------------------------------------------------------------
# saves


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.weight": torch.randn(3 << 20, generator=g) for i in range(8)},
            "small": torch.arange(10), "step": 7}


def _files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


@pytest.mark.parametrize("direct_writes, direct", [(None, True), (False, False), (True, True)])
def test_a_save_to_a_memory_backed_folder_writes_from_the_tensors(shm_path, small_engine, direct_writes, direct):
    state = _state()
    snapshot = clone_state(state)
    before = engine_stats().get("direct_bytes", 0)
    writer = DataStatesWriter(shm_path, direct_writes=direct_writes)
    dcp.async_save(state, storage_writer=writer).upload_completion.result(timeout=120)
    moved = engine_stats()["direct_bytes"] - before
    tensor_bytes = sum(t.nbytes for t in state["model"].values())
    assert (moved >= tensor_bytes) if direct else (moved == 0)
    # 96 MiB of host tensors: one file per flush thread when written directly.
    assert len(_files(shm_path)) == (2 if direct else 1), _files(shm_path)
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=DataStatesReader(shm_path))
    assert_state_equal(snapshot, dest)


def test_a_direct_save_still_fails_when_a_tensor_changes_before_it_is_written(shm_path, small_engine):
    """The lazy guarantee holds with direct writes: staging ends when the files are written, and
    an in-place change before then fails the save, naming the tensor; nothing is committed."""
    state = _state(1)
    start_engine()
    engine = current_engine()
    engine.set_fault("stall", 0, shm_path)
    try:
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(shm_path))
        time.sleep(0.2)
        state["model"]["layer5.weight"].add_(1.0)  # a version bump while its bytes are not written
    finally:
        engine.set_fault("none", 0, "")
    with raises_through_dcp(r"tensor 'model\.layer5\.weight' was changed in place .* before its copy finished"):
        resp.upload_completion.result(timeout=120)
    assert not os.path.exists(os.path.join(shm_path, ".metadata"))


def test_the_next_step_waits_for_the_direct_writes(shm_path, small_engine):
    """protect_optimizer / the global step hook wait for staging: with direct writes that is the
    files' writes, held here by the stall fault."""
    model = torch.nn.Linear(2048, 4096)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 2048)).sum().backward()
    start_engine()
    engine = current_engine()
    engine.set_fault("stall", 0, shm_path)
    try:
        state = {"model": model.state_dict()}
        snapshot = clone_state(state)
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(shm_path))
        stepper = threading.Thread(target=opt.step, daemon=True)
        stepper.start()
        stepper.join(0.5)
        assert stepper.is_alive(), "optimizer.step() ran while the direct writes were held"
    finally:
        engine.set_fault("none", 0, "")
    stepper.join(60)
    assert not stepper.is_alive()
    resp.upload_completion.result(timeout=120)
    dest = zeros_like_state(snapshot)
    dcp.load(dest, storage_reader=DataStatesReader(shm_path))
    assert_state_equal(snapshot, dest)


def test_a_local_tier_on_tmpfs_is_written_directly_and_drained_whole(tmp_path, shm_path, small_engine):
    """The multi-level case direct writes are for: the local tier on /dev/shm, the durable tier
    on a disk folder. The local files are written from the tensors (two of them for 96 MiB), the
    drain copies them, and a load from the durable tier alone returns the saved bytes."""
    from dcp_datastates import commit

    state = _state(2)
    snapshot = clone_state(state)
    durable = str(tmp_path / "ckpt" / "step-1")
    before = engine_stats().get("direct_bytes", 0)
    writer = DataStatesWriter(durable, local_tier=shm_path)
    dcp.async_save(state, storage_writer=writer).upload_completion.result(timeout=120)
    assert engine_stats()["direct_bytes"] - before >= sum(t.nbytes for t in state["model"].values())
    local = writer.local_commit.result(timeout=0)
    assert local.startswith(shm_path)
    _, local_files = commit.read_commit(local)
    _, durable_files = commit.read_commit(durable)
    assert sorted(local_files) == sorted(durable_files) and len(durable_files) == 2
    for name in durable_files:
        with open(os.path.join(local, name), "rb") as a, open(os.path.join(durable, name), "rb") as b:
            assert a.read() == b.read(), name
    shutil.rmtree(shm_path)  # the durable tier alone
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=DataStatesReader(durable))
    assert_state_equal(snapshot, dest)


@pytest.mark.parametrize("direct_writes, direct", [(None, True), (False, False)])
def test_a_held_file_follows_the_option_when_it_is_written(shm_path, small_engine, direct_writes, direct):
    """A save whose folder is given only as DCP's checkpoint_id holds its items in the cache until
    the folder is known, then writes them: through the same option as every other file."""
    state = _state(3)
    snapshot = clone_state(state)
    before = engine_stats().get("direct_bytes", 0)
    writer = DataStatesWriter(direct_writes=direct_writes)
    dcp.async_save(state, checkpoint_id=shm_path, storage_writer=writer).upload_completion.result(timeout=120)
    moved = engine_stats()["direct_bytes"] - before
    assert (moved >= sum(t.nbytes for t in state["model"].values())) if direct else (moved == 0)
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=DataStatesReader(shm_path))
    assert_state_equal(snapshot, dest)
