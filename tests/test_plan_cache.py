"""The stage plan cache: what stage() derives from the structure alone is reused while the
structure is unchanged, and any change of name, shape, dtype or value length is saved right."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates.format.layout import data_file_name
from dcp_datastates.save.plan_cache import plan_stats

from conftest import assert_state_equal, clone_state, zeros_like_state


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(64, 32, generator=g),
            "layers": {str(i): {"w": torch.randn(32, 32, generator=g), "b": torch.randn(32, generator=g)} for i in range(4)},
            "norm.weight": torch.randn(32, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3),
        },
        "step": seed,
        "sched": {"lr": 1e-3 * (seed + 1), "name": "cosine"},
    }


def _save(state: dict, path) -> tuple[int, int]:
    """Save and wait until committed; (hits, misses) this save added."""
    before = plan_stats()
    dcp.async_save(state, storage_writer=DataStatesWriter(path)).upload_completion.result()
    after = plan_stats()
    return after["hits"] - before["hits"], after["misses"] - before["misses"]


def _roundtrip(state: dict, path) -> None:
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=DataStatesReader(path))
    assert_state_equal(state, dest)


def test_steady_state_reuses_the_plan_and_captures_fresh_values(tmp_path):
    state = _state(0)
    _save(state, tmp_path / "warm")  # this structure is now cached
    for k in range(1, 4):
        with torch.no_grad():  # training changed the values, not the structure
            for t in (state["model"]["embed.weight"], state["model"]["layers"]["2"]["w"]):
                t.add_(float(k))
        state["step"] = k
        snapshot = clone_state(state)
        assert _save(state, tmp_path / f"c{k}") == (1, 0)
        _roundtrip(snapshot, tmp_path / f"c{k}")


def _changed(kind: str, state: dict) -> dict:
    m = state["model"]
    if kind == "shape":  # same bytes, other shape: the header must change
        m["embed.weight"] = m["embed.weight"].reshape(32, 64).clone()
    elif kind == "dtype":  # same bytes, other dtype
        m["layers"]["1"]["b"] = m["layers"]["1"]["b"].view(torch.int32).clone()
    elif kind == "key added":
        m["layers"]["4"] = {"w": torch.ones(32, 32), "b": torch.zeros(32)}
    elif kind == "key removed":
        del m["layers"]["3"]
    elif kind == "key renamed":
        m["head.weight"] = m.pop("norm.weight")
    elif kind == "order":  # same items in another order: other offsets
        state["model"] = dict(reversed(list(m.items())))
    elif kind == "value length":
        state["sched"]["name"] = "cosine" * 200  # torch.save pads records: grow it a lot
    elif kind == "tensor to value":
        m["norm.weight"] = "not a tensor any more"
    return state


@pytest.mark.parametrize(
    "kind", ["shape", "dtype", "key added", "key removed", "key renamed", "order", "value length", "tensor to value"]
)
def test_changed_structure_is_a_miss_and_saved_right(tmp_path, kind):
    _save(_state(1), tmp_path / "warm")
    assert _save(_state(1), tmp_path / "again") == (1, 0)
    state = _changed(kind, _state(2))
    snapshot = clone_state(state)
    assert _save(state, tmp_path / "changed") == (0, 1)
    _roundtrip(snapshot, tmp_path / "changed")
    with safe_open(str(tmp_path / "changed" / data_file_name(0)), "pt") as f:  # the header matches too
        if "embed.weight" in snapshot["model"]:
            assert tuple(f.get_tensor("model.embed.weight").shape) == tuple(snapshot["model"]["embed.weight"].shape)
    # The changed structure is cached in turn; the old one still is (a run may save several).
    assert _save(state, tmp_path / "changed2") == (1, 0)
    assert _save(_state(3), tmp_path / "old") == (1, 0)
    _roundtrip(_state(3), tmp_path / "old")


def test_views_are_never_cached_but_saved_right(tmp_path):
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    state = {"t": base.t(), "x": torch.ones(3)}  # a non-contiguous view: copied at stage()
    for k in range(2):
        assert _save(state, tmp_path / f"v{k}") == (0, 1)
        _roundtrip(clone_state(state), tmp_path / f"v{k}")


def test_parameter_storage_swapped_after_stage_is_kept_alive(tmp_path):
    """The plan path keeps each tensor's storage, not the tensor object: swapping a parameter's
    .data right after stage() leaves the bytes of the call in the checkpoint."""
    p = torch.nn.Parameter(torch.full((256, 256), 7.0))
    state = {"p": p}
    _save(state, tmp_path / "warm")
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "swap"))
    p.data = torch.zeros(256, 256)
    resp.upload_completion.result()
    dest = {"p": torch.zeros(256, 256)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "swap"))
    assert torch.equal(dest["p"], torch.full((256, 256), 7.0))


@pytest.mark.parametrize("sizes, max_bytes, total, limit", [
    ([8, 4096] + [32768] * 40, 65536, 65536, 4096),  # the smallest first; the 32 KiB tensors do not fit
    ([8, 4096] + [32768] * 40, 65536, 64 << 20, 65536),  # all fit: the per-tensor limit stays
    ([4, 8, 8, 8], 65536, 12, 4),  # equal sizes go together: 4 + 8 fits, 4 + 3 x 8 does not
    ([4, 8, 8, 8], 65536, 28, 65536),
    ([100, 70000], 65536, 10, 0),  # nothing fits: nothing is copied at the request
    ([0, 0, 100, 70000], 65536, 100, 65536),  # empty tensors and those over the limit do not count
    ([1, 2], 0, 5, 0),  # copy_at_request_max_bytes=0: off
    ([1, 2], 65536, None, 65536),
])
def test_request_copy_limit_keeps_the_smallest_tensors_within_the_total(sizes, max_bytes, total, limit):
    from dcp_datastates.save.copy_at_request import request_copy_limit

    assert request_copy_limit(sizes, max_bytes, total) == limit


def _flatten_cases():
    import collections
    import types

    t = torch.ones(2)
    return {
        "nested": {"model": {"a": t, "b": {"c": t, "d": 3}}, "step": 1, "empty": {}},
        "int and tuple keys": {"m": {0: t, 1: {2: t}, (3, 4): t}},
        "OrderedDict and MappingProxy": {"m": collections.OrderedDict(w=t, x=types.MappingProxyType({"y": t}))},
        "parameters and values": {"p": torch.nn.Parameter(torch.ones(3)), "s": "text", "n": None, "f": 1.5},
        "a list (DCP's traversal)": {"m": {"w": t}, "l": [t, {"x": t}]},
        "str subclass keys": {type("Key", (str,), {})("k"): {"j": t}},
    }


@pytest.mark.parametrize("case", list(_flatten_cases()))
def test_flatten_gives_exactly_what_dcp_flatten_state_dict_gives(case):
    """``scan.flatten`` (the training thread's own walk) returns DCP's keys, order, values and
    paths for every kind of nesting, and its duplicate-key error."""
    from dcp_datastates.compat import flatten_state_dict
    from dcp_datastates.save.scan import flatten

    state = _flatten_cases()[case]
    ours, theirs = flatten(state), flatten_state_dict(state)
    assert list(ours[0]) == list(theirs[0]) and list(ours[1].items()) == list(theirs[1].items())
    assert all(ours[0][k] is theirs[0][k] for k in theirs[0])


def test_flatten_refuses_a_duplicated_key_as_dcp_does():
    from dcp_datastates.compat import flatten_state_dict
    from dcp_datastates.save.scan import flatten

    state = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten_state_dict(state)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten(state)
