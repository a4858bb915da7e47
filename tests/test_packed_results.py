"""Write results packed per rank (format/results.py): the coordinator commits the same bytes from
them as from DCP's one-result-per-chunk lists, refuses the same damage naming the same item, and
reads them as the usual mapping when a tier asks; a rank's packed results pickle small."""

from __future__ import annotations

import dataclasses
import pickle
import random
from array import array

import pytest
import torch
from test_packed_metadata import SHAPES, sharded
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from dcp_datastates import CheckpointFormatError
from dcp_datastates.format import packed_encode
from dcp_datastates.format.locations import ItemLocation
from dcp_datastates.format.metadata import decode_metadata, encode_commit
from dcp_datastates.format.results import NARROWED, PACKED_RESULTS, CommitLocations, PackedResults, pack_write_results


def per_rank(locs: dict) -> list[list[WriteResult]]:
    """The locations as each rank's write results (a rank: the file its items are in)."""
    ranks: dict[str, list[WriteResult]] = {}
    for index, loc in locs.items():
        ranks.setdefault(loc.file, []).append(WriteResult(index=index, size_in_bytes=loc.length, storage_data=loc))
    return list(ranks.values())


def gathered(md, locs: dict) -> CommitLocations:
    """What the coordinator holds once every rank sent its packed results (pickled, as DCP does)."""
    return CommitLocations([pickle.loads(pickle.dumps(pack_write_results(r))) for r in per_rank(locs)], md)


def hashes(i: int):
    return None if i % 3 == 0 else (i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)


@pytest.fixture(params=["one group", "a group per rank"])
def place_group(request, monkeypatch):
    """The commit places the ranks' results a group of ranks at a time: all at once, or each
    rank alone (a later group's result for a chunk must still win, its numbering continue)."""
    if request.param != "one group":
        monkeypatch.setattr(packed_encode, "_PLACE_GROUP", 1)
    return request.param


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("grid", [None, (3, 2)])
def test_commit_from_packed_results_is_the_commit_from_each_result(grid, packed, place_group):
    md, locs = sharded(SHAPES, 6, grid=grid, hashed=hashes)
    expected = encode_commit(md, locs, "test", packed=packed)
    results = gathered(md, locs)
    assert all(isinstance(b, PackedResults) for b in results.blocks) and len(results.blocks) == 6
    assert results.chunks_packed and all(i.offset is None for i in results.plain)
    assert encode_commit(md, results, "test", packed=packed) == expected
    assert dict(results) == locs  # the mapping a tier reads: every index and location as sent


def test_hints_wrong_or_missing_and_duplicates_resolve_as_the_dict_does(place_group):
    md, locs = sharded(SHAPES, 4, grid=(2, 2))
    rng = random.Random(3)
    changed = {}
    for index, loc in locs.items():
        if index.offset is not None:
            hint = rng.choice([None, index.index, 0, 10**6, -1 if index.index else None])
            index = dataclasses.replace(index, index=hint)
        changed[index] = loc
    ranks = per_rank(changed)
    # a later rank sends another result for one chunk: it wins, as in a dict of all results
    victim = next(i for i in changed if i.fqn == "big" and i.offset is not None)
    moved = changed[victim]._replace(offset=changed[victim].offset)
    ranks[-1].append(WriteResult(index=dataclasses.replace(victim, index=None), size_in_bytes=1, storage_data=moved))
    plain = {r.index: r.storage_data for rr in ranks for r in rr}
    results = CommitLocations([pack_write_results(r) for r in ranks], md)
    assert encode_commit(md, results, "test", packed=True) == encode_commit(md, plain, "test", packed=True)


def test_a_result_for_a_tensor_the_metadata_does_not_list_is_left_out():
    md, locs = sharded(SHAPES, 2)
    extra = ItemLocation("__9_0.safetensors", 4096, 8, "float32", (2,), (1,), 4096, 4096, 0, None)
    ranks = per_rank(locs) + [[WriteResult(index=MetadataIndex("ghost", torch.Size([0])), size_in_bytes=8,
                                           storage_data=extra)]]
    plain = {r.index: r.storage_data for rr in ranks for r in rr}
    packed = encode_commit(md, CommitLocations([pack_write_results(r) for r in ranks], md), "test", packed=True)
    assert packed == encode_commit(md, plain, "test", packed=True)
    assert b"__9_0" not in packed[0]


@pytest.mark.parametrize("damage, message", [
    (lambda locs, i: locs.pop(i), r"no write result for item 'big' at offset \[750, 0\]"),
    (lambda locs, i: locs.__setitem__(i, locs[i]._replace(data_start=8192)),
     r"item 'big' at offset \[750, 0\]: its checksum grid \(8192, 4096\) is not its file's"),
    (lambda locs, i: locs.__setitem__(i, locs[i]._replace(length=locs[i].length + 4)),
     r"item 'big' chunk 1: its stored length does not match"),
    (lambda locs, i: locs.__setitem__(i, locs[i]._replace(crc32c=(1 << 33,) + locs[i].crc32c[1:])),
     r"item 'big' chunk 1: crc32c must be a list of 32-bit integers"),
])
def test_damage_is_refused_naming_the_item_as_from_each_result(damage, message):
    md, locs = sharded(SHAPES, 4)
    target = next(i for i in locs if i.fqn == "big" and i.offset is not None and i.offset[0] == 750)
    damage(locs, target)
    for source in (locs, gathered(md, locs)):
        with pytest.raises(CheckpointFormatError, match=message):
            encode_commit(md, source, "test", packed=True)


def test_columns_that_fit_travel_as_32_bit_items_and_a_mix_of_widths_commits_the_same():
    md, locs = sharded(SHAPES, 4, grid=(2, 2), hashed=hashes)
    ranks = [pack_write_results(r) for r in per_rank(locs)]
    blocks = [r.storage_data for rr in ranks for r in rr if isinstance(r.storage_data, PackedResults)]
    assert {getattr(b, name).typecode for b in blocks for name in NARROWED} == {"i"}
    assert {b.key.typecode for b in blocks} == {"q"}  # a 64-bit name key stays 64-bit
    expected = encode_commit(md, locs, "test", packed=True)
    assert encode_commit(md, CommitLocations(ranks, md), "test", packed=True) == expected
    # One rank's values do not fit (a file past 2 GiB): its offsets stay 64-bit, the others' not.
    far = {i: (loc._replace(offset=loc.offset + (3 << 30), file_size=loc.file_size + (3 << 30))
               if loc.file == blocks[1].files[0][0] else loc) for i, loc in locs.items()}
    ranks = [pickle.loads(pickle.dumps(pack_write_results(r))) for r in per_rank(far)]
    codes = [r.storage_data.offset.typecode for rr in ranks for r in rr if isinstance(r.storage_data, PackedResults)]
    assert sorted(codes) == ["i", "i", "i", "q"]
    results = CommitLocations(ranks, md)
    assert encode_commit(md, results, "test", packed=True) == encode_commit(md, far, "test", packed=True)
    assert dict(results) == far


def test_a_chunk_grid_past_32_bits_stays_64_bit_and_commits_the_same():
    """The metadata's chunk offsets and sizes are kept as 32-bit columns when they fit: a tensor of
    3 GiB in three 1 GiB chunks (an offset past 2**31) keeps 64-bit ones, committed and read back
    as from each result."""
    GiB, start = 1 << 30, 4096
    chunks = [ChunkStorageMetadata(torch.Size([k * GiB]), torch.Size([GiB])) for k in range(3)]
    md = Metadata({"huge": TensorStorageMetadata(TensorProperties(dtype=torch.uint8), torch.Size([3 * GiB]), chunks),
                   "w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]),
                                              [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])})
    locs = {MetadataIndex("huge", torch.Size([k * GiB]), k): ItemLocation(
        f"__{k}_0.safetensors", start, GiB, "uint8", (GiB,), (k + 1,), start, GiB, start + GiB + 16, None)
        for k in range(3)}
    locs[MetadataIndex("w", torch.Size([0]), 0)] = ItemLocation("__0_0.safetensors", start + GiB, 16, "float32", (4,),
                                                              (9,), start, GiB, start + GiB + 16, None)
    assert packed_encode._layout_of(md.state_dict_metadata).offsets.dtype == torch.int64
    assert packed_encode._layout_of(sharded(SHAPES, 2)[0].state_dict_metadata).offsets.dtype == torch.int32
    expected = encode_commit(md, locs, "test", packed=True)
    assert encode_commit(md, gathered(md, locs), "test", packed=True) == expected
    decoded, _ = decode_metadata(expected[0], "test")
    assert [list(c.offsets) for c in decoded.state_dict_metadata["huge"].chunks] == [[0], [GiB], [2 * GiB]]


def test_a_packed_column_of_another_item_type_is_refused_naming_it():
    md, locs = sharded(SHAPES, 2)
    ranks = [pack_write_results(r) for r in per_rank(locs)]
    block = ranks[0][-1].storage_data
    block.length = array("d", block.length)
    with pytest.raises(CheckpointFormatError, match="column 'length' holds items of type 'd', not integers"):
        encode_commit(md, CommitLocations(ranks, md), "test", packed=True)


def test_a_rank_sends_one_small_object():
    md, locs = sharded({f"layer{i}.w": ((64, 8), torch.float32) for i in range(300)}, 8)  # one checksum each
    rank = per_rank(locs)[0]
    packed = pack_write_results(rank)
    assert [r.index for r in packed] == [PACKED_RESULTS]
    assert packed[0].size_in_bytes == sum(r.size_in_bytes for r in rank)
    one_by_one, at_once = len(pickle.dumps(rank)), len(pickle.dumps(packed))
    assert at_once < one_by_one * 2 / 3, (at_once, one_by_one)


def test_the_layout_of_a_metadata_reused_is_made_once_and_again_when_it_changes():
    import copy

    from dcp_datastates.format import packed_encode as packed_codec

    md, locs = sharded(SHAPES, 4)
    first = encode_commit(md, gathered(md, locs), "test", packed=True)
    layout = packed_codec._last_layout[1]
    packed = []
    real_pack = packed_codec._pack

    def counting(values, **kwargs):
        packed.append(values)
        return real_pack(values, **kwargs)

    packed_codec._pack = counting
    try:
        assert encode_commit(md, gathered(md, locs), "test", packed=True) == first
        again = packed_codec.pack_items(md.state_dict_metadata)
    finally:
        packed_codec._pack = real_pack
    assert packed_codec._last_layout[1] is layout  # the steady state: DCP's cached metadata again
    # ... whose chunk grid is packed once: a commit packs the locations that changed alone (here its
    # checksums: the file, offset, length and checksum-count columns are the last commit's), the
    # metadata broadcast after it nothing.
    assert len(packed) == 1 and packed[0].numel() == sum(len(v.crc32c) for i, v in locs.items() if i.offset is not None)
    assert again[2] == layout.packed_columns() and set(again[2]) == {"chunks", "offsets", "sizes"}
    # The same metadata object, one tensor's chunks changed in place: laid out anew, and the
    # commit is what a fresh copy of that metadata commits (here: refused, two chunks share bytes).
    big = md.state_dict_metadata["big"]
    big.chunks.append(copy.deepcopy(big.chunks[-1]))
    with pytest.raises(CheckpointFormatError) as fresh:
        encode_commit(copy.deepcopy(md), gathered(md, locs), "test", packed=True)
    with pytest.raises(CheckpointFormatError) as reused:
        encode_commit(md, gathered(md, locs), "test", packed=True)
    assert packed_codec._last_layout[1] is not layout and str(reused.value) == str(fresh.value)


def test_a_steady_state_placement_is_taken_again_only_for_the_same_placement_columns(monkeypatch):
    """The last commit's placement (which result each chunk takes) is kept with a digest of the
    results' key, hint, ndim and offsets columns: a save sending the same ones (new checksums)
    is not placed again; results in another order, or with other offsets, are; every commit
    equals the one from the results one by one."""
    md, locs = sharded(SHAPES, 4, grid=(2, 2))
    # no hints: offsets alone decide where a result goes
    locs = {dataclasses.replace(i, index=None) if i.offset is not None else i: v for i, v in locs.items()}
    afresh = []
    real = packed_encode._place_afresh
    monkeypatch.setattr(packed_encode, "_place_afresh", lambda *a: afresh.append(1) or real(*a))

    def commit(locations, ranks=None):
        ranks = ranks or per_rank(locations)
        packed = CommitLocations([pickle.loads(pickle.dumps(pack_write_results(r))) for r in ranks], md)
        plain = {r.index: r.storage_data for rr in ranks for r in rr}
        assert encode_commit(md, packed, "test", packed=True) == encode_commit(md, plain, "test", packed=True)
        return len(afresh)

    assert commit(locs) == 1
    rng = random.Random(5)
    new_sums = {i: v._replace(crc32c=tuple(rng.getrandbits(32) for _ in v.crc32c)) for i, v in locs.items()}
    assert commit(new_sums) == 1  # the steady state: the same placement, new checksums
    # Two results of one tensor sent with each other's offsets (their key, hint and ndim alike):
    # each now holds the other chunk.
    a, b = (i for i in locs if i.fqn == "big" and list(i.offset) in ([0, 0], [1500, 0]))
    swapped = {(b if i == a else a if i == b else i): v for i, v in new_sums.items()}
    assert commit(swapped) == 2
    assert commit(swapped) == 2
    assert commit(swapped, per_rank(swapped)[::-1]) == 3  # the ranks' results in another order


def test_decoded_packed_metadata_pickles_to_the_same_items_and_locations():
    """DCP may send a reader's metadata between processes: the views of the decoded columns go
    as arrays and read back the same."""
    from dcp_datastates.format.metadata import decode_metadata

    md, locs = sharded(SHAPES, 3, grid=(3, 1), hashed=hashes)
    decoded, _ = decode_metadata(encode_commit(md, locs, "test", packed=True)[0], "test")
    again = pickle.loads(pickle.dumps(decoded))
    assert dict(again.storage_data) == dict(decoded.storage_data) == {
        dataclasses.replace(i, index=None): loc._replace(file_size=decoded.storage_data[i].file_size) for i, loc in locs.items()}
    assert {f: again.state_dict_metadata[f] for f in again.state_dict_metadata} == dict(md.state_dict_metadata)


def test_real_saves_commit_version_3_from_packed_results(tmp_path):
    """4 gloo ranks: async saves with plan caching, results through node leaders and straight
    to the coordinator, committed as version 3 and loaded back resharded, value for value."""
    import json

    import multirank_workers as W
    from dist_harness import run_ranks

    run_ranks(4, W.phase_packed, str(tmp_path))
    for name in ("packed_hier", "packed_flat"):
        assert json.loads((tmp_path / name / ".metadata").read_bytes())["version"] == 3


def test_the_global_metadata_is_sent_packed_and_copied_as_a_dict():
    """DCP pickles the global metadata to every rank after a save: a large one goes as packed
    columns and arrives as a PackedItems of the same items; a copy stays a plain dict."""
    import copy

    from dcp_datastates.format.packed import PackedItems
    from dcp_datastates.planners import _SentPacked

    md, _ = sharded(SHAPES, 5, grid=(5, 1))
    sent = _SentPacked(md.state_dict_metadata)
    received = pickle.loads(pickle.dumps(sent))
    assert isinstance(received, PackedItems) and dict(received) == dict(md.state_dict_metadata)
    assert len(pickle.dumps(sent)) < len(pickle.dumps(dict(sent)))
    assert type(copy.deepcopy(sent)) is dict and copy.deepcopy(sent) == dict(sent) and type(copy.copy(sent)) is dict
