"""A node that stops in the middle of a save (SIGSTOP: its process frozen, its sockets open, as for
a node whose network died) fails that save on every surviving rank within ``stall_timeout``, the
one knob scaled down here (default options otherwise): the durable folder keeps its previous
checkpoint, loadable bitwise, and the surviving process goes on.

Two ranks as two nodes (``DCPDS_NODE``), each with its own local tier, ``peer_copies=1``, DCP's
collectives on ``checkpoint_process_group()``. Rank 1 freezes either during its drain to the
durable tier (the coordinator waits for its drain report: the library's own wait), or as its
write step starts (the coordinator waits in DCP's gather: the group's timeout)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, checkpoint_process_group, commit, recent_checkpoints
from dcp_datastates.tiers import peers

from conftest import assert_state_equal, zeros_like_state

STALL = 5.0  # stall_timeout, scaled down from its default of 300 s


def own_state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(100 * seed + rank)
    return {f"own{rank}": torch.randn(256, 64, generator=g), "shared": torch.arange(64.0) + seed, "step": seed}


def save(state: dict, durable: str, nv: str, group) -> None:
    writer = DataStatesWriter(durable, local_tier=nv, peer_copies=1, stall_timeout=STALL, process_group=group)
    dcp.async_save(state, storage_writer=writer, process_group=group).upload_completion.result(timeout=600)


def _freeze_when(where: str, durable: str) -> None:
    """Rank 1 stops: as its drain starts, once the coordinator recorded the checkpoint as
    committed on the local tiers (``drain``), or as its write step starts (``write``)."""
    from dcp_datastates import save as save_steps
    from dcp_datastates.tiers import drain

    def stop() -> None:
        os.kill(os.getpid(), signal.SIGSTOP)

    # Out of the test's process group: when that group becomes orphaned while this process is
    # stopped (the shell that started pytest exits first, e.g. under nohup), the kernel sends
    # the group SIGHUP then SIGCONT (POSIX), which would resume this "frozen node" and let its
    # save finish. In a session of its own, no such group event reaches it.
    os.setsid()

    if where == "drain":
        def frozen(*args, **kwargs):
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(durable, ".pending.metadata")) and time.monotonic() < deadline:
                time.sleep(0.01)
            stop()

        drain._copy_files = frozen
    else:
        def frozen(*args, **kwargs):
            stop()

        save_steps.write_rank = frozen


def _frozen_mid_save(rank, world, root, where):
    os.environ[peers.NODE_ENV] = f"node{rank}"
    nv = os.path.join(root, f"nv{rank}")
    durable = os.path.join(root, "ck", "step")
    group = checkpoint_process_group(stall_timeout=STALL)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    first = own_state(rank, 1)
    save(first, durable, nv, group)
    first_id = commit.checkpoint_id(durable)
    dist.barrier()
    if rank == 1:
        _freeze_when(where, durable)
    t0 = time.monotonic()
    error = None
    try:
        save(own_state(rank, 2), durable, nv, group)
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        error = exc
    out = {"seconds": time.monotonic() - t0, "type": type(error).__name__, "text": str(error),
           "recorded": recent_checkpoints(1)[0].error}
    # Only the survivor gets here. Nothing new is committed durably; the previous checkpoint loads.
    now_id = commit.checkpoint_id(durable)
    out["committed"] = now_id == first_id
    back = zeros_like_state(first)
    dcp.load(back, storage_reader=DataStatesReader(durable), no_dist=True)
    try:
        assert_state_equal(first, back)
    except AssertionError as exc:
        # Which checkpoint loaded, and how the survivor's save ended: what tells a second save
        # committed after all from a first one damaged.
        raise AssertionError(f"{exc}; durable commit {now_id} (first {first_id}), second save: {out}, "
                             f"loaded step {back.get('step')}, folder {sorted(os.listdir(durable))}") from exc
    out["previous_loads"] = True
    out["trains_on"] = bool(torch.isfinite((torch.randn(64, 64) @ torch.randn(64, 64)).sum()))
    with open(os.path.join(root, "survivor.json"), "w") as f:
        json.dump(out, f)
    os.kill(pids[1], signal.SIGKILL)
    os._exit(0)  # the process group still counts the frozen rank: nothing collective from here


@pytest.mark.parametrize("where", ["drain", "write"])
def test_a_frozen_node_fails_the_save_on_the_survivors_within_stall_timeout(tmp_path, where):
    from dist_harness import _launch

    failure = _launch(2, _frozen_mid_save, (str(tmp_path), where), 300.0)
    assert failure == "ranks exited abnormally: [(1, -9)]", failure
    out = json.loads((tmp_path / "survivor.json").read_text())
    # The survivor's save raises: DCP's CheckpointException, or gloo's timeout where DCP's own
    # collective then waited for the frozen rank (its broadcast of the coordinator's error, its
    # gather of the write results), bounded by the checkpoint group's timeout.
    assert out["type"] in ("CheckpointException", "RuntimeError"), out
    assert out["type"] == "CheckpointException" or "Timed out" in out["text"], out
    if where == "drain":  # the coordinator names the rank and the knob
        assert "rank(s) [1] showed no progress" in out["recorded"] and "stall_timeout" in out["recorded"], out
    assert out["seconds"] < 2 * STALL + 20, out  # stall_timeout, then at most one collective's timeout
    assert out["committed"] and out["previous_loads"] and out["trains_on"], out


def test_a_live_drain_is_waited_for_past_stall_timeout_and_a_silent_one_is_not(tmp_path):
    """The coordinator's wait (pending_ckpt.wait_drained): a rank whose drain is alive, even queued and
    slow, renews its report and is waited for past ``stall_timeout`` (``drain_timeout`` bounds
    it); a rank that never renews it fails the wait after ``stall_timeout``, named."""
    import threading

    from dcp_datastates.errors import CheckpointWriteError
    from dcp_datastates.storage import LocalStorage
    from dcp_datastates.tiers import drain
    from dcp_datastates.tiers import pending as pending_ckpt

    store = LocalStorage(str(tmp_path))
    beat = drain.Heartbeat(store, 1, "s1", every=0.2)

    def finish_later() -> None:
        time.sleep(2.0)  # four stall_timeouts of a live drain
        beat.stop()
        pending_ckpt.report_drained(store, 1, "s1", None)

    threading.Thread(target=finish_later).start()
    t0 = time.monotonic()
    pending_ckpt.wait_drained(store, "s1", {1}, timeout=30, stall=0.5)
    assert 1.8 < time.monotonic() - t0 < 10
    t0 = time.monotonic()
    with pytest.raises(CheckpointWriteError, match=r"rank\(s\) \[2\] showed no progress for 0.5 s \(stall_timeout\)"):
        pending_ckpt.wait_drained(store, "s1", {2}, timeout=30, stall=0.5)
    assert time.monotonic() - t0 < 5
