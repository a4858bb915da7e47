"""A checkpoint whose chunk table is packed (format version 3, tests/data/format_v3, made by the
commit that introduced it) loads value for value, verifies, inspects as version 3, and the current
code writes the same table when it packs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp
from test_format_v1 import _assert_same, _empty_like, build_state

import dcp_datastates.format.metadata as metadata_codec
from dcp_datastates import DataStatesReader, DataStatesWriter

OLD = Path(__file__).parent / "data" / "format_v3"


def test_packed_checkpoint_loads_value_for_value():
    got = _empty_like(build_state())
    dcp.load(got, storage_reader=DataStatesReader(OLD), no_dist=True)
    _assert_same(build_state(), got)


def test_packed_checkpoint_verifies_and_inspects_as_version_3():
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "verify", str(OLD)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "14 items" in r.stdout and "match their CRC32C" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "inspect", "--json", str(OLD)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"] == 3


def test_current_code_packs_the_same_table(tmp_path, monkeypatch):
    monkeypatch.setattr(metadata_codec, "PACK_FROM_CHUNKS", 1)
    dcp.save(build_state(), storage_writer=DataStatesWriter(tmp_path), no_dist=True)
    assert (tmp_path / "__0_0.safetensors").read_bytes() == (OLD / "__0_0.safetensors").read_bytes()
    old, new = json.loads((OLD / ".metadata").read_bytes()), json.loads((tmp_path / ".metadata").read_bytes())
    for doc in (old, new):
        doc.pop("storage_meta")
    assert old == new
