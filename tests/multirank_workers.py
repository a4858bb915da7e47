"""Functions run on each rank by the multi-rank tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner, DataStatesWriter


def full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The global values every test derives its shards from (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "row": torch.randn(16, 12, generator=g),
        "col": torch.randn(10, 8, generator=g).to(torch.bfloat16),
        "rep": torch.randn(7, 3, generator=g),
        "mesh2d": torch.randn(8, 12, generator=g),
        "uneven": torch.randn(9, 5, generator=g),
        "plain": torch.arange(30, dtype=torch.int64).reshape(5, 6),
        "plain_half": torch.randn(4, 4, generator=g).half(),
        "big": torch.randn(512, 64, generator=g),
    }


def sharded_state(world: int, layout: str = "save", seed: int = 0) -> dict:
    """DTensor state at this world size. layout "save" uses Shard(0)/Shard(1)/Replicate and a
    2-D mesh when world is even; "swap" shards every tensor on the other dim (Shard(0)<->Shard(1))."""
    full = full_tensors(seed)
    mesh = init_device_mesh("cpu", (world,))
    dim_row, dim_col = (0, 1) if layout == "save" else (1, 0)
    state = {
        "row": distribute_tensor(full["row"], mesh, [Shard(dim_row)]),
        "col": distribute_tensor(full["col"], mesh, [Shard(dim_col)]),
        "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        "uneven": distribute_tensor(full["uneven"], mesh, [Shard(0)]),
        "big": distribute_tensor(full["big"], mesh, [Shard(dim_col)]),
        "plain": full["plain"].clone(),
        "nested": {"plain_half": full["plain_half"].clone(), "step": 17, "note": "hello"},
    }
    if world % 2 == 0 and world >= 2:
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        placements = [Shard(0), Shard(1)] if layout == "save" else [Shard(1), Replicate()]
        state["mesh2d"] = distribute_tensor(full["mesh2d"], mesh2, placements)
    else:
        state["mesh2d"] = distribute_tensor(full["mesh2d"], mesh, [Shard(1)])
    return state


def zero_like_sharded(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = zero_like_sharded(v)
        elif isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape, stride=v.stride())
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = None
    return out


def check_against_full(state: dict, seed: int = 0) -> None:
    full = full_tensors(seed)
    for k in ("row", "col", "rep", "uneven", "mesh2d", "big"):
        got = state[k].full_tensor()
        assert torch.equal(got.view(-1).view(torch.uint8) if got.dtype != torch.bool else got, full[k].view(-1).view(torch.uint8)), k
    assert torch.equal(state["plain"], full["plain"])
    assert torch.equal(state["nested"]["plain_half"], full["plain_half"])
    assert state["nested"]["step"] == 17 and state["nested"]["note"] == "hello"


def save_sharded(rank, world, path, mode, planner):
    state = sharded_state(world)
    writer = DataStatesWriter(path)
    plan = DataStatesSavePlanner() if planner == "datastates" else None
    if mode == "sync":
        dcp.save(state, storage_writer=writer, planner=plan)
    else:
        resp = dcp.async_save(state, storage_writer=writer, planner=plan)
        resp.upload_completion.result()
    dist.barrier()


def load_sharded(rank, world, path, layout, planner):
    state = zero_like_sharded(sharded_state(world, layout))
    plan = DataStatesLoadPlanner() if planner == "datastates" else None
    dcp.load(state, storage_reader=DataStatesReader(path), planner=plan)
    check_against_full(state)


# ------------------------------------------------------------------------------- test phases
import json  # noqa: E402
import pickle  # noqa: E402

from torch.distributed.checkpoint.planner import SavePlan  # noqa: E402

from dcp_datastates import engine_stats  # noqa: E402


class RecordingPlanner(DataStatesSavePlanner):
    """Records, on the coordinator, how many bytes of local plans reached planning."""

    log: list = []

    def create_global_plan(self, all_plans: list[SavePlan]):
        RecordingPlanner.log.append(
            {"payload": len(pickle.dumps([dataclass_items(p) for p in all_plans])), "usable": [p.usable for p in all_plans]}
        )
        return super().create_global_plan(all_plans)


def dataclass_items(plan: SavePlan):
    return (plan.items, plan.planner_data, plan.usable)


def phase_two_first(rank, world, root):
    """2 ranks: a 2-rank checkpoint for later resharding, and ranks holding different plain tensors."""
    state = sharded_state(world)
    dcp.async_save(state, storage_writer=DataStatesWriter(f"{root}/c2")).upload_completion.result()

    # Pipeline-parallel-like: each rank holds plain tensors the other does not; default options.
    for k, opts in enumerate(({}, {}, {"dedup_replicated": False})):  # new structure, learned, no dedup
        pp = {"shared": torch.arange(6.0) + k, f"stage{rank}": torch.full((3,), float(rank + k))}
        dcp.async_save(pp, storage_writer=DataStatesWriter(f"{root}/pp{k}", **opts)).upload_completion.result()
        dist.barrier()
        back = {"shared": torch.zeros(6), f"stage{rank}": torch.zeros(3)}
        dcp.load(back, storage_reader=DataStatesReader(f"{root}/pp{k}"))
        assert torch.equal(back["shared"], pp["shared"]) and torch.equal(back[f"stage{rank}"], pp[f"stage{rank}"])


def phase_four(rank, world, root):
    """4 ranks: sync and async saves, loads at 4 (own and from 2 ranks), dedup, plan caching."""
    save_sharded(rank, world, f"{root}/c4_sync", "sync", "default")
    save_sharded(rank, world, f"{root}/c4", "async", "datastates")
    load_sharded(rank, world, f"{root}/c4_sync", "save", "default")
    load_sharded(rank, world, f"{root}/c4", "save", "datastates")
    load_sharded(rank, world, f"{root}/c2", "swap", "default")

    # DDP-style: every rank holds the same full model; it must be written once in total.
    torch.manual_seed(5)
    ddp = {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)}
    dcp.async_save({"model": ddp}, storage_writer=DataStatesWriter(f"{root}/ddp")).upload_completion.result()

    # Plan caching: unchanged structure sends no plan items; a dtype change is noticed.
    RecordingPlanner.log.clear()
    for k in range(3):
        state = sharded_state(world, seed=0)
        dcp.async_save(state, storage_writer=DataStatesWriter(f"{root}/cache{k}"), planner=RecordingPlanner()).upload_completion.result()
    state = sharded_state(world, seed=0)
    state["row"] = distribute_tensor(full_tensors(0)["row"].double(), state["row"].device_mesh, state["row"].placements)
    dcp.async_save(state, storage_writer=DataStatesWriter(f"{root}/cache3"), planner=RecordingPlanner()).upload_completion.result()
    if rank == 0:
        with open(f"{root}/plan_log.json", "w") as f:
            json.dump(RecordingPlanner.log, f)
    back = zero_like_sharded(state)
    dcp.load(back, storage_reader=DataStatesReader(f"{root}/cache3"), planner=DataStatesLoadPlanner(strict_dtype=True))
    assert back["row"].dtype == torch.float64
    assert torch.equal(back["row"].full_tensor(), full_tensors(0)["row"].double())


def phase_hierarchy(rank, world, root):
    """4 ranks as 2 simulated nodes of 2: results go rank -> node leader -> coordinator."""
    import dcp_datastates.save.consolidate as C

    sends = []
    real_send = C.dist.send_object_list

    def recording_send(obj, dst=None, group=None, **kw):
        sends.append(dst)
        return real_send(obj, dst=dst, group=group, **kw)

    os.environ["DCP_DATASTATES_RANKS_PER_NODE"] = "2"
    C.dist.send_object_list = recording_send
    try:
        state = sharded_state(world)
        writer = DataStatesWriter(f"{root}/hier", process_group=dist.group.WORLD)
        dcp.async_save(state, storage_writer=writer, planner=DataStatesSavePlanner()).upload_completion.result()
        flat = DataStatesWriter(f"{root}/flat", hierarchical_consolidation=False)
        dcp.save(sharded_state(world), storage_writer=flat)
    finally:
        C.dist.send_object_list = real_send
        del os.environ["DCP_DATASTATES_RANKS_PER_NODE"]
    with open(f"{root}/sends_{rank}.json", "w") as f:
        json.dump(sends, f)
    load_sharded(rank, world, f"{root}/hier", "swap", "datastates")


def phase_two_last(rank, world, root):
    """2 ranks: load the 4-rank checkpoint with every tensor sharded the other way, reading only
    the byte ranges this rank needs."""
    before = engine_stats().get("bytes_read", 0)
    state = zero_like_sharded(sharded_state(world, "swap"))
    dcp.load(state, storage_reader=DataStatesReader(f"{root}/c4", verify=False))
    check_against_full(state)
    read = engine_stats()["bytes_read"] - before
    with open(f"{root}/read_{rank}.json", "w") as f:
        json.dump({"bytes_read": read}, f)


import os  # noqa: E402


def phase_packed(rank, world, root):
    """Version 3 markers committed from packed write results, through node leaders (2 simulated
    nodes) and straight to the coordinator; the second save of each reuses cached plans."""
    import dcp_datastates.format.metadata as codec

    codec.PACK_FROM_CHUNKS = 1
    os.environ["DCP_DATASTATES_RANKS_PER_NODE"] = "2"
    try:
        for name, group in (("packed_hier", dist.group.WORLD), ("packed_flat", None)):
            writer = DataStatesWriter(f"{root}/{name}", process_group=group)
            planner = DataStatesSavePlanner(cache_key=name)
            for seed in (1, 2):
                dcp.async_save(sharded_state(world, seed=seed), storage_writer=writer,
                               planner=planner).upload_completion.result()
            state = zero_like_sharded(sharded_state(world, "swap"))
            dcp.load(state, storage_reader=DataStatesReader(f"{root}/{name}"), planner=DataStatesLoadPlanner())
            check_against_full(state, seed=2)
        # What dcp.save returns on every rank: the coordinator's metadata, sent packed, the same.
        md = dcp.save(sharded_state(world, seed=3), storage_writer=DataStatesWriter(f"{root}/packed_sync"),
                      planner=DataStatesSavePlanner(cache_key="packed_sync"))
        from dcp_datastates.format.packed import PackedItems

        assert isinstance(md.state_dict_metadata, dict if rank == 0 else PackedItems), type(md.state_dict_metadata)
        seen = {fqn: (type(v).__name__, getattr(v, "size", None), [(tuple(c.offsets), tuple(c.sizes))
                                                                    for c in getattr(v, "chunks", [])])
                for fqn, v in md.state_dict_metadata.items()}
        everyone = [None] * world
        dist.all_gather_object(everyone, seen)
        assert all(other == everyone[0] for other in everyone), "ranks received different metadata"
    finally:
        del os.environ["DCP_DATASTATES_RANKS_PER_NODE"]
