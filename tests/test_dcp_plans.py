"""Save plans packed for DCP's gather and scatter (format/dcp_plans.py): unpickled, a packed plan
is the plan that was sent, field by field and item by item (index hints and tensor properties
included); whatever does not fit the columns is sent as it is; a layered model's plan pickles
far smaller."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner
from dcp_datastates.format.dcp_plans import PackedLoadPlan, wire_load_plan, wire_save_plan, wire_save_plans


def state_dict(layers: int = 3) -> dict:
    """Tensors of several dtypes, layouts and flags, nested dicts and lists (int keys in the
    flatten mapping), values that are not tensors, and names outside ASCII."""
    sd = {
        "model": {f"layers.{i}.w": torch.randn(4, 3) for i in range(layers)},
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "grad": torch.ones(2, 2, requires_grad=True),
        "nhwc": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "ints": torch.arange(6, dtype=torch.int64),
        "empty": torch.empty(0, 7),
        "groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}],
        "step": 7,
        "name": "x",
        "größe": torch.ones(3, dtype=torch.bfloat16),
        "odd\ud800": torch.ones(1),
    }
    return sd


def local_plan(planner_cls, sd: dict) -> SavePlan:
    planner = planner_cls()
    planner.set_up_planner(sd, is_coordinator=True)
    return planner.create_local_plan()


def global_plans(planner_cls, plans: list[SavePlan]) -> list[SavePlan]:
    return planner_cls().create_global_plan(plans)[0]


def sent(plan: SavePlan) -> SavePlan:
    return pickle.loads(pickle.dumps(wire_save_plan(plan)))


def assert_same(back: SavePlan, plan: SavePlan) -> None:
    """Equal field by field, and what equality leaves out: the index hints (MetadataIndex does
    not compare them), the exact types, one properties object per item as DCP's pickle gives."""
    assert back == plan
    assert type(back.items) is list and type(back.planner_data) is type(plan.planner_data)
    assert [i.index.index for i in back.items] == [i.index.index for i in plan.items]
    assert [type(i.index.offset) for i in back.items] == [type(i.index.offset) for i in plan.items]
    for a, b in zip(back.items, plan.items):
        assert type(a) is WriteItem and a.type is b.type
        if b.tensor_data is not None:
            assert a.tensor_data.properties.memory_format == b.tensor_data.properties.memory_format
            assert type(a.tensor_data.size) is torch.Size
    props = [i.tensor_data.properties for i in back.items if i.tensor_data is not None]
    assert len({id(p) for p in props}) == len(props)


@pytest.mark.parametrize("planner_cls", [DefaultSavePlanner, DataStatesSavePlanner])
def test_a_local_plan_comes_back_as_it_was_sent(planner_cls):
    plan = local_plan(planner_cls, state_dict())
    assert isinstance(plan.planner_data, dict) and any(isinstance(k, int) for p in plan.planner_data.values() for k in p)
    wired = wire_save_plan(plan)
    assert type(wired.items) is not list and type(wired.planner_data) is not dict  # packed
    assert wired == plan  # before pickling too: the same items and mapping
    assert_same(sent(plan), plan)
    assert copy.copy(wired.items) == plan.items and copy.copy(wired.planner_data) == plan.planner_data
    assert_same(copy.deepcopy(wired), plan)
    as_dict = dataclasses.asdict(wired)  # rebuilds each container by its type, from its content
    assert as_dict == dataclasses.asdict(plan)
    assert pickle.loads(pickle.dumps(as_dict))["items"] == as_dict["items"]


def test_global_plans_with_index_hints_come_back_as_they_were_sent():
    sd = state_dict()
    plans = [dataclasses.replace(local_plan(DefaultSavePlanner, sd), storage_data=r) for r in range(3)]
    out = global_plans(DefaultSavePlanner, plans)
    hints = [i.index.index for p in out for i in p.items]
    assert any(h is not None for h in hints)
    for plan in out:
        assert_same(sent(plan), plan)


class MyItem(WriteItem):
    """A planner's own item type."""


def test_items_dcp_does_not_make_round_trip_or_travel_as_they_are():
    props = TensorProperties(torch.float16, pin_memory=True)
    chunk = ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 5]))
    items = [
        # An index offset other than the chunk's, and a large hint.
        WriteItem(MetadataIndex("a", [0, 0], 2**40), WriteItemType.SHARD, None,
                  TensorWriteData(chunk, props, torch.Size([4, 5]))),
        WriteItem(MetadataIndex("b", None, None), WriteItemType.BYTE_IO, BytesIOWriteData(123), None),
        WriteItem(MetadataIndex("c", [3], 0), WriteItemType.BYTE_IO, None, None),
    ]
    plan = SavePlan(items, storage_data={"x": 1}, planner_data=None)
    assert_same(sent(plan), plan)

    for odd in (MyItem(MetadataIndex("d"), WriteItemType.BYTE_IO),
                WriteItem(MetadataIndex("e", [0], -5), WriteItemType.SHARD, None,
                          TensorWriteData(chunk, props, torch.Size([4, 5]))),
                WriteItem(MetadataIndex("f", [0]), WriteItemType.SHARD, None,
                          TensorWriteData(chunk, props, (4, 5)))):
        plan = SavePlan([*items, odd])
        wired = wire_save_plan(plan)
        assert type(wired.items) is list  # not packed: sent as DCP would
        back = pickle.loads(pickle.dumps(wired))
        assert back == plan and type(back.items[-1]) is type(odd)


@pytest.mark.parametrize("mapping", [
    {"a.b": ("a", "c")},  # the path does not spell the name
    {"a.1": ("a", True)},  # a key of another type
    {"a": ["a"]},  # not a tuple
    {"a": ()},
])
def test_a_mapping_that_is_not_dcps_flattening_travels_as_it_is(mapping):
    plan = SavePlan([], planner_data=mapping)
    wired = wire_save_plan(plan)
    assert type(wired.planner_data) is dict and wired.planner_data == mapping
    assert pickle.loads(pickle.dumps(wired)) == plan


def test_a_mapping_with_int_keys_and_empty_names_comes_back():
    mapping = {"a.0.b": ("a", 0, "b"), "x.-3": ("x", -3), "..y": ("", "", "y"), "": ("",), "12": (12,)}
    plan = SavePlan([], planner_data=mapping)
    back = sent(plan)
    assert back.planner_data == mapping
    assert [tuple(map(type, p)) for p in back.planner_data.values()] == [tuple(map(type, p)) for p in mapping.values()]


def test_a_plan_without_items_or_mapping_is_the_same_object():
    plan = SavePlan([], usable=False)
    assert wire_save_plan(plan) is plan
    other = SavePlan([], planner_data=object())
    assert wire_save_plan(other) is other


def test_a_layered_models_plan_pickles_far_smaller():
    sd = {"model": {f"layers.{i}.{p}": torch.empty(8, 8) for i in range(200) for p in ("wq", "wk", "wv", "wo")}}
    plan = local_plan(DataStatesSavePlanner, sd)
    plain = len(pickle.dumps(plan))
    packed = len(pickle.dumps(wire_save_plan(plan)))
    assert packed * 10 < plain, (packed, plain)
    # The names are sent once for the items and the mapping (both refer to them).
    buf = io.BytesIO()
    pickle.dump(wire_save_plan(plan), buf)
    assert buf.getvalue().count(b"layers") <= 1


# ---------------------------------------------------------------------------- load plans
def load_plan(planner_cls, tmp_path, sd: dict) -> LoadPlan:
    """The load plan of ``sd`` against a checkpoint of ``sd`` saved by DCP's own writer."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    dcp_save(sd, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    planner = planner_cls()
    planner.set_up_planner(sd, FileSystemReader(str(tmp_path)).read_metadata(), True)
    return planner.create_local_plan()


def assert_same_reads(back: LoadPlan, plan: LoadPlan) -> None:
    assert back == plan and type(back.items) is list
    for a, b in zip(back.items, plan.items):
        assert type(a) is ReadItem and a.type is b.type
        assert (a.dest_index.index, a.storage_index.index) == (b.dest_index.index, b.storage_index.index)
        assert (a.dest_index.fqn, a.storage_index.fqn) == (b.dest_index.fqn, b.storage_index.fqn)
        assert all(type(x) is torch.Size for x in (a.dest_offsets, a.storage_offsets, a.lengths))


@pytest.mark.parametrize("planner_cls", [DefaultLoadPlanner, DataStatesLoadPlanner])
def test_a_load_plan_comes_back_as_it_was_sent(tmp_path, planner_cls):
    sd = {k: v for k, v in state_dict().items() if k != "odd\ud800"}  # DCP's writer names files by keys
    plan = load_plan(planner_cls, tmp_path, sd)
    assert any(i.type is LoadItemType.BYTE_IO for i in plan.items) and any(i.storage_index.index is not None for i in plan.items)
    wired = wire_load_plan(plan)
    assert isinstance(wired, PackedLoadPlan) and wired.unread and wired == plan and plan == wired
    back = pickle.loads(pickle.dumps(wired))
    assert back.unread
    assert_same_reads(back, plan)
    assert type(back.items) is list and not back.unread
    assert_same_reads(copy.copy(wired), plan)
    assert_same_reads(copy.deepcopy(wired), plan)
    assert_same_reads(copy.deepcopy(pickle.loads(pickle.dumps(wired))), plan)


def test_read_items_dcp_does_not_make_round_trip_or_travel_as_they_are():
    size = torch.Size
    items = [
        # Another storage name, offsets that differ, no offsets, large hints.
        ReadItem(LoadItemType.TENSOR, MetadataIndex("a", [4, 0], 2**40), size([1, 0]),
                 MetadataIndex("b", [0, 0], 3), size([0, 2]), size([3, 3])),
        ReadItem(LoadItemType.BYTE_IO, MetadataIndex("c"), size([0]), MetadataIndex("c"), size([0]), size([0])),
        ReadItem(LoadItemType.TENSOR, MetadataIndex("d", [], 0), size([]), MetadataIndex("d", [], None), size([]),
                 size([])),
        ReadItem(LoadItemType.TENSOR, MetadataIndex("e", [2]), size([0]), MetadataIndex("e"), size([0]), size([2])),
    ]
    plan = LoadPlan(items, storage_data=7, planner_data={"p": 1})
    assert_same_reads(pickle.loads(pickle.dumps(wire_load_plan(plan))), plan)
    for odd in (ReadItem(LoadItemType.TENSOR, MetadataIndex("f", [0], -1), size([0]), MetadataIndex("f", [0]),
                         size([0]), size([1])),  # a hint of -1 is not "none"
                ReadItem(LoadItemType.TENSOR, MetadataIndex("g", [0]), (0,), MetadataIndex("g", [0]), size([0]),
                         size([1]))):
        plan = LoadPlan([*items, odd])
        wired = wire_load_plan(plan)
        assert wired is plan  # sent as DCP would
        back = pickle.loads(pickle.dumps(wired))
        assert back == plan and back.items[-1].dest_index.index == odd.dest_index.index
    assert wire_load_plan(LoadPlan([])).items == []


def test_a_layered_models_load_plan_pickles_far_smaller(tmp_path):
    sd = {f"layers.{i}.{p}": torch.zeros(8, 8) for i in range(200) for p in ("wq", "wk", "wv", "wo")}
    plan = load_plan(DataStatesLoadPlanner, tmp_path, sd)
    plain = len(pickle.dumps(plan))
    assert len(pickle.dumps(wire_load_plan(plan))) * 10 < plain


def test_the_coordinators_plans_share_one_packed_mapping_and_each_comes_back():
    """Every rank's plan under FSDP has the same flatten mapping: the coordinator packs it once.
    A plan with a name the shared table lacks, or another mapping, gets its own."""
    sd = state_dict()
    plans = [pickle.loads(pickle.dumps(dataclasses.replace(local_plan(DefaultSavePlanner, sd), storage_data=r)))
             for r in range(3)]
    extra = {**sd, "late": torch.ones(2)}
    other = local_plan(DefaultSavePlanner, extra)  # its mapping has "late" too
    odd_items = dataclasses.replace(plans[0], items=[*plans[0].items, WriteItem(
        MetadataIndex("only.in.items"), WriteItemType.BYTE_IO)])  # a name the mapping lacks
    tensors = SavePlan(plans[0].items, planner_data={"t": torch.ones(3)})  # a mapping that is not paths
    sent_plans = [*plans, odd_items, other, plans[1], tensors, tensors]
    wired = wire_save_plans(sent_plans)
    assert wired[0].planner_data is wired[1].planner_data is wired[2].planner_data
    assert wired[3].planner_data is not wired[2].planner_data  # its own names table
    assert wired[4].planner_data is not wired[3].planner_data and wired[4].planner_data == other.planner_data
    assert type(wired[6].planner_data) is dict and type(wired[6].items) is not list
    for w, plan in zip(wired, sent_plans):
        back = pickle.loads(pickle.dumps(w))
        if plan.planner_data is tensors.planner_data:
            assert back.items == plan.items and torch.equal(back.planner_data["t"], plan.planner_data["t"])
        else:
            assert_same(back, plan)


def test_packed_plans_keep_no_index_of_their_names(tmp_path):
    """The coordinator holds every rank's packed plan until DCP scatters it: each keeps its
    compressed names, not the dict that numbered them (a dict of every name, per plan)."""
    sd = state_dict()
    saves = wire_save_plans([local_plan(DefaultSavePlanner, sd), local_plan(DefaultSavePlanner, sd)])
    loads = [wire_load_plan(load_plan(DataStatesLoadPlanner, tmp_path, {"w": torch.ones(2), "v": torch.ones(3)}))]
    for plan in [*saves, wire_save_plan(local_plan(DefaultSavePlanner, sd))]:
        names = plan.items.__reduce__()[1][0]
        assert names.blob and not names.index
    for plan in loads:  # a load plan keeps its columns alone: the names compressed
        assert all(type(column) is bytes for column in plan.__reduce__()[1][0])


def test_the_coordinator_hands_on_load_plans_unread(tmp_path, monkeypatch):
    """At a load the coordinator gathers every rank's plan and scatters it back; DCP's default
    planners never read the items there. A gathered plan is not decoded unless its items are
    read, is handed on as it came (the same columns, no ReadItem made), and a plan whose items
    a hook read, or replaced, is packed anew from what they are then."""
    import dcp_datastates.format.dcp_plans as wire

    plan = load_plan(DataStatesLoadPlanner, tmp_path, state_dict())
    sent = pickle.dumps(wire_load_plan(plan))
    decoded = []
    real = wire._reads_from
    monkeypatch.setattr(wire, "_reads_from", lambda *a: decoded.append(1) or real(*a))
    gathered = [pickle.loads(sent) for _ in range(3)]
    scattered = DataStatesReader(str(tmp_path)).prepare_global_plan(
        DataStatesLoadPlanner().create_global_plan(gathered))
    assert all(a is b for a, b in zip(scattered, gathered)) and decoded == []
    assert [pickle.dumps(p) for p in scattered] == [sent] * 3 and decoded == []
    # A rank reads its own: equal to what its planner made.
    assert_same_reads(pickle.loads(pickle.dumps(scattered[0])), plan) and decoded == [1]
    # A hook read the items and changed one: what travels is what they are now.
    hooked = pickle.loads(sent)
    hooked.items.pop()
    again = pickle.loads(pickle.dumps(wire_load_plan(hooked)))
    assert again.items == plan.items[:-1]
    replaced = dataclasses.replace(pickle.loads(sent), planner_data={"k": 1})
    assert isinstance(replaced, PackedLoadPlan) and not replaced.unread
    back = pickle.loads(pickle.dumps(replaced))
    assert back.items == plan.items and back.planner_data == {"k": 1}
    plain = LoadPlan(list(plan.items), storage_data=3)
    assert pickle.loads(sent) == plain.__class__(plan.items) and pickle.loads(sent) != plain
