"""The lazy device -> host path on a real GPU (marked ``gpu``; skipped without CUDA).

Run on a GPU machine with:  python -m pytest -q -p no:logging -m gpu tests/test_gpu.py
The engine must find the CUDA runtime PyTorch loaded (not the test double), so these tests
clear DCP_DATASTATES_CUDART and start a fresh process-wide engine.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import (
    DataStatesReader,
    DataStatesWriter,
    engine_stats,
    protect_optimizer,
    shutdown_engine,
    start_engine,
    wait_staged,
)
from dcp_datastates.runtime import inflight as staging

from conftest import assert_state_equal, clone_state, tensors_equal_bitwise

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpu(fn):
    return pytest.mark.gpu(needs_cuda(fn))


@pytest.fixture(autouse=True)
def real_runtime(monkeypatch):
    monkeypatch.delenv("DCP_DATASTATES_CUDART", raising=False)
    shutdown_engine()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    shutdown_engine()


def options(**kw):
    kw.setdefault("host_cache_size", 256 * MiB)
    kw.setdefault("chunk_size", 8 * MiB)
    return kw


def zeros_on(state, device: str):
    """A load destination: the same structure, tensors zeroed on `device`."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state, device=device)
    if isinstance(state, dict):
        return {k: zeros_on(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_on(v, device) for v in state]
    return state


def cpu_zeros_like(state):
    return zeros_on(state, "cpu")


def cuda_zeros_like(state):
    return zeros_on(state, "cuda")


@gpu
def test_engine_runs_in_cuda_mode_with_pytorchs_runtime(tmp_path):
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    dcp.async_save({"x": x}, storage_writer=DataStatesWriter(tmp_path / "c", **options())).upload_completion.result()
    st = engine_stats()
    assert st["cuda"] == 1 and st["pinned"] == 1 and st["d2h_bytes"] == 4000
    from dcp_datastates.runtime import current_engine

    eng = current_engine()
    assert "libcudart.so" in os.path.basename(eng.cuda_runtime) and eng.cuda_devices == torch.cuda.device_count()
    maps = Path("/proc/self/maps").read_text()
    assert os.path.realpath(eng.cuda_runtime) in maps  # the one PyTorch loaded, not a second copy


@gpu
def test_tensor_written_by_a_kernel_just_before_async_save_is_saved_with_its_new_value(tmp_path):
    x = torch.zeros(64 * MiB // 4, device="cuda")
    torch.cuda._sleep(200_000_000)  # keep the stream busy (~0.1 s) so an unordered copy would read zeros
    x.fill_(3.0)  # queued behind the sleep: done only when the stream gets there
    resp = dcp.async_save({"x": x}, storage_writer=DataStatesWriter(tmp_path / "c", **options()))
    resp.upload_completion.result()
    dest = {"x": torch.zeros(x.numel())}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert torch.all(dest["x"] == 3.0)


def _model_and_optimizer(width=2048, layers=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, seed, step=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(64, model[0].in_features, device="cuda", generator=g)
    model(x).pow(2).mean().backward()
    if step:
        opt.step()
        opt.zero_grad()


@gpu
@pytest.mark.parametrize("device_side", [False, True])
def test_optimizer_step_right_after_async_save_does_not_leak(tmp_path, device_side):
    """device_side: the cache holds the whole state and the GPU is kept busy before the save, so
    every copy is queued (none done) when the step comes: its wait must be device-side. Otherwise
    a small cache makes the step wait on the host for copies still waiting for cache space."""
    model, opt = _model_and_optimizer()
    for s in range(2):
        _train(model, opt, s)
    guard = protect_optimizer(opt)
    try:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        snapshot = clone_state(state)
        cache = 1024 * MiB if device_side else 32 * MiB
        writer = DataStatesWriter(tmp_path / "c", **options(host_cache_size=cache))
        if device_side:
            torch.cuda._sleep(400_000_000)  # the copies are ordered after this (~0.2 s)
        resp = dcp.async_save(state, storage_writer=writer)
        before = engine_stats()
        _train(model, opt, 99, step=False)
        if device_side:
            pending = staging.staging()
            deadline = time.monotonic() + 30
            # host files staged (a memcpy), device files with every copy queued on the GPU
            while not all(f.job.is_staged() if f.job.device < 0 else f.job.all_enqueued() for s_ in pending for f in s_.files):
                assert time.monotonic() < deadline
                time.sleep(0.001)
            assert not all(f.job.is_staged() for s_ in pending for f in s_.files)
        opt.step()  # protected: waits (on the GPU or the host) for the copies
        if device_side:
            assert engine_stats()["device_waits"] == before["device_waits"] + 1
        opt.step()
        resp.upload_completion.result()
        assert not torch.equal(model[0].weight.cpu(), snapshot["model"]["0.weight"].cpu())
        dest = cpu_zeros_like(snapshot)
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
        assert_state_equal({k: v.cpu() for k, v in snapshot["model"].items()}, dest["model"])
        for pid, s in snapshot["optim"]["state"].items():
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    assert tensors_equal_bitwise(v.cpu(), dest["optim"]["state"][pid][k]), (pid, k)
    finally:
        guard.remove()


def _gpu_state():
    g = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(300, 257, device="cuda", generator=g)
    state = {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16": base[:, :100].to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (1000,), device="cuda", generator=g),
        "bool": torch.rand(77, device="cuda", generator=g) > 0.5,
        "u8": torch.randint(0, 256, (3, 5, 7), device="cuda", dtype=torch.uint8, generator=g),
        "view": base.t(),  # non-contiguous
        "scalar": torch.tensor(2.5, device="cuda"),
        "empty": torch.empty(0, 4, device="cuda"),
        "cpu": torch.arange(10),  # mixed devices: a second data file
        "step": 12,
    }
    if hasattr(torch, "float8_e4m3fn"):
        state["f8"] = base[:10].to(torch.float8_e4m3fn)
    return state


@gpu
def test_bitwise_round_trip_of_gpu_state_into_cpu_and_cuda_tensors(tmp_path):
    state = _gpu_state()
    snapshot = clone_state(state)
    dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c", **options())).upload_completion.result()
    files = sorted(p.name for p in (tmp_path / "c").iterdir() if p.name != ".metadata")
    assert len(files) == 2, files  # host items and device-0 items
    for make in (cpu_zeros_like, cuda_zeros_like):
        dest = make(snapshot)
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
        for k, v in snapshot.items():
            if isinstance(v, torch.Tensor):
                assert dest[k].device.type == (v.device.type if make is cuda_zeros_like else "cpu") or k == "cpu"
                assert tensors_equal_bitwise(v, dest[k]), k
            else:
                assert dest[k] == v


@gpu
def test_restore_into_cuda_tensors_with_casts_and_dcp_save(tmp_path):
    state = {"w": torch.randn(1024, 513, device="cuda"), "b": torch.randn(513, device="cuda")}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c", **options()))  # the unstaged path
    dest = {"w": torch.zeros(1024, 513, device="cuda", dtype=torch.bfloat16), "b": torch.zeros(513, device="cuda")}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert torch.equal(dest["w"], state["w"].to(torch.bfloat16))
    assert torch.equal(dest["b"], state["b"])
    # The load is complete when dcp.load returns: the current stream sees the restored values.
    assert float((dest["b"] - state["b"]).abs().sum()) == 0.0


@gpu
@pytest.mark.parametrize("through_planner", [False, True])
def test_load_into_cuda_tensors_is_ordered_on_both_sides_of_the_copies(tmp_path, monkeypatch, through_planner):
    """The destinations are filled on the current stream behind a ~0.2 s sleep: the copies from
    the host buffers must run after that fill (else the fill overwrites them). With a planner
    that loads into scratch tensors and copies them into the state in ``commit_tensor`` (on the
    current stream), that copy must run after the loads (else it copies the scratch's garbage).
    1 MiB pinned slots and 256 KiB checksum pieces: the 2 MiB items are read in parts, and both
    slots are filled many times while the copies out of them wait behind the sleep: a slot
    filled again before its copies ran would load the next batch's bytes. A cast read larger
    than a slot takes a pageable buffer of its own, awaited before it goes."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    import dcp_datastates.load.read as read

    class ScratchPlanner(DefaultLoadPlanner):
        def resolve_tensor(self, read_item):
            target = super().resolve_tensor(read_item)
            scratch = torch.empty_like(target)
            self.targets[id(scratch)] = target
            return scratch

        def commit_tensor(self, read_item, tensor):
            self.targets.pop(id(tensor)).copy_(tensor)

    monkeypatch.setattr(read, "SLOT_BYTES", MiB)
    g = torch.Generator(device="cuda").manual_seed(11)
    state = {f"s{i}": torch.randn(100 + 37 * i, device="cuda", generator=g) for i in range(40)}
    state.update({f"b{i}": torch.randn(512 * 1024, device="cuda", generator=g) for i in range(3)})
    state["cast"] = torch.randn(4096, device="cuda", generator=g)
    state["wide_cast"] = torch.randn(400_000, device="cuda", generator=g)  # 1.6 MiB: a buffer of its own
    state["empty"] = torch.empty(0, 4, device="cuda")
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c", **options(chunk_size=256 * 1024)))
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    dest["cast"] = torch.empty(4096, device="cuda", dtype=torch.float64)
    dest["wide_cast"] = torch.empty(400_000, device="cuda", dtype=torch.float64)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    for v in dest.values():
        v.fill_(7)
    planner = None
    if through_planner:
        planner = ScratchPlanner()
        planner.targets = {}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"), planner=planner)
    for k, v in state.items():
        assert torch.equal(dest[k], v.to(dest[k].dtype)), k


@gpu
def test_checkpoint_larger_than_the_cache_streams_through_it(tmp_path):
    x = torch.randn(48 * MiB // 4, device="cuda")  # 48 MiB through a 16 MiB cache
    resp = dcp.async_save({"x": x}, storage_writer=DataStatesWriter(tmp_path / "c", **options(host_cache_size=16 * MiB, chunk_size=4 * MiB)))
    assert wait_staged(timeout=60)
    resp.upload_completion.result()
    dest = {"x": torch.zeros_like(x)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert torch.equal(dest["x"], x)
    assert engine_stats()["backpressure_waits"] >= 1


def test_gpu_bench_dry_run(tmp_path):
    """Not GPU-bound: keeps benchmarks/gpu_bench.py importable and its plumbing working on CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import gpu_bench
    finally:
        sys.path.pop(0)
    out = tmp_path / "dry.json"
    report = gpu_bench.main(["--dry-run", "--out", str(out), "--ckpt-dir", str(tmp_path / "ck")])
    assert set(report["modes"]) == set(gpu_bench.MODES) and out.exists()
    assert report["modes"]["datastates"]["engine"]["checkpoints"] == 3


@gpu
@pytest.mark.parametrize("copy_at_request", [64 * 1024, 0])
def test_batchnorm_statistics_on_the_gpu_are_saved_at_request_time(tmp_path, copy_at_request):
    """The stream is kept busy before each save, so every lazy copy is queued behind it; the next
    forward's BatchNorm kernels (no version bump) are queued right after the request. The small
    buffers' request-time copy is on the current stream, before those kernels. Two saves: the
    second takes the plan cache's path. Turned off, the counter's in-place bump fails the save."""
    from dcp_datastates.save.plan_cache import plan_stats

    from conftest import raises_through_dcp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.BatchNorm1d(2048), torch.nn.ReLU()).cuda()
    net(torch.randn(256, 64, device="cuda"))
    start_engine(**options())  # started now: its start must not use up the sleeps below
    hits = plan_stats()["hits"]
    for k in range(2):
        state = {"model": net.state_dict()}
        snapshot = clone_state(state)
        torch.cuda._sleep(400_000_000)
        writer = DataStatesWriter(tmp_path / f"c{k}", **options(copy_at_request_max_bytes=copy_at_request))
        resp = dcp.async_save(state, storage_writer=writer)
        for _ in range(3):
            net(torch.randn(256, 64, device="cuda"))
        if not copy_at_request:
            with raises_through_dcp("num_batches_tracked' was changed in place"):
                resp.upload_completion.result()
            return
        resp.upload_completion.result()
        assert not torch.equal(net[1].running_mean, snapshot["model"]["1.running_mean"])
        dest = cpu_zeros_like(snapshot)
        dcp.load(dest, storage_reader=DataStatesReader(tmp_path / f"c{k}"))
        assert_state_equal({key: v.cpu() for key, v in snapshot["model"].items()}, dest["model"])
    assert plan_stats()["hits"] == hits + 1  # the second save reused the first one's plan


@gpu
@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_foreach_adamw_steps_wait_without_protect_optimizer(tmp_path, fused):
    model, _ = _model_and_optimizer(layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    _train(model, opt, 0)
    state = {"model": model.state_dict()}
    snapshot = clone_state(state)
    _train(model, opt, 1, step=False)
    start_engine(**options(host_cache_size=1024 * MiB))  # started now: its start must not use up the sleep
    torch.cuda._sleep(400_000_000)  # every copy queued behind this
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c", **options(host_cache_size=1024 * MiB)))
    opt.step()  # no protect_optimizer: the global hook orders it after the copies
    resp.upload_completion.result()
    assert not torch.equal(model[0].weight, snapshot["model"]["0.weight"])
    dest = cpu_zeros_like(snapshot)
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert_state_equal({k: v.cpu() for k, v in snapshot["model"].items()}, dest["model"])
