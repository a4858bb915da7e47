"""A checkpoint written by an older commit (tests/data/format_v1, made by ef8db5f, before issue 13's
restructuring) still loads, value for value, verifies, and the current code writes the same bytes."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter

DATA = Path(__file__).parent / "data"
OLD = DATA / "format_v1"
sys.path.insert(0, str(DATA))
from make_format_v1 import build_state  # noqa: E402


def _empty_like(value):
    if isinstance(value, torch.Tensor):
        return torch.full_like(value.contiguous(), 7) if value.dtype != torch.bool else torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _empty_like(v) for k, v in value.items()}
    if isinstance(value, io.BytesIO):
        return io.BytesIO()
    return None


def _assert_same(want, got, where=""):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), f"{where} differs"
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _assert_same(want[k], got[k], f"{where}.{k}")
    elif isinstance(want, io.BytesIO):
        got.seek(0)
        assert got.read() == want.getvalue(), where
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_old_checkpoint_loads_value_for_value():
    want = build_state()
    got = _empty_like(want)
    dcp.load(got, storage_reader=DataStatesReader(OLD), no_dist=True)
    _assert_same(want, got)


def test_old_checkpoint_verifies():
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "verify", str(OLD)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "14 items" in r.stdout and "match their CRC32C" in r.stdout


def test_current_code_writes_the_same_bytes(tmp_path):
    """The format is unchanged: the same state saved now gives byte-identical data files and the
    same metadata (file names, offsets, lengths, checksums)."""
    dcp.save(build_state(), storage_writer=DataStatesWriter(tmp_path / "new"), no_dist=True)
    names = sorted(n for n in os.listdir(OLD) if n.endswith(".safetensors"))
    assert names == sorted(n for n in os.listdir(tmp_path / "new") if n.endswith(".safetensors"))
    for n in names:
        assert (OLD / n).read_bytes() == (tmp_path / "new" / n).read_bytes(), n
    old_md = DataStatesReader(OLD).read_metadata()
    new_md = DataStatesReader(tmp_path / "new").read_metadata()
    assert old_md.state_dict_metadata.keys() == new_md.state_dict_metadata.keys()
    def located(md):  # item -> where it lies (file, offsets, length, checksums)
        return {repr(k): repr(v) for k, v in md.storage_data.items()}

    assert located(old_md) == located(new_md)


def test_a_damaged_copy_of_the_old_checkpoint_is_refused(tmp_path):
    """The check above can fail: one flipped byte in the old data file is caught on load."""
    copy = tmp_path / "copy"
    shutil.copytree(OLD, copy)
    data = copy / "__0_0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BaseException, match="CRC32C|checksum"):
        dcp.load(_empty_like(build_state()), storage_reader=DataStatesReader(copy), no_dist=True)
