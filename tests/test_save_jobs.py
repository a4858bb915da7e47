"""One job protocol serves every kind of data file of a save (issue 50): ``in_flight.FileJob`` (a
file the engine writes as planned at the request) and ``held_file.HeldFile`` (items held in the
host cache until the plan says which this rank writes) both follow ``held_file.DataFileWork``,
member for member, and the save's steps use only it. A save whose items are held (an incremental
save holds its tensors for their hashes; ``dcp.save`` holds its late items) writes and loads back
bit-identical data, and a failed one waits for both kinds through ``wait_ended``."""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.save import held_file, write
from dcp_datastates.save.held_file import DataFileWork, HeldFile
from dcp_datastates.save.in_flight import FileJob
from dcp_datastates.storage import LocalStorage

from conftest import assert_state_equal, clone_state, raises_through_dcp, zeros_like_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KINDS = (FileJob, HeldFile)
DATA_MEMBERS = ("keys", "name", "job", "mirrors", "mirror_of", "written")


def protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(DataFileWork).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def test_the_protocol_names_every_member_the_save_uses():
    methods = protocol_methods()
    assert {"result", "wait_ended", "device_wait", "wait_staged", "is_staged", "is_done", "abort"} <= set(methods)
    assert isinstance(vars(DataFileWork)["device"], property)
    assert set(DATA_MEMBERS) <= set(DataFileWork.__annotations__)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_both_kinds_follow_the_protocol(kind):
    """Every method of ``DataFileWork`` is one of the kind's, with the same parameters (names,
    kinds, defaults): a caller never needs to know which kind a job is."""
    for name, expected in protocol_methods().items():
        member = getattr(kind, name, None)
        assert callable(member), f"{kind.__name__}.{name} is missing"
        got = inspect.signature(member)
        shape = [(p.name, p.kind, p.default) for p in expected.parameters.values()]
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == shape, \
            f"{kind.__name__}.{name}{got} does not match DataFileWork.{name}{expected}"
    # ``HeldFile.result`` is a method now, no Future: one meaning of ``result`` for both kinds.
    assert inspect.isfunction(kind.result)
    assert not hasattr(HeldFile, "selected_keys")  # (dead code, removed)


def test_no_save_step_asks_which_kind_a_job_is():
    save_dir = Path(held_file.__file__).parent
    asks = re.compile(r"isinstance\(.*\b(FileJob|HeldFile)\b")
    found = [f"{p.name}:{n}" for p in sorted(save_dir.glob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if asks.search(line)]
    assert not found, found


@pytest.fixture
def jobs_seen(monkeypatch):
    """Every job of each save, when ``write_data`` waits for them to be durable, and after."""
    seen: list[list] = []
    real = write._wait_durable

    def spy(staged):
        seen.append(list(staged.jobs()))
        return real(staged)

    monkeypatch.setattr(write, "_wait_durable", spy)
    return seen


def state_of(seed: float) -> dict:
    g = torch.Generator().manual_seed(int(seed))
    return {
        "frozen": torch.randn(256, 128, generator=g),
        "w": torch.randn(1000, generator=g) + seed,
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "ints": torch.arange(517, dtype=torch.int64) * int(seed),
        "step": int(seed),
        "meta": {"lr": 0.5 * seed, "name": f"run-{seed}"},
    }


def load(path, like) -> dict:
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    return out


def check_jobs(jobs: list, *, held: bool) -> None:
    assert jobs and all(isinstance(j, DataFileWork) for j in jobs), [type(j).__name__ for j in jobs]
    assert all(isinstance(j, KINDS) for j in jobs)
    assert any(isinstance(j, HeldFile) for j in jobs) == held, [type(j).__name__ for j in jobs]
    for j in jobs:
        assert j.is_done() and j.wait_ended(0.0)
        assert j.written is not None and dict(j.written) == j.result()
        assert set(j.written) <= set(j.keys)
        assert j.device == -1


def test_a_save_with_held_files_writes_and_loads_back_bit_identical(tmp_path, jobs_seen):
    """Incremental saves hold their tensors (async: at the request; ``dcp.save``: the late
    items) beside engine files for the other values; a plain ``dcp.save`` writes its late items
    as an engine file. Each loads back bitwise, references to the base included."""
    states, paths = {}, {}
    for step, how in enumerate(("async", "async", "sync", "plain-sync"), start=1):
        state = state_of(step)
        if step > 1:
            state["frozen"] = states[1]["frozen"]  # unchanged: a reference to step 1's bytes
        paths[step] = tmp_path / f"step-{step}"
        writer = DataStatesWriter(paths[step], incremental=how != "plain-sync")
        if how == "async":
            dcp.async_save(state, storage_writer=writer).upload_completion.result(timeout=120)
        else:
            dcp.save(state, storage_writer=writer, no_dist=True)
        states[step] = clone_state(state)
        check_jobs(jobs_seen[-1], held=how != "plain-sync")
    assert len(jobs_seen) == 4
    assert any(isinstance(j, FileJob) for j in jobs_seen[0])  # the first save: both kinds at once
    for step, state in states.items():
        assert_state_equal(state, load(paths[step], state), strict=True)
    # step 2 wrote the frozen tensor by reference: its held file dropped it from its selection
    files = list(paths[2].glob("*.safetensors"))
    assert files and sum(p.stat().st_size for p in files) < states[1]["frozen"].nbytes, files


def test_a_failed_save_waits_for_both_kinds_to_end(tmp_path, monkeypatch):
    """The commit marker's write fails once every file is durable: the discard waits for each
    job through ``wait_ended`` (both kinds), then nothing of the save is left."""
    ended: list[tuple[str, bool]] = []
    for kind in KINDS:
        def spy(self, timeout, real=kind.wait_ended):
            out = real(self, timeout)
            ended.append((type(self).__name__, out))
            return out
        monkeypatch.setattr(kind, "wait_ended", spy)
    good = state_of(1)
    path = tmp_path / "ck"
    dcp.async_save(good, storage_writer=DataStatesWriter(path, incremental=True)).upload_completion.result(timeout=120)
    before = sorted(os.listdir(path))
    real_put = LocalStorage.put

    def put(self, name, data, *, sync):
        if name == ".metadata":
            raise OSError(28, "No space left on device", name)
        return real_put(self, name, data, sync=sync)

    with monkeypatch.context() as m:
        m.setattr(LocalStorage, "put", put)
        with raises_through_dcp("No space left on device"):
            dcp.async_save(state_of(2), storage_writer=DataStatesWriter(path, incremental=True)) \
                .upload_completion.result(timeout=120)
    assert {name for name, _ in ended} == {"FileJob", "HeldFile"}, ended
    assert all(out for _, out in ended), ended
    assert sorted(os.listdir(path)) == before
    assert_state_equal(good, load(path, good), strict=True)
