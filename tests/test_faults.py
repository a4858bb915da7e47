"""Faults while writing: the error comes out of dcp.save / upload_completion with the file path
and the cause, the process and the training loop go on, and the next checkpoint succeeds once
the fault is gone. Engine faults are injected with Engine.set_fault; "file too large" comes
from a real RLIMIT_FSIZE in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, engine_stats, protect_optimizer
from dcp_datastates.runtime import current_engine

from conftest import raises_through_dcp

CACHE, CHUNK = 1 << 20, 64 << 10

# kind -> (what the message must say, needs sync_files)
CAUSES = {
    "eio": (r"pwrite of \d+ bytes at offset \d+ failed: Input/output error \(errno 5\)", False),
    "enospc": (r"pwrite of \d+ bytes at offset \d+ failed: No space left on device \(errno 28\)", False),
    "short_write": (r"short write: pwrite of \d+ bytes at offset \d+ stopped after \d+ bytes", False),
    "fsync_eio": (r"fsync of \d+ bytes failed: Input/output error \(errno 5\)", True),
}


def model_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 256, generator=g) for i in range(6)} | {"step": seed}


def zeros() -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in model_state().items()}


def writer(folder, **kw) -> DataStatesWriter:
    return DataStatesWriter(folder, host_cache_size=CACHE, chunk_size=CHUNK, **kw)


def assert_loads(folder, expected: dict) -> None:
    dest = zeros()
    dcp.load(dest, storage_reader=DataStatesReader(folder))
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(dest[k], v), k
        else:
            assert dest[k] == v, k


def assert_engine_clean(wait_s: float = 10.0) -> None:
    """Every job ended and no cache slot leaked by the failed one. A failure found while staging
    is reported (by the writer's staging watcher) while the failed job may still be skipping its
    remaining chunks, so this waits a little for the engine to wind down."""
    deadline = time.monotonic() + wait_s
    while True:
        st = engine_stats()
        if st["slots_free"] == st["slots_total"] and st["jobs_done"] == st["jobs_submitted"]:
            return
        assert time.monotonic() < deadline, st
        time.sleep(0.01)


@pytest.mark.parametrize("kind", sorted(CAUSES))
def test_engine_fault_in_dcp_save(tmp_path, small_engine, kind):
    cause, sync = CAUSES[kind]
    folder = tmp_path / "step-1"
    state = model_state(1)
    dcp.save(state, storage_writer=writer(folder, sync_files=sync))  # a committed checkpoint first
    eng = current_engine()
    eng.set_fault(kind, 100 << 10, str(tmp_path))  # fails part-way through the file
    data = rf"{folder}/__0_0\.[0-9a-f]{{12}}\.safetensors"  # the resave's own file: the old one stays
    with raises_through_dcp(rf"CheckpointWriteError: saving checkpoint {folder} failed: {data}: {cause}"):
        dcp.save(model_state(2), storage_writer=writer(folder, sync_files=sync))
    assert_loads(folder, state)  # the previous checkpoint, exactly
    assert engine_stats()["jobs_failed"] >= 1
    assert_engine_clean()
    eng.set_fault("none", 0, "")
    dcp.save(model_state(3), storage_writer=writer(folder, sync_files=sync))
    assert_loads(folder, model_state(3))


@pytest.mark.parametrize("kind", sorted(CAUSES))
def test_engine_fault_in_async_save_training_goes_on(tmp_path, small_engine, kind):
    cause, sync = CAUSES[kind]
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = protect_optimizer(opt)

    def train_step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        loss = model(torch.randn(16, 128, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    try:
        train_step(0)
        bad = tmp_path / "step-1"
        resp0 = dcp.async_save({"model": model.state_dict()}, storage_writer=writer(tmp_path / "step-0", sync_files=sync))
        resp0.upload_completion.result(timeout=60)
        current_engine().set_fault(kind, 50 << 10, str(bad))
        resp = dcp.async_save({"model": model.state_dict()}, storage_writer=writer(bad, sync_files=sync))
        before = [p.detach().clone() for p in model.parameters()]
        for s in range(1, 4):  # training goes on while (and after) the save fails
            train_step(s)
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        with raises_through_dcp(rf"{bad / '__0_0.safetensors'}: {cause}"):  # a fresh folder: plain names
            resp.upload_completion.result(timeout=60)
        assert not (bad / ".metadata").exists()
        assert_engine_clean()
        current_engine().set_fault("none", 0, "")
        # the next checkpoint succeeds and holds the current parameters exactly
        good = tmp_path / "step-2"
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        resp = dcp.async_save({"model": model.state_dict()}, storage_writer=writer(good, sync_files=sync))
        train_step(9)  # waits for staging (protect_optimizer), then changes the parameters
        resp.upload_completion.result(timeout=60)
        dest = {"model": {k: torch.zeros_like(v) for k, v in snapshot.items()}}
        dcp.load(dest, storage_reader=DataStatesReader(good))
        for k, v in snapshot.items():
            assert torch.equal(dest["model"][k], v), k
    finally:
        handle.remove()


@pytest.mark.parametrize("api", ["sync", "async"])
def test_parent_is_a_file(tmp_path, small_engine, api):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    folder = blocker / "step-1"
    pattern = rf"cannot create checkpoint folder {folder}: Not a directory"
    if api == "sync":
        with raises_through_dcp(pattern):
            dcp.save(model_state(), storage_writer=writer(folder))
    else:
        resp = dcp.async_save(model_state(), storage_writer=writer(folder))
        with raises_through_dcp(pattern):
            resp.upload_completion.result(timeout=60)
    assert blocker.read_text() == "x"
    ok = tmp_path / "step-1"  # the process goes on: the next checkpoint elsewhere works
    dcp.save(model_state(4), storage_writer=writer(ok))
    assert_loads(ok, model_state(4))


def test_set_fault_rejects_unknown_kind(small_engine, tmp_path):
    dcp.save(model_state(), storage_writer=writer(tmp_path / "c"))
    with pytest.raises(ValueError, match="unknown fault kind 'disk_on_fire'"):
        current_engine().set_fault("disk_on_fire", 0, "")


_RLIMIT_CHILD = textwrap.dedent(
    r"""
    import json, os, resource, signal, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesReader, DataStatesWriter, engine_stats
    from dcp_datastates.errors import checkpoint_error_cause

    root = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    out = {}

    def w(path):
        return DataStatesWriter(path, host_cache_size=1 << 20, chunk_size=64 << 10)

    def attempt(name, fn):
        try:
            fn()
            out[name] = {"ok": True}
        except BaseException as exc:
            cause = checkpoint_error_cause(exc)
            out[name] = {"ok": False, "type": type(cause).__name__, "text": str(exc)}

    big = {f"t{i}": torch.randn(256 * 1024) for i in range(4)}  # 4 MiB of data
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    attempt("save", lambda: dcp.save(big, storage_writer=w(os.path.join(root, "big-sync"))))
    attempt("async", lambda: dcp.async_save(big, storage_writer=w(os.path.join(root, "big-async"))).upload_completion.result(timeout=60))
    # data that fits under the limit, a commit marker that does not: 3000 scalars
    many = {f"scalar_{i:05d}": torch.tensor(float(i)) for i in range(3000)}
    resource.setrlimit(resource.RLIMIT_FSIZE, (400 << 10, hard))
    attempt("commit", lambda: dcp.save(many, storage_writer=w(os.path.join(root, "many"))))
    out["many_files"] = sorted(os.listdir(os.path.join(root, "many")))
    st = engine_stats()
    out["slots_clean"] = st["slots_free"] == st["slots_total"]
    # the fault is gone: everything saves and loads
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    attempt("after", lambda: dcp.save(big, storage_writer=w(os.path.join(root, "big-sync"))))
    dest = {k: torch.zeros_like(v) for k, v in big.items()}
    dcp.load(dest, storage_reader=DataStatesReader(os.path.join(root, "big-sync")))
    out["after_exact"] = all(torch.equal(dest[k], big[k]) for k in big)
    print("RESULT " + json.dumps(out))
    """
)


def test_file_too_large_rlimit_fsize(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_RLIMIT_CHILD)
    res = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    for name, folder in (("save", "big-sync"), ("async", "big-async")):
        r = out[name]
        assert not r["ok"], name
        assert r["type"] == "CheckpointWriteError", r
        data = tmp_path / folder / "__0_0.safetensors"
        assert f"{data}: pwrite of" in r["text"] and "File too large (errno 27)" in r["text"], r["text"]
    r = out["commit"]
    assert not r["ok"] and r["type"] == "CheckpointWriteError", r
    assert f"committing checkpoint {tmp_path / 'many'} failed: File too large" in r["text"], r["text"]
    assert out["many_files"] == []  # no marker, no temporary, and the data file it was for is gone
    assert out["slots_clean"]
    assert out["after"] == {"ok": True} and out["after_exact"]
