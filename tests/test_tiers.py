"""Multi-level checkpoints (local_tier=): commit locally, drain to the durable path, read the
nearest good copy back."""

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from dcp_datastates import DataStatesConfig, DataStatesReader, DataStatesWriter, commit, recent_checkpoints
from dcp_datastates.errors import CheckpointWriteError
from dcp_datastates.tiers import drain, file_copy, layered
from dcp_datastates.tiers import local_tier as tiers

from conftest import assert_state_equal, clone_state, raises_through_dcp, zeros_like_state


def make_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g).to(torch.bfloat16),
            "step": seed, "i": torch.arange(seed, seed + 50)}


def data_bytes(folder):
    """name -> bytes of every data file the folder's commit lists."""
    _, files = commit.read_commit(folder)
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(files)}


def save(state, durable, local_tier, asynchronous=True, **options):
    w = DataStatesWriter(durable, local_tier=str(local_tier), **options)
    if asynchronous:
        dcp.async_save(state, storage_writer=w).upload_completion.result()
    else:
        dcp.save(state, storage_writer=w)
    return w


def load(durable, local_tier, like):
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=DataStatesReader(durable, local_tier=str(local_tier)))
    return out


def damage_first_file(folder):
    """Flip the first data byte of the first data file the folder's commit lists."""
    _, files = commit.read_commit(folder)
    name, info = next(iter(files.items()))
    with open(os.path.join(folder, name), "r+b") as f:
        f.seek(info.data_start)
        b = f.read(1)
        f.seek(info.data_start)
        f.write(bytes([b[0] ^ 0xFF]))


def load_logged(durable, nv, state, caplog):
    """Load through the tiers; assert the values; the log lines it wrote."""
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        assert_state_equal(state, load(durable, nv, state))
    return caplog.text


def test_config_local_tier_checked(tmp_path):
    assert DataStatesConfig(local_tier=str(tmp_path / "nv")).local_tier == str(tmp_path / "nv")
    with pytest.raises(ValueError, match="local_tier: must be a node-local folder, not a URL"):
        DataStatesConfig(local_tier="s3://bucket/x")
    with pytest.raises(ValueError, match="local_tier: expected a local folder path, got 3"):
        DataStatesConfig(local_tier=3)
    assert DataStatesConfig.from_dict({"local_tier": "/nvme/ck"}).local_tier == "/nvme/ck"
    # Config files: a Nanotron-style YAML block and a DeepSpeed-style JSON section.
    (tmp_path / "ds.yaml").write_text("datastates:\n  local_tier: /nvme/ck\n  keep_local: 3\n")
    (tmp_path / "ds.json").write_text('{"train_batch_size": 8, "datastates_ckpt": {"local_tier": "/nvme/x"}}')
    c = DataStatesConfig.from_file(str(tmp_path / "ds.yaml"))
    assert (c.local_tier, c.keep_local) == ("/nvme/ck", 3)
    assert DataStatesConfig.from_file(str(tmp_path / "ds.json")).local_tier == "/nvme/x"
    w = DataStatesWriter(str(tmp_path / "durable" / "step-1"), config=str(tmp_path / "ds.yaml"))
    assert w.durable_path == str(tmp_path / "durable" / "step-1") and w.path.startswith("/nvme/ck/step-1-")


@pytest.mark.parametrize("asynchronous", [True, False])
def test_save_commits_locally_then_drains_same_bytes(tmp_path, asynchronous):
    state = make_state(1)
    durable, nv = str(tmp_path / "ckpt" / "step-1"), tmp_path / "nvme"
    w = save(clone_state(state), durable, nv, asynchronous)
    local = tiers.local_copy(str(nv), durable)
    assert w.local_commit.result(timeout=0) == local
    assert data_bytes(local) == data_bytes(durable) and data_bytes(local)
    assert commit.checkpoint_id(local) == commit.checkpoint_id(durable) == w.save_id
    assert tiers.durable_of(local) == durable
    if asynchronous:  # dcp.save stages nothing: its figures are not recorded per save
        stats = recent_checkpoints(1)[0]
        assert stats.path == durable and stats.error is None
        assert stats.local_s is not None and stats.durable_s is not None and stats.local_s <= stats.durable_s
    assert_state_equal(state, load(durable, nv, state))
    out = zeros_like_state(state)  # the durable copy alone loads too
    dcp.load(out, storage_reader=DataStatesReader(durable))
    assert_state_equal(state, out)


def test_second_save_into_committed_durable_keeps_both_ids_tied(tmp_path):
    durable, nv = str(tmp_path / "step-2"), tmp_path / "nvme"
    save(make_state(1), durable, nv)
    state = make_state(2)
    w = save(clone_state(state), durable, nv)
    local = tiers.local_copy(str(nv), durable)
    assert commit.checkpoint_id(durable) == commit.checkpoint_id(local) == w.save_id
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(durable))
    assert_state_equal(state, out)
    assert_state_equal(state, load(durable, nv, state))


def test_one_process_saves_from_a_plan_cache_keep_each_saves_word(tmp_path):
    """One process with a local tier (the coordinator's word: the durable folder and its file
    names' tag). DataStatesSavePlanner's cached saves each drain to their own folder; DCP's
    planner with plan caching hands the second save the first's word, and it fails, committing
    nothing and leaving the first checkpoint as it was."""
    from dcp_datastates import DataStatesSavePlanner

    nv = tmp_path / "nvme"
    for i in (1, 2, 3):
        durable, state = str(tmp_path / "ours" / f"step-{i}"), make_state(i)
        dcp.async_save(clone_state(state), storage_writer=DataStatesWriter(durable, local_tier=str(nv)),
                       planner=DataStatesSavePlanner(cache_key="solo-word")).upload_completion.result()
        out = zeros_like_state(state)
        dcp.load(out, storage_reader=DataStatesReader(durable))  # the durable copy alone
        assert_state_equal(state, out)
    first, second = str(tmp_path / "stock" / "step-1"), str(tmp_path / "stock" / "step-2")
    dcp.async_save(clone_state(make_state(1)), storage_writer=DataStatesWriter(first, local_tier=str(nv)),
                   planner=DefaultSavePlanner(enable_plan_caching=True)).upload_completion.result()
    before = data_bytes(first)
    with raises_through_dcp(r"checkpoint \S*step-2: this rank was handed an earlier save's plan"):
        dcp.async_save(clone_state(make_state(2)), storage_writer=DataStatesWriter(second, local_tier=str(nv)),
                       planner=DefaultSavePlanner(enable_plan_caching=True)).upload_completion.result()
    assert not commit.is_committed(second)
    assert data_bytes(first) == before
    assert_state_equal(make_state(1), load(first, nv, make_state(1)))


def test_failing_drain_raises_names_durable_and_keeps_local(tmp_path):
    durable, nv = str(tmp_path / "ro" / "step-3"), tmp_path / "nvme"
    os.makedirs(tmp_path / "ro")
    with open(durable, "w") as f:  # a file where the durable folder should be: every drain fails
        f.write("in the way")
    state = make_state(3)
    w = DataStatesWriter(durable, local_tier=str(nv))
    resp = dcp.async_save(clone_state(state), storage_writer=w)
    with raises_through_dcp(rf"draining .* to the durable tier {durable} failed"):
        resp.upload_completion.result()
    local = tiers.local_copy(str(nv), durable)
    assert w.local_commit.result(timeout=0) == local
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(local))
    assert_state_equal(state, out)
    # the durable path is fixed: a save under another root leaves it (its storage options may be
    # another store's); the next save under the same root drains it too
    os.unlink(durable)
    save(make_state(5), str(tmp_path / "elsewhere" / "step-5"), nv, keep_local=5)
    assert not commit.is_committed(durable)
    save(make_state(4), str(tmp_path / "ro" / "step-4"), nv, keep_local=5)
    assert data_bytes(durable) == data_bytes(local)
    assert commit.checkpoint_id(durable) == w.save_id
    assert drain.drain_pending(str(nv)) == []  # nothing left to drain


def test_drain_refuses_local_file_corrupted_before_drain(tmp_path):
    durable, nv = str(tmp_path / "step-4"), tmp_path / "nvme"
    save(make_state(4), durable, nv)
    old_id = commit.checkpoint_id(durable)
    state = make_state(5)
    # commit locally by hand, then corrupt a data byte before the drain
    local = tiers.local_copy(str(nv), durable)
    save(clone_state(state), str(tmp_path / "other"), tmp_path / "unused")  # keep engine warm
    w = DataStatesWriter(local)
    dcp.save(clone_state(state), storage_writer=w)
    tiers.record_durable(local, durable)
    damage_first_file(local)
    with pytest.raises(CheckpointWriteError, match=rf"draining {local} to the durable tier {durable} failed: "
                                                   r"ChecksumMismatchError: .*checksum mismatch in item"):
        drain.drain(local, durable, DataStatesConfig())
    assert commit.checkpoint_id(durable) == old_id  # the durable tier kept its commit
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(durable))
    assert_state_equal(make_state(4), out)


def test_reader_falls_back_when_local_tier_wiped(tmp_path, caplog):
    durable, nv = str(tmp_path / "step-6"), tmp_path / "nvme"
    state = make_state(6)
    save(clone_state(state), durable, nv)
    shutil.rmtree(nv)
    log = load_logged(durable, nv, state, caplog)
    assert f"reading {durable} from the durable tier (no complete local copy" in log


@pytest.mark.parametrize("damaged", ["durable", "local"])
def test_reader_reads_the_undamaged_tier_and_logs_it(tmp_path, caplog, damaged):
    durable, nv = str(tmp_path / "step-7"), tmp_path / "nvme"
    state = make_state(7)
    save(clone_state(state), durable, nv)
    local = tiers.local_copy(str(nv), durable)
    # one tier damaged: the load can only return the saved values if it reads the other one
    damage_first_file(durable if damaged == "durable" else local)
    log = load_logged(durable, nv, state, caplog)
    if damaged == "durable":
        assert f"reading {durable} from the local tier {local}" in log
    else:
        assert f"reading {durable} from the durable tier: the local copy is damaged" in log
        assert "checksum mismatch" in log


def test_reader_ignores_local_copy_of_another_checkpoint(tmp_path, caplog):
    durable, nv = str(tmp_path / "step-9"), tmp_path / "nvme"
    save(make_state(9), durable, nv)
    local = tiers.local_copy(str(nv), durable)
    stale = str(tmp_path / "stale")
    shutil.copytree(local, stale)
    newer = make_state(10)
    save(clone_state(newer), durable, nv)
    shutil.rmtree(local)
    shutil.copytree(stale, local)  # the local tier now holds the older checkpoint (another id)
    log = load_logged(durable, nv, newer, caplog)
    assert "from the durable tier: the local copy" in log and "holds checkpoint" in log


def test_fsspec_durable_tier(tmp_path):
    durable, nv = f"memory://tiers-{uuid.uuid4().hex[:8]}/step-12", tmp_path / "nvme"
    for seed in (12, 13):  # the second drain goes into a committed folder
        state = make_state(seed)
        w = save(clone_state(state), durable, nv, asynchronous=seed == 12)
        assert commit.checkpoint_id(durable) == w.save_id
        out = zeros_like_state(state)
        dcp.load(out, storage_reader=DataStatesReader(durable))
        assert_state_equal(state, out)
    shutil.rmtree(nv)
    assert_state_equal(state, load(durable, nv, state))


_KILLED_BEFORE_DRAIN = """
import os, signal, sys
import torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, {tests!r})
from test_tiers import make_state
from dcp_datastates import DataStatesWriter
from dcp_datastates.tiers import drain, file_copy
drain.drain = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # die right after the local commit
dcp.save(make_state(11), storage_writer=DataStatesWriter({durable!r}, local_tier={nv!r}))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_killed_after_local_commit_restarts_from_local_then_drains(tmp_path):
    import subprocess
    import sys

    durable, nv = str(tmp_path / "step-11"), str(tmp_path / "nvme")
    code = _KILLED_BEFORE_DRAIN.format(tests=os.path.dirname(__file__), durable=durable, nv=nv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not commit.is_committed(durable)  # killed before the drain
    assert commit.latest_checkpoint(str(tmp_path)) is None
    assert tiers.latest_checkpoint(str(tmp_path), local_tier=nv) == durable
    state = make_state(11)
    assert_state_equal(state, load(durable, nv, state))  # restart: the local copy
    assert drain.drain_pending(nv) == [durable]
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(durable))
    assert_state_equal(state, out)
    assert commit.checkpoint_id(durable) == commit.checkpoint_id(tiers.local_copy(nv, durable))
    assert tiers.latest_checkpoint(str(tmp_path), local_tier=nv) == commit.latest_checkpoint(str(tmp_path)) == durable


def test_keep_local_evicts_only_drained_copies(tmp_path):
    nv = tmp_path / "nvme"
    blocked = str(tmp_path / "blocked" / "step-0")
    os.makedirs(tmp_path / "blocked")
    with open(blocked, "w") as f:  # this one's drain fails: its local copy is the only one
        f.write("in the way")
    with raises_through_dcp("draining .* failed"):
        save(make_state(0), blocked, nv, keep_local=2)
    durables = [str(tmp_path / "ck" / f"step-{i}") for i in range(1, 5)]
    for i, durable in enumerate(durables, start=1):
        save(make_state(i), durable, nv, keep_local=2)
    left = sorted(os.listdir(nv))
    expected = sorted(os.path.basename(tiers.local_copy(str(nv), d)) for d in [blocked, *durables[-2:]])
    assert left == expected
    assert tiers.latest_checkpoint(str(tmp_path / "ck"), local_tier=str(nv)) == durables[-1]
    for i, durable in enumerate(durables, start=1):  # every checkpoint still loads, evicted or not
        state = make_state(i)
        assert_state_equal(state, load(durable, nv, state))
    with pytest.raises(ValueError, match="keep_local: expected a positive integer, got 0"):
        DataStatesConfig(keep_local=0)


def test_object_store_down_fails_upload_completion_keeps_local_copy(tmp_path):
    pytest.importorskip("s3fs")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here: the store is down
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    durable, nv = "s3://nobucket/step-30", str(tmp_path / "nvme")
    state = make_state(30)
    drain_fails_local_copy_loads(state, durable, nv, options)


def drain_fails_local_copy_loads(state, durable, nv, options):
    """An async save whose drain fails: upload_completion raises naming the durable path, and the
    local copy stays committed, tied to that path, and loads the saved values. Returns it."""
    w = DataStatesWriter(durable, local_tier=nv, storage_options=options)
    resp = dcp.async_save(clone_state(state), storage_writer=w)
    with raises_through_dcp(rf"draining .* to the durable tier {durable} failed"):
        resp.upload_completion.result(timeout=120)
    local = w.local_commit.result(timeout=0)
    assert local == tiers.local_copy(nv, durable) and tiers.durable_of(local) == durable
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(local))
    assert_state_equal(state, out)
    return local


def _bytes_under(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def test_full_local_tier_evicts_drained_copies_oldest_first_never_undrained(tmp_path, monkeypatch):
    """A local tier with room for two and a half copies (free space simulated from what is in it)."""
    nv, root = tmp_path / "nvme", tmp_path / "ck"
    durables = [str(root / f"step-{i}") for i in range(1, 7)]
    save(make_state(1), durables[0], nv, keep_local=10)
    cap = int(2.5 * _bytes_under(nv))
    monkeypatch.setattr(tiers, "free_bytes", lambda folder: cap - _bytes_under(nv))
    copy = lambda i: tiers.local_copy(str(nv), durables[i - 1])  # noqa: E731
    save(make_state(2), durables[1], nv, keep_local=10)
    save(make_state(3), durables[2], nv, keep_local=10)  # no room for a third: step-1's copy goes
    assert sorted(os.listdir(nv)) == sorted(os.path.basename(copy(i)) for i in (2, 3))

    def store_down(*args, **kwargs):
        raise OSError(5, "Input/output error", "durable")

    monkeypatch.setattr(file_copy, "_write_durable", store_down)
    for i in (4, 5):  # committed locally, never drained: step-2 then step-3 make room for them
        with raises_through_dcp("draining .* failed"):
            save(make_state(i), durables[i - 1], nv, keep_local=10)
    assert sorted(os.listdir(nv)) == sorted(os.path.basename(copy(i)) for i in (4, 5))
    # Nothing durable is left to remove: the save fails before writing, both copies stay.
    with raises_through_dcp(r"local_tier .*: \d+ bytes free, this save needs \d+ bytes; the local copies .* are not "
                            r"durable yet, so they were kept"):
        save(make_state(6), durables[5], nv, keep_local=10)
    assert sorted(os.listdir(nv)) == sorted(os.path.basename(copy(i)) for i in (4, 5))
    for i in (4, 5):
        state = make_state(i)
        assert_state_equal(state, load(durables[i - 1], nv, state))
    for i in (1, 2, 3):  # the evicted copies' checkpoints load from the durable tier
        state = make_state(i)
        assert_state_equal(state, load(durables[i - 1], nv, state))


def _files_with_pieces(folder, sizes, piece):
    """Data files of random bytes in ``folder``: {name: size}, {name: [(off, len, crc32c, item)]}
    (a 16-byte header before the pieces, a gap of 5 bytes between them)."""
    from dcp_datastates._engine import crc32c

    g = torch.Generator().manual_seed(7)
    os.makedirs(folder, exist_ok=True)
    out_sizes, out_pieces = {}, {}
    for k, size in enumerate(sizes):
        name = f"f{k}.bin"
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
        pieces, off = [], 16
        while off + piece <= size:
            pieces.append((off, piece, crc32c(data[off:off + piece]), f"item{k}.{off}"))
            off += piece + 5
        out_sizes[name], out_pieces[name] = size, pieces
    return out_sizes, out_pieces


def _drain_readers_alive():
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("dcp-datastates-drain-read")]


def test_drain_copies_files_in_parallel_blocks_byte_for_byte(tmp_path, monkeypatch):
    """Several files, each in many blocks read and verified ahead of the writer: every byte
    lands in order, gaps (headers, padding) included, under the new names."""
    from dcp_datastates.storage import open_storage

    monkeypatch.setattr(file_copy, "_COPY_BLOCK", 3000)
    monkeypatch.setattr(file_copy, "_BLOCKS_AHEAD", 2)
    sizes, pieces = _files_with_pieces(str(tmp_path / "local"), [50_000, 1, 70_123, 0, 9000], 1000)
    renamed = {n: f"new-{n}" for n in sizes}
    os.makedirs(tmp_path / "durable")
    file_copy._copy_all(open_storage(str(tmp_path / "local")), open_storage(str(tmp_path / "durable")), sizes, pieces,
                    renamed, DataStatesConfig())
    for name in sizes:
        assert (tmp_path / "durable" / renamed[name]).read_bytes() == (tmp_path / "local" / name).read_bytes()
    assert _drain_readers_alive() == []


@pytest.mark.parametrize("where", ["first", "last"])
def test_drain_names_the_damaged_piece_and_stops_its_reader(tmp_path, monkeypatch, where):
    from dcp_datastates.errors import ChecksumMismatchError
    from dcp_datastates.storage import open_storage

    monkeypatch.setattr(file_copy, "_COPY_BLOCK", 4096)
    sizes, pieces = _files_with_pieces(str(tmp_path / "local"), [40_000, 40_000], 1000)
    os.makedirs(tmp_path / "durable")
    off, length, _crc, item = pieces["f1.bin"][0 if where == "first" else -1]
    with open(tmp_path / "local" / "f1.bin", "r+b") as f:
        f.seek(off + length - 1)
        b = f.read(1)
        f.seek(off + length - 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumMismatchError, match=rf"f1.bin: checksum mismatch in item '{item}', bytes \[{off}, {off + length}\)"):
        file_copy._copy_all(open_storage(str(tmp_path / "local")), open_storage(str(tmp_path / "durable")), sizes, pieces,
                        {n: n for n in sizes}, DataStatesConfig())
    assert _drain_readers_alive() == []


def test_a_failing_durable_write_stops_the_read_ahead(tmp_path, monkeypatch):
    from dcp_datastates.storage import open_storage

    monkeypatch.setattr(file_copy, "_COPY_BLOCK", 2048)
    sizes, pieces = _files_with_pieces(str(tmp_path / "local"), [100_000], 500)

    class Full:
        def __init__(self):
            self.writes = 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                raise OSError(28, "No space left on device")
            return len(data)

    out = Full()
    with pytest.raises(OSError, match="No space left"):
        file_copy.copy_verified(open_storage(str(tmp_path / "local")), "f0.bin", out, sizes["f0.bin"], pieces["f0.bin"],
                         file_copy.get_engine(DataStatesConfig()))
    assert out.writes == 3 and _drain_readers_alive() == []


def test_drain_blocks_cover_the_file_in_order_and_never_split_a_piece(monkeypatch):
    monkeypatch.setattr(file_copy, "_COPY_BLOCK", 100)
    pieces = [(10, 30, 0, "a"), (40, 70, 0, "b"), (110, 250, 0, "big"), (400, 5, 0, "c")]
    blocks = file_copy._blocks(620, pieces)
    assert [(o, n) for o, n, _ in blocks] == [(0, 40), (40, 70), (110, 250), (360, 100), (460, 100), (560, 60)]
    assert [[p[3] for p in inside] for _, _, inside in blocks] == [["a"], ["b"], ["big"], ["c"], [], []]
    assert file_copy._blocks(0, []) == []
    # a piece past the recorded size: the block reaches it, so the read fails as truncated
    assert [(o, n) for o, n, _ in file_copy._blocks(20, [(10, 30, 0, "a")])] == [(0, 40)]


# ------------------------------------------------------------ drained while the files are written
def _recording(writes: list):
    """file_copy._write_durable, recording (durable name, made while the file was written, i.e. by a
    file_copy.Follower) into ``writes``."""
    real = file_copy._write_durable

    def recording(local, name, durable, durable_name, *args):
        writes.append((durable_name, len(args) > 4 and args[4] is not None))
        return real(local, name, durable, durable_name, *args)

    return recording


@contextlib.contextmanager
def durable_writes():
    """The drain's durable file writes made in the block (``_recording``)."""
    writes: list = []
    with mock.patch.object(file_copy, "_write_durable", _recording(writes)):
        yield writes


def _durable_writes(monkeypatch) -> list:
    """The drain's durable file writes made in the rest of the test (``_recording``)."""
    writes: list = []
    monkeypatch.setattr(file_copy, "_write_durable", _recording(writes))
    return writes


def _big_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1024, generator=g), "v": torch.randn(64, 1024, generator=g), "step": seed}


@pytest.mark.parametrize("durable_folder", ["empty", "holding a commit"])
def test_files_are_copied_to_the_durable_tier_while_the_engine_writes_them(tmp_path, monkeypatch, small_engine,
                                                                           durable_folder):
    """The local flushes stall after 256 KiB (one copy and one flush worker: chunks in file order;
    64 KiB chunks): the durable copy
    of the file already holds exactly the bytes written so far, never more (the copy follows the
    engine's written prefix). Released, the save commits on both tiers, the durable file is that
    copy (the drain copies nothing again) and loads back bitwise, from the durable tier alone."""
    from dcp_datastates.runtime import get_engine

    durable, nv = tmp_path / "durable" / "step-1", tmp_path / "nv"
    # Through the cache (staged while the writes stall) even with tmp_path on tmpfs: a direct
    # write is staged only once written, so the copier would start after the file is complete.
    opts = dict(chunk_size=64 << 10, copy_threads=1, flush_threads=1, host_cache_size=4 << 20, direct_writes=False)
    if durable_folder == "holding a commit":
        save(_big_state(0), durable, nv, **opts)  # the new files get tagged names next to it
    writes = _durable_writes(monkeypatch)
    monkeypatch.setattr(file_copy, "_COPY_BLOCK", 64 << 10)  # blocks of one chunk (16 MiB: this file at once)
    state = _big_state(1)
    w = DataStatesWriter(durable, local_tier=str(nv), **opts)
    engine_of = get_engine(w.config)
    engine_of.set_fault("stall", 256 << 10, str(nv))
    try:
        resp = dcp.async_save(state, storage_writer=w)
        deadline = time.monotonic() + 20
        while not writes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writes and writes[0][1], writes  # started by the follower, before the local commit
        copied = durable / writes[0][0]
        deadline = time.monotonic() + 30
        while (not copied.exists() or copied.stat().st_size == 0) and time.monotonic() < deadline:
            time.sleep(0.01)  # the follower copies what the engine wrote so far
        time.sleep(0.2)  # (and would go on, were it not held to the written prefix)
        from dcp_datastates.runtime import inflight

        progress = [(f.name, f.job.written_prefix, f.job.error())
                    for s in inflight.inflight() for f in s.files]
        assert 0 < copied.stat().st_size <= (256 << 10) + 4096, progress  # the header and 4 chunks at most
        assert not w.local_commit.done()
    finally:
        engine_of.set_fault("none", 0, "")
    resp.upload_completion.result(timeout=60)
    assert commit.is_committed(str(durable))
    assert all(made_while_written for _, made_while_written in writes), writes  # no second copy
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(str(durable)))
    assert_state_equal(state, out)


def test_a_copy_made_while_written_whose_checksums_differ_is_made_again(tmp_path, monkeypatch, small_engine, caplog):
    """The copy made while the file was written reads other bytes than the save checksummed
    (here: its CRC32Cs are off by one): the drain warns, copies the file again from the local
    copy, verified, and commits that; nothing wrong reaches the durable commit."""
    real_get_engine = file_copy.get_engine

    class OffByOne:
        def __init__(self, engine):
            self._engine = engine

        def crc32c_ranges(self, ptr, ranges):
            return [(c + 1) & 0xFFFFFFFF for c in self._engine.crc32c_ranges(ptr, ranges)]

        def __getattr__(self, name):
            return getattr(self._engine, name)

    monkeypatch.setattr(file_copy, "get_engine", lambda config: OffByOne(real_get_engine(config)))
    writes = _durable_writes(monkeypatch)
    durable, nv = tmp_path / "durable" / "step-1", tmp_path / "nv"
    state = _big_state(2)
    with caplog.at_level(logging.WARNING, logger="dcp_datastates"):
        save(state, durable, nv, chunk_size=64 << 10)
    assert "does not match its recorded crc32c; copying the file again" in caplog.text
    assert [m for _, m in writes] == [True, False]  # the follower's copy, then the drain's
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(str(durable)))
    assert_state_equal(state, out)


def test_a_durable_tier_that_cannot_be_reached_while_writing_never_fails_the_local_save(tmp_path, monkeypatch):
    """Starting the copies made while the files are written fails (the durable store unreachable
    at that moment): the local save commits all the same, and the drain copies every file after
    the local commit, verified."""
    writes = _durable_writes(monkeypatch)

    def unreachable(*args, **kwargs):
        raise OSError(113, "No route to host", "durable")

    monkeypatch.setattr(file_copy, "follow", unreachable)
    durable, nv = tmp_path / "durable" / "step-1", tmp_path / "nv"
    state = make_state(5)
    w = save(state, durable, nv)
    assert w.local_commit.result(timeout=0) == tiers.local_copy(str(nv), str(durable))
    assert writes and not any(while_written for _, while_written in writes), writes
    assert_state_equal(state, load(durable, nv, state))
    assert commit.is_committed(str(durable))


def test_durable_local_files_start_their_writeback_as_they_are_written(tmp_path, monkeypatch):
    """A local folder's file written by the drain (create with sync) starts each 8 MiB of it on
    its way to the disk as it goes, like the engine's own files, so the final fsync finds little
    left; the bytes are the ones written."""
    from dcp_datastates.channel import channel_for
    from dcp_datastates.channel import local as local_channel
    from dcp_datastates.storage import open_storage

    started, real = [], local_channel.engine_module()

    class Recording:
        def start_writeback(self, fd, offset, nbytes):
            started.append((offset, nbytes))
            real.start_writeback(fd, offset, nbytes)

    monkeypatch.setattr(local_channel, "engine_module", lambda: Recording())
    data = os.urandom(20 << 20)
    with channel_for(open_storage(str(tmp_path))).create_streamed("f.bin", sync=True) as out:
        for k in range(0, len(data), 3 << 20):
            out.write(data[k: k + (3 << 20)])
    assert (tmp_path / "f.bin").read_bytes() == data
    assert started == [(0, 9 << 20), (9 << 20, 9 << 20)]  # every 8 MiB or more, in order, no gap
    with channel_for(open_storage(str(tmp_path))).create_streamed("g.bin", sync=False) as out:  # not durable: no hint
        out.write(data)
    assert len(started) == 2
    with pytest.raises(ValueError, match="must be >= 0"):
        real.start_writeback(-1, 0, 1)


class _PlanningWaitsFor(DefaultSavePlanner):
    """DCP's default planner whose local plan first waits (up to 30 s) for ``ready()``; ``seen``:
    whether it held when DCP planned."""

    def __init__(self, ready) -> None:
        super().__init__()
        self._ready, self.seen = ready, None

    def create_local_plan(self):
        deadline = time.monotonic() + 30
        while not self._ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.seen = self._ready()
        return super().create_local_plan()


def _durable_copies_whole(durable, nv) -> bool:
    """Every data file of the local copy of ``durable`` has a durable copy of its size (the
    durable folder was empty: the same names)."""
    local = tiers.local_copy(str(nv), str(durable))
    names = [n for n in os.listdir(local) if n.endswith(".safetensors")] if os.path.isdir(local) else []
    return bool(names) and all((durable / n).is_file() and (durable / n).stat().st_size == os.path.getsize(
        os.path.join(local, n)) for n in names)


@pytest.mark.parametrize("start", ["first chunk", "end of staging"])
def test_one_process_copies_its_files_to_the_durable_tier_before_dcp_plans(tmp_path, monkeypatch, start):
    """One process with a local tier: the durable folder is prepared at the request and each
    data file is copied to it while it is written, from the first chunk (cores to spare) or
    from the end of staging, not from DCP's planning on (DCP plans only once staging ended).
    Here DCP's planning waits until the durable copies are whole: they are, before it plans.
    The save commits that copy (the drain copies nothing again) and loads back bitwise from the
    durable tier alone."""
    monkeypatch.setattr(layered, "_cores_to_spare", lambda config: start == "first chunk")
    writes = _durable_writes(monkeypatch)
    durable, nv = tmp_path / "durable" / "step-1", tmp_path / "nv"
    state = _big_state(3)
    planner = _PlanningWaitsFor(lambda: _durable_copies_whole(durable, nv))
    w = DataStatesWriter(str(durable), local_tier=str(nv))
    dcp.async_save(state, storage_writer=w, planner=planner).upload_completion.result(timeout=60)
    assert planner.seen is True
    assert writes and all(made_while_written for _, made_while_written in writes), writes  # no second copy
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(str(durable)))
    assert_state_equal(state, out)


def test_copies_started_for_a_folder_dcp_then_renames_are_cancelled_and_removed(tmp_path, monkeypatch):
    """A writer made for one path saves under another checkpoint_id (DCP's reset names it after
    staging): the copies the request started toward the first path's durable folder stop and
    their files are removed; the checkpoint is committed, drained and loadable at the new path."""
    monkeypatch.setattr(layered, "_cores_to_spare", lambda config: True)
    first, other, nv = tmp_path / "durable" / "step-1", tmp_path / "durable" / "step-2", tmp_path / "nv"
    state = _big_state(4)
    w = DataStatesWriter(str(first), local_tier=str(nv))
    dcp.async_save(state, storage_writer=w, checkpoint_id=str(other)).upload_completion.result(timeout=60)
    assert commit.is_committed(str(other)) and not commit.is_committed(str(first))
    deadline = time.monotonic() + 10
    while first.is_dir() and any(first.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)  # (a cancelled copy stops before its next block)
    assert not first.is_dir() or not any(first.iterdir()), sorted(first.iterdir())
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(str(other)))
    assert_state_equal(state, out)


def test_a_save_with_a_local_tier_decodes_no_marker_it_wrote(tmp_path, monkeypatch):
    """The drain, drain_pending and eviction ask for the checkpoint ids of the local copies and
    their durable folders at every save; the markers this process wrote are known without a
    decode (75 ms for 1,612 items), and a marker is decoded at most once per content."""
    import dcp_datastates.commit.reading as reading

    decoded = []
    real = reading.decode_metadata
    monkeypatch.setattr(reading, "decode_metadata", lambda raw, where: decoded.append(where) or real(raw, where))
    nv = tmp_path / "nv"
    for step in range(3):
        save(make_state(step), str(tmp_path / "durable" / f"step-{step}"), nv, keep_local=1)
    assert decoded == []
    assert sorted(os.listdir(nv)) and len([n for n in os.listdir(nv) if n.startswith("step-")]) <= 1


def test_checkpoint_id_reads_a_marker_changed_in_place_again(tmp_path):
    """The ids kept per marker are keyed by its bytes: a marker rewritten in place, same size and
    folder, gives the id it holds now (not the one seen before)."""
    folder = tmp_path / "ck"
    dcp.save(make_state(1), storage_writer=DataStatesWriter(str(folder)))
    before = commit.checkpoint_id(str(folder))
    marker = folder / ".metadata"
    raw = marker.read_bytes()
    assert before and raw.count(before.encode()) == 1
    changed = before[:-1] + ("0" if before[-1] != "0" else "1")
    marker.write_bytes(raw.replace(before.encode(), changed.encode()))
    assert len(marker.read_bytes()) == len(raw)
    assert commit.checkpoint_id(str(folder)) in (changed, None)


class _UnstagedJob:
    """An engine job whose ``size`` bytes are written but which is staged only once ``staged`` is set."""

    def __init__(self, size: int) -> None:
        self.size, self.staged = size, threading.Event()

    def wait_staged(self, timeout):
        return self.staged.wait(timeout)

    def wait_written(self, end, timeout):
        return self.size

    def error(self):
        return ""

    def is_done(self):
        return self.staged.is_set()


@pytest.mark.parametrize("from_staged", [True, False])
def test_a_copy_from_the_end_of_staging_reads_nothing_before(tmp_path, from_staged):
    """``from_staged``: the follower's first read waits until the engine's job is staged (the
    bytes are written already: only the wait holds it); without, it copies what is written."""
    from dcp_datastates.storage import open_storage

    (tmp_path / "local").mkdir()
    (tmp_path / "durable").mkdir()
    data = os.urandom(300_000)
    (tmp_path / "local" / "f").write_bytes(data)
    job = _UnstagedJob(len(data))
    follower = file_copy.Follower(open_storage(str(tmp_path / "local")), "f", job, len(data), {},
                              open_storage(str(tmp_path / "durable")), "f", DataStatesConfig(), from_staged)
    copy = tmp_path / "durable" / "f"
    deadline = time.monotonic() + (0.5 if from_staged else 10)
    while not (copy.is_file() and copy.stat().st_size == len(data)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (copy.is_file() and copy.stat().st_size == len(data)) is not from_staged
    job.staged.set()
    assert follower.delivered("f", len(data), [])
    assert copy.read_bytes() == data


def test_copies_that_cannot_start_at_the_request_never_fail_the_save(tmp_path, monkeypatch):
    """The tier's thread refuses work (the interpreter shutting down): the save is not failed for
    it; the files are drained after the local commit, and both tiers hold the checkpoint."""

    class Refusing:
        def submit(self, *args, **kwargs):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(layered, "_early", Refusing())
    writes = _durable_writes(monkeypatch)
    durable, nv = tmp_path / "durable" / "step-1", tmp_path / "nv"
    state = _big_state(5)
    w = save(state, str(durable), nv)
    assert w.local_commit.result(timeout=0) == tiers.local_copy(str(nv), str(durable))
    assert writes, writes
    assert commit.is_committed(str(durable))
    assert_state_equal(state, load(durable, nv, state))
