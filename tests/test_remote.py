"""Remote checkpoints through fsspec: ``memory://`` (no server) and a real S3 API (a moto server
on 127.0.0.1, s3fs as the client): save (dcp.save, dcp.async_save), load, resharding loads from a
2-rank save, missing and short objects, an upload cut off mid-save (no commit marker), commit
helpers on URLs, and the engine's streaming path underneath."""

from __future__ import annotations

import os
import re
import socket
import time
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, commit
from dcp_datastates.channel import objectstore as object_channel
from dcp_datastates.errors import IncompleteCheckpointError
from dcp_datastates.runtime import engine_stats
from dcp_datastates.storage import ObjectStorage

from conftest import assert_state_equal, raises_through_dcp, zeros_like_state
from s3_util import CutProxy as _CutProxy
from s3_util import s3_options as _options

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20


def make_state(big: int = 0) -> dict:
    g = torch.Generator().manual_seed(1)
    state = {
        "w": torch.randn(64, 33, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "nested": {"i": torch.arange(100, dtype=torch.int32).reshape(10, 10), "empty": torch.empty(0, 3)},
        "flag": torch.tensor([True, False, True]),
        "step": 12,
        "note": {"lr": 0.5, "tags": ["a", "b"]},
    }
    if big:
        state["big"] = torch.randn(big // 4, generator=g)
    return state


def save_load(url: str, state: dict, *, asynchronous: bool = False, **options) -> dict:
    writer = DataStatesWriter(url, **options)
    if asynchronous:
        resp = dcp.async_save(state, storage_writer=writer)
        resp.upload_completion.result(timeout=120)
    else:
        dcp.save(state, storage_writer=writer)
    return load_only(url, state, **options)


def load_only(url: str, state: dict, **options) -> dict:
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(url, **options))
    return out


# ------------------------------------------------------------------------------------ memory://
@pytest.fixture
def mem_url():
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://dcpds-{uuid.uuid4().hex[:8]}/ckpt"
    yield url
    fs = fsspec.filesystem("memory")
    try:
        fs.rm(url.split("://", 1)[1].split("/")[0], recursive=True)
    except FileNotFoundError:
        pass


def test_memory_save_and_load_round_trip(mem_url):
    state = make_state(big=3 * MiB)
    out = save_load(mem_url, state)
    assert_state_equal(state, out)
    folder = ObjectStorage(mem_url)
    names = sorted(folder.sizes())
    assert names == [".metadata", "__0_0.safetensors"]
    # The object is a valid safetensors file.
    from safetensors.torch import load as st_load

    tensors = st_load(folder.fs.cat_file(folder.fs_path("__0_0.safetensors")))
    assert torch.equal(tensors["w"], state["w"]) and torch.equal(tensors["nested.i"], state["nested"]["i"])
    commit.check_commit(mem_url)
    assert commit.is_committed(mem_url) and commit.is_committed(mem_url, check_files=True)


def test_memory_async_save_resave_and_overwrite_false(mem_url):
    state = make_state(big=MiB)
    out = save_load(mem_url, state, asynchronous=True)
    assert_state_equal(state, out)
    state["w"].add_(1)
    out = save_load(mem_url, state, asynchronous=True)  # re-save into the same folder
    assert_state_equal(state, out)
    with raises_through_dcp("Checkpoint already exists and overwrite=False: .* already holds a committed checkpoint"):
        dcp.save(state, storage_writer=DataStatesWriter(mem_url, overwrite=False))


def test_memory_missing_short_and_uncommitted(mem_url):
    state = make_state()
    save_load(mem_url, state)
    folder = ObjectStorage(mem_url)
    data = folder.fs_path("__0_0.safetensors")
    raw = folder.fs.cat_file(data)
    folder.fs.pipe_file(data, raw[:-10])
    with raises_through_dcp(r"__0_0\.safetensors is \d+ bytes, the metadata expects \d+ \(truncated\)"):
        dcp.load(zeros_like_state(state), storage_reader=DataStatesReader(mem_url))
    folder.fs.rm_file(data)
    with raises_through_dcp(r"incomplete checkpoint memory://.*data file __0_0\.safetensors is missing"):
        dcp.load(zeros_like_state(state), storage_reader=DataStatesReader(mem_url))
    assert not commit.is_committed(mem_url, check_files=True)
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        commit.check_commit(mem_url)
    folder.fs.rm_file(folder.fs_path(".metadata"))
    folder.fs.pipe_file(data, raw)
    with raises_through_dcp("incomplete checkpoint memory://.*no .metadata commit marker"):
        dcp.load(zeros_like_state(state), storage_reader=DataStatesReader(mem_url))
    with raises_through_dcp("no checkpoint at memory://.*nothing is stored there"):
        dcp.load(zeros_like_state(state), storage_reader=DataStatesReader(mem_url + "-absent"))


def test_memory_checksum_mismatch_is_detected(mem_url):
    state = make_state()
    save_load(mem_url, state)
    folder = ObjectStorage(mem_url)
    path = folder.fs_path("__0_0.safetensors")
    raw = bytearray(folder.fs.cat_file(path))
    raw[-5] ^= 0xFF  # inside the last item's bytes
    folder.fs.pipe_file(path, bytes(raw))
    with raises_through_dcp("checksum mismatch"):
        dcp.load(zeros_like_state(state), storage_reader=DataStatesReader(mem_url))


def test_memory_latest_checkpoint_and_url_forms(mem_url, tmp_path):
    state = make_state()
    for step in (5, 20, 10):
        dcp.save(state, storage_writer=DataStatesWriter(f"{mem_url}/step-{step}/"))  # trailing slash
    folder = ObjectStorage(f"{mem_url}/step-20")
    folder.fs.rm_file(folder.fs_path(".metadata"))
    assert commit.latest_checkpoint(mem_url) == f"{mem_url}/step-10"
    # Every URL form is accepted; file:// is the local path.
    for url in ("s3://b/x", "gs://b/x", "az://c/x", "memory://x", "file:///tmp/x", "/tmp/x", "rel/x"):
        assert DataStatesWriter.validate_checkpoint_id(url) and DataStatesReader.validate_checkpoint_id(url)
    assert not DataStatesWriter.validate_checkpoint_id("nosuchproto://x/y")
    local = tmp_path / "local"
    w = DataStatesWriter(f"file://{local}")
    assert w.path == str(local)
    dcp.save(state, storage_writer=w)
    assert (local / ".metadata").is_file()
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(f"file://{local}"))
    assert_state_equal(state, out)


def test_memory_upload_error_surfaces_from_upload_completion(mem_url, monkeypatch):
    """A store that fails mid-object: the error names the URL and the cause, nothing is committed,
    the partial object is removed and the cache is whole again."""
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFile

    calls = {"n": 0}
    real_write = MemoryFile.write

    def failing_write(self, data):
        if getattr(self, "path", "").endswith(".safetensors"):
            calls["n"] += 1
            if calls["n"] >= 2:  # the header went through, then the store fails
                raise OSError(28, "No space left on the store")
        return real_write(self, data)

    state = make_state(big=2 * MiB)
    save_load(mem_url, state)
    monkeypatch.setattr(MemoryFile, "write", failing_write)
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(mem_url))
    with raises_through_dcp(r"upload of memory://.*/__0_0\.[0-9a-f]{12}\.safetensors failed: OSError: .*No space left on the store"):
        resp.upload_completion.result(timeout=60)
    monkeypatch.undo()
    folder = ObjectStorage(mem_url)
    assert sorted(folder.sizes()) == [".metadata", "__0_0.safetensors"]  # the old commit; the partial object was deleted
    assert_state_equal(state, load_only(mem_url, state))  # the previous checkpoint still loads
    st = engine_stats()
    assert st["slots_free"] == st["slots_total"]
    fsspec.filesystem("memory")  # the store still works
    assert_state_equal(state, save_load(mem_url, state))


def test_read_requests_split_merge_and_cover_every_range():
    ranges = [(1000, 0, 10), (2000, 10, 5), (3000, 100, 50), (40_000, 10_000, 25_000)]
    reqs = object_channel._requests(ranges, request=8192, gap=64)
    assert reqs[0][:2] == (0, 15) and reqs[1][:2] == (100, 150)  # adjacent merged; gap 85 > 64 not
    assert len(reqs) == 2 + 4  # 25,000 bytes in requests of at most 8 KiB
    got = {}
    for start, end, parts in reqs:
        assert end - start <= 8192
        for dst, off, n in parts:
            assert start <= off and off + n <= end
            got[dst] = (off, n)
    # Every byte of every range lands once, at the right destination.
    for dst, off, n in ranges:
        pieces = sorted((d, o, k) for d, (o, k) in got.items() if dst <= d < dst + n)
        assert sum(k for _, _, k in pieces) == n
        assert all(d - dst == o - off for d, o, _ in pieces)


# ------------------------------------------------------------------------------------ S3 (moto)
def test_s3_save_async_save_and_load(s3):
    url = f"s3://{s3.bucket()}/run/step-1"
    state = make_state(big=5 * MiB)
    assert_state_equal(state, save_load(url, state, storage_options=s3.options))
    state["w"].mul_(2)
    assert_state_equal(state, save_load(url, state, asynchronous=True, storage_options=s3.options))
    bucket, key = url[5:].split("/", 1)
    listing = sorted(p.rsplit("/", 1)[1] for p in s3.fs.ls(f"{bucket}/{key}", refresh=True))
    assert len(listing) == 2 and listing[0] == ".metadata", listing  # the first save's object is gone
    assert re.fullmatch(r"__0_0\.[0-9a-f]{12}\.safetensors", listing[1]), listing
    assert commit.is_committed(url, check_files=True, storage_options=s3.options)
    assert commit.latest_checkpoint(f"s3://{bucket}/run", storage_options=s3.options) == url


def test_s3_fsspec_config_from_environment(s3, monkeypatch):
    """No storage_options: fsspec's own configuration (FSSPEC_S3_* variables, read into
    fsspec.config.conf) reaches s3fs."""
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", dict(s3.options))
    url = f"s3://{s3.bucket()}/env"
    state = make_state()
    assert_state_equal(state, save_load(url, state))


def test_s3_missing_object_names_it(s3):
    url = f"s3://{s3.bucket()}/ck"
    state = make_state()
    save_load(url, state, storage_options=s3.options)
    s3.fs.rm_file(f"{url[5:]}/__0_0.safetensors")
    with raises_through_dcp(r"incomplete checkpoint s3://.*/ck: data file __0_0\.safetensors is missing \(s3://.*/ck/__0_0\.safetensors"):
        dcp.load(zeros_like_state(state), storage_reader=DataStatesReader(url, storage_options=s3.options))


def test_s3_server_gone_mid_upload_fails_the_save_without_commit(s3, monkeypatch):
    bucket = s3.bucket()
    url = f"s3://{bucket}/victim"
    proxy = _CutProxy(int(s3.endpoint.rsplit(":", 1)[1]))
    options = dict(_options(proxy.endpoint), config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5})
    monkeypatch.setattr(object_channel, "UPLOAD_BLOCK_SIZE", 5 * MiB)
    state = make_state(big=24 * MiB)
    assert_state_equal(state, save_load(url, state, storage_options=options))  # a committed checkpoint first
    assert commit.is_committed(url, storage_options=s3.options)

    proxy.arm(8 * MiB)  # the server goes away after ~8 MiB of the next upload
    t0 = time.monotonic()
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(url, storage_options=options))
    with raises_through_dcp(r"upload of s3://.*/victim/__0_0\.[0-9a-f]{12}\.safetensors failed: .*"):
        resp.upload_completion.result(timeout=60)
    assert proxy.dead.is_set()
    assert time.monotonic() - t0 < 30
    # Seen from the real server: the previous commit is intact and still loads exactly.
    assert commit.is_committed(url, check_files=True, storage_options=s3.options)
    assert_state_equal(state, load_only(url, state, storage_options=s3.options))
    st = engine_stats()
    assert st["slots_free"] == st["slots_total"]
    # Everything works again through a live endpoint.
    assert_state_equal(state, save_load(url, state, storage_options=s3.options))


def test_s3_dcp_save_with_unreachable_endpoint_raises_clearly():
    pytest.importorskip("s3fs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    options = dict(_options(f"http://127.0.0.1:{port}"), config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})
    with raises_through_dcp(r"s3://nobucket/x"):
        dcp.save(make_state(), storage_writer=DataStatesWriter("s3://nobucket/x", storage_options=options))


# ------------------------------------------------------------------------- 2 ranks (resharding)
def _two_rank_save_and_reshard(rank: int, world: int, url: str, options: dict) -> None:
    import multirank_workers as W

    state = W.sharded_state(world, "save")
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(url, storage_options=options))
    resp.upload_completion.result(timeout=120)
    # Load with every tensor sharded on the other dim: each rank reads sub-boxes of the objects.
    target = W.zero_like_sharded(W.sharded_state(world, "swap"))
    dcp.load(target, storage_reader=DataStatesReader(url, storage_options=options))
    W.check_against_full(target)


def test_s3_two_rank_save_loads_resharded_and_at_one_rank(s3):
    import multirank_workers as W
    from dist_harness import run_ranks

    url = f"s3://{s3.bucket()}/dist"
    run_ranks(2, _two_rank_save_and_reshard, url, s3.options, timeout=120)
    listing = sorted(p.rsplit("/", 1)[1] for p in s3.fs.ls(url[5:], refresh=True))
    assert listing[0] == ".metadata" and {"__0_0.safetensors", "__1_0.safetensors"} <= set(listing), listing
    assert all(re.fullmatch(r"__[01]_\d\.safetensors", n) for n in listing[1:]), listing
    full = W.full_tensors(0)
    names = ("row", "col", "rep", "uneven", "mesh2d", "big", "plain")
    state = {k: torch.zeros_like(full[k]) for k in names}
    state["nested"] = {"plain_half": torch.zeros(4, 4, dtype=torch.half), "step": None, "note": None}
    dcp.load(state, storage_reader=DataStatesReader(url, storage_options=s3.options))
    for k in names:
        assert torch.equal(state[k], full[k]), k
    assert state["nested"]["step"] == 17 and state["nested"]["note"] == "hello"


def test_oversized_remote_marker_is_refused_before_reading(mem_url, monkeypatch):
    from dcp_datastates.errors import CheckpointFormatError

    state = make_state(big=64 * 1024)
    save_load(mem_url, state)
    monkeypatch.setattr(commit.reading, "MAX_METADATA_BYTES", 16)
    with pytest.raises(CheckpointFormatError, match=r"\.metadata: \d+ bytes, more than the 16-byte limit"):
        commit.read_commit(mem_url)


def test_one_writer_saves_to_a_local_folder_then_to_a_store(tmp_path, mem_url):
    """A writer given its folder per save (checkpoint_id), first local then an fsspec URL: the
    second save is staged into the first folder and its files move to the store when DCP names it."""
    state = make_state()
    w = DataStatesWriter()
    for url in (str(tmp_path / "local-ck"), mem_url, str(tmp_path / "local-again")):
        dcp.async_save(state, storage_writer=w, checkpoint_id=url).upload_completion.result(timeout=60)
        assert_state_equal(state, load_only(url, state))
    assert sorted(os.listdir(tmp_path / "local-ck")) == [".metadata", "__0_0.safetensors"]
