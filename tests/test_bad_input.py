"""Bad input to the reader and the validators: each is a clear exception naming the checkpoint,
file and item; never a crash, a hang, an absurd allocation or wrong values."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ChecksumMismatchError,
    DataStatesLoadPlanner,
    DataStatesReader,
    DataStatesWriter,
    IncompleteCheckpointError,
)
from dcp_datastates.errors import checkpoint_error_cause
from dcp_datastates.format.header import MAX_HEADER_BYTES, parse_header
from dcp_datastates.load.verify import read_header, validate_checkpoint, validate_data_file

from conftest import raises_through_dcp

DATA = "__0_0.safetensors"


def make_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)},
        "ids": torch.arange(100, dtype=torch.int64),
        "step": 17,
    }


def dest_state() -> dict:
    return {
        "model": {"w": torch.zeros(64, 32), "b": torch.zeros(32, dtype=torch.bfloat16)},
        "ids": torch.zeros(100, dtype=torch.int64),
        "step": None,
    }


@pytest.fixture
def ckpt(tmp_path):
    folder = tmp_path / "step-17"
    dcp.save(make_state(), storage_writer=DataStatesWriter(folder))
    return folder


def load(folder, dest=None, **kw):
    dest = dest_state() if dest is None else dest
    dcp.load(dest, storage_reader=DataStatesReader(folder), **kw)
    return dest


def read_metadata_error(folder) -> BaseException:
    """The error dcp.load raises, unwrapped, and the one read_metadata raises directly; they
    must agree in type and text."""
    with pytest.raises(BaseException) as through_dcp:
        load(folder)
    with pytest.raises(BaseException) as direct:
        DataStatesReader(folder).read_metadata()
    cause = checkpoint_error_cause(through_dcp.value)
    assert type(cause) is type(direct.value) and str(cause) == str(direct.value)
    return direct.value


def header_doc(path) -> tuple[int, dict]:
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def rewrite_header(path, doc: dict, n: int | None = None) -> None:
    """Replace the JSON header in place, keeping its length (padded with spaces)."""
    raw = bytearray(open(path, "rb").read())
    (old_n,) = struct.unpack("<Q", raw[:8])
    body = json.dumps(doc, separators=(",", ":")).encode()
    assert len(body) <= old_n
    raw[8 : 8 + old_n] = body + b" " * (old_n - len(body))
    if n is not None:
        raw[:8] = struct.pack("<Q", n)
    open(path, "wb").write(bytes(raw))


# ------------------------------------------------------------------------------- data files
def test_truncated_data_file(ckpt):
    f = ckpt / DATA
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    pattern = rf"IncompleteCheckpointError: incomplete checkpoint {ckpt}: data file {DATA} is {size - 100} bytes, the metadata expects {size} \(truncated\)"
    with raises_through_dcp(pattern):
        load(ckpt)
    with open(f, "r+b") as fh:
        fh.truncate(0)
    with raises_through_dcp(rf"data file {DATA} is 0 bytes, the metadata expects {size} \(truncated\)"):
        load(ckpt)


def test_appended_data_file(ckpt):
    with open(ckpt / DATA, "ab") as fh:
        fh.write(b"tail")
    with raises_through_dcp(r"IncompleteCheckpointError: .* the metadata expects \d+ \(replaced or appended to\)"):
        load(ckpt)


def test_missing_data_file(ckpt):
    os.unlink(ckpt / DATA)
    with raises_through_dcp(rf"IncompleteCheckpointError: incomplete checkpoint {ckpt}: data file {DATA} is missing"):
        load(ckpt)


def test_data_file_is_a_folder(ckpt):
    os.unlink(ckpt / DATA)
    os.mkdir(ckpt / DATA)
    with raises_through_dcp(rf"CheckpointFormatError: checkpoint {ckpt}: data file {DATA} is a folder, not a regular file"):
        load(ckpt)


def test_garbage_data_same_size_is_a_checksum_error(ckpt):
    f = ckpt / DATA
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    raw[8 + n :] = os.urandom(len(raw) - 8 - n)
    f.write_bytes(bytes(raw))
    with raises_through_dcp(rf"ChecksumMismatchError: checkpoint {ckpt}: checksum mismatch in {DATA}, item '[\w.]+'"):
        load(ckpt)


def test_damaged_header_does_not_change_loaded_values_but_validation_reports_it(ckpt):
    """The reader trusts our .metadata (and the checksums), not the safetensors header; the
    header is checked by validate_data_file / validate_checkpoint."""
    f = ckpt / DATA
    n, doc = header_doc(f)
    doc["model.w"]["data_offsets"] = [0, 10**12]
    rewrite_header(f, doc)
    dest = load(ckpt)
    want = make_state()
    assert torch.equal(dest["model"]["w"], want["model"]["w"]) and dest["step"] == 17
    with pytest.raises(CheckpointFormatError, match=rf"{f}: tensor 'model.w': data_offsets \[0, 1000000000000\] exceed the data region"):
        validate_data_file(f)
    with pytest.raises(CheckpointFormatError, match=rf"{f}: tensor 'model.w'"):
        validate_checkpoint(ckpt)


# ------------------------------------------------------------------------------- .metadata
def test_garbage_metadata(ckpt):
    # Not 0x80 first: that byte starts a pickle, which is reported as a stock DCP checkpoint
    # (test_foreign_metadata_from_filesystemwriter); random bytes began with it 1 time in 256.
    (ckpt / ".metadata").write_bytes(b"\x01" + os.urandom(3000) + b"\xff")
    err = read_metadata_error(ckpt)
    assert isinstance(err, CheckpointFormatError)
    assert str(err).startswith(f"{ckpt / '.metadata'}: not a dcp_datastates metadata file (invalid JSON")


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.999])
def test_truncated_metadata(ckpt, keep):
    raw = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(raw[: int(len(raw) * keep)])
    err = read_metadata_error(ckpt)
    assert isinstance(err, CheckpointFormatError)
    if keep == 0.0:
        assert "empty metadata file (truncated or never written)" in str(err)
    else:
        assert "not a dcp_datastates metadata file (invalid JSON" in str(err)


def test_unknown_format_version(ckpt):
    doc = json.loads((ckpt / ".metadata").read_bytes())
    doc["version"] = 4
    (ckpt / ".metadata").write_text(json.dumps(doc))
    err = read_metadata_error(ckpt)
    assert isinstance(err, CheckpointFormatError)
    assert "unknown format version 4; this dcp_datastates reads versions 1, 2, 3" in str(err)


def test_foreign_metadata_from_filesystemwriter(tmp_path):
    """A checkpoint of DCP's own FileSystemWriter (a pickled .metadata) is refused without
    unpickling anything."""
    folder = tmp_path / "fs"
    dcp.save(make_state(), storage_writer=FileSystemWriter(folder))
    err = read_metadata_error(folder)
    assert isinstance(err, CheckpointFormatError)
    assert f"{folder} is a stock DCP checkpoint (pickled .metadata" in str(err)
    assert "FileSystemReader" in str(err)  # says what reads it


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d["items"]["model.w"]["chunks"][0].update(offset=10**9), r"lies outside the data region"),
        (lambda d: d["items"]["model.w"]["chunks"][0].update(length=12), r"stored length 12 bytes does not match shape \[64, 32\]"),
        (lambda d: d["items"]["ids"]["chunks"][0].update(file="../../etc/passwd"), r"refers to file '../../etc/passwd'"),
        (lambda d: d["files"].update({"../x": d["files"][DATA]}), r"plain names inside the checkpoint folder"),
        (lambda d: d["items"]["model.w"].update(dtype="float13"), r"unknown dtype name 'float13'"),
        (lambda d: d["items"]["model.w"].update(size=[2**40, 2**40]), r"absurd number of elements"),
        (lambda d: d["items"]["model.w"].update(size=[128, 32]), r"chunks hold 2048 elements, the tensor of size \[128, 32\] has 4096"),
        (lambda d: d["items"]["model.w"]["chunks"][0].update(crc32c=[1, 2, 3, 4, 5, 6, 7]), r"7 checksums for 1 pieces"),
        (lambda d: d.pop("items"), r"missing field 'items'"),
        (lambda d: d.update(storage_meta={"modules": 5}), r"storage_meta.modules must be a list of strings"),
    ],
)
def test_inconsistent_metadata(ckpt, mutate, message):
    doc = json.loads((ckpt / ".metadata").read_bytes())
    mutate(doc)
    (ckpt / ".metadata").write_text(json.dumps(doc))
    err = read_metadata_error(ckpt)
    assert isinstance(err, CheckpointFormatError), err
    assert str(err).startswith(str(ckpt / ".metadata") + ": ")
    assert __import__("re").search(message, str(err)), str(err)


def test_metadata_is_a_folder_and_path_is_a_file(ckpt, tmp_path):
    os.unlink(ckpt / ".metadata")
    os.mkdir(ckpt / ".metadata")
    err = read_metadata_error(ckpt)
    assert isinstance(err, CheckpointFormatError) and "the commit marker is a folder" in str(err)
    afile = tmp_path / "plain-file"
    afile.write_text("x")
    err = read_metadata_error(afile)
    assert isinstance(err, NotADirectoryError) and str(err) == f"no checkpoint at {afile}: it is a file, not a checkpoint folder"
    err = read_metadata_error(tmp_path / "missing")
    assert type(err) is FileNotFoundError and "the folder does not exist" in str(err)
    with raises_through_dcp(f"no checkpoint at {tmp_path / 'missing'}: the folder does not exist"):
        load(tmp_path / "missing")


def test_huge_claimed_sizes_fail_before_any_allocation(ckpt):
    """Metadata that claims a 4 TiB tensor in a 4 TiB file: the size check fails before a
    buffer is allocated (the destination is a 4-byte tensor expanded to the claimed shape)."""
    doc = json.loads((ckpt / ".metadata").read_bytes())
    n = 1 << 40
    fi = doc["files"][DATA]
    chunk = doc["items"]["ids"]["chunks"][0]
    chunk.update(offset=fi["size"], sizes=[n], length=8 * n, crc32c=[])  # past every other item: no shared bytes
    doc["items"]["ids"]["size"] = [n]
    fi["size"] = chunk["offset"] + 8 * n
    (ckpt / ".metadata").write_text(json.dumps(doc))
    dest = dest_state()
    dest["ids"] = torch.zeros(1, dtype=torch.int64).expand(n)
    with raises_through_dcp(rf"incomplete checkpoint {ckpt}: data file {DATA} is \d+ bytes, the metadata expects {fi['size']}"):
        load(ckpt, dest)


# ------------------------------------------------------------------------------- state dicts
def test_missing_key(ckpt):
    dest = dest_state()
    dest["model"]["extra"] = torch.zeros(3)
    # DCP's wording first (as DefaultLoadPlanner words it), our details after.
    with raises_through_dcp(
        rf"CheckpointMismatchError: Missing key in checkpoint state_dict: model.extra\. checkpoint {ckpt} has no item\(s\) 'model.extra'"
    ):
        load(ckpt, dest, planner=DataStatesLoadPlanner())
    with pytest.raises(BaseException) as info:
        load(ckpt, dest, planner=DataStatesLoadPlanner())
    cause = checkpoint_error_cause(info.value)
    assert isinstance(cause, RuntimeError) and isinstance(cause, CheckpointMismatchError)  # DCP raises RuntimeError
    assert str(cause).startswith("Missing key in checkpoint state_dict: model.extra.")
    del dest["model"]["extra"]
    load(ckpt, dest, planner=DataStatesLoadPlanner())  # a subset of the checkpoint is fine
    partial = {"ids": torch.zeros(100, dtype=torch.int64), "nope": torch.zeros(2)}
    load(ckpt, partial, planner=DataStatesLoadPlanner(allow_partial_load=True))
    assert torch.equal(partial["ids"], make_state()["ids"]) and torch.equal(partial["nope"], torch.zeros(2))


def test_shape_mismatch(ckpt):
    dest = dest_state()
    dest["model"]["w"] = torch.zeros(32, 64)
    with raises_through_dcp(
        rf"CheckpointMismatchError: Size mismatch between saved torch.Size\(\[64, 32\]\) and current: torch.Size\(\[32, 64\]\) "
        rf"for model.w\. checkpoint {ckpt}: item 'model.w' has shape \[64, 32\] in the checkpoint, the state dict expects \[32, 64\]"
    ):
        load(ckpt, dest, planner=DataStatesLoadPlanner())
    with pytest.raises(BaseException) as info:
        load(ckpt, dest, planner=DataStatesLoadPlanner())
    assert isinstance(checkpoint_error_cause(info.value), ValueError)  # DCP raises ValueError for this
    assert torch.equal(dest["model"]["w"], torch.zeros(32, 64))  # nothing was read


def test_dtype_mismatch_strict_and_cast(ckpt):
    dest = dest_state()
    dest["model"]["w"] = torch.zeros(64, 32, dtype=torch.float64)
    with raises_through_dcp(r"CheckpointMismatchError: .*item 'model.w' is torch.float32 in the checkpoint, the state dict expects torch.float64 \(strict_dtype=True\)"):
        load(ckpt, dest, planner=DataStatesLoadPlanner(strict_dtype=True))
    load(ckpt, dest, planner=DataStatesLoadPlanner())  # default: cast on copy
    assert torch.equal(dest["model"]["w"], make_state()["model"]["w"].double())


def test_tensor_versus_value_mismatch(ckpt):
    dest = dest_state()
    dest["ids"] = 5
    with raises_through_dcp(r"CheckpointMismatchError: .*item 'ids' is a tensor \[100\] of torch.int64 in the checkpoint, the state dict holds a int there"):
        load(ckpt, dest, planner=DataStatesLoadPlanner())
    dest = dest_state()
    dest["step"] = torch.zeros(1)
    with raises_through_dcp(r"CheckpointMismatchError: .*item 'step' is a non-tensor value in the checkpoint"):
        load(ckpt, dest, planner=DataStatesLoadPlanner())


def test_mismatch_names_the_folder_it_was_loaded_from(ckpt, tmp_path):
    moved = tmp_path / "moved"
    os.rename(ckpt, moved)
    dest = dest_state()
    dest["ids"] = torch.zeros(99, dtype=torch.int64)
    with raises_through_dcp(rf"checkpoint {moved}: item 'ids' has shape \[100\]"):
        load(moved, dest, planner=DataStatesLoadPlanner())


# ------------------------------------------------------------------------------- header parser
def _file(items: list[tuple[str, str, list, list]], data_len: int, n_override=None, meta=None) -> bytes:
    doc = {name: {"dtype": dt, "shape": shape, "data_offsets": offs} for name, dt, shape, offs in items}
    if meta is not None:
        doc["__metadata__"] = meta
    body = json.dumps(doc).encode()
    n = len(body) if n_override is None else n_override
    return struct.pack("<Q", n) + body + bytes(data_len)


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\x01\x02", r"file is 2 bytes, too short for a safetensors header"),
        (struct.pack("<Q", 2**63) + b"{}", rf"header length {2**63} exceeds the {MAX_HEADER_BYTES}-byte limit"),
        (struct.pack("<Q", 500) + b"{}", r"header length 500 runs past the end of the file \(10 bytes\)"),
        (struct.pack("<Q", 4) + b"[1] ", r"does not start with '\{'"),
        (struct.pack("<Q", 4) + b"{\xff\xfe}", r"not valid UTF-8 JSON"),
        (_file([("a", "F32", [2], [0, 8])], 4), r"tensor 'a': data_offsets \[0, 8\] exceed the data region \(4 bytes\)"),
        (_file([("a", "F32", [3], [0, 8])], 8), r"tensor 'a': shape \[3\] of F32 needs 12 bytes, data_offsets \[0, 8\] hold 8"),
        (_file([("a", "F99", [2], [0, 8])], 8), r"tensor 'a': unknown dtype 'F99'"),
        (_file([("a", "F32", [-2], [0, 8])], 8), r"tensor 'a': shape \[-2\] is not a list"),
        (_file([("a", "F32", [2], [8, 0])], 8), r"tensor 'a': data_offsets \[8, 0\] are not an increasing pair"),
        (_file([("a", "U8", [2], [0, 2]), ("b", "U8", [2], [4, 6])], 6), r"tensor 'b': data at \[4, 6\) leaves a hole of 2 bytes"),
        (_file([("a", "U8", [4], [0, 4]), ("b", "U8", [2], [2, 4])], 4), r"tensor 'a': data at \[2, 4\) overlaps|tensor '[ab]': data at \[\d, \d\) overlaps"),
        (_file([("a", "U8", [2], [0, 2])], 5), r"3 bytes after the last tensor are not described by the header"),
        (_file([("a", "U8", [2], [0, 2])], 2, meta={"k": 1}), r"__metadata__ must map strings to strings"),
        (struct.pack("<Q", 29) + b'{"a":{"dtype":"U8"},"a":{}}  ', r"duplicate key 'a' in the header"),
        (struct.pack("<Q", 38) + b'{"a":{"dtype":"U8","shape":[0],"x":1}}', r"tensor 'a': missing field 'data_offsets'"),
    ],
)
def test_header_parser_rejects(data, message, tmp_path):
    with pytest.raises(CheckpointFormatError, match=message):
        parse_header(data, None, "f.safetensors")
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointFormatError, match=rf"^{path}: "):
        validate_data_file(path)


def test_header_parser_never_reads_a_huge_claimed_header(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES - 1) + b"{")
        f.truncate(1 << 34)  # sparse: 16 GiB claimed, nothing on disk
    with pytest.raises(CheckpointFormatError, match="not valid UTF-8 JSON"):
        read_header(path)  # reads at most the 100 MB header once, no 16 GiB buffer


def test_validate_real_checkpoint_and_expected(ckpt):
    items = validate_data_file(ckpt / DATA, cross_check=True)
    by = {it.name: it for it in items}
    assert by["model.w"].dtype == "F32" and by["model.w"].shape == (64, 32) and by["model.w"].length == 64 * 32 * 4
    assert by["model.b"].dtype == "BF16" and by["step"].dtype == "U8"
    assert validate_checkpoint(ckpt, cross_check=True)[DATA] == items
    validate_data_file(ckpt / DATA, {"model.w": {"shape": [64, 32], "dtype": "F32"}, "ids": by["ids"]})
    with pytest.raises(CheckpointFormatError, match=r"tensor 'model.w': shape is \(64, 32\) in the header, expected \(32, 64\)"):
        validate_data_file(ckpt / DATA, {"model.w": {"shape": [32, 64]}})
    with pytest.raises(CheckpointFormatError, match=r"tensor 'gone': expected but missing from the header"):
        validate_data_file(ckpt / DATA, {"gone": {}})
    # a header that is valid safetensors but disagrees with the metadata
    f = ckpt / DATA
    n, doc = header_doc(f)
    doc["model.w"]["shape"], doc["model.w"]["dtype"] = [32, 64], "F32"
    rewrite_header(f, doc)
    validate_data_file(f, cross_check=True)  # fine as a safetensors file ...
    with pytest.raises(CheckpointFormatError, match=r"item 'model.w' chunk at \[0, 0\] should be bytes .* of float32 \[64, 32\]; the header has 'model.w' F32 \[32, 64\] there"):
        validate_checkpoint(ckpt)  # ... but not what our metadata says


def test_validate_checkpoint_incomplete(ckpt):
    os.unlink(ckpt / DATA)
    with pytest.raises(IncompleteCheckpointError, match=f"data file {DATA} is missing"):
        validate_checkpoint(ckpt)
    os.unlink(ckpt / ".metadata")
    with pytest.raises(IncompleteCheckpointError, match="there is no .metadata commit marker"):
        validate_checkpoint(ckpt)


def test_checksum_error_type_through_dcp(ckpt):
    f = ckpt / DATA
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(BaseException) as info:
        load(ckpt)
    assert isinstance(checkpoint_error_cause(info.value), ChecksumMismatchError)
    assert isinstance(checkpoint_error_cause(CheckpointMismatchError("x")), CheckpointMismatchError)


def test_validate_checkpoint_accepts_every_dtype(tmp_path):
    from test_roundtrip import every_dtype_state, nested_state

    state = every_dtype_state() | nested_state()
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c"))
    items = validate_checkpoint(tmp_path / "c", cross_check=True)[DATA]
    by = {it.name: it for it in items}
    assert by["complex128"].dtype == "U8" and by["complex128"].length == 4 * 16  # raw bytes, real dtype in .metadata
    assert by["float8_e4m3fn"].dtype == "F8_E4M3" and by["empty"].shape == (0, 4) and by["scalar"].shape == ()


@pytest.mark.parametrize("path, message", [
    ("", r"checkpoint path '' is empty"),
    ("file://", r"checkpoint path 'file://' is empty"),
    ("s3://", r"checkpoint URL 's3://' names no bucket or folder after s3://"),
    ("memory:///", r"checkpoint URL 'memory:///' names no bucket or folder after memory://"),
])
def test_an_empty_path_or_a_url_without_a_folder_is_refused_by_name(path, message, tmp_path, monkeypatch):
    """Refused when given, naming what is missing (before: "cannot create checkpoint folder : No
    such file or directory", or the store's bare "ValueError()"); nothing is written anywhere."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        DataStatesWriter(path)
    with pytest.raises(ValueError, match=message):
        DataStatesReader(path)
    with pytest.raises(ValueError, match=message):
        dcp.save({"x": torch.ones(2)}, storage_writer=DataStatesWriter(), checkpoint_id=path, no_dist=True)
    assert os.listdir(tmp_path) == []
