"""Functions run on each of 2 gloo ranks by tests/test_megatron.py (importable by spawned processes).

Megatron-core checkpoints through ``dcp_datastates.integrations.megatron``: sharded, replicated,
bf16, int64, unevenly split and layer-stacked (``prepend_axis_num``) tensors, per-rank
``ShardedObject``s (RNG state among them) and Megatron's common state, saved synchronously,
asynchronously (the request run in this process, and run by Megatron's own ``AsyncCallsQueue``
in a forked helper process) and through ``FullyParallelSaveStrategyWrapper``; loaded with the
saving sharding, with another one, and as full tensors. Every loaded tensor is compared bitwise
with the saved values on the rank that loaded it; each rank writes a summary of its checks.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

WORLD = 2


def megatron():
    """The Megatron-core pieces the workers use (imported in the ranks, after the skip check)."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    return dist_checkpointing, ShardedTensor, ShardedObject


def full_values(seed: int) -> dict[str, torch.Tensor]:
    """The global tensors (same on every rank); every shard is cut from these."""
    g = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(8, 6, generator=g),  # fp32, rows split at save
        "proj": torch.randn(6, 10, generator=g).to(torch.bfloat16),  # bf16, columns split at save
        "bias": torch.randn(5, generator=g),  # replicated on both ranks
        "embed": torch.randint(-(2**40), 2**40, (9, 4), generator=g),  # int64, rows split 5 / 4
        "layers": torch.randn(WORLD, 3, 4, generator=g).to(torch.bfloat16),  # one layer per rank (prepend_axis_num)
    }


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def uneven_rows(rank: int) -> tuple[int, int]:
    return (0, 5) if rank == 0 else (5, 9)


def rng_state(rank: int, seed: int) -> dict:
    """What Megatron-LM checkpoints as RNG state: Python, NumPy and torch generator states."""
    random.seed(seed * 100 + rank)
    np.random.seed(seed * 100 + rank)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": g.get_state(),
        "rng_tracker_states": {"model-parallel-rng": g.get_state()},
    }


def saved_state(rank: int, seed: int, *, empty: bool = False) -> dict:
    """Megatron sharded state dict with the saving layout. ``empty``: zeroed buffers (for a load)."""
    _, ShardedTensor, ShardedObject = megatron()
    full = full_values(seed)

    def data(t):
        return torch.zeros_like(t) if empty else t.clone()

    lo, hi = uneven_rows(rank)
    embed = data(full["embed"][lo:hi])
    return {
        "model": {
            "weight": ShardedTensor.from_rank_offsets("decoder.weight", data(full["weight"].chunk(WORLD, 0)[rank]), (0, rank, WORLD)),
            "proj": ShardedTensor.from_rank_offsets("decoder.proj", data(full["proj"].chunk(WORLD, 1)[rank]), (1, rank, WORLD)),
            "bias": ShardedTensor.from_rank_offsets("decoder.bias", data(full["bias"]), replica_id=rank),
            "embed": ShardedTensor(
                key="embedding.word", data=embed, dtype=embed.dtype, local_shape=tuple(embed.shape),
                global_shape=tuple(full["embed"].shape), global_offset=(lo, 0), axis_fragmentations=None,
            ),
            "layers": ShardedTensor.from_rank_offsets(
                "decoder.layers.w", data(full["layers"][rank]), (0, rank, WORLD), prepend_axis_num=1
            ),
        },
        "rank_state": ShardedObject("rank_state", None if empty else {"rank": rank, "seed": seed, "tokens": [rank] * 3},
                                    (WORLD,), (rank,), replica_id=0),
        "rng_state": ShardedObject("rng_state", None if empty else [rng_state(rank, seed)], (WORLD,), (rank,), replica_id=0),
        "iteration": 100 + seed,  # common state (Megatron's own common.pt)
        "args": {"seed": seed, "lr": 0.5},
    }


def check_saved_layout(loaded: dict, rank: int, seed: int) -> int:
    """Compare a load with the saving layout against the saved values; returns tensors checked."""
    full = full_values(seed)
    lo, hi = uneven_rows(rank)
    expected = {
        "weight": full["weight"].chunk(WORLD, 0)[rank],
        "proj": full["proj"].chunk(WORLD, 1)[rank],
        "bias": full["bias"],
        "embed": full["embed"][lo:hi],
        "layers": full["layers"][rank],
    }
    for name, want in expected.items():
        assert bitwise_equal(loaded["model"][name], want), (seed, name)
    check_objects(loaded, rank, seed, own=rank)
    return len(expected)


def check_objects(loaded: dict, rank: int, seed: int, own: int) -> None:
    assert loaded["rank_state"] == {"rank": own, "seed": seed, "tokens": [own] * 3}, loaded["rank_state"]
    assert loaded["iteration"] == 100 + seed and loaded["args"] == {"seed": seed, "lr": 0.5}
    (got,) = loaded["rng_state"]
    want = rng_state(own, seed)
    assert got["random_rng_state"] == want["random_rng_state"]
    np_got, np_want = got["np_rng_state"], want["np_rng_state"]
    assert np_got[0] == np_want[0] and np.array_equal(np_got[1], np_want[1]) and tuple(np_got[2:]) == tuple(np_want[2:])
    assert bitwise_equal(got["torch_rng_state"], want["torch_rng_state"])
    assert bitwise_equal(got["rng_tracker_states"]["model-parallel-rng"], want["rng_tracker_states"]["model-parallel-rng"])


def resharded_state(rank: int) -> dict:
    """Zeroed buffers with another sharding: rows <-> columns swapped, the uneven rows split by
    columns instead, the stacked layers as one plain tensor split on its last axis, and each
    rank reads the ShardedObject the *other* rank saved."""
    _, ShardedTensor, ShardedObject = megatron()
    full = full_values(0)  # shapes only

    def zeros(t):
        return torch.zeros_like(t)

    return {
        "model": {
            "weight": ShardedTensor.from_rank_offsets("decoder.weight", zeros(full["weight"].chunk(WORLD, 1)[rank]), (1, rank, WORLD)),
            "proj": ShardedTensor.from_rank_offsets("decoder.proj", zeros(full["proj"].chunk(WORLD, 0)[rank]), (0, rank, WORLD)),
            "bias": ShardedTensor.from_rank_offsets("decoder.bias", zeros(full["bias"]), replica_id=rank),
            "embed": ShardedTensor.from_rank_offsets("embedding.word", zeros(full["embed"].chunk(WORLD, 1)[rank]), (1, rank, WORLD)),
            "layers": ShardedTensor.from_rank_offsets("decoder.layers.w", zeros(full["layers"].chunk(WORLD, 2)[rank]), (2, rank, WORLD)),
        },
        "rank_state": ShardedObject("rank_state", None, (WORLD,), (1 - rank,), replica_id=0),
        "rng_state": ShardedObject("rng_state", None, (WORLD,), (1 - rank,), replica_id=0),
    }


def check_resharded(loaded: dict, rank: int, seed: int) -> int:
    full = full_values(seed)
    expected = {
        "weight": full["weight"].chunk(WORLD, 1)[rank],
        "proj": full["proj"].chunk(WORLD, 0)[rank],
        "bias": full["bias"],
        "embed": full["embed"].chunk(WORLD, 1)[rank],
        "layers": full["layers"].chunk(WORLD, 2)[rank],
    }
    for name, want in expected.items():
        assert bitwise_equal(loaded["model"][name], want), ("resharded", seed, name)
    check_objects(loaded, rank, seed, own=1 - rank)
    return len(expected)


def check_full(plain: dict, seed: int) -> int:
    """``load_plain_tensors``: every tensor whole, under its global key."""
    full = full_values(seed)
    keys = {"decoder.weight": "weight", "decoder.proj": "proj", "decoder.bias": "bias", "embedding.word": "embed",
            "decoder.layers.w": "layers"}
    for key, name in keys.items():
        assert bitwise_equal(plain[key], full[name]), ("full", seed, key)
    return len(keys)


def cpu_async_calls_queue():
    """Megatron's AsyncCallsQueue (forks a helper process per request) with its CUDA calls pointed
    at the CPU: it synchronizes the device before forking and all-reduces its flags on
    ``torch.cuda.current_device()``. Returns (queue, restore)."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # the harness starts ranks as daemonic processes, which multiprocessing forbids to have children
    multiprocessing.current_process().daemon = False

    def restore():
        torch.cuda.synchronize, torch.cuda.current_device = saved

    return AsyncCallsQueue(persistent=False), restore


def round_trips(rank: int, world: int, root: str) -> None:
    assert world == WORLD
    dc, _, _ = megatron()
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    from dcp_datastates import wait_staged
    from dcp_datastates.integrations.megatron import (
        BACKEND,
        DataStatesLoadShardedStrategy,
        DataStatesSaveShardedStrategy,
        register_strategies,
    )

    summary: dict = {"timings": {}}

    def folder(name: str) -> str:
        path = os.path.join(root, name)
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        return path

    def timed(name, fn):
        t0 = time.monotonic()
        out = fn()
        summary["timings"][name] = round(time.monotonic() - t0, 3)
        return out

    # 1. synchronous save through the registry by name (the import registered the defaults:
    #    their gloo group is made at this first save), loaded back with the same sharding.
    sync_dir = folder("sync")
    timed("sync_save", lambda: dc.save(saved_state(rank, 0), sync_dir, sharded_strategy=(BACKEND, 1)))
    loaded = timed("sync_load", lambda: dc.load(saved_state(rank, 0, empty=True), sync_dir))
    summary["sync"] = check_saved_layout(loaded, rank, 0)

    # 2. asynchronous save on a dedicated gloo group; the request runs in this process. The
    #    source tensors change in place once staged (training goes on): the checkpoint keeps the
    #    values of the request.
    ckpt_group = dist.new_group(backend="gloo")
    save_strategy, load_strategy = register_strategies(process_group=ckpt_group)
    async_dir = folder("async")
    state = saved_state(rank, 0)
    request = dc.save(state, async_dir, sharded_strategy=save_strategy, async_sharded_save=True)
    summary["metadata_json_before_finalize"] = os.path.exists(os.path.join(async_dir, "metadata.json"))
    wait_staged()
    for sh in state["model"].values():
        sh.data.add_(1)  # "the optimizer step"
    timed("async_finish", request.execute_sync)
    # loaded with another sharding (load strategy picked from metadata.json), and whole
    summary["async_resharded"] = check_resharded(timed("resharded_load", lambda: dc.load(resharded_state(rank), async_dir)), rank, 0)
    summary["async_full"] = check_full(dc.load_plain_tensors(async_dir), 0)

    # 3. the same request type run by Megatron's own AsyncCallsQueue: async_fn waits in a forked
    #    helper process for this process's upload; finalize (here) commits metadata.json.
    queue, restore = cpu_async_calls_queue()
    try:
        queue_dir = folder("queue")
        request = dc.save(saved_state(rank, 1), queue_dir, sharded_strategy=save_strategy, async_sharded_save=True)
        queue.schedule_async_request(request)
        polls, finalized = 0, []
        while not finalized and polls < 400:  # non-blocking polls, as a training loop does
            finalized = queue.maybe_finalize_async_calls(blocking=False)
            polls += 1
            if not finalized:
                time.sleep(0.02)
        finalized += queue.maybe_finalize_async_calls(blocking=True)
        summary["queue_finalized"] = finalized
        summary["queue_polls"] = polls
        # wait_in_async_fn=False: no helper process; the finalize function waits for the upload
        no_helper = DataStatesSaveShardedStrategy(process_group=ckpt_group, wait_in_async_fn=False)
        no_helper_dir = folder("queue_no_helper")
        request = dc.save(saved_state(rank, 3), no_helper_dir, sharded_strategy=no_helper, async_sharded_save=True)
        summary["no_helper_async_fn"] = request.async_fn is None
        queue.schedule_async_request(request)
        summary["no_helper_finalized"] = queue.maybe_finalize_async_calls(blocking=False)
        queue.close()
    finally:
        restore()
    summary["queue"] = check_saved_layout(dc.load(saved_state(rank, 1, empty=True), queue_dir, sharded_strategy=load_strategy), rank, 1)
    summary["queue_no_helper"] = check_saved_layout(dc.load(saved_state(rank, 3, empty=True), no_helper_dir), rank, 3)

    # 4. Megatron's FullyParallelSaveStrategyWrapper (spreads the replicated writes) around it
    wrapped_dir = folder("wrapped")
    dc.save(saved_state(rank, 2), wrapped_dir, sharded_strategy=FullyParallelSaveStrategyWrapper(save_strategy))
    summary["wrapped"] = check_resharded(dc.load(resharded_state(rank), wrapped_dir), rank, 2)

    # 5. a failed asynchronous save (overwrite=False into a committed folder) raises from the
    #    request's finalize on every rank, before Megatron writes metadata.json; the checkpoint
    #    already there stays loadable
    refusing = DataStatesSaveShardedStrategy(process_group=ckpt_group, overwrite=False)
    request = dc.save(saved_state(rank, 0), sync_dir, sharded_strategy=refusing, async_sharded_save=True)
    try:
        request.execute_sync()
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        summary["failed_save_raised"] = f"{type(exc).__name__}: {exc}"
    summary["sync_after_failure"] = check_saved_layout(dc.load(saved_state(rank, 0, empty=True), sync_dir), rank, 0)
    # every finished request removed its flag file
    prefix = f"dcp-datastates-megatron-{os.getpid()}-"
    summary["flags_left"] = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)]

    # 6. refusals: the default group for an asynchronous save, a checkpoint of another backend
    try:
        DataStatesSaveShardedStrategy(process_group=dist.group.WORLD).async_save(saved_state(rank, 0), async_dir)
    except ValueError as exc:
        summary["default_group_refused"] = "process group of its own" in str(exc)
    try:
        DataStatesLoadShardedStrategy().check_backend_compatibility("torch_dist")
    except CheckpointingException as exc:
        summary["other_backend_refused"] = "torch_dist" in str(exc)

    with open(os.path.join(root, f"summary_{rank}.json"), "w") as f:
        json.dump(summary, f)
