"""Multi-level checkpoints with several ranks: each node's ranks share a node-local tier (two
simulated nodes: the first half of the ranks use nvA, the rest nvB), every rank drains its own
files, the coordinator commits the durable folder once all have, and a load reads each file from
the nearest verified copy."""

import logging
import os
import shutil
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_tiers import durable_writes

from dcp_datastates import DataStatesReader, DataStatesWriter, commit
from dcp_datastates.errors import CheckpointWriteError
from dcp_datastates.load import verify as integrity
from dcp_datastates.tiers import drain, file_copy
from dcp_datastates.tiers import local_tier as tiers

from conftest import assert_state_equal, clone_state, raises_through_dcp, zeros_like_state
from dist_harness import run_ranks


def node_tier(root, rank, world):
    return os.path.join(root, "nvA" if rank < world // 2 else "nvB")


def rank_state(rank, seed):
    g = torch.Generator().manual_seed(100 * seed + rank)
    return {
        f"own{rank}": torch.randn(40, 24, generator=g),  # written by this rank only
        "shared": torch.arange(64, dtype=torch.float32) + seed,  # the same on every rank: written once
        "b": torch.full((5,), float(seed), dtype=torch.bfloat16),
        "step": seed,
    }


def save(state, durable, nv, asynchronous, **options):
    w = DataStatesWriter(durable, local_tier=nv, **options)
    if asynchronous:
        dcp.async_save(clone_state(state), storage_writer=w).upload_completion.result(timeout=120)
    else:
        dcp.save(clone_state(state), storage_writer=w)
    return w


def load(durable, nv, like):
    out = zeros_like_state(like)
    reader = DataStatesReader(durable, local_tier=nv)
    dcp.load(out, storage_reader=reader)
    return out, reader


def _save_drain_load(rank, world, root, asynchronous):
    nv = node_tier(root, rank, world)
    durable = os.path.join(root, "step-1")
    states = [rank_state(rank, seed) for seed in (1, 2)]
    with durable_writes() as copies:
        for state in states:  # the second save goes into a committed durable folder: new names
            copies.clear()
            w = save(state, durable, nv, asynchronous)
            local = tiers.local_copy(nv, durable)
            assert w.local_commit.result(timeout=0) == local
            # Each file copied once (never again by the drain), and, from the second save on
            # (the ownership decision learned: no held file), while the engine wrote it.
            names = [n for n, _ in copies]
            assert copies and len(names) == len(set(names)), copies
            assert state is states[0] or all(while_written for _, while_written in copies), copies
    # Every byte on the durable tier is a verified copy of a local file of the same checkpoint.
    md, files = commit.read_commit(durable)
    mine = tiers.local_files(local, md.storage_meta.save_id)
    assert mine, f"rank {rank}: nothing of the checkpoint recorded in {local}"
    for name, path in mine.items():
        with open(path, "rb") as a, open(os.path.join(durable, name), "rb") as b:
            assert a.read() == b.read(), name
    assert len(files) <= world  # the replicated tensor was written once
    out, reader = load(durable, nv, states[1])
    assert_state_equal(states[1], out)
    # Its own file from this node (another node's file, e.g. the one replicated tensor, durably).
    assert reader.tier_reads["local"] >= 1, reader.tier_reads
    dist.barrier()
    # Node B replaced (its local tier wiped): its ranks read the durable tier, node A's stay local.
    if rank == world // 2:
        shutil.rmtree(os.path.join(root, "nvB"))
    dist.barrier()
    out, reader = load(durable, nv, states[1])
    assert_state_equal(states[1], out)
    if rank >= world // 2:
        assert reader.tier_reads["local"] == 0 and reader.tier_reads["durable"] >= 1, reader.tier_reads
    else:
        assert reader.tier_reads["local"] >= 1, reader.tier_reads
    dist.barrier()
    # A local file damaged after the commit: that file is read from the durable tier.
    if rank == 0:
        path = sorted(tiers.local_files(tiers.local_copy(nv, durable), md.storage_meta.save_id).values())[0]
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    dist.barrier()
    out, reader = load(durable, nv, states[1])
    assert_state_equal(states[1], out)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_ranks_drain_their_files_and_load_from_the_nearest_tier(tmp_path, world, asynchronous):
    run_ranks(world, _save_drain_load, str(tmp_path), asynchronous)
    integrity.validate_checkpoint(str(tmp_path / "step-1"))
    # Every local copy records only files of the committed checkpoint or of none.
    md, _ = commit.read_commit(str(tmp_path / "step-1"))
    local = tiers.local_copy(str(tmp_path / "nvA"), str(tmp_path / "step-1"))
    assert set(tiers.local_files(local, md.storage_meta.save_id)) <= set(commit.read_commit(str(tmp_path / "step-1"))[1])


def _failing_drain_on_one_rank(rank, world, root):
    nv = node_tier(root, rank, world)
    durable = os.path.join(root, "step-7")
    old = rank_state(rank, 1)
    save(old, durable, nv, asynchronous=True)
    new = rank_state(rank, 2)
    real = file_copy._write_durable

    def disk_full(src, *args, **kwargs):
        raise OSError(28, "No space left on device", src)

    with mock.patch.object(file_copy, "_write_durable", disk_full if rank == world - 1 else real):
        for asynchronous in (True, False):
            with raises_through_dcp(r"draining .* to the durable tier .* failed: OSError: No space left on device"):
                save(new, durable, nv, asynchronous)
    # Nothing was committed: the durable tier still holds the first checkpoint, on every rank.
    out, _ = load(durable, nv, old)
    assert_state_equal(old, out)
    dist.barrier()
    # The next checkpoint drains fine.
    save(new, durable, nv, asynchronous=True)
    out, _ = load(durable, nv, new)
    assert_state_equal(new, out)


def test_a_failing_drain_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    run_ranks(2, _failing_drain_on_one_rank, str(tmp_path))


def _fsdp2_tiers(rank, world, root):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from dcp_datastates import DataStatesLoadPlanner, DataStatesSavePlanner

    import fsdp_workers

    nv = os.path.join(root, "nvA")  # one node: every file this rank reads is local
    durable = os.path.join(root, "fsdp", "step-3")
    model, opt = fsdp_workers.build(world)
    for step in range(3):
        fsdp_workers.train_step(model, opt, step, rank, world)
    msd, osd = get_state_dict(model, opt)
    saved = clone_state({"model": msd, "optim": osd})
    group = dist.new_group(backend="gloo")
    w = DataStatesWriter(durable, local_tier=nv)
    dcp.async_save({"model": msd, "optim": osd}, storage_writer=w, planner=DataStatesSavePlanner(),
                   process_group=group).upload_completion.result(timeout=120)
    assert w.local_commit.done()
    model2, opt2 = fsdp_workers.build(world)
    fsdp_workers.train_step(model2, opt2, 0, rank, world)  # optimizer state to load into
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    reader = DataStatesReader(durable, local_tier=nv)
    dcp.load(state, storage_reader=reader, planner=DataStatesLoadPlanner())
    assert reader.tier_reads["local"] >= 1 and reader.tier_reads["durable"] == 0, reader.tier_reads
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = get_state_dict(model2, opt2)
    assert_state_equal(saved, clone_state({"model": got[0], "optim": got[1]}))


def test_fsdp2_state_through_the_tiers(tmp_path):
    run_ranks(2, _fsdp2_tiers, str(tmp_path))


def _rank_local_refused(rank, world, root):
    w = DataStatesWriter(os.path.join(root, "step-9"), local_tier=node_tier(root, rank, world))
    with pytest.raises(CheckpointWriteError, match="local_tier: rank-local saves"):
        dcp.save({"x": torch.ones(2)}, storage_writer=w, use_collectives=False)


def test_rank_local_saves_with_a_local_tier_are_refused(tmp_path):
    run_ranks(2, _rank_local_refused, str(tmp_path))


def test_log_names_the_tiers(tmp_path, caplog):
    """One process reading a several-rank checkpoint: each file from the local copy that holds it."""
    run_ranks(2, _save_only, str(tmp_path))
    like = {**rank_state(0, 1), **{k: v for k, v in rank_state(1, 1).items() if k == "own1"}}
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        out, reader = load(str(tmp_path / "step-5"), str(tmp_path / "nvA"), like)
    assert_state_equal(like, out)
    n = len(commit.read_commit(str(tmp_path / "step-5"))[1])
    assert n >= 2 and reader.tier_reads == {"local": n, "durable": 0}
    assert f"rank 0 read {n} data file(s)" in caplog.text and "and 0 from the durable tier" in caplog.text


def _save_only(rank, world, root):
    save(rank_state(rank, 1), os.path.join(root, "step-5"), os.path.join(root, "nvA"), asynchronous=True)


def _keep_local(rank, world, root):
    nv = node_tier(root, rank, world)
    durables = [os.path.join(root, "ck", f"step-{i}") for i in (1, 2, 3)]
    for i, durable in enumerate(durables, start=1):
        save(rank_state(rank, i), durable, nv, asynchronous=True, keep_local=1)
    dist.barrier()
    assert os.listdir(nv) == [os.path.basename(tiers.local_copy(nv, durables[-1]))]
    out, reader = load(durables[0], nv, rank_state(rank, 1))  # its local copies are gone
    assert_state_equal(rank_state(rank, 1), out)
    assert reader.tier_reads["local"] == 0, reader.tier_reads


def test_keep_local_with_several_ranks(tmp_path):
    run_ranks(2, _keep_local, str(tmp_path))


def _plan_cache_and_the_coordinators_word(rank, world, root):
    """Saves planned from a plan cache with a local tier. DataStatesSavePlanner carries each
    save's word from the coordinator, so every rank records its files under that save's id (what
    a restart's check of the node's copies looks them up by) and each checkpoint loads. DCP's
    own planner with plan caching hands a rank the first save's word again: that save fails on
    every rank and commits nothing."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from dcp_datastates import DataStatesSavePlanner

    nv = node_tier(root, rank, world)
    for i in (1, 2, 3):
        durable, state = os.path.join(root, "ours", f"step-{i}"), rank_state(rank, i)
        dcp.async_save(clone_state(state), storage_writer=DataStatesWriter(durable, local_tier=nv),
                       planner=DataStatesSavePlanner(cache_key="tier-word")).upload_completion.result(timeout=120)
        held = tiers.local_files(tiers.local_copy(nv, durable), commit.checkpoint_id(durable))
        assert any(name.startswith(f"__{rank}_") for name in held), (i, held)
        out, _ = load(durable, nv, state)
        assert_state_equal(state, out)
    first, second = (os.path.join(root, "stock", f"step-{i}") for i in (1, 2))
    dcp.async_save(clone_state(rank_state(rank, 1)), storage_writer=DataStatesWriter(first, local_tier=nv),
                   planner=DefaultSavePlanner(enable_plan_caching=True)).upload_completion.result(timeout=120)
    with raises_through_dcp(r"checkpoint \S*step-2: this rank was handed an earlier save's plan .*enable_plan_caching=True.*"
                            r"save with DataStatesSavePlanner"):
        dcp.async_save(clone_state(rank_state(rank, 2)), storage_writer=DataStatesWriter(second, local_tier=nv),
                       planner=DefaultSavePlanner(enable_plan_caching=True)).upload_completion.result(timeout=120)
    dist.barrier()
    assert not commit.is_committed(second)
    out, _ = load(first, nv, rank_state(rank, 1))
    assert_state_equal(rank_state(rank, 1), out)


def test_saves_from_a_plan_cache_keep_each_saves_word_from_the_coordinator(tmp_path):
    run_ranks(2, _plan_cache_and_the_coordinators_word, str(tmp_path))


def _killed_before_its_drain(rank, world, root):
    """The last rank's process dies after its local flush, before draining (its drain never runs,
    never reports): the save fails on every rank within drain_timeout, the checkpoint is restorable
    from the nodes' local copies (every rank picks it), and the next save completes its drain."""
    import time

    nv = node_tier(root, rank, world)
    ck = os.path.join(root, "ck")
    first, second, third = (os.path.join(ck, f"step-{i}") for i in (1, 2, 3))
    # Rank-unique tensors (pipeline-parallel-like): each rank reads only the files it wrote.
    states = {i: {f"own{rank}": rank_state(rank, i)[f"own{rank}"]} for i in (1, 2, 3)}
    save(states[1], first, nv, asynchronous=True)
    dead = (lambda *args, **kwargs: None) if rank == world - 1 else drain.drain_rank
    # ... nor copied anything while its files were written (file_copy.follow)
    no_copies = (lambda *args, **kwargs: {}) if rank == world - 1 else file_copy.follow
    with mock.patch.object(drain, "drain_rank", dead), mock.patch.object(file_copy, "follow", no_copies):
        with raises_through_dcp(rf"rank\(s\) \[{world - 1}\] did not report within 2 s \(drain_timeout\)"):
            save(states[2], second, nv, asynchronous=True, drain_timeout=2)
    assert not commit.is_committed(second)
    dist.barrier()
    # Restart: every rank finds step-2 (committed on the local tiers) and loads it from there.
    assert tiers.latest_checkpoint(ck, local_tier=nv) == second
    assert commit.latest_checkpoint(ck) == first  # without the local tier: the durable one
    out, reader = load(second, nv, states[2])
    assert_state_equal(states[2], out)
    assert reader.tier_reads == {"local": 1, "durable": 0}
    # A rank that needs a file only the other node holds (here: both ranks' tensors) gets a clear
    # error, on every rank (DCP's read gathers it), naming what to do.
    both = {f"own{r}": rank_state(r, 2)[f"own{r}"] for r in range(world)}
    with raises_through_dcp(r"committed only on the nodes' local tiers .* neither on this node's local tier"):
        load(second, nv, both)
    dist.barrier()
    # The next save drains this rank's share of step-2 too; the rank completing the set commits it.
    save(states[3], third, nv, asynchronous=True)
    deadline = time.monotonic() + 60
    while not commit.is_committed(second) and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    out = zeros_like_state(states[2])
    dcp.load(out, storage_reader=DataStatesReader(second))  # the durable tier alone
    assert_state_equal(states[2], out)
    assert not os.path.exists(os.path.join(second, ".pending.metadata"))


def test_killed_before_its_drain_restarts_from_the_local_copies_then_drains(tmp_path):
    run_ranks(2, _killed_before_its_drain, str(tmp_path))


def _save_then_sigkill_mid_drain(rank, world, root):
    """Phase 1: step-1 saved; step-2's processes are SIGKILLed during its drain, once the coordinator
    has recorded the checkpoint as committed on the local tiers (rank 0 after copying its files,
    the others before copying anything)."""
    import signal
    import time

    nv = node_tier(root, rank, world)
    first, second = (os.path.join(root, "ck", f"step-{i}") for i in (1, 2))
    save(own_state(rank, 1), first, nv, asynchronous=True)
    real = drain._copy_files

    def killed(local, durable, locations, renamed, config, followed):
        deadline = time.monotonic() + 60
        while not durable.has(".pending.metadata") and time.monotonic() < deadline:
            time.sleep(0.01)
        if rank == 0:
            real(local, durable, locations, renamed, config, followed)
        os.kill(os.getpid(), signal.SIGKILL)

    drain._copy_files = killed
    save(own_state(rank, 2), second, nv, asynchronous=True)
    time.sleep(120)  # never reached: the drain thread kills the process


def _restart_after_the_kill(rank, world, root):
    import time

    nv = node_tier(root, rank, world)
    ck = os.path.join(root, "ck")
    second, third = os.path.join(ck, "step-2"), os.path.join(ck, "step-3")
    assert not commit.is_committed(second)
    path = tiers.latest_checkpoint(ck, local_tier=nv)
    assert path == second, path
    out, reader = load(path, nv, own_state(rank, 2))
    assert_state_equal(own_state(rank, 2), out)
    assert reader.tier_reads == {"local": 1, "durable": 0}
    dist.barrier()
    save(own_state(rank, 3), third, nv, asynchronous=True)  # drains what the killed run left
    deadline = time.monotonic() + 60
    while not commit.is_committed(second) and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    out = zeros_like_state(own_state(rank, 2))
    dcp.load(out, storage_reader=DataStatesReader(second))  # the durable tier alone
    assert_state_equal(own_state(rank, 2), out)


def own_state(rank, seed):
    """Rank-unique tensors (pipeline-parallel-like): each rank reads only what it wrote."""
    return {f"own{rank}": rank_state(rank, seed)[f"own{rank}"]}


def test_sigkill_mid_drain_restarts_from_the_local_copies_then_the_next_run_drains(tmp_path):
    from dist_harness import _launch

    failure = _launch(2, _save_then_sigkill_mid_drain, (str(tmp_path),), 120.0)
    assert failure == "ranks exited abnormally: [(0, -9), (1, -9)]", failure
    assert os.path.exists(tmp_path / "ck" / "step-2" / ".pending.metadata")
    run_ranks(2, _restart_after_the_kill, str(tmp_path))


def _local_tier_fills_while_copied(rank, world, root):
    """The last rank's local tier fills up (ENOSPC on its local files) while every rank's files
    are being copied to the durable tier as they are written: the save fails on every rank,
    naming the full disk, within seconds; the durable tier keeps its previous commit, nothing
    partial is committed, and the next save (disk freed) commits and loads."""
    import time

    from dcp_datastates.runtime import get_engine

    nv = node_tier(root, rank, world)
    durable = os.path.join(root, "step-1")
    first, second = rank_state(rank, 1), rank_state(rank, 2)
    w = save(first, durable, nv, asynchronous=True)
    engine = get_engine(w.config)
    if rank == world - 1:
        engine.set_fault("enospc", 0, nv)
    t0 = time.monotonic()
    try:
        with raises_through_dcp(r"No space left on device"):
            save(second, durable, nv, asynchronous=True)
    finally:
        engine.set_fault("none", 0, "")
    assert time.monotonic() - t0 < 30
    dist.barrier()
    # Nothing of the failed save is left in the durable folder: not the copies made while its
    # files were written, on either rank.
    _, files = commit.read_commit(durable)
    assert sorted(os.listdir(durable)) == sorted({".metadata", *files}), os.listdir(durable)
    out, _ = load(durable, None, first)  # the durable tier alone: still the first checkpoint
    assert_state_equal(first, out)
    dist.barrier()
    save(second, durable, nv, asynchronous=True)
    out, _ = load(durable, None, second)
    assert_state_equal(second, out)
    dist.barrier()
    # The copies the failed save made of the other rank's files went with its commit's cleanup.
    _, files = commit.read_commit(durable)
    assert {n for n in os.listdir(durable) if n.endswith(".safetensors")} == set(files)


def test_a_full_local_tier_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    run_ranks(2, _local_tier_fills_while_copied, str(tmp_path))


def _incremental_through_the_tiers(rank, world, root):
    nv = node_tier(root, rank, world)
    frozen = torch.randn(128, 64, generator=torch.Generator().manual_seed(rank))
    saved = {}
    for step in (1, 2, 3):
        state = {f"frozen{rank}": frozen, **rank_state(rank, step)}
        save(state, os.path.join(root, f"step-{step}"), nv, asynchronous=step != 2, incremental=True)
        saved[step] = clone_state(state)
    md, files = commit.read_commit(os.path.join(root, "step-3"))
    for r in range(world):  # every rank's frozen tensor: a reference to step-1's durable file
        assert md.storage_data[next(i for i in md.storage_data if i.fqn == f"frozen{r}")].file.startswith("../step-1/")
    assert any(not name.startswith("../") for name in files)  # the changing tensors: written again
    # This node's copy of step-3 holds only the files it wrote; references are durable files.
    local = tiers.local_copy(nv, os.path.join(root, "step-3"))
    assert all(not name.startswith("../") for name in tiers.local_files(local, md.storage_meta.save_id))
    out, reader = load(os.path.join(root, "step-3"), nv, saved[3])
    assert_state_equal(saved[3], out)
    assert reader.tier_reads["local"] >= 1 and reader.tier_reads["durable"] >= 1, reader.tier_reads


def test_incremental_saves_through_the_tiers_refer_to_durable_files(tmp_path):
    run_ranks(2, _incremental_through_the_tiers, str(tmp_path))
