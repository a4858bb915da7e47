"""Save with DataStatesWriter, load with DataStatesReader: bytes back equal bytes saved."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from dcp_datastates import DataStatesReader, DataStatesWriter, IncompleteCheckpointError

from conftest import assert_state_equal, clone_state, raises_through_dcp, zeros_like_state


def every_dtype_state():
    g = torch.Generator().manual_seed(1)
    s = {}
    for dt in (torch.float32, torch.float16, torch.float64, torch.bfloat16):
        s[f"f_{dt}"] = torch.randn(7, 5, generator=g).to(dt)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        s[name] = torch.randn(33, generator=g).to(getattr(torch, name))
    s["float8_e8m0fnu"] = torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        info = torch.iinfo(dt)
        s[f"i_{dt}"] = torch.randint(info.min, info.max, (11,), dtype=dt, generator=g)
    for dt in (torch.uint16, torch.uint32, torch.uint64):
        s[f"u_{dt}"] = torch.randint(0, 1 << 15, (6,), dtype=torch.int64, generator=g).to(dt)
    s["bool"] = torch.rand(13, generator=g) > 0.5
    s["complex64"] = torch.randn(4, dtype=torch.complex64, generator=g)
    s["complex128"] = torch.randn(4, dtype=torch.complex128, generator=g)
    s["special"] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45])
    s["scalar"] = torch.tensor(3.25)
    s["empty"] = torch.empty(0, 4)
    s["empty_int"] = torch.empty(3, 0, dtype=torch.int32)
    return s


def nested_state():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": {"w": torch.randn(16, 8), "layers": [{"b": torch.randn(3)}, {"b": torch.randn(5)}]},
        "view_t": base.t(),  # non-contiguous view
        "view_slice": base[1:3, ::2],
        "shared_a": base,
        "shared_b": base.view(6, 4),  # shares storage with shared_a
        "step": 42,
        "lr": 3.5e-4,
        "name": "run-7",
        "milestones": [10, 20, 30],
        "extra": {"seed": 1234, "tags": ["a", "b"]},
    }


def roundtrip(tmp_path, state, save):
    path = tmp_path / "ckpt"
    expected = clone_state(state)
    if save == "sync":
        dcp.save(state, storage_writer=DataStatesWriter(path))
    else:
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(path))
        resp.staging_completion.result()
        resp.upload_completion.result()
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=DataStatesReader(path))
    return expected, dest, path


@pytest.mark.parametrize("save", ["sync", "async"])
def test_every_dtype_bitwise(tmp_path, save):
    state = every_dtype_state()
    expected, dest, _ = roundtrip(tmp_path, state, save)
    assert_state_equal(expected, dest)


@pytest.mark.parametrize("save", ["sync", "async"])
def test_nested_views_and_objects(tmp_path, save):
    state = nested_state()
    expected, dest, _ = roundtrip(tmp_path, state, save)
    # non-tensor values come back through the load planner
    for k in ("step", "lr", "name", "milestones"):
        assert dest[k] == expected[k]
    assert dest["extra"] == expected["extra"]
    assert_state_equal(expected["model"], dest["model"])
    for k in ("view_t", "view_slice", "shared_a", "shared_b"):
        assert torch.equal(dest[k], expected[k]), k


def test_async_returns_response_and_commits(tmp_path):
    state = {"w": torch.randn(1000)}
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    assert type(resp).__name__ == "AsyncSaveResponse"
    assert resp.staging_completion.result(timeout=60) is None
    resp.upload_completion.result(timeout=60)
    assert (tmp_path / "c" / ".metadata").is_file()
    assert not [p for p in os.listdir(tmp_path / "c") if ".tmp" in p]


def test_data_file_is_valid_safetensors(tmp_path):
    state = every_dtype_state()
    _, _, path = roundtrip(tmp_path, state, "async")
    files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
    assert files == ["__0_0.safetensors"]
    with safe_open(str(path / files[0]), "pt") as f:
        names = set(f.keys())
        for k, v in state.items():
            assert k in names
            got = f.get_tensor(k)
            if v.dtype == torch.complex128:  # not a safetensors dtype: raw bytes, real dtype in our metadata
                assert got.dtype == torch.uint8 and got.numel() == v.numel() * v.element_size()
                assert torch.equal(got, v.contiguous().view(-1).view(torch.uint8))
                continue
            assert got.dtype == v.dtype and tuple(got.shape) == tuple(v.shape), k
            assert torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got, v.reshape(-1).view(torch.uint8) if v.numel() else got), k


def test_metadata_is_json_not_pickle(tmp_path):
    _, _, path = roundtrip(tmp_path, nested_state(), "sync")
    raw = (path / ".metadata").read_bytes()
    doc = json.loads(raw)
    assert doc["format"] == "dcp_datastates" and doc["version"] == 1
    assert "model.w" in doc["items"]
    chunk = doc["items"]["model.w"]["chunks"][0]
    assert chunk["file"] == "__0_0.safetensors" and chunk["length"] == 16 * 8 * 4 and chunk["crc32c"]


def test_moved_folder_still_loads(tmp_path):
    state = nested_state()
    expected, _, path = roundtrip(tmp_path, state, "async")
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(path, moved)
    shutil.rmtree(path)
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=DataStatesReader(moved))
    assert_state_equal(expected["model"], dest["model"])


def test_writer_and_reader_reused_with_checkpoint_id(tmp_path):
    writer, reader = DataStatesWriter(), DataStatesReader()
    snapshots = []
    for step in range(3):
        state = {"w": torch.full((64,), float(step)), "step": step}
        snapshots.append(clone_state(state))
        if step % 2:
            dcp.save(state, checkpoint_id=tmp_path / f"step-{step}", storage_writer=writer)
        else:
            resp = dcp.async_save(state, checkpoint_id=tmp_path / f"step-{step}", storage_writer=writer)
            resp.upload_completion.result()
    for step in range(3):
        dest = {"w": torch.zeros(64), "step": None}
        dcp.load(dest, checkpoint_id=tmp_path / f"step-{step}", storage_reader=reader)
        assert torch.equal(dest["w"], snapshots[step]["w"]) and dest["step"] == step
    # each async save went straight to its own folder (no stray files in the writer's last path)
    for step in range(3):
        assert sorted(os.listdir(tmp_path / f"step-{step}")) == [".metadata", "__0_0.safetensors"]


def test_storage_meta_names_the_checkpoint_its_save_and_each_load(tmp_path):
    # as stock DCP's FileSystemWriter/Reader fill StorageMeta (PyTorch's test_compatibility)
    writer = DataStatesWriter(tmp_path / "c")
    dcp.save({"a": torch.zeros(4, 4)}, storage_writer=writer)
    reader = DataStatesReader(tmp_path / "c")
    meta = reader.read_metadata().storage_meta
    assert str(meta.checkpoint_id) == str(tmp_path / "c") and meta.save_id == writer.save_id
    assert meta.load_id == reader.load_id and meta.load_id
    first = reader.load_id
    dest = {"a": torch.ones(4, 4)}
    dcp.load(dest, checkpoint_id=tmp_path / "c", storage_reader=reader)  # reset(): a new load
    assert torch.equal(dest["a"], torch.zeros(4, 4))
    assert reader.load_id != first and reader.read_metadata().storage_meta.load_id == reader.load_id


def test_overwrite_false_refuses_committed_folder(tmp_path):
    dcp.save({"w": torch.ones(3)}, storage_writer=DataStatesWriter(tmp_path / "c"))
    with raises_through_dcp("CheckpointWriteError.*Checkpoint already exists and overwrite=False: .*already holds a committed checkpoint"):
        dcp.save({"w": torch.ones(3)}, storage_writer=DataStatesWriter(tmp_path / "c", overwrite=False))
    resp = dcp.async_save({"w": torch.ones(3)}, storage_writer=DataStatesWriter(tmp_path / "c", overwrite=False))
    with raises_through_dcp("CheckpointWriteError.*overwrite=False"):
        resp.upload_completion.result()
    # the committed checkpoint is untouched
    dest = {"w": torch.zeros(3)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert torch.equal(dest["w"], torch.ones(3))


def test_resave_overwrites(tmp_path):
    for value in (1.0, 2.0):
        dcp.save({"w": torch.full((5,), value)}, storage_writer=DataStatesWriter(tmp_path / "c"))
    dest = {"w": torch.zeros(5)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert torch.equal(dest["w"], torch.full((5,), 2.0))


def test_process_mode_cannot_take_the_writer(tmp_path):
    import pickle

    # DCP's process mode sends the writer to a checkpoint process; ours refuses with the fix.
    with pytest.raises(TypeError, match="AsyncCheckpointerType.THREAD"):
        pickle.dumps(DataStatesWriter(tmp_path / "c"))


def test_incomplete_checkpoint_is_reported(tmp_path):
    dcp.save({"w": torch.ones(3)}, storage_writer=DataStatesWriter(tmp_path / "c"))
    os.unlink(tmp_path / "c" / ".metadata")
    with raises_through_dcp(f"incomplete checkpoint {tmp_path / 'c'}: there is no .metadata commit marker"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=DataStatesReader(tmp_path / "c"))
    with pytest.raises(IncompleteCheckpointError, match="no .metadata commit marker"):
        DataStatesReader(tmp_path / "c").read_metadata()
    with pytest.raises(FileNotFoundError, match="folder does not exist"):
        DataStatesReader(tmp_path / "nothing-here").read_metadata()


def test_flipped_byte_is_detected(tmp_path):
    state = {"w": torch.randn(4096), "v": torch.randn(10)}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    doc = json.loads((tmp_path / "c" / ".metadata").read_bytes())
    off = doc["items"]["w"]["chunks"][0]["offset"] + 1234
    f = tmp_path / "c" / "__0_0.safetensors"
    raw = bytearray(f.read_bytes())
    raw[off] ^= 0x10
    f.write_bytes(bytes(raw))
    with raises_through_dcp(r"ChecksumMismatchError.*checksum mismatch in __0_0.safetensors, item 'w' .*bytes \["):
        dcp.load({"w": torch.zeros(4096), "v": torch.zeros(10)}, storage_reader=DataStatesReader(tmp_path / "c"))
    # verification can be turned off: the flipped value loads, the others are intact
    dest = {"w": torch.zeros(4096), "v": torch.zeros(10)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c", verify=False))
    assert torch.equal(dest["v"], state["v"]) and not torch.equal(dest["w"], state["w"])


def _multi_piece_checkpoint(tmp_path, cache):
    """A 1.5 MiB tensor over six 256 KiB checksum pieces (1 MiB cache), plus small items."""
    g = torch.Generator().manual_seed(5)
    state = {"big": torch.randn(512, 768, generator=g), "small": torch.randn(10, generator=g), "step": 3}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c", host_cache_size=cache))
    doc = json.loads((tmp_path / "c" / ".metadata").read_bytes())
    big = doc["items"]["big"]["chunks"][0]
    assert len(big["crc32c"]) >= 6
    return state, big, doc["files"][big["file"]]


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])  # direct reads, and reads into a buffer
def test_multi_piece_load_and_flipped_byte_in_the_middle(tmp_path, small_engine, layout):
    state, big, info = _multi_piece_checkpoint(tmp_path, small_engine)

    def dest():
        b = torch.zeros(512, 768) if layout == "contiguous" else torch.zeros(768, 512).t()
        return {"big": b, "small": torch.zeros(10), "step": None}

    for threads in (1, 4):
        out = dest()
        dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c", read_threads=threads))
        assert torch.equal(out["big"], state["big"]) and torch.equal(out["small"], state["small"]) and out["step"] == 3

    start, piece = info["data_start"], info["piece_size"]
    lo = start + ((big["offset"] - start) // piece + 3) * piece  # the item's 4th piece
    f = tmp_path / "c" / "__0_0.safetensors"
    raw = bytearray(f.read_bytes())
    raw[lo + 777] ^= 0x01
    f.write_bytes(bytes(raw))
    message = (
        rf"ChecksumMismatchError: checkpoint {tmp_path / 'c'}: checksum mismatch in __0_0.safetensors, "
        rf"item 'big' \(chunk offsets \[0, 0\]\), bytes \[{lo}, {lo + piece}\): stored crc32c {big['crc32c'][3]:#010x}, read 0x"
    )
    with raises_through_dcp(message):
        dcp.load(dest(), storage_reader=DataStatesReader(tmp_path / "c"))
    out = dest()
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "c", verify=False))
    diff = (out["big"] != state["big"]).nonzero()
    assert diff.shape[0] == 1 and torch.equal(out["small"], state["small"])


def test_sync_files_off_still_roundtrips(tmp_path):
    state = {"w": torch.randn(100)}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c", sync_files=False))
    dest = {"w": torch.zeros(100)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert torch.equal(dest["w"], state["w"])


def test_load_casts_into_other_dtype(tmp_path):
    state = {"w": torch.randn(50)}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    dest = {"w": torch.zeros(50, dtype=torch.float64)}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert torch.equal(dest["w"], state["w"].double())


def lazy_view_state():
    """Tensors whose memory is not their values: torch applies a conjugate or negative bit when
    reading them. Next to plain tensors, so the rest of the state still takes its usual path."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, dtype=torch.complex64, generator=g)
    return {
        "plain": torch.randn(8, generator=g),
        "conj": z.conj(),  # contiguous, conjugate bit
        "neg": torch._neg_view(torch.randn(7, generator=g)),  # contiguous, negative bit
        "conj_imag": z.conj().imag,  # strided, negative bit
        "neg_conj": torch._neg_view(torch.randn(3, dtype=torch.complex128, generator=g).conj()),
        "small_conj": torch.randn(2, dtype=torch.complex64, generator=g).conj(),
        "big_conj": torch.randn(40_000, dtype=torch.complex64, generator=g).conj(),  # over the request-copy size
    }


@pytest.mark.parametrize("save", ["sync", "async", "async twice"])
def test_conjugate_and_negative_views_save_their_values(tmp_path, save):
    """A conjugate or negative view saves the values it shows, not the memory under it (which
    holds them before the bit): stock DCP does; the lazy path once wrote the raw memory."""
    state = lazy_view_state()
    assert all(t.is_conj() or t.is_neg() for k, t in state.items() if k != "plain")
    if save == "async twice":  # the second save with the structure's plan cached
        roundtrip(tmp_path / "first", state, "async")
        save = "async"
    expected, dest, _ = roundtrip(tmp_path, state, save)
    for k, t in state.items():
        assert not dest[k].is_conj() and not dest[k].is_neg()
        assert torch.equal(dest[k], t.resolve_conj().resolve_neg()), k
        assert torch.equal(dest[k], expected[k]), k


def test_a_cached_plan_does_not_take_a_view_for_the_tensor_it_was_made_for(tmp_path):
    """The structure's plan is cached from saves of plain tensors; then the same names hold
    conjugate / negative views and a ZeroTensor of the same dtypes and shapes (the signature the
    cache keys on): their values are saved, not the memory under them (nor address 0)."""
    g = torch.Generator().manual_seed(9)
    z = torch.randn(6, dtype=torch.complex64, generator=g)
    plain = {"c": z.clone(), "n": torch.randn(7, generator=g), "zero": torch.ones(5), "w": torch.randn(4, generator=g)}
    for k in range(2):
        roundtrip(tmp_path / f"plain-{k}", plain, "async")
    views = {"c": z.conj(), "n": torch._neg_view(plain["n"]), "zero": torch._efficientzerotensor(5), "w": plain["w"]}
    _, dest, _ = roundtrip(tmp_path, views, "async")
    assert torch.equal(dest["c"], z.conj().resolve_conj()) and torch.equal(dest["n"], -plain["n"])
    assert torch.equal(dest["zero"], torch.zeros(5)) and torch.equal(dest["w"], plain["w"])


@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_tensor_whose_storage_was_freed_before_the_save_is_refused_by_name(tmp_path, save):
    """A tensor whose storage was already resized to 0 (memory-saving code frees unsharded
    parameters so) has a shape and no memory (torch's own clone() of it segfaults): the save
    fails naming it, nothing is committed."""
    freed = torch.randn(8)
    freed.untyped_storage().resize_(0)
    state = {"w": torch.randn(4), "freed": freed}
    path = tmp_path / "ckpt"
    with raises_through_dcp(r"item 'freed': a torch.float32 tensor of shape \(8,\) on cpu has no memory"):
        if save == "sync":
            dcp.save(state, storage_writer=DataStatesWriter(path))
        else:
            dcp.async_save(state, storage_writer=DataStatesWriter(path)).upload_completion.result()
    assert not (path / ".metadata").exists()


def test_loads_into_conjugate_and_negative_views(tmp_path):
    """A load target that is a conjugate or negative view shows the saved values afterwards (its
    memory gets the conjugated or negated bytes), as with stock DCP's copy_."""
    z, r = torch.randn(5, dtype=torch.complex64), torch.randn(4)
    dcp.save({"z": z, "r": r}, storage_writer=DataStatesWriter(tmp_path / "c"))
    dest = {"z": torch.zeros(5, dtype=torch.complex64).conj(), "r": torch._neg_view(torch.zeros(4))}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert dest["z"].is_conj() and dest["r"].is_neg()  # loaded in place
    assert torch.equal(dest["z"], z) and torch.equal(dest["r"], r)


@pytest.mark.parametrize("save", ["sync", "async"])
@pytest.mark.parametrize("numel", [3, 1 << 20])
def test_zero_tensor_saves_as_zeros(tmp_path, save, numel):
    """Autograd's ZeroTensor has no memory (data_ptr 0): it is saved as the zeros it is. The small
    one is one the request copies at once: that copy read address 0 and killed the process."""
    state = {"z": torch._efficientzerotensor(numel), "w": torch.arange(4.0)}
    _, dest, _ = roundtrip(tmp_path, state, save)
    assert torch.equal(dest["z"], torch.zeros(numel)) and torch.equal(dest["w"], torch.arange(4.0))


def test_a_load_counts_as_an_in_place_change_of_its_targets(tmp_path):
    """Targets read straight into (the stored chunk is the target, byte for byte) get their version
    counters bumped, as stock DCP's copy_ does: autograd's checks of saved tensors and the lazy
    save's guard both read them."""
    state = {"whole": torch.randn(64), "cast": torch.randn(8), "big": torch.randn(1 << 18)}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    dest = {"whole": torch.zeros(64), "cast": torch.zeros(8, dtype=torch.float64), "big": torch.zeros(1 << 18)}
    before = {k: t._version for k, t in dest.items()}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert all(dest[k]._version > before[k] for k in dest), {k: (before[k], dest[k]._version) for k in dest}
    assert torch.equal(dest["big"], state["big"]) and torch.equal(dest["cast"], state["cast"].double())


def test_second_save_to_a_path_still_being_written_is_refused(tmp_path):
    state = {f"t{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB: still flushing after stage()
    snapshot = clone_state(state)
    first = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    second = dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    with raises_through_dcp("CheckpointWriteError: a save to .* is still running; wait for its upload_completion"):
        second.upload_completion.result()
    first.upload_completion.result()  # the first save is unaffected
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert_state_equal(snapshot, dest)
    dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c")).upload_completion.result()  # then allowed


def test_writer_built_for_one_folder_saved_to_another_by_checkpoint_id(tmp_path):
    """DCP names the folder only after staging (reset()): the files staged into the writer's
    folder move to the one DCP names; the writer's folder keeps no data."""
    state = {"w": torch.randn(4096), "step": 3}
    snapshot = clone_state(state)
    w = DataStatesWriter(tmp_path / "a")
    dcp.async_save(state, storage_writer=w, checkpoint_id=tmp_path / "b").upload_completion.result(timeout=60)
    dest = {"w": torch.zeros(4096), "step": None}
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "b"))
    assert_state_equal(snapshot, dest)
    # (torch 2.9 names the folder before staging: then the writer's folder is never made)
    assert not (tmp_path / "a").exists() or not [n for n in os.listdir(tmp_path / "a") if n.endswith(".safetensors")]
    # the same writer, retargeted again: its folder is now taken from checkpoint_id every time
    state["w"].add_(1)
    snapshot = clone_state(state)
    dcp.async_save(state, storage_writer=w, checkpoint_id=tmp_path / "c").upload_completion.result(timeout=60)
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"))
    assert_state_equal(snapshot, dest)
    assert sorted(os.listdir(tmp_path / "c")) == [".metadata", "__0_0.safetensors"]
