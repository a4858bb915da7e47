"""The lazy guarantee with code people run, not code written for this library: every torch.optim
optimizer as people configure it (fused, foreach, for-loop; no ``protect_optimizer``), BatchNorm
networks checkpointed every step, a save planner that packs objects the way Megatron-core's does
(and one that transforms tensors), ``convert --to dcp`` of such a checkpoint.

The copies are held back with the engine's "stall" fault (flushes wait, so a small cache cannot
take every copy): whatever the training loop does next certainly happens while the save stages.
"""

from __future__ import annotations

import io
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from dcp_datastates import DataStatesReader, DataStatesWriter, protect_optimizer, wait_staged
from dcp_datastates.runtime import current_engine

from conftest import assert_state_equal, clone_state, raises_through_dcp, tensors_equal_bitwise, zeros_like_state

# 8 MiB cache for 64+ MiB of state: the copies wait for flushes, which the stall holds.
OPTS = dict(host_cache_size=8 << 20, chunk_size=1 << 20, sync_files=False)


class stalled_flushes:
    """Flushes into ``path`` wait until the block ends (the engine must be running)."""

    def __init__(self, path):
        self.path = str(path)

    def __enter__(self):
        current_engine().set_fault("stall", 0, self.path)
        return self

    def __exit__(self, *exc):
        current_engine().set_fault("none", 0, "")


def start_engine_now():
    from dcp_datastates import start_engine

    start_engine(**OPTS)


def save_and_step_while_staging(state, path, step, what: str):
    """Lazily save ``state`` into ``path`` with its flushes held and run ``step`` in a thread: it
    must still be waiting half a second later. Then the flushes go on; the save is committed."""
    with stalled_flushes(path):
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, **OPTS))
        stepper = threading.Thread(target=step, daemon=True)
        stepper.start()
        stepper.join(0.5)
        assert stepper.is_alive(), f"{what}: step() ran while the save was still staging"
    stepper.join(60)
    assert not stepper.is_alive()
    resp.upload_completion.result(timeout=120)


# ------------------------------------------------------------------------------ optimizers
def _wide_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB of weights


OPTIMIZERS = {
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "Adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "Adam-for-loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "SGD-fused-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_torch_optim_step_waits_for_lazy_staging_without_protect_optimizer(tmp_path, small_engine, name):
    """Fused kernels do not bump tensor versions, so the guard alone cannot see them: the step
    itself must wait (the global optimizer step pre-hook). Model-only checkpoint, as in the
    report of the torn commits."""
    start_engine_now()
    model = _wide_model()
    opt = OPTIMIZERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(4, 1024)).square().mean().backward()
        opt.step()
        sched.step()
    model(torch.randn(4, 1024)).square().mean().backward()  # the next step's gradients
    before = clone_state(model.state_dict())
    path = tmp_path / "ckpt"
    save_and_step_while_staging(model.state_dict(), path, opt.step, name)
    assert not torch.equal(model[0].weight, before["0.weight"])  # the step did happen
    dest = zeros_like_state(before)
    dcp.load(dest, storage_reader=DataStatesReader(path))
    assert_state_equal(before, dest)


def test_protect_optimizer_wraps_the_step_of_update_code_outside_torch_optim(tmp_path, small_engine):
    class SignUpdate:  # an optimizer that is not a torch.optim.Optimizer
        def __init__(self, params):
            self.params = list(params)

        def step(self):
            with torch.no_grad():
                for p in self.params:
                    p.add_(p.grad.sign(), alpha=-1e-2)

    start_engine_now()
    model = _wide_model()
    opt = SignUpdate(model.parameters())
    model(torch.randn(4, 1024)).square().mean().backward()
    guard = protect_optimizer(opt)
    before = clone_state(model.state_dict())
    path = tmp_path / "ckpt"
    save_and_step_while_staging(model.state_dict(), path, opt.step, "SignUpdate")
    dest = zeros_like_state(before)
    dcp.load(dest, storage_reader=DataStatesReader(path))
    assert_state_equal(before, dest)
    guard.remove()
    assert "step" not in vars(opt)  # the class's own step again
    with pytest.raises(TypeError, match="step\\(\\) method"):
        protect_optimizer(object())


def test_torch_optim_guard_handle_and_cost_when_nothing_stages(monkeypatch):
    from dcp_datastates.runtime import inflight

    calls = []
    monkeypatch.setattr(inflight, "wait_staged", lambda *a, **k: calls.append(1) or True)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = protect_optimizer(opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert calls == []  # nothing staging: the hook does not wait
    fake_save = object()
    inflight.register(fake_save)  # the registry lists it as staging
    try:
        opt.step()
        assert calls == [1]
    finally:
        inflight.unregister(fake_save)
    handle.remove()  # a torch.optim optimizer stays guarded while a save stages


# ------------------------------------------------------------------------------- BatchNorm
def _bn_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 4096), torch.nn.BatchNorm1d(4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8),
    )


def test_batchnorm_statistics_are_saved_at_their_request_time_values(tmp_path, small_engine):
    """The next forward updates running_mean/var (no version bump) and num_batches_tracked (in
    place) while the save stages: the checkpoint holds the request-time values, and the save
    does not fail."""
    start_engine_now()
    net = _bn_net()
    net.train()
    net(torch.randn(32, 64))
    state = {"model": net.state_dict()}
    before = clone_state(state)
    path = tmp_path / "ckpt"
    with stalled_flushes(path):
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, **OPTS))
        for _ in range(3):
            net(torch.randn(32, 64))  # forward while staging
    resp.upload_completion.result(timeout=120)
    assert not torch.equal(net[1].running_mean, before["model"]["1.running_mean"])
    dest = zeros_like_state(before)
    dcp.load(dest, storage_reader=DataStatesReader(path))
    assert_state_equal(before, dest)


def test_batchnorm_without_the_request_copy_fails_rather_than_commit_a_changed_counter(tmp_path, small_engine):
    """copy_at_request_max_bytes=0: the counter's in-place bump is seen by the guard."""
    start_engine_now()
    net = _bn_net()
    net(torch.randn(32, 64))
    path = tmp_path / "ckpt"
    with stalled_flushes(path):
        resp = dcp.async_save({"model": net.state_dict()},
                              storage_writer=DataStatesWriter(path, copy_at_request_max_bytes=0, **OPTS))
        net(torch.randn(32, 64))
    with raises_through_dcp(r"num_batches_tracked' was changed in place"):
        resp.upload_completion.result(timeout=120)


@pytest.mark.parametrize("total, mutate, committed", [
    (64 << 10, "stats", True),  # the statistic is copied at the request although the total is small
    (64 << 10, "mid", False),  # the 32 KiB tensors are past the total: copied lazily, guarded
    (64 << 20, "both", True),  # the default total: every tensor under 64 KiB copied at the request
])
def test_the_request_copy_takes_the_smallest_tensors_up_to_its_total(tmp_path, small_engine, caplog, monkeypatch,
                                                                      total, mutate, committed):
    """``copy_at_request_total_bytes`` bounds what the training thread copies at the request,
    the smallest tensors first. With 64 KiB, a 4 KiB statistic and a counter fit and forty 32 KiB
    tensors (1.25 MiB, each under ``copy_at_request_max_bytes``) do not: a change of the
    statistic that bumps no version (BatchNorm's kernel; here through ``.data``) made after the
    request does not reach the checkpoint, while an in-place change of a 32 KiB tensor fails the
    save through the version guard (were it copied at the request, the save would commit; were
    the statistic left lazy, it would hold -1). With the default total all of them are copied at
    the request. Each case saves twice: the second reuses the cached plan (one rule on both paths)."""
    from dcp_datastates.save import copy_at_request, plan_cache

    monkeypatch.setattr(copy_at_request, "_limits_told", set())
    monkeypatch.setattr(plan_cache, "_plans", {})  # the first save lays the state out, the second reuses it
    start_engine_now()
    for attempt in range(2):
        g = torch.Generator().manual_seed(attempt)
        # First in the file, 16 MiB: the 8 MiB cache cannot take it while flushes wait, so no lazy
        # copy of the tensors after it starts before the stall ends.
        state = {"big": torch.randn(4 << 20, generator=g), "stats": torch.randn(1024, generator=g),
                 "count": torch.tensor(7 + attempt), **{f"mid{k}": torch.randn(8192, generator=g) for k in range(40)}}
        before = clone_state(state)
        path = tmp_path / f"ckpt{attempt}"
        hits = plan_cache.plan_stats()["hits"]
        with caplog.at_level("WARNING", logger="dcp_datastates"), stalled_flushes(path):
            resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, copy_at_request_total_bytes=total,
                                                                         **OPTS))
            if mutate in ("stats", "both"):
                state["stats"].data.fill_(-1.0)
            if mutate in ("mid", "both"):
                state["mid3"].add_(1.0)
        assert plan_cache.plan_stats()["hits"] == hits + attempt  # the second save is a plan-cache hit
        if not committed:
            with raises_through_dcp(r"tensor 'mid3' was changed in place"):
                resp.upload_completion.result(timeout=120)
            continue
        resp.upload_completion.result(timeout=120)
        dest = zeros_like_state(before)
        dcp.load(dest, storage_reader=DataStatesReader(path))
        assert_state_equal(before, dest)
    told = [r.getMessage() for r in caplog.records if "copy_at_request_total_bytes" in r.getMessage()]
    if total < 1 << 20:
        assert len(told) == 1 and "only those up to 4096 bytes" in told[0] and "the other 40 " in told[0], told
    else:
        assert told == []


def _train_bn(net, opt, steps, start, ckpt_root=None, every=1):
    losses = []
    pending = None
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g)
        loss = net(x).square().mean()
        loss.backward()
        opt.step()  # no protect_optimizer: the global hook waits
        opt.zero_grad()
        losses.append(loss.item())
        if ckpt_root is not None and step % every == 0:
            if pending is not None:
                pending.result(timeout=120)
            state = {"model": net.state_dict(), "optim": opt.state_dict()}
            pending = dcp.async_save(state, storage_writer=DataStatesWriter(ckpt_root / f"step-{step}", host_cache_size=64 << 20)).upload_completion
    if pending is not None:
        pending.result(timeout=120)
    return losses


def test_batchnorm_network_checkpointed_every_step_resumes_bitwise(tmp_path):
    net = _bn_net()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
    first = _train_bn(net, opt, 6, 1, tmp_path)
    reference = _train_bn(net, opt, 3, 7)  # what an uninterrupted run does next

    net2 = _bn_net(seed=123)
    opt2 = torch.optim.SGD(net2.parameters(), lr=1e-2, momentum=0.9)
    _train_bn(net2, opt2, 1, 1)  # creates the momentum buffers to load into
    state = {"model": net2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(state, storage_reader=DataStatesReader(tmp_path / "step-6"))
    net2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    resumed = _train_bn(net2, opt2, 3, 7)
    assert len(first) == 6 and resumed == reference  # bitwise: the same float losses
    for (k, a), b in zip(net.state_dict().items(), net2.state_dict().values()):
        assert tensors_equal_bitwise(a, b), k


# --------------------------------------------------------------------------------- planners
class PackedObjectsSavePlanner(DefaultSavePlanner):
    """What Megatron-core's save planner does with objects: they arrive packed in io.BytesIO and
    are written as they are."""

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


class PackedObjectsLoadPlanner(DefaultLoadPlanner):
    """Its load side: the stored bytes come back as an io.BytesIO, unpacked by the caller."""

    def load_bytes(self, read_item, value):
        from torch.distributed.checkpoint._traverse import set_element  # test only: DCP's own helper

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], io.BytesIO(value.read()))


def _packed(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _load_packed(reader, template):
    dest = dict(template)
    dcp.load(dest, storage_reader=reader, planner=PackedObjectsLoadPlanner())
    return dest


def test_a_planner_that_packs_objects_is_honoured_on_the_lazy_path(tmp_path):
    state = {"w": torch.randn(256, 256), "rng": _packed({"seed": 7, "state": [1, 2, 3]}), "plain": {"epoch": 3}}
    template = {"w": torch.zeros(256, 256), "rng": None, "plain": {"epoch": None}}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock"), planner=PackedObjectsSavePlanner())
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "lazy"), planner=PackedObjectsSavePlanner())
    state["rng"] = _packed({"seed": 8})  # the caller moves on: the request-time value is saved
    resp.upload_completion.result(timeout=120)
    stock = _load_packed(FileSystemReader(tmp_path / "stock"), template)
    lazy = _load_packed(DataStatesReader(tmp_path / "lazy", trusted=True), template)
    assert isinstance(lazy["rng"], io.BytesIO)
    assert lazy["rng"].getvalue() == stock["rng"].getvalue() == _packed({"seed": 7, "state": [1, 2, 3]}).getvalue()
    assert torch.load(lazy["rng"]) == {"seed": 7, "state": [1, 2, 3]}  # what Megatron then does
    assert torch.equal(lazy["w"], stock["w"])
    # A value that is not packed: torch.save'd by the planner's default transform, on both paths.
    assert lazy["plain"]["epoch"].getvalue() == stock["plain"]["epoch"].getvalue()
    assert torch.load(lazy["plain"]["epoch"]) == 3


class ScalingSavePlanner(DefaultSavePlanner):
    """Transforms tensors (same dtype and shape): writes twice each value."""

    def transform_object(self, write_item, object):
        if write_item.type != WriteItemType.BYTE_IO:
            return object * 2
        return super().transform_object(write_item, object)


def test_a_planner_that_transforms_tensors_gets_the_request_time_values(tmp_path, small_engine):
    start_engine_now()
    state = {f"t{i}": torch.randn(1024, 1024) for i in range(8)}
    before = clone_state(state)
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock"), planner=ScalingSavePlanner())
    path = tmp_path / "lazy"
    with stalled_flushes(path):
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, **OPTS), planner=ScalingSavePlanner())
        assert wait_staged(timeout=0.2) is False  # still staging
    wait_staged()
    for t in state.values():
        t.add_(1.0)  # after staging: allowed, and must not reach the checkpoint
    resp.upload_completion.result(timeout=120)
    lazy, stock = zeros_like_state(before), zeros_like_state(before)
    dcp.load(lazy, storage_reader=DataStatesReader(path))
    dcp.load(stock, storage_reader=FileSystemReader(tmp_path / "stock"))
    for k, v in before.items():
        assert torch.equal(lazy[k], v * 2) and torch.equal(stock[k], v * 2), k


class LookupElsewhereSavePlanner(DefaultSavePlanner):
    def lookup_object(self, index):
        obj = super().lookup_object(index)
        return obj.clone() if isinstance(obj, torch.Tensor) else obj


def test_a_planner_building_other_tensors_from_live_state_fails_the_lazy_save_clearly(tmp_path):
    state = {"w": torch.randn(64, 64)}
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c"), planner=LookupElsewhereSavePlanner())
    with raises_through_dcp(r"LookupElsewhereSavePlanner, item 'w'.*Use dcp.save"):
        resp.upload_completion.result(timeout=120)
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "d"), planner=LookupElsewhereSavePlanner())
    dest = {"w": torch.zeros(64, 64)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "d"))
    assert torch.equal(dest["w"], state["w"])


class ConjugatingSavePlanner(DefaultSavePlanner):
    """Hands back a conjugate view of each complex tensor: the same memory, other values."""

    def lookup_object(self, index):
        obj = super().lookup_object(index)
        return obj.conj() if isinstance(obj, torch.Tensor) and obj.is_complex() else obj


def test_a_planner_handing_back_a_conjugate_view_is_not_taken_for_the_state(tmp_path):
    """Same memory, dtype, shape and strides as the state's tensor, but its conjugate: the lazy
    save must not write the state's bytes for it (it did, silently). It fails clearly, as for any
    other tensor the planner builds; dcp.save writes what the planner hands back, as stock DCP."""
    state = {"z": torch.randn(16, dtype=torch.complex64), "w": torch.randn(4)}
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c"), planner=ConjugatingSavePlanner())
    with raises_through_dcp(r"ConjugatingSavePlanner, item 'z'.*Use dcp.save"):
        resp.upload_completion.result(timeout=120)
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "d"), planner=ConjugatingSavePlanner())
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock"), planner=ConjugatingSavePlanner())
    ours, stock = zeros_like_state(state), zeros_like_state(state)
    dcp.load(ours, storage_reader=DataStatesReader(tmp_path / "d"))
    dcp.load(stock, storage_reader=FileSystemReader(tmp_path / "stock"))
    assert torch.equal(ours["z"], state["z"].conj()) and torch.equal(stock["z"], state["z"].conj())
    assert torch.equal(ours["w"], state["w"])


def test_convert_to_dcp_copies_packed_objects_verbatim(tmp_path):
    from dcp_datastates.convert import to_dcp

    packed = _packed({"seed": 7})
    state = {"w": torch.randn(32, 32), "rng": packed}
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "ck"), planner=PackedObjectsSavePlanner())
    resp.upload_completion.result(timeout=120)
    to_dcp(str(tmp_path / "ck"), str(tmp_path / "out"))
    back = _load_packed(FileSystemReader(tmp_path / "out"), {"w": torch.zeros(32, 32), "rng": None})
    assert back["rng"].getvalue() == packed.getvalue()
    assert torch.equal(back["w"], state["w"])
