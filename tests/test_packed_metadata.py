"""The packed ``.metadata`` (format version 3, format/packed.py): what it encodes decodes to the
same DCP objects as version 1, every damage the version 1 decoder refuses is refused here too,
naming the item, and the load planning it allows (a tensor's chunks near a rank's own) makes the
same read items as DCP's over all chunks."""

from __future__ import annotations

import base64
import json
import random
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import dcp_datastates.format.metadata as metadata_codec
from dcp_datastates import CheckpointFormatError, DataStatesLoadPlanner, DataStatesReader, DataStatesWriter
from dcp_datastates.format.locations import ItemLocation
from dcp_datastates.format.metadata import decode_metadata, encode_commit, encode_metadata
from dcp_datastates.format.packed import PackedItems, PackedLocations
from dcp_datastates.native import engine_module

STEP = 1 << 12  # a small checksum grid, so items span several pieces
_engine = engine_module()


def sharded(shapes: dict, ranks: int, *, grid: tuple[int, int] | None = None, hashed=lambda i: None,
            values=("step",)) -> tuple[Metadata, dict]:
    """Metadata and locations of a save of ``shapes`` split along dim 0 over ``ranks`` files (or a
    2-D ``grid`` of dim-0 x dim-1 blocks), each rank's items back to back in its file."""
    rng = random.Random(7)
    state, locs = {}, {}
    ends = [STEP] * ranks
    serial = 0

    def place(rank: int, fqn: str, offsets, sizes, dtype) -> None:
        nonlocal serial
        n = 1
        for s in sizes:
            n *= s
        n *= dtype.itemsize
        start = ends[rank]
        pieces = _engine.piece_count(start, n, STEP, STEP)
        locs[MetadataIndex(fqn, torch.Size(offsets), len(state[fqn].chunks))] = ItemLocation(
            f"__{rank}_0.safetensors", start, n, str(dtype).removeprefix("torch."), tuple(sizes),
            tuple(rng.getrandbits(32) for _ in range(pieces)), STEP, STEP, 0, hashed(serial))
        state[fqn].chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        ends[rank] += n
        serial += 1

    for fqn, (shape, dtype) in shapes.items():
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])
        if not shape:
            place(0, fqn, (), (), dtype)
            continue
        rows = ranks if grid is None or len(shape) < 2 else grid[0]
        cols = 1 if grid is None or len(shape) < 2 else grid[1]
        per_r, per_c = -(-shape[0] // rows), -(-shape[1] // cols) if len(shape) > 1 else 0
        for r in range(rows):
            for q in range(cols):
                o0 = min(r * per_r, shape[0])
                s0 = max(0, min(per_r, shape[0] - o0))
                offsets, sizes = [o0], [s0]
                if len(shape) > 1:
                    o1 = min(q * per_c, shape[1]) if cols > 1 else 0
                    s1 = max(0, min(per_c, shape[1] - o1)) if cols > 1 else shape[1]
                    offsets, sizes = [o0, o1] + [0] * (len(shape) - 2), [s0, s1] + list(shape[2:])
                place((r * cols + q) % ranks, fqn, offsets, sizes, dtype)
    for name in values:
        state[name] = BytesStorageMetadata()
        rank = ranks - 1
        locs[MetadataIndex(name)] = ItemLocation(f"__{rank}_0.safetensors", ends[rank], 37, "uint8", (37,),
                                                 (rng.getrandbits(32),), STEP, STEP, 0, None)
        ends[rank] += 37
    return Metadata(state_dict_metadata=state, storage_meta=StorageMeta(checkpoint_id="c", save_id="s")), locs


SHAPES = {
    "w": ((50, 8), torch.float32), "b": ((13,), torch.bfloat16), "big": ((3000, 5), torch.float32),
    "scalar": ((), torch.float64), "empty": ((0, 4), torch.float32), "cube": ((9, 6, 2), torch.int64),
}


def _plain(md: Metadata) -> tuple[dict, dict]:
    """The decoded metadata as plain values, for comparing two decodes."""
    items = {fqn: (type(v).__name__, getattr(v, "size", None), str(getattr(getattr(v, "properties", None), "dtype", "")),
                   [(tuple(c.offsets), tuple(c.sizes)) for c in getattr(v, "chunks", [])])
             for fqn, v in md.state_dict_metadata.items()}
    locs = {(i.fqn, None if i.offset is None else tuple(i.offset)): loc for i, loc in md.storage_data.items()}
    return items, locs


@pytest.mark.parametrize("grid", [None, (3, 2)])
def test_packed_decodes_to_what_version_1_decodes(grid):
    hashes = lambda i: None if i % 3 == 0 else (i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)  # noqa: E731
    md, locs = sharded(SHAPES, 6, grid=grid, hashed=hashes)
    packed, files_p = encode_commit(md, locs, "test", packed=True)
    plain, files_j = encode_commit(md, locs, "test", packed=False)
    assert json.loads(packed)["version"] == 3 and json.loads(plain)["version"] == 1
    assert files_p == files_j
    md_p, f_p = decode_metadata(packed, "p")
    md_j, f_j = decode_metadata(plain, "j")
    assert f_p == f_j
    assert isinstance(md_p.state_dict_metadata, PackedItems) and isinstance(md_p.storage_data, PackedLocations)
    items_p, locs_p = _plain(md_p)
    items_j, locs_j = _plain(md_j)
    assert items_p == items_j
    assert locs_p == locs_j
    assert any(loc.hash64 is not None and loc.hash64 >= 1 << 63 for loc in locs_p.values())  # full 64 bits
    assert md_p.storage_meta == md_j.storage_meta and md_p.planner_data == md_j.planner_data
    # a lookup by DCP's index (position hint right, wrong or missing) finds the same location
    for index, loc in locs.items():
        assert md_p.storage_data[index].crc32c == loc.crc32c
        if index.offset is not None:
            assert md_p.storage_data[MetadataIndex(index.fqn, index.offset)].offset == loc.offset
            assert md_p.storage_data[MetadataIndex(index.fqn, index.offset, 0)].offset == loc.offset
    with pytest.raises(KeyError):
        md_p.storage_data[MetadataIndex("w", torch.Size([1, 0]))]
    # the document re-encodes from the decoded objects to the same bytes
    assert encode_metadata(md_p, dict(md_p.storage_data), packed=True) == packed


def test_a_regular_sharding_packs_to_a_few_bytes_per_chunk():
    shapes = {f"l{i}.w": ((4096, 64), torch.float32) for i in range(40)}
    md, locs = sharded(shapes, 256, values=())
    packed = encode_commit(md, locs, "t", packed=True)[0]
    plain = encode_commit(md, locs, "t", packed=False)[0]
    crc_bytes = 4 * sum(len(loc.crc32c) for loc in locs.values())
    assert len(packed) < crc_bytes * 4 / 3 + 12 * len(locs) + 40_000, len(packed)  # base64'd checksums dominate
    assert len(plain) > 8 * len(packed)


def test_a_save_of_many_chunks_writes_version_3_and_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(metadata_codec, "PACK_FROM_CHUNKS", 5)
    state = {"a": torch.randn(10, 3), "b": torch.arange(7), "e": torch.zeros(0, 4), "s": torch.tensor(3.0),
             "h": torch.randn(4, 4).to(torch.bfloat16), "opt": {"lr": 0.1, "betas": (0.9, 0.95)}}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path), no_dist=True)
    assert json.loads((tmp_path / ".metadata").read_bytes())["version"] == 3
    out = {"a": torch.zeros(10, 3), "b": torch.zeros(7, dtype=torch.int64), "e": torch.ones(0, 4),
           "s": torch.tensor(0.0), "h": torch.zeros(4, 4, dtype=torch.bfloat16), "opt": {"lr": 0.0, "betas": None}}
    dcp.load(out, storage_reader=DataStatesReader(tmp_path), no_dist=True)
    for k in ("a", "b", "s", "h"):
        assert torch.equal(out[k], state[k]), k
    assert out["opt"] == {"lr": 0.1, "betas": (0.9, 0.95)}
    # the stock planner reads it the same way
    again = {"a": torch.zeros(10, 3)}
    dcp.load(again, storage_reader=DataStatesReader(tmp_path), planner=DefaultLoadPlanner(allow_partial_load=True),
             no_dist=True)
    assert torch.equal(again["a"], state["a"])


# ----------------------------------------------------------------------------- damage
def _doc() -> tuple[dict, Metadata, dict]:
    md, locs = sharded(SHAPES, 4)
    return json.loads(encode_commit(md, locs, "t", packed=True)[0]), md, locs


def _column(doc: dict, name: str) -> list[int]:
    rec = doc["columns"][name]
    raw = zlib.decompress(base64.b64decode(rec["data"]))
    dtype = dict(i1=torch.int8, i2=torch.int16, i4=torch.int32, i8=torch.int64)[rec["int"]]
    values = torch.frombuffer(bytearray(raw), dtype=dtype).to(torch.int64) if raw else torch.zeros(0, dtype=torch.int64)
    return (torch.cumsum(values, 0) if rec["delta"] else values).tolist()


def _set_column(doc: dict, name: str, values: list[int]) -> None:
    delta = doc["columns"][name]["delta"]
    t = torch.tensor(values, dtype=torch.int64)
    if delta and len(t) > 1:
        t = torch.cat((t[:1], t[1:] - t[:-1]))
    raw = bytes(bytearray(t.numel() * 8)) if len(t) else b""
    if len(t):
        buf = bytearray(raw)
        torch.frombuffer(buf, dtype=torch.int64).copy_(t)
        raw = bytes(buf)
    doc["columns"][name] = {"int": "i8", "delta": delta, "n": len(values), "crc32": zlib.crc32(raw),
                            "data": base64.b64encode(zlib.compress(raw)).decode()}


def _decode(doc: dict):
    return decode_metadata(json.dumps(doc).encode(), "ckpt/.metadata")


def _refused(doc: dict, *words: str) -> None:
    with pytest.raises(CheckpointFormatError) as info:
        _decode(doc)
    text = str(info.value)
    assert "ckpt/.metadata" in text
    for w in words:
        assert w in text, text


def test_an_intact_document_decodes():
    doc, md, _ = _doc()
    assert list(_decode(doc)[0].state_dict_metadata["w"].chunks) == md.state_dict_metadata["w"].chunks


def test_damaged_columns_are_refused():
    doc, _, _ = _doc()
    doc["columns"]["offset"]["data"] = doc["columns"]["offset"]["data"][:-8] + "AAAAAAA="
    _refused(doc, "column 'offset'")
    doc, _, _ = _doc()
    doc["columns"]["length"]["crc32"] ^= 1
    _refused(doc, "column 'length'", "checksum mismatch")
    doc, _, _ = _doc()
    doc["columns"]["file"]["n"] += 1
    _refused(doc, "column 'file'")
    doc, _, _ = _doc()
    doc["columns"]["file"]["int"] = "f8"
    _refused(doc, "unknown integer type")
    doc, _, _ = _doc()
    del doc["columns"]["sizes"]
    _refused(doc, "missing column 'sizes'")
    doc, _, _ = _doc()
    # a column that inflates far beyond what it claims is cut at its claimed size
    bomb = zlib.compress(bytes(50_000_000))
    doc["columns"]["offset"].update(data=base64.b64encode(bomb).decode())
    _refused(doc, "column 'offset'")


def test_a_chunk_outside_its_tensor_is_refused():
    doc, _, _ = _doc()
    offs = _column(doc, "offsets")
    offs[0] = 10_000  # "w" chunk 0, dim 0
    _set_column(doc, "offsets", offs)
    _refused(doc, "item 'w' chunk 0", "exceeds the tensor's size")


def test_a_length_that_does_not_match_the_shape_is_refused():
    doc, _, _ = _doc()
    lengths = _column(doc, "length")
    lengths[1] -= 4
    _set_column(doc, "length", lengths)
    _refused(doc, "item 'w' chunk 1", "length does not match")


def test_chunks_that_do_not_cover_their_tensor_are_refused():
    doc, _, _ = _doc()
    sizes, lengths = _column(doc, "sizes"), _column(doc, "length")
    sizes[0] -= 1  # "w" chunk 0 one row short, its length to match
    lengths[0] -= 8 * 4
    _set_column(doc, "sizes", sizes)
    _set_column(doc, "length", lengths)
    _refused(doc, "item 'w'", "its chunks hold 392 elements", "has 400")


def test_a_range_outside_its_file_is_refused():
    doc, _, _ = _doc()
    offsets = _column(doc, "offset")
    offsets[2] = doc["files"]["__2_0.safetensors"]["size"]
    _set_column(doc, "offset", offsets)
    _refused(doc, "item 'w' chunk 2", "outside the data region")
    doc, _, _ = _doc()
    files = _column(doc, "file")
    files[0] = 99
    _set_column(doc, "file", files)
    _refused(doc, "item 'w' chunk 0", "file the metadata does not list")


def test_a_wrong_number_of_checksums_is_refused():
    doc, _, _ = _doc()
    counts = _column(doc, "crc_count")
    counts[0] += 1
    _set_column(doc, "crc_count", counts)
    _refused(doc, "item 'w' chunk 0", "2 checksums for 1 pieces")


def test_two_items_sharing_bytes_are_refused():
    doc, md, locs = _doc()
    files, offsets = _column(doc, "file"), _column(doc, "offset")
    # "b" chunk 0 moved onto the bytes of "w" chunk 0 (same file, overlapping)
    b0 = len(md.state_dict_metadata["w"].chunks)
    files[b0], offsets[b0] = files[0], offsets[0] + 4
    _set_column(doc, "file", files)
    _set_column(doc, "offset", offsets)
    _refused(doc, "share bytes", "w chunk 0", "b chunk 0")
    # a value over a chunk's bytes
    doc, md, locs = _doc()
    doc["values"]["step"]["file"] = "__0_0.safetensors"
    doc["values"]["step"]["offset"] = locs[MetadataIndex("w", torch.Size([0, 0]), 0)].offset
    _refused(doc, "share bytes", "'step'", "'w chunk 0'")  # the chunk named by its own index


def test_bad_tensor_entries_are_refused():
    doc, _, _ = _doc()
    doc["tensors"][0][1] = "float128"
    _refused(doc, "item 'w'", "unknown dtype")
    doc, _, _ = _doc()
    doc["tensors"][1] = ["w"] + doc["tensors"][1][1:]
    _refused(doc, "listed twice")
    doc, _, _ = _doc()
    doc["tensors"][0][3] = [-1, 8]
    _refused(doc, "item 'w'", "non-negative")
    doc, _, _ = _doc()
    doc["tensors"][0] = "w"
    _refused(doc, "tensors[0]")
    doc, _, _ = _doc()
    doc["values"]["w"] = doc["values"].pop("step")
    _refused(doc, "'w' is both a tensor and a value")


def test_the_commit_refuses_what_the_decoder_would():
    md, locs = sharded(SHAPES, 4)
    first = MetadataIndex("w", torch.Size([0, 0]), 0)
    second = MetadataIndex("w", torch.Size([13, 0]), 1)
    bad = dict(locs)
    bad[second] = locs[second]._replace(file=locs[first].file, offset=locs[first].offset + 8)
    with pytest.raises(CheckpointFormatError, match="share bytes"):
        encode_commit(md, bad, "being committed", packed=True)
    missing = dict(locs)
    del missing[second]
    with pytest.raises(CheckpointFormatError, match=r"no write result for item 'w' at offset \[13, 0\]"):
        encode_commit(md, missing, "being committed", packed=True)


# ----------------------------------------------------------------------------- planning
class Shard(torch.Tensor):
    """A local tensor that DCP plans as one box of a larger tensor (as a DTensor's shard)."""

    @staticmethod
    def __new__(cls, box, size):
        out = torch.Tensor._make_subclass(cls, torch.zeros(box[1]))
        out._box, out._global = box, torch.Size(size)
        return out

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(torch.Size(self._box[0]), torch.Size(self._box[1]))]

    def size(self, *dim):
        return self._global if not dim else self._global[dim[0]]

    @property
    def shape(self):
        return self._global

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def _items(plan) -> list:
    return sorted((r.storage_index.fqn, tuple(r.storage_index.offset or ()), r.storage_index.index,
                   tuple(r.dest_offsets), tuple(r.storage_offsets), tuple(r.lengths)) for r in plan.items)


@pytest.mark.parametrize("grid", [None, (4, 3)])
def test_planning_against_nearby_chunks_reads_what_dcp_reads(grid):
    shapes = {"w": ((97, 12), torch.float32), "v": ((40,), torch.float32), "s": ((), torch.float32)}
    md, locs = sharded(shapes, 12, grid=grid)
    raw = encode_commit(md, locs, "t", packed=True)[0]
    rng = random.Random(3)
    for _ in range(40):
        state = {}
        for fqn, (shape, _) in shapes.items():
            if not shape:
                state[fqn] = torch.zeros(())
                continue
            offsets = [rng.randrange(0, d) for d in shape]
            sizes = [rng.randrange(0, d - o + 1) for o, d in zip(offsets, shape)]
            state[fqn] = Shard((offsets, sizes), shape)
        state["step"] = 0
        plans = []
        for planner in (DataStatesLoadPlanner(), DefaultLoadPlanner()):
            decoded = decode_metadata(raw, "t")[0]
            planner.set_up_planner(state, decoded, is_coordinator=False)
            plans.append(_items(planner.create_local_plan()))
            for index in (r[0] for r in plans[-1]):
                assert index
        assert plans[0] == plans[1]
    # every read item's index finds its location by its position hint
    decoded = decode_metadata(raw, "t")[0]
    planner = DataStatesLoadPlanner()
    planner.set_up_planner(state, decoded, is_coordinator=False)
    for item in planner.create_local_plan().items:
        if item.storage_index.offset is not None:
            assert locs[item.storage_index] == decoded.storage_data[item.storage_index]._replace(
                file_size=0), item.storage_index


def test_planning_of_a_partial_state_dict_goes_through_dcp():
    shapes = {"w": ((20, 4), torch.float32), "v": ((8,), torch.float32)}
    md, locs = sharded(shapes, 4, values=())
    raw = encode_commit(md, locs, "t", packed=True)[0]
    state = {"w": Shard(([5, 0], [10, 4]), (20, 4))}
    got = []
    for planner in (DataStatesLoadPlanner(allow_partial_load=True), DefaultLoadPlanner(allow_partial_load=True)):
        planner.set_up_planner(state, decode_metadata(raw, "t")[0], is_coordinator=False)
        got.append(_items(planner.create_local_plan()))
    assert got[0] == got[1] and len(got[0]) == 2
