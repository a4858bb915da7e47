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
