"""dcp_datastates.integrity as a library: verify_checkpoint collects every problem with the same
messages the reader raises, and file_size_error words a missing or resized data file once."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, IncompleteCheckpointError
from dcp_datastates.commit import file_size_error, read_commit
from dcp_datastates.config import tool_config
from dcp_datastates.load.verify import verify_checkpoint
from dcp_datastates.runtime import get_engine

from conftest import raises_through_dcp, zeros_like_state


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ckpt")
    state = {"a": torch.arange(4096.0), "b": torch.ones(300, dtype=torch.int32), "step": 5}
    dcp.save(state, storage_writer=DataStatesWriter(path), no_dist=True)
    return path, state


def _flip(path, fqn):
    md, _ = read_commit(path)
    loc = next(loc for index, loc in md.storage_data.items() if index.fqn == fqn)
    with open(os.path.join(path, loc.file), "r+b") as f:
        f.seek(loc.offset + 8)
        byte = f.read(1)
        f.seek(loc.offset + 8)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_sound_checkpoint_has_no_problems(saved):
    report = verify_checkpoint(saved[0], engine=get_engine(tool_config()))
    assert report.problems == []
    assert (report.items, report.files, report.checked_items) == (3, 1, 3)
    md, _ = read_commit(saved[0])
    assert report.checked_bytes == sum(loc.length for loc in md.storage_data.values()) > 4096 * 4 + 300 * 4


def test_every_damaged_item_is_reported_as_the_reader_words_it(saved):
    path, state = saved
    _flip(path, "a")
    _flip(path, "b")
    problems = verify_checkpoint(path, engine=get_engine(tool_config())).problems
    assert len(problems) == 2
    assert all(p.startswith(f"checkpoint {path}: checksum mismatch in __0_0.safetensors, item ") for p in problems)
    assert "item 'a'" in problems[0] + problems[1] and "item 'b'" in problems[0] + problems[1]
    with raises_through_dcp("ChecksumMismatchError: ") as raised:
        dcp.load(zeros_like_state(state), storage_reader=DataStatesReader(path), no_dist=True)
    assert any(p in str(raised.value) for p in problems)  # the reader stops at its first bad piece


def test_a_truncated_file_is_named_with_what_is_lost(saved):
    path, _ = saved
    md, files = read_commit(path)
    (name,) = files
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(files[name].size - 10)
    (problem,) = verify_checkpoint(path, engine=get_engine(tool_config())).problems
    assert problem.startswith(f"{name}: data file is {files[name].size - 10} bytes, the metadata expects "
                              f"{files[name].size} (truncated); past the end: item ")


def test_file_size_error_words():
    missing = file_size_error("/c", "__0_0.safetensors", None, 10, location="s3://b/c/__0_0.safetensors")
    assert isinstance(missing, IncompleteCheckpointError)
    assert str(missing) == ("incomplete checkpoint /c: data file __0_0.safetensors is missing "
                            "(s3://b/c/__0_0.safetensors; the metadata lists it)")
    assert str(file_size_error("/c", "f", 12, 10)) == (
        "incomplete checkpoint /c: data file f is 12 bytes, the metadata expects 10 (replaced or appended to)")
    assert file_size_error("/c", "f", 10, 10) is None
