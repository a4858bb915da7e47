"""Peer copies (``peer_copies=1``, tiers/peers.py) and the restart that uses them
(``prepare_restart``, tiers/restart.py): ranks in pairs form emulated nodes (``DCPDS_NODE``, one
local tier each: 4 ranks as 2 nodes, 8 as 4); every rank's files of a save are copied, verified,
into a rank of the next node."""

import logging
import os
import shutil
import time

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem

import dcp_datastates
from dcp_datastates import DataStatesReader, DataStatesWriter, commit
from dcp_datastates.config import DataStatesConfig
from dcp_datastates.tiers import local_tier as tiers
from dcp_datastates.tiers import peer_wire, peers

from conftest import assert_state_equal, clone_state, raises_through_dcp, zeros_like_state
from dist_harness import run_ranks

WORLD = 4


def node_of(rank: int) -> str:
    """Two ranks per node: node0 holds ranks 0 and 1, node1 ranks 2 and 3, ..."""
    return f"node{rank // 2}"


def as_node(rank: int, root: str) -> str:
    """Emulate this rank's node: its name and its local tier."""
    os.environ[peers.NODE_ENV] = node_of(rank)
    return os.path.join(root, node_of(rank))


def rank_state(rank, seed):
    g = torch.Generator().manual_seed(100 * seed + rank)
    return {
        f"own{rank}": torch.randn(300, 64, generator=g),  # written by this rank only
        "shared": torch.arange(64, dtype=torch.float32) + seed,  # the same on every rank: written once
        "step": seed,
    }


def save(state, durable, nv, **options):
    w = DataStatesWriter(durable, local_tier=nv, peer_copies=1, **options)
    dcp.async_save(clone_state(state), storage_writer=w).upload_completion.result(timeout=120)
    return w


def recorded(nv: str, durable: str) -> dict[str, dict]:
    """{durable file name: the record naming it} in this node's local copy of ``durable``."""
    out = {}
    for _, record in tiers._rank_records(tiers.local_copy(nv, durable)):
        for name in record["files"]:
            out[name] = record
    return out


def _copies_on_the_other_node(rank, world, root):
    nv = as_node(rank, root)
    durable = os.path.join(root, "step-1")
    state = rank_state(rank, 1)
    w = save(state, durable, nv)
    done = w.peer_copy.result(timeout=60)
    assert peers.current().map.target(rank) == (rank + world // 2) % world
    assert done["sent"] and done["kept"], done  # every rank wrote its own tensor, and keeps its source's
    assert done["metadata"], done  # every node keeps the checkpoint's metadata
    dist.barrier()
    md, files = commit.read_commit(durable)
    held = recorded(nv, durable)
    assert set(held) == set(files), (sorted(held), sorted(files))  # this node holds every file
    local = tiers.local_copy(nv, durable)
    for name, record in held.items():
        assert record["save_id"] == md.storage_meta.save_id
        peer_made = "peer_of" in record
        assert peer_made == (node_of(record["rank"]) != node_of(rank)), record
        with open(os.path.join(local, record["files"][name]), "rb") as a, open(os.path.join(durable, name), "rb") as b:
            assert a.read() == b.read(), name
    assert not [n for n in os.listdir(local) if n.endswith(".tmp")]
    # Node 1 lost (its tier wiped): node 0's ranks still read every file locally, its own and node 1's.
    dist.barrier()
    if rank == world // 2:
        shutil.rmtree(os.path.join(root, "node1"))
    dist.barrier()
    out = zeros_like_state(state)
    reader = DataStatesReader(durable, local_tier=nv)
    dcp.load(out, storage_reader=reader)
    assert_state_equal(state, out)
    if node_of(rank) == "node0":
        assert reader.tier_reads["durable"] == 0 and reader.tier_reads["local"] >= 1, reader.tier_reads


def test_each_rank_s_files_are_kept_verified_on_the_other_node(tmp_path):
    run_ranks(WORLD, _copies_on_the_other_node, str(tmp_path))


def _damaged_in_transit(rank, world, root):
    """Rank 0's blocks arrive with one bit flipped (after the sender's CRC): its peer drops the
    file, naming the piece, and records nothing of it; everything else stands."""
    nv = as_node(rank, root)
    durable = os.path.join(root, "step-2")
    if rank == 0:
        real_send = peer_wire.send_tensor

        def flipping(p, dst, t, what, **kwargs):
            if what.startswith("a block of") and t.numel() > 100:
                t = t.clone()
                t[t.numel() // 2] ^= 1
            return real_send(p, dst, t, what, **kwargs)

        peer_wire.send_tensor = flipping
    logging.getLogger("dcp_datastates").setLevel(logging.WARNING)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dcp_datastates").addHandler(handler)
    w = save(rank_state(rank, 2), durable, nv)
    done = w.peer_copy.result(timeout=60)
    dist.barrier()
    md, files = commit.read_commit(durable)
    held = recorded(nv, durable)
    if rank == world // 2:  # rank 0's peer
        assert done["kept"] == [], done
        warned = [r.getMessage() for r in records if "was not kept" in r.getMessage()]
        assert warned and "recorded crc32c" in warned[0] and "from rank 0" in warned[0], warned
    if node_of(rank) == "node1":
        rank0_files = {n for n in files if n.startswith("__0_")}
        assert rank0_files and not rank0_files & set(held), (sorted(held), rank0_files)
        assert set(files) - rank0_files <= set(held)
    else:
        assert set(held) == set(files)
    assert commit.is_committed(durable)


def test_a_copy_damaged_in_transit_is_not_kept(tmp_path):
    run_ranks(WORLD, _damaged_in_transit, str(tmp_path))


def _a_peer_that_never_answers(rank, world, root, how):
    """Rank 3 takes no part in the exchanges (``never``), or its link dies in the middle of its
    first file (``mid-copy``: its first block waits past peer_timeout, then its send fails): its
    partner's copies fail after peer_timeout, leaving no partial file, the other pair's files
    arrive but the metadata every rank hands on does not; the saves commit durably all the same,
    training goes on, and every rank's later saves skip peer copies."""
    nv = as_node(rank, root)
    if rank == 3 and how == "never":
        peers._exchange = lambda *args: (_ for _ in ()).throw(RuntimeError("this rank is gone"))
    if rank == 3 and how == "mid-copy":
        real_send = peer_wire.send_tensor

        def dying(p, dst, t, what, **kwargs):
            if what.startswith("a block of"):
                time.sleep(8)
                raise peer_wire.OutOfStep(f"sending {what} to rank {dst}: connection lost")
            return real_send(p, dst, t, what, **kwargs)

        peer_wire.send_tensor = dying
    states = [rank_state(rank, s) for s in (3, 4)]
    for k, state in enumerate(states):
        durable = os.path.join(root, f"step-{3 + k}")
        t0 = time.monotonic()
        w = save(state, durable, nv, peer_timeout=3)
        assert time.monotonic() - t0 < 30  # the save never waited for its peer copies
        assert commit.is_committed(durable)
        if rank in (0, 2) and k == 0:  # 0 and 2 copy to each other: their files arrive, but
            done = w.peer_copy.result(timeout=60)  # not the metadata, which every rank hands on
            assert done["kept"] and done["metadata"] is False, done
        else:  # 1 and 3 copy to each other: 1 times out; then every rank stops making peer copies
            with pytest.raises(Exception) as caught:
                w.peer_copy.result(timeout=60)
            if rank != 3:
                want = "from rank 3" if k == 0 else "stopped earlier in this process"
                assert want in str(caught.value), caught.value
        if rank == 1:  # nothing of rank 3's half-sent file is left, nor recorded
            local = tiers.local_copy(nv, durable)
            assert not [n for n in os.listdir(local) if n.endswith(".tmp") or n.startswith("__3_")], os.listdir(local)
            assert tiers.rank_record(local, 3) is None
        out = zeros_like_state(state)
        dcp.load(out, storage_reader=DataStatesReader(durable, local_tier=nv))
        assert_state_equal(state, out)


@pytest.mark.parametrize("how", ["never", "mid-copy"])
def test_a_peer_that_never_answers_never_stalls_the_saves(tmp_path, how):
    run_ranks(WORLD, _a_peer_that_never_answers, str(tmp_path), how)


def test_the_peer_map_pairs_each_node_with_the_next():
    m = peers.PeerMap(("a", "a", "b", "b", "c", "c"))
    assert [m.target(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert m.sources(0) == [4] and m.sources(3) == [1]
    uneven = peers.PeerMap(("a", "a", "a", "b"))
    assert [uneven.target(r) for r in range(4)] == [3, 3, 3, 0]
    assert uneven.sources(3) == [0, 1, 2]
    assert peers.PeerMap(("a", "a")).target(0) is None


def test_peer_copies_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="peer_copies: needs local_tier"):
        DataStatesConfig(peer_copies=1)
    with pytest.raises(ValueError, match="peer_copies: expected 0 or 1"):
        DataStatesConfig(peer_copies=2, local_tier=str(tmp_path))
    with pytest.raises(ValueError, match="peer_timeout: expected seconds > 0"):
        DataStatesConfig(peer_copies=1, local_tier=str(tmp_path), peer_timeout=0)
    assert DataStatesConfig.from_dict({"peer_copies": 1, "local_tier": str(tmp_path)}).peer_copies == 1


# ------------------------------------------------------------------ restart after a node is lost
class CountingFileSystem(LocalFileSystem):
    """A local folder as fsspec ``countfile://``: counts the bytes this process reads from any of
    its files (data files and metadata alike), so a test can show a restart read nothing from
    the durable store."""

    protocol = "countfile"
    bytes_read = 0
    _strip_protocol = classmethod(lambda cls, path: LocalFileSystem._strip_protocol(
        str(path).removeprefix("countfile://")))

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        return _Counted(f) if "r" in mode else f

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        CountingFileSystem.bytes_read += len(data)
        return data


class _Counted:
    def __init__(self, f) -> None:
        self._f = f

    def read(self, n=-1):
        data = self._f.read(n)
        CountingFileSystem.bytes_read += len(data)
        return data

    def readinto(self, b):
        n = self._f.readinto(b)
        CountingFileSystem.bytes_read += n or 0
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)


def _durable_root(root: str) -> str:
    return f"countfile://{root}/ck"


def _three_saves_then_killed(rank, world, root):
    """Steps 1 and 2 committed durably; step 3 committed on the nodes' local tiers, its peer
    copies made, and every process SIGKILLed before its drain ends."""
    import signal

    from dcp_datastates.tiers import drain

    nv = as_node(rank, root)
    ck = _durable_root(root)
    for step in (1, 2):
        w = save(rank_state(rank, step), f"{ck}/step-{step}", nv)
        w.peer_copy.result(timeout=60)

    def held(*args, **kwargs):
        time.sleep(600)  # the drain never ends: killed first

    drain._copy_files = held
    w = DataStatesWriter(f"{ck}/step-3", local_tier=nv, peer_copies=1)
    dcp.async_save(clone_state(rank_state(rank, 3)), storage_writer=w)
    w.peer_copy.result(timeout=60)
    pending = os.path.join(root, "ck", "step-3", ".pending.metadata")
    deadline = time.monotonic() + 60
    while not os.path.exists(pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)  # (each rank once its own copies are made: no collective)


def _lose_node1(root, world: int) -> None:
    from dist_harness import _launch

    failure = _launch(world, _three_saves_then_killed, (str(root),), 240.0)
    assert failure is not None and "exited abnormally" in failure and "-9" in failure, failure
    assert os.path.exists(root / "ck" / "step-3" / ".pending.metadata")
    assert not commit.is_committed(str(root / "ck" / "step-3"))
    shutil.rmtree(root / "node1")  # node 1 (ranks 2 and 3) is replaced: its local tier is empty


def _restart(rank, world, root, expected_step):
    nv = as_node(rank, root)
    ck = _durable_root(root)
    like = zeros_like_state(rank_state(rank, expected_step))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dcp_datastates").addHandler(handler)
    logging.getLogger("dcp_datastates").setLevel(logging.INFO)
    CountingFileSystem.bytes_read = 0
    path = dcp_datastates.prepare_restart(ck, local_tier=nv, state_dict=like)
    assert path == f"{ck}/step-{expected_step}", path
    out = zeros_like_state(rank_state(rank, expected_step))
    reader = DataStatesReader(path, local_tier=nv)
    dcp.load(out, storage_reader=reader)
    assert_state_equal(rank_state(rank, expected_step), out)
    assert reader.tier_reads["durable"] == 0 and reader.tier_reads["local"] >= 1, reader.tier_reads
    if expected_step == 3:  # the metadata too came from the nodes (kept at the save, agreed at the restart)
        assert CountingFileSystem.bytes_read == 0, CountingFileSystem.bytes_read
    return [r.getMessage() for r in records]


def _restart_from_peers(rank, world, root):
    _restart(rank, world, root, 3)


@pytest.mark.parametrize("world", [4, 8], ids=["2-nodes", "4-nodes"])
def test_a_lost_node_restarts_from_its_peers_copies_reading_no_data_from_the_durable_store(tmp_path, world):
    """Every process SIGKILLed while step 3 was committed only on the local tiers (its drain
    held), and node 1's tier wiped: fresh processes agree on step 3 and load it bitwise, node 1's
    ranks from files pulled from the other nodes' copies; no data file byte is read from the
    durable store on any rank: not a data file, not the metadata."""
    _lose_node1(tmp_path, world)
    run_ranks(world, _restart_from_peers, str(tmp_path), timeout=300.0)


def _restart_past_a_corrupt_replica(rank, world, root):
    messages = _restart(rank, world, root, 2)
    if rank == 0:
        assert any("does not verify" in m and "step-3" in m for m in messages), messages
        assert any("trying the next checkpoint" in m for m in messages), messages


def test_a_corrupt_replica_sends_every_rank_to_the_previous_checkpoint(tmp_path):
    """Node 0's copy of rank 2's step-3 file has one byte flipped and node 1 is lost: no node holds
    that file verified and step 3 is not durable, so every rank resumes from step 2 (the copy
    named in a warning and set aside, never loaded)."""
    _lose_node1(tmp_path, WORLD)
    local = tiers.local_copy(str(tmp_path / "node0"), f"{_durable_root(str(tmp_path))}/step-3")
    victim = next(os.path.join(local, n) for n in sorted(os.listdir(local)) if n.startswith("__2_"))
    with open(victim, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    run_ranks(WORLD, _restart_past_a_corrupt_replica, str(tmp_path))
    assert os.path.exists(victim + ".corrupt") and not os.path.exists(victim)


def _damaged_at_the_sender(rank, world, root):
    """Rank 1's local file is damaged after its local commit, before it is sent: the sender does
    not check it, its peer (rank 3) does and drops it, naming the item; nothing else changes."""
    nv = as_node(rank, root)
    durable = os.path.join(root, "step-5")
    if rank == 1:
        real_exchange = peers.exchange

        def damaging(local, durable_path, save_id, files, config, **kwargs):
            name = sorted(files)[0]
            with open(os.path.join(local, name), "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
            return real_exchange(local, durable_path, save_id, files, config, **kwargs)

        peers.exchange = damaging
        from dcp_datastates.tiers import drain

        drain.drain_rank = lambda *args, **kwargs: None  # (the drain would refuse it: not this test's point)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dcp_datastates").addHandler(handler)
    w = DataStatesWriter(durable, local_tier=nv, peer_copies=1, drain_timeout=5)
    with raises_through_dcp(r"rank\(s\) \[1\] did not report"):  # rank 1 never drains: no durable commit
        dcp.async_save(clone_state(rank_state(rank, 5)), storage_writer=w).upload_completion.result(timeout=120)
    done = w.peer_copy.result(timeout=60)
    if rank == 3:  # rank 1's peer
        assert done["kept"] == [], done
        warned = [r.getMessage() for r in records if "was not kept" in r.getMessage()]
        assert warned and "from rank 1" in warned[0] and "recorded crc32c" in warned[0], warned
    else:
        assert done["kept"], done


def test_a_file_damaged_at_the_sender_is_dropped_by_its_peer(tmp_path):
    run_ranks(WORLD, _damaged_at_the_sender, str(tmp_path))


def test_a_one_process_save_says_it_has_no_peer(tmp_path):
    w = DataStatesWriter(str(tmp_path / "step-1"), local_tier=str(tmp_path / "nv"), peer_copies=1)
    dcp.save({"w": torch.ones(8)}, storage_writer=w)
    assert commit.is_committed(str(tmp_path / "step-1"))
    with pytest.raises(RuntimeError, match="saved by one process: there is no other node"):
        w.peer_copy.result(timeout=5)


# ------------------------------------------- a Hugging Face model under FSDP2, restarted from peers
def _llama_saved_then_killed(rank, world, root):
    """A transformers Llama (built from a config) under FSDP2 with fused AdamW, 4 ranks as 2
    nodes: step 1 committed durably, step 2 committed only on the local tiers (its drain held)
    with its peer copies made; then every process is SIGKILLed."""
    import signal

    import incremental_workers as W
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dcp_datastates.tiers import drain

    nv = as_node(rank, root)
    ck = _durable_root(root)
    model, opt = W._sharded()
    group = dist.new_group(backend="gloo")  # the checkpoint's own group, beside training's
    for step in (1, 2):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 256, (8, 16), generator=g)[rank * 2:(rank + 1) * 2]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        full = W._full({"model": msd, "optim": osd})
        if rank == 0:
            torch.save(full, os.path.join(root, f"expected-{step}.pt"))
        if step == 2:
            drain._copy_files = lambda *args, **kwargs: time.sleep(600)  # killed first
        w = DataStatesWriter(f"{ck}/step-{step}", local_tier=nv, peer_copies=1, process_group=group)
        response = dcp.async_save({"model": msd, "optim": osd, "step": step}, storage_writer=w, process_group=group)
        assert w.peer_copy.result(timeout=120)["metadata"]
        if step == 1:
            response.upload_completion.result(timeout=120)
    pending = os.path.join(root, "ck", "step-2", ".pending.metadata")
    deadline = time.monotonic() + 60
    while not os.path.exists(pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def _llama_restarted(rank, world, root):
    import incremental_workers as W
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    nv = as_node(rank, root)
    model, opt = W._sharded()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(99))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the optimizer's state exists, as when resuming
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    CountingFileSystem.bytes_read = 0
    path = dcp_datastates.prepare_restart(_durable_root(root), local_tier=nv, state_dict=state)
    assert path.endswith("/step-2"), path
    dcp.load(state, storage_reader=DataStatesReader(path, local_tier=nv))
    assert CountingFileSystem.bytes_read == 0, CountingFileSystem.bytes_read
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    full = W._full({"model": msd, "optim": osd})
    expected = torch.load(os.path.join(root, "expected-2.pt"), weights_only=True)
    assert state["step"] == 2
    W._same(expected, full, "state")


def test_a_fsdp2_llama_resumes_bitwise_from_peer_copies_after_losing_a_node(tmp_path):
    """Code nobody here wrote: a Hugging Face Llama under FSDP2 with fused AdamW on 4 gloo ranks
    as 2 nodes; after every process is killed and node 1's tier wiped, fresh processes resume the
    newest checkpoint (committed only on the local tiers) bitwise, model and optimizer, reading
    nothing from the durable store."""
    pytest.importorskip("transformers")
    from dist_harness import _launch

    failure = _launch(WORLD, _llama_saved_then_killed, (str(tmp_path),), 300.0)
    assert failure is not None and "-9" in failure, failure
    shutil.rmtree(tmp_path / "node1")
    run_ranks(WORLD, _llama_restarted, str(tmp_path), timeout=300.0)


def _a_rank_that_cannot_restart(rank, world, root):
    """Rank 2 cannot read its local tier during prepare_restart: every rank raises RestartError
    naming rank 2 (none goes on alone, none waits in a collective)."""
    from dcp_datastates.tiers import restart

    nv = as_node(rank, root)
    ck = os.path.join(root, "ck")
    save(rank_state(rank, 1), os.path.join(ck, "step-1"), nv).peer_copy.result(timeout=60)
    if rank == 2:
        def unreadable(*args):
            raise OSError(f"{nv}: Input/output error")

        restart._verify_held = unreadable
    t0 = time.monotonic()
    with pytest.raises(dcp_datastates.RestartError, match=r"prepare_restart failed on rank 2: OSError: .*Input/output"):
        dcp_datastates.prepare_restart(ck, local_tier=nv)
    assert time.monotonic() - t0 < 30


def test_an_error_on_one_rank_in_prepare_restart_is_raised_on_every_rank(tmp_path):
    run_ranks(WORLD, _a_rank_that_cannot_restart, str(tmp_path))


def _a_failed_save_keeps_the_exchanges_in_step(rank, world, root):
    """Rank 1's write fails in the first save (which fails on every rank); it still takes its
    part in that save's exchange, so the second save's copies are made on every rank, metadata
    included, without waiting out peer_timeout."""
    import dcp_datastates.save as save_steps

    nv = as_node(rank, root)
    if rank == 1:
        real = save_steps.write_rank

        def failing_once(*args, **kwargs):
            save_steps.write_rank = real
            raise OSError("injected: the local disk failed")

        save_steps.write_rank = failing_once
    w = DataStatesWriter(os.path.join(root, "step-1"), local_tier=nv, peer_copies=1, peer_timeout=20)
    with raises_through_dcp("injected: the local disk failed"):
        dcp.async_save(clone_state(rank_state(rank, 1)), storage_writer=w).upload_completion.result(timeout=120)
    t0 = time.monotonic()
    w = save(rank_state(rank, 2), os.path.join(root, "step-2"), nv, peer_timeout=20)
    done = w.peer_copy.result(timeout=60)
    assert done["kept"] and done["metadata"], done
    assert time.monotonic() - t0 < 20, time.monotonic() - t0


def test_a_failed_save_keeps_every_rank_s_exchanges_in_step(tmp_path):
    run_ranks(WORLD, _a_failed_save_keeps_the_exchanges_in_step, str(tmp_path))


# ------------------------------------------------- a replicated (HSDP-like) layout: mirrors, not bytes
def _hsdp_state(rank, seed, diverge=False):
    """DTensors replicated across the 2 nodes and sharded within each (HSDP: mesh ("replicate",
    "shard"), ranks 0-1 on node0 and 2-3 on node1 hold the same shards pairwise), an optimizer
    step counter (a plain tensor every rank holds) and a non-tensor value. ``diverge``: rank 2's
    replicas differ from rank 0's (what a keeper's check must catch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k in range(6):
        full = torch.randn(128, 96, generator=g)
        local = full.chunk(2)[rank % 2].clone()
        if diverge and rank == 2:
            local[0, 0] += 1.0
        state[f"layers.{k}.weight"] = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                                        shape=full.shape, stride=full.stride())
    state["step"] = torch.tensor(float(seed))
    state["lr"] = 0.001 * seed
    return state


def _local_bytes(state) -> dict:
    return {k: (v.to_local().clone() if hasattr(v, "to_local") else v.clone() if torch.is_tensor(v) else v)
            for k, v in state.items()}


def _hsdp_zeros(state) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, shape=v.shape,
                                        stride=v.stride())
        else:
            out[k] = torch.zeros_like(v) if torch.is_tensor(v) else None
    return out


def _hsdp_saved(rank, world, root):
    nv = as_node(rank, root)
    replicated = sum(v.to_local().numel() * 4 for k, v in _hsdp_state(rank, 1).items() if k.startswith("layers"))
    # 1. Every replica holds the same shards: each rank's replicated shards travel as no bytes:
    # its peer (the rank of the other node holding the same shards) staged the same file from its
    # own memory at the same save and keeps that, once it matches the sender's checksums.
    w = save(_hsdp_state(rank, 1), f"{_durable_root(root)}/step-1", nv, keep_local=3)  # (kept for the restart)
    done = w.peer_copy.result(timeout=60)
    assert done["mirrored"] and done["kept"], done
    assert done["bytes_sent"] < replicated // 8, (done, replicated)
    dist.barrier()
    durable = os.path.join(root, "ck", "step-1")
    md, files = commit.read_commit(durable)
    sent_items = {index.fqn for index, loc in md.storage_data.items() if loc.file in done["sent"]}
    assert not [fqn for fqn in sent_items if fqn.startswith("layers.")], sent_items  # what travels: step, lr
    held = recorded(nv, f"{_durable_root(root)}/step-1")
    assert set(held) == set(files), (sorted(held), sorted(files))  # this node holds every file
    local = tiers.local_copy(nv, f"{_durable_root(root)}/step-1")
    for name, record in held.items():  # a mirror is byte for byte the file its writer wrote
        with open(os.path.join(local, record["files"][name]), "rb") as a, open(os.path.join(durable, name), "rb") as b:
            assert a.read() == b.read(), name
    # A mirror is kept under its writer's name, or removed: what no record names is at most a
    # rank's small value file that DCP's planner gave another rank (written, referenced by nothing).
    recorded_names = {os.path.basename(p) for r in held.values() for p in r["files"].values()}
    leftovers = {n: os.path.getsize(os.path.join(local, n)) for n in os.listdir(local)
                 if n.endswith(".safetensors") and n not in recorded_names}
    assert all(size < 16384 for size in leftovers.values()), leftovers
    # 2. Replicas that differ: the keeper's check fails and the bytes are sent, as for any file.
    other = os.path.join(root, "other", "step-1")
    w = save(_hsdp_state(rank, 1, diverge=True), other, nv, keep_local=3)
    done = w.peer_copy.result(timeout=60)
    if rank in (0, 2):
        assert not done["mirrored"] and f"__{rank}_0.safetensors" in done["sent"] and done["bytes_sent"] > 16384, done
    dist.barrier()
    for name, record in recorded(nv, other).items():
        with open(os.path.join(tiers.local_copy(nv, other), record["files"][name]), "rb") as a, \
                open(os.path.join(other, name), "rb") as b:
            assert a.read() == b.read(), name


    # 3. The folder given only at the call (as TorchTitan's manager does): the files are held
    # until DCP names it, mirrors included.
    late = os.path.join(root, "late", "step-1")
    w = DataStatesWriter(local_tier=nv, peer_copies=1, keep_local=3)
    dcp.async_save(_hsdp_state(rank, 1), storage_writer=w, checkpoint_id=late).upload_completion.result(timeout=120)
    done = w.peer_copy.result(timeout=60)
    assert done["mirrored"] and done["bytes_sent"] < replicated // 8, done
    dist.barrier()
    assert set(recorded(nv, late)) == set(commit.read_commit(late)[1])


def _hsdp_restarted(rank, world, root):
    nv = as_node(rank, root)
    expected = _hsdp_state(rank, 1)
    out = _hsdp_zeros(expected)
    CountingFileSystem.bytes_read = 0
    path = dcp_datastates.prepare_restart(_durable_root(root), local_tier=nv, state_dict=out)
    assert path == f"{_durable_root(root)}/step-1", path
    reader = DataStatesReader(path, local_tier=nv)
    dcp.load(out, storage_reader=reader)
    assert CountingFileSystem.bytes_read == 0, CountingFileSystem.bytes_read
    assert reader.tier_reads["durable"] == 0, reader.tier_reads
    want, got = _local_bytes(expected), _local_bytes(out)
    for k in want:
        if torch.is_tensor(want[k]):
            assert torch.equal(want[k], got[k]), k
        else:
            assert got[k] == want[k], k


def test_a_replicated_layout_moves_none_of_its_replicas_and_a_lost_node_restarts_from_them(tmp_path):
    """HSDP-like (DTensors replicated across 2 nodes, sharded within each): a save's peer copies
    move none of the replicated bytes (each keeper keeps the file it staged from its own replica,
    checked against the writer's checksums), replicas that differ are sent instead; after node
    1's tier is wiped, fresh processes agree on the checkpoint and load it bitwise reading no
    byte from the durable store."""
    run_ranks(WORLD, _hsdp_saved, str(tmp_path))
    shutil.rmtree(tmp_path / "node1")
    run_ranks(WORLD, _hsdp_restarted, str(tmp_path), timeout=300.0)
