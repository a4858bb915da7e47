"""Lazy staging semantics: what the checkpoint holds when training keeps changing the tensors."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, engine_stats, protect_optimizer, wait_staged

from conftest import assert_state_equal, clone_state, zeros_like_state


def make_model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()


def full_state(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.mark.parametrize("explicit_wait", [False, True])
def test_step_after_async_save_does_not_leak(tmp_path, explicit_wait):
    model, opt = make_model_and_optimizer()
    handle = protect_optimizer(opt)
    try:
        for s in range(3):  # populate Adam state
            train_step(model, opt, s)
            opt.step()
        state = full_state(model, opt)
        snapshot = clone_state(state)
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
        train_step(model, opt, 99)  # forward/backward overlap the copies
        if explicit_wait:
            assert wait_staged(timeout=60)
        opt.step()  # waits for staging through the pre-hook, then mutates params and Adam state
        opt.step()
        resp.upload_completion.result()
        after = clone_state(full_state(model, opt))
        assert not torch.equal(after["model"]["0.weight"], snapshot["model"]["0.weight"])
        dest = zeros_like_state(full_state(model, opt))
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
        assert_state_equal(snapshot["model"], dest["model"])
        assert_state_equal(snapshot["optim"]["state"], dest["optim"]["state"])
    finally:
        handle.remove()


def test_in_place_mutation_after_staging_never_reaches_checkpoint(tmp_path):
    state = {f"t{i}": torch.randn(256, 256) for i in range(8)}
    snapshot = clone_state(state)
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    resp.staging_completion.result()
    for t in state.values():
        t.mul_(-3.0).add_(1.0)
    resp.upload_completion.result()
    dest = zeros_like_state(snapshot)
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert_state_equal(snapshot, dest)


def test_non_tensor_values_are_captured_at_stage_time(tmp_path):
    extra = {"step": 5, "history": [1, 2, 3]}
    state = {"w": torch.ones(4), "extra": extra}
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    extra["step"] = 6
    extra["history"].append(4)
    resp.upload_completion.result()
    dest = {"w": torch.zeros(4), "extra": {"step": None, "history": None}}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert dest["extra"] == {"step": 5, "history": [1, 2, 3]}


def test_checkpoint_8x_larger_than_cache_and_cache_is_reused(tmp_path, small_engine):
    cache = small_engine
    state = {f"t{i}": torch.randn(64 * 1024) for i in range(32)}  # 8 MiB through a 1 MiB cache
    state["tiny"] = [torch.randn(3) for _ in range(50)]
    addresses = set()
    for k in range(3):
        snapshot = clone_state(state)
        # Through the cache whatever file system tmp_path is on (tmpfs would write directly).
        w = DataStatesWriter(tmp_path / f"c{k}", host_cache_size=cache, chunk_size=256 << 10, direct_writes=False)
        resp = dcp.async_save(state, storage_writer=w)
        resp.upload_completion.result(timeout=120)
        st = engine_stats()
        addresses.add(st["cache_address"])
        assert st["cache_bytes"] == cache
        assert st["cache_allocations"] == 1
        assert st["slots_free"] == st["slots_total"]
        dest = zeros_like_state(state)
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / f"c{k}"))
        assert_state_equal(snapshot, dest)
        for t in state.values():
            if isinstance(t, torch.Tensor):
                t.add_(1.0)
    st = engine_stats()
    assert len(addresses) == 1
    assert st["backpressure_waits"] > 0
    assert st["bytes_staged"] >= 3 * 8 * (1 << 20)
    assert st["jobs_done"] >= 3 and st["jobs_failed"] == 0


def test_a_finished_save_keeps_no_tensor_of_the_state_alive(tmp_path):
    """The writer (kept, as trainers keep theirs) holds nothing of a committed save's state:
    large tensors (copied lazily), small ones (copied at the request) and values."""
    import gc
    import weakref

    writer = DataStatesWriter(tmp_path / "c")
    big, small = torch.randn(512, 512), torch.randn(10)
    refs = [weakref.ref(big), weakref.ref(small)]
    state = {"model": {"w": big, "b": small}, "step": 1}
    dcp.async_save(state, storage_writer=writer).upload_completion.result()
    del big, small, state
    gc.collect()
    assert [r() is None for r in refs] == [True, True]
    assert writer.path.endswith("c")  # the writer itself is still there


def test_folder_work_runs_off_the_training_thread(tmp_path, monkeypatch):
    """The request starts the copies and returns; the tier's room, the folder and the file names
    are done on another thread, before anything is written."""
    import threading

    import dcp_datastates.save.request as request_mod

    seen = []
    real = request_mod.prepare_folder

    def spy(storage, **kw):
        seen.append(threading.current_thread() is threading.main_thread())
        return real(storage, **kw)

    monkeypatch.setattr(request_mod, "prepare_folder", spy)
    state = {"w": torch.randn(1000), "b": torch.arange(10)}
    expected = clone_state(state)
    for k in range(3):  # a plan-cache miss, then hits; a second save into a committed folder
        dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / f"c{min(k, 1)}")).upload_completion.result()
    assert seen == [False, False, False]
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c1"))
    assert_state_equal(out, expected)


def test_a_folder_that_cannot_be_prepared_fails_the_save_and_frees_the_cache(tmp_path, small_engine):
    """The folder is prepared after the request started the copies: its error still fails the
    save (raised through DCP), nothing is written, and the cache slots come back."""
    from dcp_datastates import start_engine

    from conftest import raises_through_dcp

    start_engine(host_cache_size="4MB")  # running before the save (whose request may fail first)
    target = tmp_path / "not-a-folder"
    target.write_bytes(b"a file where the checkpoint folder should be")
    state = {"w": torch.randn(300_000)}
    writer = DataStatesWriter(target, host_cache_size="4MB")
    with raises_through_dcp(r"not-a-folder"):
        dcp.async_save(state, storage_writer=writer).upload_completion.result()
    assert target.read_bytes() == b"a file where the checkpoint folder should be"
    st = engine_stats()
    assert st["slots_free"] == st["slots_total"]
    assert st["jobs_done"] == st["jobs_submitted"]
