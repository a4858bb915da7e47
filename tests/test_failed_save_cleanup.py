"""A save that fails leaves nothing behind: what it wrote is removed by the time the error reaches
the caller, on every storage, and the folder's previous checkpoint loads back bitwise.

Each case saves a good checkpoint into a folder, then fails a second save into the same folder
(and, where it matters, into a new one) and compares the folder's entries with what its commit
lists. Failures: the file-size limit of a full disk or quota (RLIMIT_FSIZE, in a child process,
the way a user meets it), the commit marker's write refused, a planner that raises after an
``async_save`` staged and wrote its files. Storages: a local folder, tmpfs (direct writes),
fsspec ``memory://``, the moto S3 server; the node-local tier (its local copy and its drain);
an incremental save (its base stays). Several ranks: tests/test_fault_matrix.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_datastates import DataStatesReader, DataStatesWriter, commit
from dcp_datastates.save import wait_settled
from dcp_datastates.storage import LocalStorage, ObjectStorage, open_storage
from dcp_datastates.tiers import local_tier as tiers

from conftest import assert_state_equal, raises_through_dcp, zeros_like_state

MiB = 1 << 20


def state_of(seed: float, mib: int = 4) -> dict:
    return {"w": torch.arange(mib * MiB // 4, dtype=torch.float32) + seed, "b": torch.full((64,), seed), "step": int(seed)}


def entries(url: str, options: dict | None = None) -> list[str]:
    """The names directly in checkpoint folder ``url`` (a local path or an fsspec URL)."""
    storage = open_storage(url, options)
    if isinstance(storage, LocalStorage):
        return sorted(os.listdir(url)) if os.path.isdir(url) else []
    fs = storage.fs
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(storage.root, detail=False, refresh=True))
    except FileNotFoundError:
        return []


def committed_entries(url: str, options: dict | None = None) -> list[str]:
    _, files = commit.read_commit(url, storage_options=options)
    return sorted({".metadata", *files})


def save(url: str, state: dict, api: str, planner=None, **options) -> None:
    writer = DataStatesWriter(url, **options)
    if api == "sync":
        dcp.save(state, storage_writer=writer, planner=planner)
    else:
        dcp.async_save(state, storage_writer=writer, planner=planner).upload_completion.result(timeout=120)


def load(url: str, like: dict, **options) -> dict:
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=DataStatesReader(url, **options))
    return out


class RefusingPlanner(DefaultSavePlanner):
    """A planner that fails the save once it is planned: with ``async_save`` every data file is
    written by then (the staging wrote it)."""

    def create_local_plan(self):
        raise RuntimeError("the planner refuses this save")


def refuse_the_marker(monkeypatch, cls) -> None:
    """The commit marker's write fails (a full disk or a store refusing the PUT): every data file
    is durable by then."""
    real = cls.put

    def put(self, name, data, *, sync):
        if name == ".metadata":
            raise OSError(28, "No space left on device", self.where(name))
        return real(self, name, data, sync=sync)

    monkeypatch.setattr(cls, "put", put)


def check_fails_leaving_nothing(url: str, how: str, api: str, monkeypatch, cls, options: dict | None = None) -> None:
    """A good checkpoint, then a save into the same folder that fails (``how``): only the good
    checkpoint's entries remain, and it loads bitwise. Then the same failure into a new folder:
    no data file there."""
    kw = {} if options is None else {"storage_options": options}
    good = state_of(1.0)
    save(url, good, "sync", **kw)
    before = committed_entries(url, options)
    planner = RefusingPlanner() if how == "planner" else None
    pattern = "the planner refuses this save" if how == "planner" else "No space left on device"
    with monkeypatch.context() as m:
        if how == "marker":
            refuse_the_marker(m, cls)
        with raises_through_dcp(pattern):
            save(url, state_of(2.0), api, planner=planner, **kw)
        settled(lambda: entries(url, options) == before, how, lambda: entries(url, options))
        fresh = url.rstrip("/") + "-fresh"
        with raises_through_dcp(pattern):
            save(fresh, state_of(3.0), api, planner=planner, **kw)
        settled(lambda: not [n for n in entries(fresh, options) if n.endswith(".safetensors")], how,
                lambda: entries(fresh, options))
    assert_state_equal(good, load(url, good, **kw))
    save(url, state_of(4.0), api, **kw)  # the folder takes the next save as usual
    assert_state_equal(state_of(4.0), load(url, good, **kw))


def settled(check, how: str, shown) -> None:
    """``check()`` holds when the save raised; for a planner's own error, once the failed save
    has left this process's saves in flight: that error reaches no hook of the writer, which
    learns of it when DCP's thread ends (save/discard.py), within a moment."""
    start = time.monotonic()
    if how == "planner":
        assert wait_settled(15.0), "the failed save is not discarded within 15 s"
    assert check(), (shown(), f"after {time.monotonic() - start:.1f} s")


CASES = [("marker", "sync"), ("marker", "async"), ("planner", "async")]


@pytest.mark.parametrize("how,api", CASES)
def test_local_folder(tmp_path, how, api, monkeypatch):
    check_fails_leaving_nothing(str(tmp_path / "ck"), how, api, monkeypatch, LocalStorage)


@pytest.fixture
def shm_url():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    root = f"/dev/shm/dcpds-cleanup-{uuid.uuid4().hex}"
    yield f"{root}/ck"
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("how,api", CASES)
def test_tmpfs_direct_writes(shm_url, how, api, monkeypatch):
    """On tmpfs the engine writes one file per flush thread without the host cache."""
    check_fails_leaving_nothing(shm_url, how, api, monkeypatch, LocalStorage)


@pytest.fixture
def mem_url():
    import fsspec

    bucket = f"dcpds-cleanup-{uuid.uuid4().hex[:8]}"
    yield f"memory://{bucket}/ck"
    try:
        fsspec.filesystem("memory").rm(bucket, recursive=True)
    except FileNotFoundError:
        pass


@pytest.mark.parametrize("how,api", CASES)
def test_object_store_memory(mem_url, how, api, monkeypatch):
    check_fails_leaving_nothing(mem_url, how, api, monkeypatch, ObjectStorage)


@pytest.mark.parametrize("how,api", [("marker", "async"), ("planner", "async")])
def test_object_store_s3(s3, how, api, monkeypatch):
    url = f"s3://{s3.bucket()}/run/ck"
    check_fails_leaving_nothing(url, how, api, monkeypatch, ObjectStorage, s3.options)


# ------------------------------------------------------------- the file-size limit, as users hit it
_RLIMIT_CHILD = r"""
import json, os, resource, signal, sys, time
import torch, torch.distributed.checkpoint as dcp
from dcp_datastates import DataStatesReader, DataStatesWriter, commit
from dcp_datastates.save import wait_settled

root = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
good = {"w": torch.arange(1 << 18, dtype=torch.float32)}  # 1 MiB
big = {"w": torch.arange(16 << 20, dtype=torch.float32)}  # 64 MiB
out = {}
for api in ("sync", "async"):
    for where in ("again", "fresh"):
        path = os.path.join(root, f"{api}-{where}")
        if where == "again":
            dcp.save(good, storage_writer=DataStatesWriter(path))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, resource.RLIM_INFINITY))
        try:
            w = DataStatesWriter(path)
            if api == "sync":
                dcp.save(big, storage_writer=w)
            else:
                dcp.async_save(big, storage_writer=w).upload_completion.result(timeout=120)
            error = None
        except BaseException as exc:
            error = str(exc)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        out[f"{api}-{where}"] = {"error": error, "at_once": sorted(os.listdir(path))}
time.sleep(1)
for key in out:
    out[key]["later"] = sorted(os.listdir(os.path.join(root, key)))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("on", ["disk", "tmpfs"])
def test_the_file_size_limit_leaves_no_partial_file(tmp_path, on):
    """64 MiB under a 16 MiB file-size limit (how a full disk or a quota looks to the writer):
    the save raises naming the cause, and neither its partial file nor any other of its files is
    left, at once, a moment later, nor after the process exits; a folder's previous checkpoint
    stays."""
    if on == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm here")
        root = f"/dev/shm/dcpds-rlimit-{uuid.uuid4().hex}"
        os.makedirs(root)
    else:
        root = str(tmp_path)
    try:
        script = tmp_path / "child.py"
        script.write_text(_RLIMIT_CHILD)
        res = subprocess.run([sys.executable, str(script), root], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        out = json.loads([ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
        for key, r in out.items():
            assert r["error"] is not None and "File too large" in r["error"], (key, r["error"])
            expected = committed_entries(os.path.join(root, key)) if key.endswith("again") else []
            assert r["at_once"] == expected, (key, r)
            assert r["later"] == expected, (key, r)
            assert entries(os.path.join(root, key)) == expected, key  # after the process exited
            if key.endswith("again"):
                back = {"w": torch.zeros(1 << 18)}
                dcp.load(back, storage_reader=DataStatesReader(os.path.join(root, key)))
                assert torch.equal(back["w"], torch.arange(1 << 18, dtype=torch.float32))
    finally:
        if on == "tmpfs":
            shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------- the local tier
@pytest.mark.parametrize("api", ["sync", "async"])
def test_local_tier_a_failed_local_copy_leaves_nothing_on_either_tier(tmp_path, api, small_engine):
    from dcp_datastates.runtime import current_engine

    """The node-local copy fails while written (EIO on the local tier): nothing of the save is
    left in the local copy nor in the durable folder (copies to it start while the files are
    written), and both keep the previous checkpoint."""
    durable, nv = str(tmp_path / "durable" / "step"), str(tmp_path / "nvme")
    good = state_of(1.0)
    save(durable, good, "sync", local_tier=nv)
    local = tiers.local_copy(nv, durable)
    before_durable, before_local = committed_entries(durable), entries(local)
    current_engine().set_fault("eio", 0, nv)
    try:
        with raises_through_dcp("Input/output error"):
            save(durable, state_of(2.0), api, local_tier=nv)
    finally:
        current_engine().set_fault("none", 0, "")
    assert entries(durable) == before_durable
    assert entries(local) == before_local
    assert_state_equal(good, load(durable, good, local_tier=nv))
    assert_state_equal(good, load(durable, good))


def test_local_tier_a_failed_drain_leaves_no_durable_file(tmp_path, monkeypatch):
    """The drain to the durable tier fails midway through a file: its partial copy goes, the
    durable folder keeps its previous checkpoint alone; the local copy stays committed (a level
    of the checkpoint, restorable; the next save drains it)."""
    from dcp_datastates.tiers import file_copy

    durable, nv = str(tmp_path / "durable" / "step"), str(tmp_path / "nvme")
    good, new = state_of(1.0), state_of(2.0)
    save(durable, good, "sync", local_tier=nv)
    before = committed_entries(durable)
    real = file_copy.copy_verified

    def failing(local, name, out, size, pieces, engine, *args, **kwargs):
        out.write(b"\0" * 4096)  # some bytes reach the durable file first
        raise OSError(5, "Input/output error", "durable store")

    monkeypatch.setattr(file_copy, "copy_verified", failing)
    with raises_through_dcp("Input/output error"):
        save(durable, new, "async", local_tier=nv)
    monkeypatch.setattr(file_copy, "copy_verified", real)
    assert entries(durable) == before
    assert_state_equal(good, load(durable, good))
    assert_state_equal(new, load(tiers.local_copy(nv, durable), new))  # committed on the local tier


# ------------------------------------------------------------------------------- incremental
def test_incremental_a_failed_save_leaves_its_base_files(tmp_path, monkeypatch):
    """step-1 full, step-2 incremental (refers to step-1's frozen tensor), step-3 incremental
    fails at its commit: step-3 holds nothing, step-1's and step-2's files all stay and load."""
    frozen = torch.randn(256, 256)
    states = {s: {"frozen": frozen, **state_of(float(s), mib=1)} for s in (1, 2, 3)}
    paths = {s: str(tmp_path / f"step-{s}") for s in (1, 2, 3)}
    for s in (1, 2):
        save(paths[s], states[s], "async", incremental=True)
    before = {s: entries(paths[s]) for s in (1, 2)}
    with monkeypatch.context() as m:
        refuse_the_marker(m, LocalStorage)
        with raises_through_dcp("No space left on device"):
            save(paths[3], states[3], "async", incremental=True)
    assert not [n for n in entries(paths[3]) if n.endswith(".safetensors")], entries(paths[3])
    assert {s: entries(paths[s]) for s in (1, 2)} == before
    for s in (1, 2):
        assert_state_equal(states[s], load(paths[s], states[s]))
