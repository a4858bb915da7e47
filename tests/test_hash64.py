"""The engine's XXH64 content hash (csrc/hash64.cpp): _engine.hash64 on a buffer and
_engine.hash64_segments on items held in (ptr, nbytes) memory segments, which must hash as the
concatenation of their segments. It decides whether a tensor's bytes are unchanged since an earlier
checkpoint, so it must be exactly XXH64 with seed 0: checked against published test vectors, a
slow pure-Python transcription of the specification, and the xxhash package where it is installed."""

from __future__ import annotations

import random

import pytest
import torch

from dcp_datastates.native import engine_module

_engine = engine_module()

_M64 = (1 << 64) - 1
_P1, _P2, _P3, _P4, _P5 = (
    0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)


def _sanity_buffer(n: int) -> bytes:
    """xxHash's own sanity-check input (cli/xsum_sanity_check.c, XSUM_fillTestBuffer): byte i is
    the top byte of 2654435761 * 11400714785074694797**i mod 2**64."""
    gen, out = 2654435761, bytearray()
    for _ in range(n):
        out.append(gen >> 56)
        gen = (gen * 11400714785074694797) & _M64
    return bytes(out)


# XXH64, seed 0. Strings: the vectors that other implementations test against (e.g. Zig's
# std.hash.XxHash64 tests). _sanity_buffer(n): the seed-0 rows of xxHash's XSUM_XXH64_testdata.
VECTORS = [
    (b"", 0xEF46DB3751D8E999),
    (b"a", 0xD24EC4F1A98C6E5B),
    (b"abc", 0x44BC2CF5AD770999),
    (b"message digest", 0x066ED728FCEEB3BE),
    (b"abcdefghijklmnopqrstuvwxyz", 0xCFE1F278FA89835C),
    (b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", 0xAAA46907D3047814),
    (b"1234567890" * 8, 0xE04A477F19EE145D),
    (_sanity_buffer(1), 0xE934A84ADB052768),
    (_sanity_buffer(4), 0x9136A0DCA57457EE),
    (_sanity_buffer(14), 0x8282DCC4994E35C8),
    (_sanity_buffer(222), 0xB641AE8CB691C174),
]


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _round(acc: int, lane: int) -> int:
    return (_rotl((acc + lane * _P2) & _M64, 31) * _P1) & _M64


def _xxh64_reference(data: bytes) -> int:
    """XXH64 with seed 0, step by step as xxhash_spec.md writes it (slow; for cross-checks)."""
    n, pos = len(data), 0
    if n >= 32:
        acc = [(_P1 + _P2) & _M64, _P2, 0, (-_P1) & _M64]
        while n - pos >= 32:
            for k in range(4):
                acc[k] = _round(acc[k], int.from_bytes(data[pos + 8 * k:pos + 8 * k + 8], "little"))
            pos += 32
        h = (_rotl(acc[0], 1) + _rotl(acc[1], 7) + _rotl(acc[2], 12) + _rotl(acc[3], 18)) & _M64
        for a in acc:
            h = (((h ^ _round(0, a)) * _P1) + _P4) & _M64
    else:
        h = _P5
    h = (h + n) & _M64
    while n - pos >= 8:
        h ^= _round(0, int.from_bytes(data[pos:pos + 8], "little"))
        h = (_rotl(h, 27) * _P1 + _P4) & _M64
        pos += 8
    if n - pos >= 4:
        h ^= (int.from_bytes(data[pos:pos + 4], "little") * _P1) & _M64
        h = (_rotl(h, 23) * _P2 + _P3) & _M64
        pos += 4
    while pos < n:
        h ^= (data[pos] * _P5) & _M64
        h = (_rotl(h, 11) * _P1) & _M64
        pos += 1
    h = ((h ^ (h >> 33)) * _P2) & _M64
    h = ((h ^ (h >> 29)) * _P3) & _M64
    return h ^ (h >> 32)


def _segments(t: torch.Tensor, cuts: list[int]) -> list[tuple[int, int]]:
    """(ptr, nbytes) of t's uint8 bytes cut at the sorted offsets `cuts`."""
    bounds = [0, *cuts, t.numel()]
    return [(t.data_ptr() + a, b - a) for a, b in zip(bounds, bounds[1:])]


# --------------------------------------------------------------------------------------------
# the algorithm


@pytest.mark.parametrize("data,expected", VECTORS, ids=[f"len{len(d)}" for d, _ in VECTORS])
def test_published_vectors(data, expected):
    assert _engine.hash64(data) == expected
    assert _xxh64_reference(data) == expected  # the transcription used below agrees too
    t = torch.tensor(list(data), dtype=torch.uint8)
    assert _engine.hash64_segments([[(t.data_ptr(), len(data))] if data else []]) == [expected]


def test_matches_spec_transcription_random_lengths():
    rng = random.Random(1)
    for n in [*range(0, 301), 1023, 4096 + 7]:
        data = rng.randbytes(n)
        assert _engine.hash64(data) == _xxh64_reference(data), n


def test_matches_xxhash_package():
    xxhash = pytest.importorskip("xxhash")
    rng = random.Random(2)
    for n in range(0, 301):
        data = rng.randbytes(n)
        assert _engine.hash64(data) == xxhash.xxh64_intdigest(data, seed=0), n
    for n in (1 << 20, 3 * (1 << 20) + 13):
        data = rng.randbytes(n)
        assert _engine.hash64(data) == xxhash.xxh64_intdigest(data, seed=0), n


def test_buffer_protocol_and_range():
    data = bytes(range(256)) * 5
    h = _engine.hash64(data)
    assert 0 <= h < 1 << 64
    assert _engine.hash64(bytearray(data)) == h
    assert _engine.hash64(memoryview(data)) == h
    assert _engine.hash64(memoryview(b"xx" + data)[2:]) == h  # unaligned start
    with pytest.raises(TypeError):
        _engine.hash64("not bytes")


def test_one_flipped_bit_changes_hash():
    data = bytearray(random.Random(3).randbytes(200))
    base = _engine.hash64(bytes(data))
    for i in range(len(data)):
        for bit in (0, 3, 7):
            data[i] ^= 1 << bit
            assert _engine.hash64(bytes(data)) != base, (i, bit)
            data[i] ^= 1 << bit
    assert _engine.hash64(bytes(data)) == base
    assert _engine.hash64(bytes(data) + b"\0") != base  # length counts too


# --------------------------------------------------------------------------------------------
# items in segments


def test_segments_every_two_way_split():
    for n in range(0, 71):
        t = torch.arange(n, dtype=torch.uint8)
        whole = _engine.hash64(t.numpy().tobytes())
        items = [_segments(t, [cut]) for cut in range(n + 1)]
        assert _engine.hash64_segments(items) == [whole] * (n + 1), n


def test_segments_random_splits():
    rng = random.Random(4)
    for n in [*range(0, 160), 1000, 4099]:
        t = torch.arange(n, dtype=torch.uint8) * 7 + n
        whole = _engine.hash64(t.numpy().tobytes())
        items = []
        for _ in range(8):
            k = rng.randint(3, 5)
            items.append(_segments(t, sorted(rng.randint(0, n) for _ in range(k - 1))))
        assert _engine.hash64_segments(items) == [whole] * len(items), n


def test_segments_from_separate_tensors():
    # The segments need not be adjacent in memory: three tensors hash as their concatenation.
    parts = [torch.arange(n, dtype=torch.uint8) + n for n in (5, 40, 33)]
    joined = b"".join(p.numpy().tobytes() for p in parts)
    item = [(p.data_ptr(), p.numel()) for p in parts]
    assert _engine.hash64_segments([item, item[::-1]]) == [
        _engine.hash64(joined), _engine.hash64(b"".join(p.numpy().tobytes() for p in parts[::-1]))]


def test_segments_empty():
    empty = 0xEF46DB3751D8E999
    assert _engine.hash64_segments([]) == []
    assert _engine.hash64_segments([[], [(0, 0)], [(0, 0), (0, 0)]]) == [empty] * 3
    t = torch.arange(10, dtype=torch.uint8)
    assert _engine.hash64_segments([[(t.data_ptr(), 0)]]) == [empty]


def test_segments_bad_input():
    t = torch.arange(16, dtype=torch.uint8)
    p = t.data_ptr()
    with pytest.raises(ValueError, match=r"^item 1 segment 2: nbytes must be >= 0, got -1$"):
        _engine.hash64_segments([[(p, 16)], [(p, 4), (p, 4), (p, -1)]])
    with pytest.raises(ValueError, match=r"^item 0 segment 1: ptr is null with nbytes 8$"):
        _engine.hash64_segments([[(p, 8), (0, 8)]])
    with pytest.raises(ValueError, match=r"^item 0 segment 0: ptr must be >= 0"):
        _engine.hash64_segments([[(-1, 8)]])
    with pytest.raises(ValueError, match=r"^item 0 segment 0 must be a tuple \(ptr, nbytes\)$"):
        _engine.hash64_segments([[(p,)]])
    with pytest.raises(TypeError, match="item 0 segments must be a list"):
        _engine.hash64_segments([5])
    with pytest.raises(TypeError, match="items must be a list"):
        _engine.hash64_segments(5)
