"""Never silently wrong: a checkpoint holds the values its tensors had when the save was
requested, or the save fails naming the tensor; the last good checkpoint stays.

The cases a migrating DCP user writes, on 2048x2048 fp32 tensors: parameters changed in place
right after ``dcp.async_save`` returns (no ``protect_optimizer``), a step pre-hook registered
before ``protect_optimizer`` that changes parameters, a manual EMA-style update."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, protect_optimizer, start_engine, wait_staged
from dcp_datastates.runtime import current_engine

from conftest import raises_through_dcp

N, SIDE = 8, 2048
# A small cache makes staging of 128 MiB take a while (flushes free the space), as it would on a
# slow disk: the in-place changes below certainly land before the copies end.
OPTS = dict(host_cache_size=8 << 20, chunk_size=1 << 20, sync_files=False)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(SIDE, SIDE)) for i in range(N)})
    return model


def load_into(path, model) -> dict:
    dest = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(dest, storage_reader=DataStatesReader(path))
    return dest


def test_in_place_change_after_async_save_fails_and_keeps_the_last_good_checkpoint(tmp_path, small_engine):
    model = make_model()
    path = tmp_path / "ckpt"
    dcp.save(model.state_dict(), storage_writer=DataStatesWriter(path, **OPTS))  # the last good one
    good = {k: v.detach().clone() for k, v in model.state_dict().items()}
    current_engine().set_fault("stall", 0, str(path))  # flushes held: the copies cannot all finish first
    resp = dcp.async_save(model.state_dict(), storage_writer=DataStatesWriter(path, **OPTS))
    with torch.no_grad():  # what a migrating user writes: stock DCP copied before returning
        for p in model.parameters():
            p.add_(1.0)
    current_engine().set_fault("none", 0, "")
    with raises_through_dcp(r"tensor 'w\d' was changed in place after the save was requested .*protect_optimizer") as err:
        resp.upload_completion.result(timeout=120)
    assert "not committed" in str(err.value)
    back = load_into(path, model)
    assert all(torch.equal(back[k], good[k]) for k in good)  # exactly the previous checkpoint


def test_protect_optimizer_waits_before_a_pre_hook_registered_earlier(tmp_path, small_engine):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # an MoE expert-bias style update, registered BEFORE protect_optimizer
    opt.register_step_pre_hook(lambda o, a, k: [p.data.add_(0.5) for p in model.parameters()] and None)
    handle = protect_optimizer(opt)
    try:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        resp = dcp.async_save(model.state_dict(), storage_writer=DataStatesWriter(tmp_path / "c", **OPTS))
        opt.step()  # the guard runs first: the hook and the step see the copies finished
        resp.upload_completion.result(timeout=120)
    finally:
        handle.remove()
    back = load_into(tmp_path / "c", model)
    assert all(torch.equal(back[k], snapshot[k]) for k in snapshot)
    assert not torch.equal(model.state_dict()["w0"], snapshot["w0"])  # training did go on


def test_manual_update_needs_wait_staged(tmp_path, small_engine):
    model = make_model()
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start_engine(host_cache_size=OPTS["host_cache_size"], chunk_size=OPTS["chunk_size"])
    current_engine().set_fault("stall", 0, str(tmp_path / "bad"))
    resp = dcp.async_save(model.state_dict(), storage_writer=DataStatesWriter(tmp_path / "bad", **OPTS))
    with torch.no_grad():
        model["w7"].mul_(0.999)  # EMA-style update, no wait
    current_engine().set_fault("none", 0, "")
    with raises_through_dcp("tensor 'w7' was changed in place"):
        resp.upload_completion.result(timeout=120)
    resp = dcp.async_save(model.state_dict(), storage_writer=DataStatesWriter(tmp_path / "ok", **OPTS))
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert wait_staged() is True
    with torch.no_grad():
        model["w7"].mul_(0.999)
    resp.upload_completion.result(timeout=120)
    back = load_into(tmp_path / "ok", model)
    assert all(torch.equal(back[k], snapshot[k]) for k in snapshot)


def test_changes_after_staging_completion_are_fine(tmp_path, small_engine):
    model = make_model()
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    resp = dcp.async_save(model.state_dict(), storage_writer=DataStatesWriter(tmp_path / "c", **OPTS))
    resp.staging_completion.result(timeout=120)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    resp.upload_completion.result(timeout=120)
    back = load_into(tmp_path / "c", model)
    assert all(torch.equal(back[k], snapshot[k]) for k in snapshot)


_LAUNCH_CHILD = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter
    folder, api, per_process = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    writer = DataStatesWriter(folder, per_process=per_process)
    try:
        if api == "sync":
            dcp.save({"w": torch.ones(8)}, storage_writer=writer)
        else:
            dcp.async_save({"w": torch.ones(8)}, storage_writer=writer).upload_completion.result(timeout=60)
        print("SAVED")
    except BaseException as exc:
        print("ERROR " + str(exc).replace("\\n", " "))
    """
)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_multi_process_launch_without_process_group_refuses_before_writing(tmp_path, api):
    script = tmp_path / "child.py"
    script.write_text(_LAUNCH_CHILD)
    env = dict(os.environ, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1")
    folder = tmp_path / "ck"
    res = subprocess.run([sys.executable, str(script), str(folder), api, "0"], env=env, capture_output=True, text=True, timeout=120)
    assert "ERROR" in res.stdout and "WORLD_SIZE=2" in res.stdout and "init_process_group" in res.stdout, res.stdout + res.stderr
    assert not folder.exists() or not [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    res = subprocess.run([sys.executable, str(script), str(folder), api, "1"], env=env, capture_output=True, text=True, timeout=120)
    assert "SAVED" in res.stdout, res.stdout + res.stderr


_FREED_CHILD = textwrap.dedent(
    """
    import ctypes, sys, warnings
    warnings.filterwarnings("ignore")
    # Freed memory stays mapped (no mmap'd chunks, no trimming): the copies then read freed memory
    # instead of faulting, the case a save could otherwise commit without a word.
    path, how = sys.argv[1], sys.argv[2]
    if how != "unmap":  # unmap: glibc's defaults, an 8 MiB block is its own mapping, unmapped when freed
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    import torch, torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesReader, DataStatesWriter
    from dcp_datastates.runtime import current_engine
    opts = dict(host_cache_size=8 << 20, chunk_size=1 << 20, sync_files=False)
    state = {f"w{i}": torch.full((2 << 20,), float(i)) for i in range(4)}  # 8 MiB each
    dcp.save(state, storage_writer=DataStatesWriter(path, **opts))  # the last good checkpoint
    current_engine().set_fault("stall", 0, path)  # flushes held: w1..w3 are not copied yet
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, **opts))
    if how in ("free", "unmap"):
        state["w2"].untyped_storage().resize_(0)
    else:
        state["w2"].untyped_storage().resize_(16 << 20)  # reallocated elsewhere, values kept
    state["w3"] = torch.zeros(1)  # the memory of w3 is kept alive by the save: nothing to report
    current_engine().set_fault("none", 0, "")
    try:
        resp.upload_completion.result(timeout=120)
        print("COMMITTED")
    except BaseException as exc:
        print("ERROR " + " ".join(str(exc).split()))
    dest = {f"w{i}": torch.empty(2 << 20) for i in range(4)}
    dcp.load(dest, storage_reader=DataStatesReader(path))
    print("LOADED", [float(dest[f"w{i}"][0]) for i in range(4)], all(bool((dest[f"w{i}"] == i).all()) for i in range(4)))
    """
)


@pytest.mark.parametrize("how", ["free", "reallocate", "unmap"])
def test_a_storage_freed_or_reallocated_while_staging_fails_the_save(tmp_path, how):
    """A storage resized before its copy ended (no version bump: the guard's counters cannot see
    it) may have had its old memory reused while the engine read it, or unmapped (the copy then
    faults: csrc/fault_guard.h). The save fails naming the tensor, the process lives on, and the
    previous checkpoint stays, loaded bitwise."""
    script = tmp_path / "child.py"
    script.write_text(_FREED_CHILD)
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), how], capture_output=True, text=True,
                         timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "ERROR" in res.stdout and "the memory of tensor 'w2' was freed or reallocated" in res.stdout, out
    assert "not committed" in res.stdout and "staging_completion" in res.stdout, out
    assert "LOADED [0.0, 1.0, 2.0, 3.0] True" in res.stdout, out


def test_a_load_into_the_tensors_of_a_save_still_staging_waits_for_it(tmp_path, small_engine):
    """A restore right after a save (the same tensors as targets): the load's reads would change
    them under the lazy copies without a version bump the guard could see, and the save committed
    the loaded values as its own. The load now waits for the save's staging, as a step does."""
    import threading
    import time

    start_engine(**OPTS)
    state = {f"w{i}": torch.full((2 << 20,), float(i)) for i in range(4)}  # 32 MiB, 8 MiB cache
    other = tmp_path / "other"
    dcp.save({k: v + 100 for k, v in state.items()}, storage_writer=DataStatesWriter(other, **OPTS))
    path = tmp_path / "new"
    current_engine().set_fault("stall", 0, str(path))
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, **OPTS))
    resume = threading.Timer(0.5, lambda: current_engine().set_fault("none", 0, ""))
    resume.start()  # the flushes go on half a second later: until then staging cannot end
    t0 = time.monotonic()
    versions = [t._version for t in state.values()]
    dcp.load(state, storage_reader=DataStatesReader(other))
    assert time.monotonic() - t0 >= 0.4  # it waited for the staging
    resume.join()
    assert all(bool((state[f"w{i}"] == 100 + i).all()) for i in range(4))  # restored
    assert all(t._version > v for t, v in zip(state.values(), versions))  # as copy_ would have counted
    resp.upload_completion.result(timeout=120)
    saved = {f"w{i}": torch.empty(2 << 20) for i in range(4)}
    dcp.load(saved, storage_reader=DataStatesReader(path))
    assert all(bool((saved[f"w{i}"] == i).all()) for i in range(4))  # the values at the request
