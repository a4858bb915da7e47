"""The commit protocol: a resave keeps the old checkpoint until its own commit, atomic marker,
failures while committing, stale temporaries, and latest_checkpoint over step-N layouts."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_datastates.save.request as request_mod
import dcp_datastates.save.write as write_mod
from dcp_datastates import DataStatesReader, DataStatesWriter, commit, latest_checkpoint
from dcp_datastates.errors import CheckpointFormatError, IncompleteCheckpointError
from dcp_datastates.runtime import current_engine
from dcp_datastates.storage import local as local_storage

from conftest import raises_through_dcp

CACHE, CHUNK = 1 << 20, 64 << 10


def state_of(value: float, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(int(value * 1000))
    return {f"t{i}": torch.randn(64 * 1024, generator=g) + value for i in range(n)} | {"step": value}


def load(folder) -> dict:
    dest = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state_of(0).items()}
    dcp.load(dest, storage_reader=DataStatesReader(folder))
    return dest


def assert_holds(folder, value: float) -> None:
    got, want = load(folder), state_of(value)
    assert got["step"] == value
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert torch.equal(got[k], want[k]), k


def save(folder, value: float, api: str, **options) -> None:
    w = DataStatesWriter(folder, host_cache_size=CACHE, chunk_size=CHUNK, **options)
    if api == "sync":
        dcp.save(state_of(value), storage_writer=w)
    else:
        dcp.async_save(state_of(value), storage_writer=w).upload_completion.result(timeout=120)


class _SpyEngine:
    """Delegates to the real engine; records whether the old marker still existed each time
    a data file was named to the engine (the first moment a data byte may change): at submit,
    or, for a job the request started unnamed, when the save names its file."""

    def __init__(self, real, marker: str, seen: list):
        self._real, self._marker, self._seen = real, marker, seen

    def _record(self, path) -> None:
        self._seen.append((os.path.basename(path), os.path.exists(self._marker), os.path.exists(path)))

    def submit_write(self, path, *args, named=True, **kwargs):
        if named:
            self._record(path)  # before the engine may create it
            return self._real.submit_write(path, *args, named=named, **kwargs)
        return _SpyJob(self._real.submit_write(path, *args, named=named, **kwargs), self._record)

    def __getattr__(self, name):
        return getattr(self._real, name)


class _SpyJob:
    def __init__(self, real, record):
        self._real, self._record_it = real, record

    def set_destination(self, path):
        self._record_it(path)
        return self._real.set_destination(path)

    def __getattr__(self, name):
        return getattr(self._real, name)


def data_files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


@pytest.mark.parametrize("api", ["sync", "async"])
def test_resave_keeps_the_old_checkpoint_until_the_new_commit(tmp_path, api, small_engine, monkeypatch):
    folder = tmp_path / "step-1"
    save(folder, 1.0, api)
    assert data_files(folder) == ["__0_0.safetensors"]
    old_bytes = (folder / "__0_0.safetensors").read_bytes()
    marker = str(folder / ".metadata")
    seen: list = []
    real_get_engine = request_mod.get_engine
    for step in (request_mod, write_mod):  # the request (async_save) and the write (dcp.save) submit files
        monkeypatch.setattr(step, "get_engine", lambda cfg: _SpyEngine(real_get_engine(cfg), marker, seen))
    save(folder, 2.0, api)
    # the new data went to a new name while the old commit (and its file) stayed in place
    assert len(seen) == 1 and seen[0][1] is True and seen[0][2] is False
    assert re.fullmatch(r"__0_0\.[0-9a-f]{12}\.safetensors", seen[0][0]), seen
    assert (folder / "__0_0.safetensors").exists() is False  # removed only after the new commit
    assert data_files(folder) == [seen[0][0]]
    assert old_bytes != (folder / seen[0][0]).read_bytes()
    assert_holds(folder, 2.0)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_failed_resave_keeps_the_old_checkpoint_loadable(tmp_path, api, small_engine):
    folder = tmp_path / "step-5"
    save(folder, 5.0, api)
    old_marker = (folder / ".metadata").read_bytes()
    old_bytes = (folder / "__0_0.safetensors").read_bytes()
    eng = current_engine()
    # Fail after ~half the data of the second save reached its file.
    eng.set_fault("eio", 768 << 10, str(folder))
    with raises_through_dcp(rf"{folder}/__0_0\.[0-9a-f]{{12}}\.safetensors: pwrite of \d+ bytes at offset \d+ failed: Input/output error"):
        save(folder, 6.0, api)
    eng.set_fault("none", 0, "")
    assert (folder / ".metadata").read_bytes() == old_marker
    assert (folder / "__0_0.safetensors").read_bytes() == old_bytes
    assert not [n for n in os.listdir(folder) if n.startswith(".metadata.tmp")]
    assert_holds(folder, 5.0)  # exactly the old checkpoint
    assert latest_checkpoint(tmp_path) == str(folder)
    save(folder, 7.0, api)  # the fault is gone: the next save succeeds and cleans the leftovers
    assert_holds(folder, 7.0)
    assert len(data_files(folder)) == 1


@pytest.mark.parametrize(
    "where,err,cause",
    [("fsync", errno.EIO, "Input/output error"), ("replace", errno.ENOSPC, "No space left on device")],
)
def test_commit_failure_raises_with_path_and_keeps_the_old_commit(tmp_path, small_engine, monkeypatch, where, err, cause):
    folder = tmp_path / "c"
    save(folder, 1.0, "sync")
    real = getattr(local_storage.os, where)

    def failing(*args, **kwargs):
        target = str(args[0]) if where == "replace" else os.readlink(f"/proc/self/fd/{args[0]}")
        if ".metadata.tmp" not in target:  # only the commit's own temporary marker fails
            return real(*args, **kwargs)
        raise OSError(err, os.strerror(err), target if where == "replace" else None)

    monkeypatch.setattr(local_storage.os, where, failing)
    with raises_through_dcp(rf"CheckpointWriteError: committing checkpoint {folder} failed: {cause}"):
        save(folder, 2.0, "sync")
    monkeypatch.setattr(local_storage.os, where, real)
    names = sorted(os.listdir(folder))
    assert names[0] == ".metadata" and "__0_0.safetensors" in names  # the old commit, no temporary
    assert not [n for n in names if n.startswith(".metadata.tmp")]
    assert_holds(folder, 1.0)
    save(folder, 3.0, "async")
    assert_holds(folder, 3.0)
    assert len(data_files(folder)) == 1


def test_first_commit_failure_leaves_no_marker(tmp_path, small_engine, monkeypatch):
    folder = tmp_path / "fresh"
    real = local_storage.os.replace
    monkeypatch.setattr(local_storage.os, "replace", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    with raises_through_dcp("committing checkpoint .* failed: Input/output error"):
        save(folder, 1.0, "sync")
    monkeypatch.setattr(local_storage.os, "replace", real)
    assert not [n for n in os.listdir(folder) if n.startswith(".metadata")]
    with raises_through_dcp("incomplete checkpoint"):
        load(folder)


def test_stale_temporary_marker_is_removed_and_ignored(tmp_path, small_engine):
    folder = tmp_path / "step-3"
    save(folder, 3.0, "sync")
    stale = folder / ".metadata.tmp-999999-deadbeef"
    stale.write_bytes(b'{"truncated')  # what a commit killed before its rename leaves
    assert_holds(folder, 3.0)  # ignored by the reader
    save(folder, 4.0, "async")
    assert not stale.exists()
    assert_holds(folder, 4.0)


def test_marker_is_written_atomically_and_last(tmp_path, small_engine, monkeypatch):
    """When the marker appears, every data file it lists is complete (sizes match) and the
    marker bytes are complete JSON."""
    folder = tmp_path / "c"
    snapshots = []
    real_replace = local_storage.os.replace

    def spy_replace(src, dst, *a, **k):
        files = {n: os.path.getsize(folder / n) for n in os.listdir(folder) if n.endswith(".safetensors")}
        snapshots.append((os.path.basename(str(dst)), os.path.exists(dst), files, open(src, "rb").read()))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(local_storage.os, "replace", spy_replace)
    save(folder, 1.0, "async")
    assert len(snapshots) == 1
    name, existed, files, raw = snapshots[0]
    assert name == ".metadata" and not existed
    doc = json.loads(raw)
    assert {n: f["size"] for n, f in doc["files"].items()} == files
    assert raw == (folder / ".metadata").read_bytes()


def _complete(folder, value: float) -> None:
    save(folder, value, "sync", sync_files=False)


def test_latest_checkpoint_picks_newest_complete(tmp_path, small_engine):
    root = tmp_path / "run"
    assert latest_checkpoint(root) is None  # no root yet
    root.mkdir()
    assert latest_checkpoint(root) is None  # empty root
    for step in (1, 2, 10):
        _complete(root / f"step-{step}", float(step))
    assert latest_checkpoint(root) == str(root / "step-10")  # numeric, not lexical (10 > 2)

    _complete(root / "step-11", 11.0)
    os.unlink(root / "step-11" / ".metadata")  # killed before its commit
    _complete(root / "step-12", 12.0)
    (root / "step-12" / ".metadata").write_bytes(b'{"format": "dcp_datastates", "vers')  # damaged marker
    _complete(root / "step-13", 13.0)
    os.unlink(root / "step-13" / "__0_0.safetensors")  # data file lost
    _complete(root / "step-14", 14.0)
    with open(root / "step-14" / "__0_0.safetensors", "r+b") as f:
        f.truncate(5000)  # data file truncated
    (root / "step-99").write_text("a file, not a folder")
    (root / "notes").mkdir()  # no number: ignored
    _complete(root / "final", 99.0)  # no number: ignored

    assert latest_checkpoint(root) == str(root / "step-10")
    assert latest_checkpoint(str(root)) == str(root / "step-10")
    # marker presence only: the damaged ones count
    assert latest_checkpoint(root, check_files=False) == str(root / "step-14")
    assert_holds(latest_checkpoint(root), 10.0)

    # other spellings of a step folder
    _complete(root / "ckpt_00020", 20.0)
    assert latest_checkpoint(root) == str(root / "ckpt_00020")


def test_check_commit_messages(tmp_path, small_engine):
    folder = tmp_path / "c"
    _complete(folder, 1.0)
    commit.check_commit(folder)
    assert commit.is_committed(folder, check_files=True)
    with open(folder / "__0_0.safetensors", "ab") as f:
        f.write(b"x")
    with pytest.raises(IncompleteCheckpointError, match=r"data file __0_0.safetensors is \d+ bytes, the metadata expects \d+"):
        commit.check_commit(folder)
    assert commit.is_committed(folder) and not commit.is_committed(folder, check_files=True)
    (folder / ".metadata").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointFormatError, match=r"\.metadata: not a dcp_datastates metadata file"):
        commit.check_commit(folder)
    os.unlink(folder / ".metadata")
    with pytest.raises(IncompleteCheckpointError, match=f"incomplete checkpoint {folder}: there is no .metadata"):
        commit.check_commit(folder)


def test_resave_never_writes_into_another_checkpoints_file(tmp_path, small_engine):
    old = tmp_path / "step-100"
    save(old, 100.0, "sync")
    snap = tmp_path / "step-200"
    snap.mkdir()
    for name in os.listdir(old):  # a cheap snapshot: hard links, as `cp -al` makes
        os.link(old / name, snap / name)
    save(snap, 200.0, "sync")
    assert_holds(snap, 200.0)
    assert_holds(old, 100.0)  # the other checkpoint must be untouched


@pytest.mark.parametrize("api", ["sync", "async"])
def test_resave_never_writes_through_a_planted_symlink(tmp_path, small_engine, api):
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"not a checkpoint" * 100)
    folder = tmp_path / "step-1"
    folder.mkdir()
    os.symlink(precious, folder / "__0_0.safetensors")
    save(folder, 1.0, api)
    assert precious.read_bytes() == b"not a checkpoint" * 100
    assert not os.path.islink(folder / "__0_0.safetensors")
    assert_holds(folder, 1.0)


def test_overwrite_false_keeps_the_commit_and_its_bytes(tmp_path, small_engine):
    folder = tmp_path / "c"
    save(folder, 1.0, "sync")
    before = (folder / "__0_0.safetensors").read_bytes()
    with raises_through_dcp("Checkpoint already exists and overwrite=False: .* already holds a committed checkpoint"):
        save(folder, 2.0, "sync", overwrite=False)
    assert (folder / "__0_0.safetensors").read_bytes() == before
    assert_holds(folder, 1.0)


@pytest.mark.parametrize("break_it, message", [
    (lambda locs, a, b: locs.__setitem__(b, locs[b]._replace(offset=locs[a].offset)), r"share bytes"),
    (lambda locs, a, b: locs.__setitem__(a, locs[a]._replace(length=locs[a].length - 4,
                                                                crc32c=locs[a].crc32c)), r"stored length|checksums for"),
    (lambda locs, a, b: locs.__setitem__(a, locs[a]._replace(crc32c=locs[a].crc32c + (7,))),
     r"checksums for \d+ pieces"),
    (lambda locs, a, b: locs.__setitem__(a, locs[a]._replace(piece_size=locs[a].piece_size * 2)),
     r"checksum grid"),
    (lambda locs, a, b: locs.__setitem__(a, locs[a]._replace(offset=locs[a].data_start - 8)),
     r"item 'a'.*starts before the data region"),
    (lambda locs, a, b: locs.__setitem__(a, locs[a]._replace(piece_size=0)),
     r"piece_size must be positive|checksum grid"),
    (lambda locs, a, b: locs.__setitem__(a, locs[a]._replace(crc32c=(1 << 32,) * len(locs[a].crc32c))),
     r"item 'a'.*crc32c must be a list of 32-bit integers"),
    (lambda locs, a, b: locs.pop(a), r"no write result for item 'a'"),
])
@pytest.mark.parametrize("packed", [False, True], ids=["json", "packed"])
def test_the_commit_refuses_locations_the_reader_would_refuse(tmp_path, monkeypatch, break_it, message, packed):
    """The commit no longer decodes the document it just encoded: the same checks run on the
    values (encode_commit), in either codec (version 1, and version 3's packed table). A writer
    bug that would make the checkpoint unreadable is refused before the marker is written, and
    the folder keeps its last good commit."""
    import dcp_datastates.format.metadata as codec
    from dcp_datastates.commit import write_commit
    from dcp_datastates.errors import CheckpointWriteError
    from dcp_datastates.format.metadata import decode_metadata

    monkeypatch.setattr(codec, "PACK_FROM_CHUNKS", 1 if packed else 1 << 40)
    folder = tmp_path / "c"
    state = {"a": torch.randn(5000), "b": torch.randn(5000)}
    dcp.save(state, storage_writer=DataStatesWriter(folder))
    good = (folder / ".metadata").read_bytes()
    md, _ = decode_metadata(good, "test")
    locations = dict(md.storage_data)
    write_commit(str(folder), md, locations, sync=False)  # the values as read back commit as they are
    committed = (folder / ".metadata").read_bytes()
    assert json.loads(committed)["version"] == (3 if packed else 1)
    assert dict(decode_metadata(committed, "again")[0].storage_data) == locations
    a, b = sorted(locations, key=lambda i: i.fqn)
    break_it(locations, a, b)
    with pytest.raises(CheckpointWriteError, match=rf"committing checkpoint {re.escape(str(folder))} refused: .*({message})"):
        write_commit(str(folder), md, locations, sync=False)
    assert (folder / ".metadata").read_bytes() == committed


def test_the_metadata_text_is_the_json_of_its_fields(tmp_path):
    """The commit writes its items as JSON text directly (format.items_codec._encode); the document
    must parse to exactly the fields of each item, names with quotes, backslashes, newlines and
    non-ASCII characters included."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from dcp_datastates.format.metadata import decode_metadata, encode_commit

    names = ['w\u00e9"q\\b\n', "plain", "\u4e2d\u6587"]
    state = {"model": {names[0]: torch.randn(3, 4).requires_grad_(), names[1]: torch.zeros(0),
                       names[2]: torch.randn(2, 2).to(torch.bfloat16)},
             "step": 7, "extra": {"s": "x" * 100}, "i8": torch.arange(10, dtype=torch.int8)}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    md, _ = decode_metadata((tmp_path / "c" / ".metadata").read_bytes(), "test")
    locations = dict(md.storage_data)
    doc = json.loads(encode_commit(md, locations, "test")[0])

    def where(loc):
        return {"file": loc.file, "offset": loc.offset, "length": loc.length, "crc32c": list(loc.crc32c)}

    expected = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            expected[fqn] = {"type": "bytes", **where(locations[MetadataIndex(fqn)])}
            continue
        expected[fqn] = {
            "type": "tensor", "dtype": doc["items"][fqn]["dtype"], "requires_grad": smd.properties.requires_grad,
            "size": list(smd.size),
            "chunks": [{"offsets": list(ch.offsets), "sizes": list(ch.sizes),
                        **where(locations[MetadataIndex(fqn, ch.offsets)])} for ch in smd.chunks]}
    assert doc["items"] == expected
    assert doc["planner_data"] == {k: list(v) for k, v in md.planner_data.items()}
    assert doc["planner_data"][f"model.{names[0]}"] == ["model", names[0]]
    assert {f"model.{n}" for n in names} <= set(doc["items"])
    assert doc["items"][f"model.{names[0]}"]["requires_grad"] is True
    assert {k: (v["dtype"]) for k, v in doc["items"].items() if v["type"] == "tensor"} == {
        f"model.{names[0]}": "float32", "model.plain": "float32", f"model.{names[2]}": "bfloat16", "i8": "int8"}


def test_planner_data_is_written_only_when_it_is_flat_keys_to_paths():
    """DefaultSavePlanner's planner_data (flat key -> path of str and int) is kept as JSON arrays,
    also with subclasses of str and int (the checks' slow path); anything else is dropped."""
    import enum

    from dcp_datastates.format.document import _jsonable_planner_data

    class Name(str, enum.Enum):
        A = "a"

    assert json.loads(json.dumps(_jsonable_planner_data({"m.0.w": ("m", 0, "w"), "s": ["s"]}))) == {
        "m.0.w": ["m", 0, "w"], "s": ["s"]}
    assert json.loads(json.dumps(_jsonable_planner_data({"a": (Name.A, True)}))) == {"a": ["a", True]}
    for bad in ({"a": ("m", 1.5)}, {1: ("m",)}, {"a": "m"}, {"a": ({"x": 1},)}, ["a"], None):
        assert _jsonable_planner_data(bad) is None, bad


def test_files_a_commit_replaces_are_freed_without_delaying_the_save(tmp_path, small_engine, monkeypatch):
    """The replaced checkpoint's data files leave their names at the commit (renamed aside, so
    nothing lists them as data) and are unlinked in the background: a save into the same folder
    completes while that unlink is still held, and the folder is clean once it ends."""
    import threading

    folder = tmp_path / "latest"
    save(folder, 1.0, "sync")
    (folder / ".dcpds-discarded-left-by-a-dead-process").write_bytes(b"x" * 10)
    release, held = threading.Event(), []
    real_unlink = local_storage._unlink_quietly

    def held_unlink(path):
        if os.path.basename(path).startswith(".dcpds-discarded-"):
            held.append(path)
            release.wait(60)
        real_unlink(path)

    monkeypatch.setattr(local_storage, "_unlink_quietly", held_unlink)
    done = threading.Event()
    saver = threading.Thread(target=lambda: (save(folder, 2.0, "async"), done.set()), daemon=True)
    saver.start()
    assert done.wait(60), "the save waited for the unlink of the files it replaced"
    assert "__0_0.safetensors" not in os.listdir(folder) and len(data_files(folder)) == 1
    assert_holds(folder, 2.0)
    release.set()
    local_storage.wait_for_discards(60)
    assert held, "the replaced file was not discarded through the background unlink"
    assert sorted(os.listdir(folder)) == [".metadata", *data_files(folder)]  # a dead process's leftover too


def test_a_discard_while_the_interpreter_shuts_down_unlinks_at_once(tmp_path, monkeypatch):
    """No background work can start during the interpreter's shutdown (a commit at exit): the
    discarded file is unlinked on the caller's thread instead of being left aside."""
    class _ShutDownPool:
        def submit(self, *args, **kwargs):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(local_storage, "_discards", _ShutDownPool())
    (tmp_path / "__0_0.safetensors").write_bytes(b"old")
    local_storage.LocalStorage(str(tmp_path)).discard("__0_0.safetensors")
    assert os.listdir(tmp_path) == []
