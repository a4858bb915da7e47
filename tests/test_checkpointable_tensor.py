"""DCP's CheckpointableTensor protocol (torch 2.14+): a plain ``torch.Tensor`` carrying
``global_shape``, ``global_offsets``, ``local_offsets`` and ``local_sizes`` is one or more shards
of a larger global tensor, not a whole tensor. Saved with DataStatesWriter (lazily staged, and
through ``dcp.save``), it must be stored as those global shards and load back, into a plain
tensor of the global shape or into another CheckpointableTensor layout (resharding), on one
rank and on two (gloo).

Skipped where torch has no such protocol (before 2.14).
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner, DataStatesWriter, compat

from conftest import raises_through_dcp
from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(
    not compat.HAS_CHECKPOINTABLE_TENSOR, reason=f"torch {torch.__version__} has no DCP CheckpointableTensor protocol (2.14+)"
)

ROWS, COLS = 8, 4


def global_tensor(seed: int = 0) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 10 + seed


def checkpointable(buf: torch.Tensor, shards) -> torch.Tensor:
    """Mark ``buf`` as holding ``shards``: (global offset, local offset, size) per shard."""
    buf.global_shape = (ROWS, COLS)
    buf.global_offsets = tuple(tuple(g) for g, _, _ in shards)
    buf.local_offsets = tuple(tuple(lo) for _, lo, _ in shards)
    buf.local_sizes = tuple(tuple(s) for _, _, s in shards)
    assert compat.is_checkpointable_tensor(buf)
    return buf


def fill(buf: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Copy each shard of ``full`` into the place ``buf``'s protocol fields give it."""
    for g, lo, s in zip(buf.global_offsets, buf.local_offsets, buf.local_sizes):
        dst = tuple(slice(o, o + n) for o, n in zip(lo, s))
        src = tuple(slice(o, o + n) for o, n in zip(g, s))
        buf[dst] = full[src]
    return buf


def shards_of(buf: torch.Tensor, full: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(what ``buf`` holds, what it should hold) per shard."""
    out = []
    for g, lo, s in zip(buf.global_offsets, buf.local_offsets, buf.local_sizes):
        out.append((buf[tuple(slice(o, o + n) for o, n in zip(lo, s))], full[tuple(slice(o, o + n) for o, n in zip(g, s))]))
    return out


def swapped_halves_with_padding(full: torch.Tensor) -> torch.Tensor:
    """A 9x4 buffer: rows 0-3 hold global rows 4-7, rows 4-7 hold global rows 0-3, row 8 is
    padding. Read as a whole tensor it is wrong in shape and in order."""
    buf = torch.full((ROWS + 1, COLS), -1.0)
    return fill(checkpointable(buf, [((4, 0), (0, 0), (4, COLS)), ((0, 0), (4, 0), (4, COLS))]), full)


def column_halves_swapped() -> torch.Tensor:
    """A load target of another layout: an 8x5 buffer, columns 0-1 hold global columns 2-3,
    columns 2-3 hold global columns 0-1, column 4 is padding."""
    buf = torch.full((ROWS, COLS + 1), -7.0)
    return checkpointable(buf, [((0, 2), (0, 0), (ROWS, 2)), ((0, 0), (0, 2), (ROWS, 2))])


def save(state: dict, path, how: str) -> None:
    planner = DataStatesSavePlanner(cache_key=f"ckpt-tensor-{how}")
    if how == "sync":
        dcp.save(state, storage_writer=DataStatesWriter(path), planner=planner)
    else:
        dcp.async_save(state, storage_writer=DataStatesWriter(path), planner=planner).upload_completion.result()


@pytest.mark.parametrize("how", ["sync", "async"])
def test_shards_of_one_rank_round_trip_and_reshard(tmp_path, how):
    full = global_tensor()
    for step in range(2):  # the second save of the same structure may reuse cached plans
        full = global_tensor(step)
        path = tmp_path / f"step-{step}"
        save({"w": swapped_halves_with_padding(full), "b": torch.ones(3)}, path, how)

        md = DataStatesReader(path).read_metadata().state_dict_metadata["w"]
        assert tuple(md.size) == (ROWS, COLS), f"stored as {tuple(md.size)}, not the global shape"
        assert sorted(tuple(c.offsets) for c in md.chunks) == [(0, 0), (4, 0)]
        assert all(tuple(c.sizes) == (4, COLS) for c in md.chunks)

        # into a plain tensor of the global shape, with both planners
        for planner in (None, DataStatesLoadPlanner()):
            dest = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(3)}
            dcp.load(dest, storage_reader=DataStatesReader(path), planner=planner)
            assert torch.equal(dest["w"], full) and torch.equal(dest["b"], torch.ones(3))

        # into another CheckpointableTensor layout (columns instead of rows, padded)
        for planner in (None, DataStatesLoadPlanner()):
            dest = {"w": column_halves_swapped()}
            dcp.load(dest, storage_reader=DataStatesReader(path), planner=planner)
            for got, want in shards_of(dest["w"], full):
                assert torch.equal(got, want)
            assert torch.all(dest["w"][:, COLS] == -7.0), "padding was written"


def test_load_planner_checks_the_global_shape(tmp_path):
    save({"w": swapped_halves_with_padding(global_tensor())}, tmp_path / "c", "sync")
    wrong = torch.zeros(ROWS, COLS)
    wrong.global_shape, wrong.global_offsets = (ROWS, COLS + 1), ((0, 0),)
    wrong.local_offsets, wrong.local_sizes = ((0, 0),), ((ROWS, COLS),)
    with raises_through_dcp(r"CheckpointMismatchError: .*item 'w' has shape \[8, 4\] in the checkpoint, the state dict expects \[8, 5\]"):
        dcp.load({"w": wrong}, storage_reader=DataStatesReader(tmp_path / "c"), planner=DataStatesLoadPlanner())


# ----------------------------------------------------------------------------- two ranks
def _two_rank_save_and_reshard(rank, world, path):
    full = global_tensor(3)
    # rank r holds global rows [4r, 4r+4) behind one row of padding at the top
    buf = torch.full((5, COLS), -1.0)
    state = {"w": fill(checkpointable(buf, [((4 * rank, 0), (1, 0), (4, COLS))]), full), "plain": torch.arange(6.0)}
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(path), planner=DataStatesSavePlanner(cache_key="ckpt-2"))
    resp.upload_completion.result()
    # load by column halves instead: rank r gets global columns [2r, 2r+2)
    dest_buf = torch.zeros(ROWS, 2)
    dest_buf.global_shape, dest_buf.global_offsets = (ROWS, COLS), ((0, 2 * rank),)
    dest_buf.local_offsets, dest_buf.local_sizes = ((0, 0),), ((ROWS, 2),)
    dest = {"w": dest_buf, "plain": torch.zeros(6)}
    dcp.load(dest, storage_reader=DataStatesReader(path), planner=DataStatesLoadPlanner())
    assert torch.equal(dest["w"], full[:, 2 * rank : 2 * rank + 2]), (rank, dest["w"])
    assert torch.equal(dest["plain"], torch.arange(6.0))


def test_two_ranks_save_row_shards_and_load_column_shards_and_whole(tmp_path):
    path = tmp_path / "c2"
    run_ranks(2, _two_rank_save_and_reshard, str(path))
    dest = {"w": torch.zeros(ROWS, COLS), "plain": torch.zeros(6)}
    dcp.load(dest, storage_reader=DataStatesReader(path))
    assert torch.equal(dest["w"], global_tensor(3))


def test_stage_plan_cache_never_covers_checkpointable_shards():
    from dcp_datastates.save.scan import scan_state

    plain = {"w": torch.zeros(ROWS + 1, COLS)}
    assert scan_state(plain) is not None
    assert scan_state({"w": swapped_halves_with_padding(global_tensor())}) is None, "shards cached as a whole tensor"
