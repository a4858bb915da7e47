"""The coordinator's first-save global plan (dcp_datastates/save/global_plan.py, the planner's
dedup_plans / validate_global_plan): the same plans, metadata and errors as DCP's own steps, on
random plans with duplicated items and random (valid and broken) chunk layouts."""

import dataclasses
import random

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcp_datastates import DataStatesSavePlanner
from dcp_datastates.compat import SavePlannerSteps
from dcp_datastates.save import global_plan


def dedup_save_plans(plans: list, to_lowest: bool) -> list:
    """DCP's own dedup (compat.SavePlannerSteps' default step)."""
    return SavePlannerSteps(dedup_save_to_lowest_rank=to_lowest).dedup_plans(plans)


def _validate_global_plan(plans: list, metadata: Metadata) -> list[str]:
    """DCP's own validation (compat.SavePlannerSteps' default step)."""
    return SavePlannerSteps().validate_global_plan(plans, metadata)


def _tensor_item(fqn: str, offsets: tuple, sizes: tuple, size: tuple, dtype=torch.float32) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype),
                                                 size=torch.Size(size)))


def _bytes_item(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _random_plans(rng: random.Random, ranks: int) -> list[SavePlan]:
    """Sharded tensors (each rank its row block), tensors and bytes replicated on random sets of
    ranks, and now and then an item twice in one plan."""
    plans: list[list[WriteItem]] = [[] for _ in range(ranks)]
    for t in range(rng.randint(1, 12)):
        kind = rng.choice(["sharded", "replicated", "bytes"])
        rows, cols = rng.randint(1, 40), rng.randint(1, 6)
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64])
        if kind == "sharded":
            step = -(-rows // ranks)
            for r in range(ranks):
                start = min(r * step, rows)
                plans[r].append(_tensor_item(f"s{t}", (start, 0), (min(step, rows - start), cols), (rows, cols), dtype))
            continue
        holders = sorted(rng.sample(range(ranks), rng.randint(1, ranks)))
        for r in holders:
            item = _bytes_item(f"b{t}") if kind == "bytes" else _tensor_item(f"r{t}", (0, 0), (rows, cols), (rows, cols), dtype)
            plans[r].append(item)
            if rng.random() < 0.1:
                plans[r].append(item)
    for items in plans:
        rng.shuffle(items)
    return [SavePlan(items) for items in plans]


def _indices(plans: list[SavePlan]) -> list[list]:
    return [[(i.index.fqn, i.index.offset, i.type) for i in p.items] for p in plans]


@pytest.mark.parametrize("to_lowest", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_dedup_keeps_what_dcps_dedup_keeps(seed, to_lowest):
    rng = random.Random(seed)
    plans = _random_plans(rng, rng.randint(1, 9))
    ours = global_plan.dedup_plans(plans, to_lowest)
    assert _indices(ours) == _indices(dedup_save_plans(plans, to_lowest))
    assert _indices(plans) == _indices([SavePlan(list(p.items)) for p in plans])  # inputs untouched


def test_dedup_of_plans_without_shared_items_returns_them_as_they_are():
    plans = [SavePlan([_tensor_item("w", (r, 0), (1, 2), (3, 2))]) for r in range(3)]
    assert all(a is b for a, b in zip(global_plan.dedup_plans(plans, False), plans))
    assert global_plan.dedup_plans([], False) == []


def _metadata(tensors: dict) -> Metadata:
    items = {"bytes": BytesStorageMetadata()}
    for fqn, (size, chunks) in tensors.items():
        items[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                           [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    return Metadata(items)


def _random_layout(rng: random.Random) -> tuple:
    """A grid tiling of a random 0-3 dim tensor, sometimes broken: a chunk moved, grown, dropped,
    doubled, sent out of bounds, or an empty chunk added."""
    ndim = rng.randint(0, 3)
    size = [rng.randint(1, 9) for _ in range(ndim)]
    cuts = [sorted(set([0, d] + rng.sample(range(d + 1), min(d + 1, rng.randint(0, 3))))) for d in size]
    chunks = [((), ())] if ndim == 0 else []
    if ndim:
        import itertools

        for cell in itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]):
            chunks.append((tuple(a for a, _ in cell), tuple(b - a for a, b in cell)))
    rng.shuffle(chunks)
    damage = rng.choice(["none", "none", "move", "grow", "drop", "double", "outside", "empty", "negative"])
    if ndim and chunks:
        k, d = rng.randrange(len(chunks)), rng.randrange(ndim)
        off, sz = list(chunks[k][0]), list(chunks[k][1])
        if damage == "move":
            off[d] = max(0, off[d] + rng.choice([-1, 1]))
        elif damage == "grow":
            sz[d] += 1
        elif damage == "outside":
            off[d] = size[d]
        elif damage == "negative":
            off[d] = -1
        if damage in ("move", "grow", "outside", "negative"):
            chunks[k] = (tuple(off), tuple(sz))
        elif damage == "drop" and len(chunks) > 1:
            chunks.pop(k)
        elif damage == "double":
            chunks.append(chunks[k])
        elif damage == "empty":
            off[d] = rng.randint(0, size[d])
            sz[d] = 0
            chunks.append((tuple(off), tuple(sz)))
    return size, chunks


@pytest.mark.parametrize("seed", range(60))
def test_validation_reports_what_dcps_validation_reports(seed):
    rng = random.Random(seed)
    md = _metadata({f"t{i}": _random_layout(rng) for i in range(rng.randint(1, 8))})
    for ranks in (1, 2):
        plans = [SavePlan([]) for _ in range(ranks)]
        assert DataStatesSavePlanner().validate_global_plan(plans, md) == _validate_global_plan(plans, md)


def test_validation_finds_an_overlap_in_a_wide_fsdp_weight():
    """FSDP shards dim 0 of a [rows, 4 * rows] weight: DCP sweeps dim 1, the longer one."""
    rows, ranks = 64, 16
    chunks = [((r * 4, 0), (4, 4 * rows)) for r in range(ranks)]
    assert global_plan.suspect_tensors(_metadata({"w": ((rows, 4 * rows), chunks)}), True) == []
    chunks[5] = ((19, 0), (4, 4 * rows))  # overlaps the next block by one row, leaves a gap
    md = _metadata({"w": ((rows, 4 * rows), chunks), "ok": ((4,), [((0,), (4,))])})
    assert global_plan.suspect_tensors(md, True) == ["w"]
    errors = DataStatesSavePlanner().validate_global_plan([SavePlan([]), SavePlan([])], md)
    assert errors == _validate_global_plan([SavePlan([]), SavePlan([])], md) and "overlapping chunks" in errors[0]


def _sharded_plans(ranks: int, broken: bool = False) -> list[SavePlan]:
    plans = []
    for r in range(ranks):
        items = [_tensor_item("w", (2 * r, 0), (2, 8), (2 * ranks, 8)), _tensor_item("step", (), (), ()),
                 _bytes_item("param_groups")]
        if broken and r == 1:
            items[0] = _tensor_item("w", (1, 0), (2, 8), (2 * ranks, 8))
        plans.append(SavePlan(items, planner_data={"w": ("w",), "step": ("step",), "param_groups": ("param_groups",)}))
    return plans


@pytest.mark.parametrize("caching", [False, True])
def test_the_planners_global_plan_equals_dcps(caching):
    plans = _sharded_plans(4)
    ours = DataStatesSavePlanner(enable_plan_caching=caching, cache_key=f"global-plan-test-{caching}")
    ours_plans, ours_md = ours.create_global_plan(plans)
    dcp_plans, dcp_md = DefaultSavePlanner(enable_plan_caching=False).create_global_plan(plans)
    assert _indices(ours_plans) == _indices(dcp_plans)
    # The ranks' own items (no copy with DCP's position hint: the commit finds chunks by offsets).
    assert all(item in [id(i) for p in plans for i in p.items] for item in (id(i) for p in ours_plans for i in p.items))
    assert {i.index.index for p in ours_plans for i in p.items} == {None}
    assert dict(ours_md.state_dict_metadata) == dict(dcp_md.state_dict_metadata)
    assert ours_md.planner_data == dcp_md.planner_data


def test_a_broken_global_plan_fails_with_dcps_message():
    plans = _sharded_plans(3, broken=True)
    with pytest.raises(ValueError, match=r"Failed to validate global plan: key:w has overlapping chunks") as ours:
        DataStatesSavePlanner(enable_plan_caching=False).create_global_plan(plans)
    with pytest.raises(ValueError) as dcp:
        DefaultSavePlanner(enable_plan_caching=False).create_global_plan(plans)
    assert str(ours.value) == str(dcp.value)


def test_a_subclass_hook_still_runs():
    """A user's planner that overrides DCP's dedup step keeps it."""
    seen = []

    class Mine(DataStatesSavePlanner):
        def _dedup_save_plans(self, all_plans):
            seen.append(len(all_plans))
            return super()._dedup_save_plans(all_plans)

    plans, _ = Mine(enable_plan_caching=False).create_global_plan(_sharded_plans(2))
    assert seen == [2] and sum(len(p.items) for p in plans) == 4
    assert dataclasses.is_dataclass(plans[0])


def test_a_coordinators_planning_near_stall_timeout_is_logged(tmp_path, caplog):
    """The other ranks wait for the coordinator's global plan in DCP's scatter, on a group that
    gives up after stall_timeout (checkpoint_process_group): planning past half of it is
    logged, naming the checkpoint, its size and the knob; planning well within it is not."""
    import logging
    import time

    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    class SlowPlanner(DataStatesSavePlanner):
        def create_global_plan(self, all_plans):
            time.sleep(0.3)
            return super().create_global_plan(all_plans)

    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    with caplog.at_level(logging.WARNING, logger="dcp_datastates"):
        dcp.save(state, storage_writer=DataStatesWriter(str(tmp_path / "quick"), stall_timeout=60),
                 planner=SlowPlanner(enable_plan_caching=False))
        assert "global plan took" not in caplog.text
        dcp.save(state, storage_writer=DataStatesWriter(str(tmp_path / "slow"), stall_timeout=0.4),
                 planner=SlowPlanner(enable_plan_caching=False))
    slow = [r.getMessage() for r in caplog.records if "global plan took" in r.getMessage()]
    assert len(slow) == 1, caplog.text
    assert str(tmp_path / "slow") in slow[0] and "(the plans of 1 ranks, 2 items, gathered and planned)" in slow[0]
    assert "gives up after stall_timeout (0.4 s)" in slow[0]
