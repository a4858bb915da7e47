"""One test per torch private name dcp_datastates touches (dcp_datastates/compat.py). When a
torch release moves one, the failing test names the release and the touch point."""

import threading

import pytest
import torch

from dcp_datastates import compat

RELEASE = f"torch {torch.__version__}"


def test_flatten_and_unflatten_state_dict_round_trip():
    state = {"a": {"b": torch.ones(2), "c": 3}, "d": [torch.zeros(1), "x"]}
    try:
        flat, mapping = compat.flatten_state_dict(state)
        back = compat.unflatten_state_dict(flat, mapping)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{RELEASE}: _nested_dict.flatten/unflatten_state_dict broke: {exc!r}")
    assert set(flat) == {"a.b", "a.c", "d.0", "d.1"}, f"{RELEASE}: flattened keys changed: {sorted(flat)}"
    assert torch.equal(back["a"]["b"], state["a"]["b"]) and back["d"][1] == "x", f"{RELEASE}: unflatten changed"


def test_create_write_items_of_a_plain_tensor():
    try:
        items = compat.create_write_items("w", torch.zeros(3, 4))
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{RELEASE}: planner_helpers._create_write_items broke: {exc!r}")
    assert len(items) == 1 and items[0].index.fqn == "w", f"{RELEASE}: _create_write_items returned {items}"
    assert tuple(items[0].index.offset) == (0, 0), f"{RELEASE}: write item offsets changed: {items[0].index}"


def test_dcp_compat_mode_is_readable():
    try:
        mode = compat.dcp_compat_mode()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{RELEASE}: torch.distributed.checkpoint._version broke: {exc!r}")
    assert mode in (None, "2_3"), f"{RELEASE}: unexpected DCP derived version {mode!r}"


def test_cached_save_plans_is_the_planner_cache():
    try:
        cache = compat.cached_save_plans()
    except compat.TorchCompatError as exc:
        pytest.fail(str(exc))
    from torch.distributed.checkpoint.planner import SavePlanner

    assert cache is SavePlanner._cached_save_plan, f"{RELEASE}: SavePlanner._cached_save_plan moved"


def test_global_optimizer_pre_hooks_run_before_instance_hooks():
    try:
        hooks = compat.global_optimizer_pre_hooks()
    except compat.TorchCompatError as exc:
        pytest.fail(str(exc))
    order = []
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.register_step_pre_hook(lambda *a: order.append("instance"))
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda *a: order.append("global"))
    try:
        assert handle.id in hooks, f"{RELEASE}: _global_optimizer_pre_hooks is not the global hook registry"
        p.grad = torch.ones(1)
        opt.step()
    finally:
        handle.remove()
    assert order == ["global", "instance"], f"{RELEASE}: optimizer pre-hook order changed: {order}"


def test_register_before_thread_join_exists():
    assert hasattr(threading, "_register_atexit"), "this Python has no threading._register_atexit"


def test_tensor_version_counts_in_place_changes_through_views_and_detach():
    p = torch.nn.Parameter(torch.zeros(4))
    sd_view = p.detach()  # what module.state_dict() hands out
    before = compat.tensor_version(sd_view)
    assert isinstance(before, int), f"{RELEASE}: Tensor._version is gone"
    with torch.no_grad():
        p.add_(1)
    assert compat.tensor_version(sd_view) > before, f"{RELEASE}: detach() no longer shares the version counter"
    with torch.inference_mode():
        t = torch.ones(2)
    assert compat.tensor_version(t) is None
    assert compat.versions_of([sd_view, None, t]) == [compat.tensor_version(sd_view), None, None]


def test_checkpointable_tensor_protocol_matches_dcp_write_items():
    """torch 2.14 added DCP's CheckpointableTensor protocol; the library keys such a tensor by
    its shards and checks its global shape (compat.is_checkpointable_tensor)."""
    t = torch.zeros(3, 4)
    t.global_shape, t.global_offsets, t.local_offsets, t.local_sizes = (6, 4), ((3, 0),), ((0, 0),), ((3, 4),)
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if release < (2, 14):
        assert not compat.HAS_CHECKPOINTABLE_TENSOR and not compat.is_checkpointable_tensor(t), (
            f"{RELEASE}: CheckpointableTensor found before 2.14"
        )
        assert compat.checkpointable_global_shape(t) == (3, 4)
        return
    assert compat.HAS_CHECKPOINTABLE_TENSOR, f"{RELEASE}: torch.distributed.checkpoint.CheckpointableTensor is gone"
    assert compat.is_checkpointable_tensor(t), f"{RELEASE}: the CheckpointableTensor protocol fields changed"
    assert not compat.is_checkpointable_tensor(torch.zeros(3, 4))
    assert compat.checkpointable_global_shape(t) == (6, 4)
    items = compat.create_write_items("w", t)
    assert [(tuple(i.index.offset), tuple(i.tensor_data.size)) for i in items] == [((3, 0), (6, 4))], (
        f"{RELEASE}: DCP's write items of a CheckpointableTensor changed: {items}"
    )


def test_async_save_runs_on_a_thread_named_by_the_executor_prefix(tmp_path):
    """The exit-time join finds DCP's async_save threads by this name (runtime.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    seen = {}

    class Planner(DefaultSavePlanner):
        def create_local_plan(self):
            seen["thread"] = threading.current_thread().name
            return super().create_local_plan()

    path = tmp_path / "c"
    resp = dcp.async_save({"w": torch.ones(2)}, checkpoint_id=path, storage_writer=FileSystemWriter(path),
                          planner=Planner(), no_dist=True)
    getattr(resp, "upload_completion", resp).result()
    assert seen.get("thread", "").startswith(compat.ASYNC_EXECUTOR_THREAD_PREFIX), (
        f"{RELEASE}: async_save's executor thread is named {seen.get('thread')!r}"
    )


def test_default_stager_reusable_matches_the_release():
    """DefaultStager's reuse across saves (torch 2.11-2.12 close it after each stage): the probe must
    agree with what a second stage of a real state dict does."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    state = {"w": torch.arange(4.0), "opt": {"step": 3, "cls": dict}}
    try:
        first = stager.stage(state)
        assert torch.equal(first["w"], state["w"])
        try:
            again = stager.stage(state)
            works = torch.equal(again["w"], state["w"])
        except Exception:  # noqa: BLE001
            works = False
    finally:
        stager.close()
    assert compat.default_stager_reusable() == works, f"{RELEASE}: DefaultStager reuse probe is wrong (reuse works: {works})"
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if release in ((2, 11), (2, 12)):
        assert not works, f"{RELEASE}: DefaultStager became reusable (docs/torch-versions.md says it is not in 2.11-2.12)"
    elif release in ((2, 9), (2, 10), (2, 13), (2, 14), (2, 15)):
        assert works, f"{RELEASE}: a DefaultStager can no longer stage twice (dcp-async-stager baseline must make one per save)"


def test_is_zero_tensor_tells_autograds_zero_tensors_apart():
    try:
        zero = compat.is_zero_tensor(torch._efficientzerotensor(3))
        plain = compat.is_zero_tensor(torch.zeros(3))
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{RELEASE}: Tensor._is_zerotensor / torch._efficientzerotensor broke: {exc!r}")
    assert zero is True and plain is False, f"{RELEASE}: _is_zerotensor answered {zero} / {plain}"
    assert torch._efficientzerotensor(3).data_ptr() == 0, f"{RELEASE}: a ZeroTensor has memory now (save/items.py)"


def _failure_reaches_every_rank(rank, world, root):
    """Rank 1's planner fails the save before any storage writer hook; every rank's DCP thread
    must pickle (the coordinator) or unpickle (the others) the CheckpointException."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    seen = []
    compat.on_save_failure_sent(lambda: seen.append(threading.current_thread().name))

    class Refusing(DefaultSavePlanner):
        def create_local_plan(self):
            if rank == 1:
                raise RuntimeError("refused")
            return super().create_local_plan()

    with pytest.raises(BaseException, match="refused"):
        dcp.save({"w": torch.ones(4)}, checkpoint_id=f"{root}/ck", planner=Refusing())
    failed = bool(seen) and seen[0] == threading.current_thread().name
    # A committed save: the coordinator's notice reaches the other rank in DCP's broadcast, so
    # no save of this thread is left waiting for its verdict (save/discard.py).
    from dcp_datastates import DataStatesWriter
    from dcp_datastates.save import wait_settled

    dcp.save({"w": torch.ones(4)}, storage_writer=DataStatesWriter(f"{root}/good"))
    out = [None] * world
    torch.distributed.all_gather_object(out, [failed, wait_settled(0)])
    if rank == 0:
        with open(f"{root}/seen.json", "w") as f:
            json.dump(out, f)


def test_a_failed_collective_save_is_pickled_to_every_rank(tmp_path):
    """save/discard.py learns of another rank's failure from DCP's CheckpointException passing
    through pickle on every rank, on the thread of the DCP call (compat.on_save_failure_sent)."""
    import json

    from dist_harness import run_ranks

    run_ranks(2, _failure_reaches_every_rank, str(tmp_path))
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert [failed for failed, _ in seen] == [True, True], (
        f"torch {compat.TORCH_VERSION}: DCP no longer sends a failed save's CheckpointException through "
        f"pickle on every rank ({seen}): a rank whose own part succeeded cannot learn of the failure"
    )
    assert [settled for _, settled in seen] == [True, True], (
        f"torch {compat.TORCH_VERSION}: DCP no longer broadcasts the metadata the coordinator's finish() "
        f"holds ({seen}): the other ranks do not learn that their save is committed"
    )


def test_save_planner_steps_are_the_steps_dcps_global_plan_runs():
    """DefaultSavePlanner.create_global_plan (cached or not) makes a first save's plan in
    _create_global_plan, whose steps SavePlannerSteps replaces; _validate_global_plan exists."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    calls = []

    class Steps(compat.SavePlannerSteps):
        def dedup_plans(self, all_plans):
            calls.append("dedup")
            return super().dedup_plans(all_plans)

        def validate_global_plan(self, global_plan, metadata):
            calls.append("validate")
            return super().validate_global_plan(global_plan, metadata)

    for caching in (False, True):
        calls.clear()
        planner = Steps(enable_plan_caching=caching)
        planner._cached_plans_key = f"compat-steps-{caching}"
        try:
            planner.create_global_plan([SavePlan([], planner_data={}), SavePlan([], planner_data={})])
        except compat.TorchCompatError as exc:
            pytest.fail(str(exc))
        assert calls == ["dedup", "validate"], (
            f"{RELEASE}: DefaultSavePlanner.create_global_plan (caching={caching}) no longer calls "
            f"_create_global_plan/_dedup_save_plans as SavePlannerSteps expects: {calls}")
    assert "_create_global_plan" in vars(DefaultSavePlanner), f"{RELEASE}: DefaultSavePlanner._create_global_plan moved"
