"""Loading through DeviceStaging (load/read.py), the path of CUDA destinations, driven here with
CPU memory: the slots are pageable and the CUDA events are tokens, so the whole pipeline runs
(batches, whole items cut into parts of checksum pieces, reads verified per part, bytewise and
strided copies, the planner's commits) and the ordering the GPU relies on is checked: a slot is
filled again only after the copies out of it were waited for. tests/test_gpu.py runs the same
path on a real GPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

import dcp_datastates.load.read as read
from dcp_datastates import DataStatesReader, DataStatesWriter

from conftest import raises_through_dcp

KiB = 1 << 10


class CpuStaging(read.DeviceStaging):
    """DeviceStaging on CPU memory, keeping a log of what it did."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded: list[tuple[int, object]] = []  # (slot, token) per batch of copies queued
        self.waited: set[int] = set()  # ids of the tokens waited for
        self.batches_bound: list[tuple[int, int]] = []  # (slot, parts) per batch
        self.parts: list[read.ReadTarget] = []
        made.append(self)

    def _new_slot(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)

    def _record(self, devices):
        token = object()
        self.recorded.append((self._slot_of_batch, token))
        return [token]

    def _wait_slot(self, k: int) -> None:
        self.waited.update(id(t) for t in self._events[k])
        self._events[k].clear()

    def _bound(self, batch, size):
        earlier = [t for slot, t in self.recorded if slot == self._turn]
        bound = super()._bound(batch, size)
        # The rule under test: the slot's earlier copies were waited for before it is filled again.
        assert all(id(t) in self.waited for t in earlier), "a slot was rebound before its copies finished"
        self.batches_bound.append((self._slot_of_batch, len(bound)))
        return bound

    def copy(self, batch, planner) -> None:
        self.parts.extend(batch)
        super().copy(batch, planner)
        if self._slot_of_batch == read._OWN:  # a pageable buffer of its own goes with this batch
            assert all(id(t) in self.waited for k, t in self.recorded if k == read._OWN), "own buffer not awaited"


made: list[CpuStaging] = []


class CommitLog(DefaultLoadPlanner):
    """What each tensor held when the planner was told it was loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: dict[str, torch.Tensor] = {}
        self.commits = 0

    def commit_tensor(self, read_item, tensor) -> None:
        self.commits += 1
        self.committed[read_item.dest_index.fqn] = tensor.clone()


@pytest.fixture
def staged_on_cpu(monkeypatch, small_engine):
    """Every tensor destination goes through the staging, 512 KiB slots; 1 MiB engine cache, so
    checksum pieces are 256 KiB."""
    monkeypatch.setattr(read, "_through_staging", lambda dst: True)
    monkeypatch.setattr(read, "DeviceStaging", CpuStaging)
    monkeypatch.setattr(read, "SLOT_BYTES", 512 * KiB)
    made.clear()
    return small_engine


def _state():
    g = torch.Generator().manual_seed(9)
    state = {
        "big": torch.randn(512, 768, generator=g),  # 1.5 MiB: six pieces, cut into parts
        "big2": torch.randn(300_000, generator=g),  # 1.14 MiB
        "cast": torch.randn(25_000, generator=g),  # loaded as float64: a strided/cast copy
        "wide_cast": torch.randn(200_000, generator=g),  # 800 KiB read for a cast: larger than a slot
        "t": torch.randn(300, 200, generator=g),  # loaded into a transposed view
        "step": 7,
    }
    state.update({f"s{i}": torch.randn(10 + 13 * i, generator=g) for i in range(30)})
    return state


def _dest(state):
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
    dest["cast"] = torch.zeros(25_000, dtype=torch.float64)
    dest["wide_cast"] = torch.zeros(200_000, dtype=torch.float64)
    dest["t"] = torch.zeros(200, 300).t()
    return dest


def test_staged_load_is_bitwise_and_reuses_a_slot_only_after_its_copies(tmp_path, staged_on_cpu):
    state = _state()
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c", host_cache_size=staged_on_cpu))
    dest = _dest(state)
    planner = CommitLog()
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c"), planner=planner)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(dest[k], v.to(dest[k].dtype)), k
            assert torch.equal(planner.committed[k], dest[k]), f"{k} was committed before all its bytes were copied"
        else:
            assert dest[k] == v
    assert planner.commits == len([v for v in state.values() if isinstance(v, torch.Tensor)])  # once each
    (staging,) = made
    big_parts = [p for p in staging.parts if p.req.storage_index.fqn == "big"]
    assert [p.nbytes for p in big_parts] == [512 * KiB] * 3  # two whole pieces per part
    assert [p.dst_offset for p in big_parts] == [0, 512 * KiB, 1024 * KiB]
    assert [p.last_part for p in big_parts] == [False, False, True]
    wide = [p for p in staging.parts if p.req.storage_index.fqn == "wide_cast"]
    assert len(wide) == 1 and wide[0].buf.untyped_storage().data_ptr() not in {
        s.untyped_storage().data_ptr() for s in staging._slots}  # a pageable buffer of its own
    assert len(staging.batches_bound) >= 6 and {k for k, _ in staging.batches_bound} == {0, 1}
    assert len(staging.recorded) == len(staging.batches_bound) + 1  # and wide_cast's own buffer
    assert len(staging.waited) == len(staging.recorded)  # finish() waited for the last ones too


def test_a_flipped_byte_in_a_part_names_its_piece(tmp_path, staged_on_cpu):
    state = _state()
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "c", host_cache_size=staged_on_cpu))
    doc = json.loads((tmp_path / "c" / ".metadata").read_bytes())
    big = doc["items"]["big"]["chunks"][0]
    info = doc["files"][big["file"]]
    start, piece = info["data_start"], info["piece_size"]
    lo = start + ((big["offset"] - start) // piece + 3) * piece  # the 4th piece: in the second part
    f = tmp_path / "c" / big["file"]
    raw = bytearray(f.read_bytes())
    raw[lo + 99] ^= 0x04
    f.write_bytes(bytes(raw))
    with raises_through_dcp(rf"checksum mismatch in {big['file']}, item 'big' .*bytes \[{lo}, {lo + piece}\)"):
        dcp.load(_dest(state), storage_reader=DataStatesReader(tmp_path / "c"))
    dest = _dest(state)
    dcp.load(dest, storage_reader=DataStatesReader(tmp_path / "c", verify=False))
    assert (dest["big"] != state["big"]).sum() == 1 and torch.equal(dest["big2"], state["big2"])


def test_a_slot_that_cannot_be_pinned_is_pageable_with_a_warning(caplog):
    """Pinning fails where no pinned allocator exists (this machine) or memory locking is
    limited: the load goes on through pageable slots (the event waits keep it correct)."""
    if torch.cuda.is_available():
        pytest.skip("pinning works here")
    with caplog.at_level("WARNING", logger="dcp_datastates"):
        slot = read.DeviceStaging()._new_slot(4096)
    assert slot.numel() == 4096 and slot.dtype == torch.uint8 and not slot.is_pinned()
    assert "could not pin a 4096-byte load buffer" in caplog.text


def test_slots_grow_for_a_larger_file_only_after_their_copies(monkeypatch):
    """Slots are sized by the first file (64 KiB for 8 KiB of items) and replaced by larger ones
    for a later, larger file only once the copies out of them were waited for; every item's
    bytes land in its destination (buffers in a batch never overlap)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from dcp_datastates.format.locations import ItemLocation

    monkeypatch.setattr(read, "SLOT_BYTES", 1 << 20)
    staging = CpuStaging()
    sizes_made = []
    monkeypatch.setattr(staging, "_new_slot", lambda size: sizes_made.append(size) or torch.empty(size, dtype=torch.uint8))
    planner = CommitLog()
    dests = {}

    def file_targets(tag: str, counts: list[int]) -> list[read.ReadTarget]:
        out, offset = [], 4096
        for i, n in enumerate(counts):
            fqn = f"{tag}{i}"
            loc = ItemLocation(f"{tag}.safetensors", offset, 4 * n, "float32", (n,), (), 4096, 1 << 20)
            req = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn), dest_offsets=torch.Size([0]),
                           storage_index=MetadataIndex(fqn), storage_offsets=torch.Size([0]), lengths=torch.Size([n]))
            dests[fqn] = (torch.zeros(n), offset)
            p = read._span_target(req, loc, dests[fqn][0], verify=False)
            p.staged, p.dst_offset = True, 0
            out.append(p)
            offset += 4 * n
        return out

    def file_bytes(start: int, end: int) -> torch.Tensor:
        return (torch.arange(start, end) % 251).to(torch.uint8)

    for tag, counts in (("a", [100] * 20), ("b", [50_000] * 10)):  # 8 KB, then 2 MB of items
        for batch in staging.batches(file_targets(tag, counts)):
            for p in batch:  # what read_targets does: the file's bytes at [read_start, read_end)
                p.buf.copy_(file_bytes(p.read_start, p.read_end))
            staging.copy(batch, planner)
    staging.finish()
    for fqn, (dst, offset) in dests.items():
        assert torch.equal(dst.view(torch.uint8), file_bytes(offset, offset + dst.nbytes)), fqn
    assert sizes_made == [64 * KiB, 1 << 20, 1 << 20]  # file a: one 64 KiB slot; file b: two 1 MiB slots
    assert planner.commits == 30 and len(staging.waited) == len(staging.recorded)
