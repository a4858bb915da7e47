"""The engine's chunk table routines (csrc/chunk_table.cpp) against plain Python statements of
what they compute, on random inputs: shared bytes found (in whatever order the items come),
results placed by key, hint and offsets with the later one winning, rows gathered with their
checksums; and their arguments refused with ValueError when their sizes disagree."""

from __future__ import annotations

import random
from array import array

import pytest

from dcp_datastates.native import engine_module

_engine = engine_module()


def q(values) -> array:
    return array("q", values)


def shared_reference(fid, start, length):
    """The first pair sharing a byte in (file, start) order, by brute force; None."""
    items = sorted((f, s, i) for i, (f, s, n) in enumerate(zip(fid, start, length)) if n > 0)
    for (fa, sa, a), (fb, sb, b) in zip(items, items[1:]):
        if fa == fb and sb < sa + length[a]:
            return a, b
    return None


@pytest.mark.parametrize("seed", range(40))
def test_find_shared_bytes_is_the_brute_force_answer(seed):
    rng = random.Random(seed)
    files, n = rng.randint(1, 4), rng.randint(0, 30)
    fid, start, length = [], [], []
    ends = [0] * files
    for _ in range(n):  # mostly laid out back to back per file, sometimes overlapping or empty
        f = rng.randrange(files)
        s = ends[f] - (rng.randint(1, 5) if rng.random() < 0.1 else 0)
        k = 0 if rng.random() < 0.1 else rng.randint(1, 9)
        fid.append(f)
        start.append(max(s, 0))
        length.append(k)
        ends[f] = max(ends[f], max(s, 0) + k)
    order = list(range(n))
    if seed % 2:
        rng.shuffle(order)  # not in file order: the engine sorts
    fid, start, length = ([v[i] for i in order] for v in (fid, start, length))
    expected = shared_reference(fid, start, length)
    # ``ordered``: how many leading items the caller expects in order per file (a hint: the
    # answer may not depend on it), e.g. the table's chunks before the values
    found = _engine.find_shared_bytes(q(fid), q(start), q(length), files, rng.randint(-1, n))
    if expected is None:
        assert found is None
    else:  # the same overlap (an equal start may pair either way round)
        assert found is not None and {start[found[0]], start[found[1]]} == {start[expected[0]], start[expected[1]]}


def test_find_shared_bytes_refuses_a_file_index_out_of_range():
    with pytest.raises(ValueError, match="item 1: file index 3 out of range"):
        _engine.find_shared_bytes(q([0, 3]), q([0, 8]), q([4, 4]), 3)


@pytest.mark.parametrize("seed", range(60))
def test_place_chunks_and_gather_pieces_are_the_python_statement(seed):
    rng = random.Random(seed)
    T = rng.randint(1, 5)
    counts = [rng.randint(0, 4) for _ in range(T)]
    ndims = [rng.randint(0, 2) if counts[t] <= 1 else rng.randint(1, 2) for t in range(T)]
    keys = rng.sample(range(-(1 << 30), 1 << 30), T)
    table = []  # per tensor, dimension-major: every chunk's offset in dim 0, then dim 1
    boxes = []
    for t in range(T):
        offs = [tuple(rng.randrange(100) for _ in range(ndims[t])) for _ in range(counts[t])]
        boxes.append(offs)
        for d in range(ndims[t]):
            table.extend(o[d] for o in offs)
    results = []  # (key, position, offsets)
    for _ in range(rng.randint(0, 12)):
        t = rng.randrange(T)
        if counts[t] == 0 or rng.random() < 0.1:
            results.append((rng.randrange(1 << 40), 0, ()))  # a tensor the table does not list
            continue
        p = rng.randrange(counts[t])
        hint = p if rng.random() < 0.6 else rng.choice([-1, counts[t], (p + 1) % counts[t]])
        offs = boxes[t][p] if rng.random() < 0.9 else tuple(rng.randrange(100) for _ in range(ndims[t]))
        results.append((keys[t], hint, offs))
    starts = [sum(counts[:t]) for t in range(T)]
    src_ref = [-1] * sum(counts)
    status_ref = []
    for i, (key, hint, offs) in enumerate(results):
        t = keys.index(key) if key in keys else None
        if t is None:
            status_ref.append(-1)
        elif len(offs) != ndims[t]:
            status_ref.append(-2 - t)
        else:  # the hint when it holds, else the first chunk with the offsets
            p = hint if 0 <= hint < counts[t] and boxes[t][hint] == offs else next(
                (q for q, box in enumerate(boxes[t]) if box == offs), None)
            if p is None:
                status_ref.append(-2 - t)
            else:
                src_ref[starts[t] + p] = i
                status_ref.append(starts[t] + p)
    # Placed in two parts, each numbering its results from where the part starts (as the commit
    # places a group of ranks at a time); src's other rows stay as they were.
    src, status, cut = q([-1] * sum(counts)), [], rng.randint(0, len(results))
    for first, part in ((0, results[:cut]), (cut, results[cut:])):
        out = q([7] * len(part))
        _engine.place_chunks(q(keys), q(counts), q(ndims), q(table), q([r[0] for r in part]),
                             q([r[1] for r in part]), q([len(r[2]) for r in part]),
                             q([o for r in part for o in r[2]]), first, src, out)
        status.extend(out)
    assert list(src) == src_ref and status == status_ref
    # Gathering: every row from a result (a random one here), its checksums moved with it.
    N = max(len(results), 1)
    crc_count = [rng.randint(0, 3) for _ in range(N)]
    crcs = [rng.getrandbits(32) for _ in range(sum(crc_count))]
    first = [sum(crc_count[:i]) for i in range(N)]
    rows = [rng.randrange(N) for _ in range(sum(counts))]
    moved = array("I", [7] * sum(crc_count[i] for i in rows))
    _engine.gather_pieces(q(rows), q(crc_count), array("I", crcs), moved)
    assert list(moved) == [c for i in rows for c in crcs[first[i]:first[i] + crc_count[i]]]
    # The same from the columns in the narrow types the commit hands them in (the checksums, as
    # always, unsigned 32-bit items, half of them past 2**31), and with every input of the placement narrowed.
    narrow = array("I", [7] * len(moved))
    _engine.gather_pieces(array("i", rows), array("b", crc_count), array("I", crcs), narrow)
    assert narrow == moved
    src32, out = q([-1] * sum(counts)), q([7] * len(results))
    _engine.place_chunks(array("q", keys), array("i", counts), array("b", ndims), array("i", table),
                         q([r[0] for r in results]), array("i", [r[1] for r in results]),
                         array("b", [len(r[2]) for r in results]), array("i", [o for r in results for o in r[2]]),
                         0, src32, out)
    assert list(src32) == src_ref and list(out) == status_ref


def test_the_routines_refuse_columns_that_disagree():
    with pytest.raises(ValueError, match="offsets holds 1 values, 2 expected"):
        _engine.place_chunks(q([5]), q([1]), q([2]), q([0]), q([]), q([]), q([]), q([]), 0, q([0]), q([]))
    with pytest.raises(ValueError, match="first must not be negative, got -1"):
        _engine.place_chunks(q([5]), q([1]), q([2]), q([0, 0]), q([]), q([]), q([]), q([]), -1, q([0]), q([]))
    with pytest.raises(ValueError, match="row 0: no result 4"):
        _engine.gather_pieces(q([4]), q([0]), q([]), q([]))
    with pytest.raises(ValueError, match="result 0: negative checksum count"):
        _engine.gather_pieces(q([0]), q([-1]), q([]), q([]))
    with pytest.raises(ValueError, match="crcs holds 1 values, 2 expected"):
        _engine.gather_pieces(q([0]), q([2]), array("I", [7]), array("I", [0, 0]))
    with pytest.raises(ValueError, match="out holds 1 values, 2 expected"):
        _engine.gather_pieces(q([0]), q([2]), array("I", [7, 8]), array("I", [0]))
    with pytest.raises(ValueError, match="crcs: items of type 'q', one of 'I' expected"):
        _engine.gather_pieces(q([0]), q([1]), q([7]), array("I", [0]))
    with pytest.raises(ValueError, match=r"fid: not a buffer of integer values \(item type 'B', 1 bytes\)"):
        _engine.find_shared_bytes(b"123", q([]), q([]), 1)
    with pytest.raises(ValueError, match=r"start: not a buffer of integer values \(item type 'd', 8 bytes\)"):
        _engine.find_shared_bytes(q([0]), array("d", [0.0]), q([1]), 1)
    with pytest.raises(ValueError, match=r"out: not a buffer of uint32 values \(item type 'q', 8 bytes\)"):
        _engine.gather_pieces(q([0]), q([1]), array("I", [7]), q([0]))
    with pytest.raises(ValueError, match=r"src: not a buffer of int64 values \(item type 'i', 4 bytes\)"):
        _engine.place_chunks(q([5]), q([1]), q([1]), q([0]), q([5]), q([0]), array("b", [1]), q([0]), 0,
                             array("i", [0]), q([0]))
    empty = [q([])] * 6
    with pytest.raises(ValueError, match="crc_starts holds 0 values, 1 expected"):
        _engine.check_chunk_table(*empty, *[q([])] * 7, q([]), q([]), q([]))
    # One tensor of one chunk, its chunk columns of two item types: refused (the check reads each
    # group of columns with one type).
    tensor = [q([1]), q([1]), q([4]), q([2]), q([0]), q([2])]
    chunk = [q([0]), q([8]), array("i", [8]), q([1])]
    files = [q([16]), q([8]), q([8])]
    with pytest.raises(ValueError, match="file, offset, length and crc_count, must each share one item type"):
        _engine.check_chunk_table(*tensor, *chunk, *files, q([0, 0]), q([0]), q([0]))
    assert _engine.check_chunk_table(*tensor, *[array("i", c) for c in chunk], *files, q([0, 0]), q([0]),
                                     q([0])) is None


@pytest.mark.parametrize("seed", range(8))
def test_a_column_packed_a_block_at_a_time_reads_back_equal(seed, monkeypatch):
    """_pack delta-codes and narrows a block at a time (its temporaries stay small at scale):
    across block edges, every value and the narrowest type that holds them come back."""
    import torch

    from dcp_datastates.format import chunk_table
    from dcp_datastates.format.checks import _Check

    monkeypatch.setattr(chunk_table, "_PACK_BLOCK", 7)
    rng = random.Random(seed)
    n = rng.choice([0, 1, 6, 7, 8, 14, 15, 50])
    scale = rng.choice([100, 1 << 20, 1 << 40])
    values = torch.tensor([rng.randrange(-scale, scale) for _ in range(n)], dtype=torch.int64)
    for delta in (True, False):
        packed = chunk_table._pack(values, delta=delta)
        back = chunk_table._unpack(_Check("test"), {"c": packed}, "c", n)
        assert back.tolist() == values.tolist()
        coded = values.tolist() if not delta else values[:1].tolist() + (values[1:] - values[:-1]).tolist()
        lo, hi = min(coded, default=0), max(coded, default=0)
        assert packed["int"] == next(name for name, bits in (("i1", 7), ("i2", 15), ("i4", 31), ("i8", 63))
                                     if -(1 << bits) <= lo and hi < (1 << bits)), (lo, hi)


@pytest.mark.parametrize("seed", range(6))
def test_the_columns_json_is_json_dumps_of_the_columns(seed):
    """The commit writes its packed columns' data without the JSON encoder's scan: the text is
    ``json.dumps``'s, byte for byte, and a column whose data is not its last field is refused."""
    import json

    import torch

    from dcp_datastates.format import chunk_table

    rng = random.Random(seed)
    columns = {}
    for name in rng.sample(["file", "offset", "crc32c", "ünïcode", 'quo"te'], rng.randint(0, 5)):
        n = rng.choice([0, 1, 9, 300])
        values = torch.tensor([rng.randrange(-(1 << 40), 1 << 40) for _ in range(n)], dtype=torch.int64)
        columns[name] = chunk_table._pack(values, delta=rng.random() < 0.5, level=rng.choice([0, 1]))
    assert "".join(chunk_table._columns_json(columns)) == json.dumps(columns, separators=(",", ":"))
    with pytest.raises(ValueError, match="column 'x': its data must be its last field"):
        chunk_table._columns_json({"x": {"data": "AA==", "n": 1}})


def test_checksums_are_gathered_into_32_bit_items_only():
    import torch

    from dcp_datastates.format.chunk_table import _checksum_view

    held = torch.zeros(2, dtype=torch.int32)
    _engine.gather_pieces(q([1, 0]), q([1, 1]), array("I", [5, (1 << 32) - 1]), _checksum_view(held))
    assert held.tolist() == [-1, 5]  # the bit patterns of 2**32 - 1 and 5
    with pytest.raises(ValueError, match="checksums are held in a contiguous int32 tensor, not torch.int64"):
        _checksum_view(torch.zeros(2, dtype=torch.int64))
