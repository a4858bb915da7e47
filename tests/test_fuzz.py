"""Fuzzing the parsers that read untrusted bytes: ``decode_metadata`` (the ``.metadata``
commit marker), ``validate.parse_header`` (a data file's safetensors header) and
``safe_unpickle.decode_value`` (a stored non-tensor value).

Property: whatever the input, the only exception that may come out is CheckpointFormatError
(or, for values, UnsafeCheckpointError); what is accepted is internally consistent (ranges
inside their file, tiles without holes); and decoding a value never runs code from it.

Quick here (a few hundred examples each); ``scripts/fuzz.py --examples 100000`` runs the same
properties for longer.
"""

from __future__ import annotations

import functools
import json
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_datastates.errors import CheckpointFormatError, UnsafeCheckpointError
from dcp_datastates.format.header import MAX_HEADER_BYTES, parse_header
from dcp_datastates.format.layout import FileEntry, plan_file
from dcp_datastates.format.locations import ItemLocation
from dcp_datastates.format.metadata import decode_metadata, encode_metadata
from dcp_datastates.format.pieces import piece_ranges
from dcp_datastates.format.safe_unpickle import decode_value

QUICK = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
    database=None,
)


# ------------------------------------------------------------------------------ seeds (valid)
@functools.lru_cache(maxsize=None)
def valid_metadata() -> bytes:
    """A realistic, valid metadata document: several dtypes, a 2-chunk tensor, bytes items,
    empty tensors, a scalar, checksums over a small piece grid."""
    piece = 64
    data_start = 4096
    locations: dict[MetadataIndex, ItemLocation] = {}
    state: dict = {}
    pos = data_start

    def place(index: MetadataIndex, nbytes: int, dtype: str, shape: tuple) -> None:
        nonlocal pos
        loc = ItemLocation("__0_0.safetensors", pos, nbytes, dtype, shape, (), data_start, piece)
        crcs = tuple((i * 2654435761) & 0xFFFFFFFF for i in range(len(piece_ranges(loc))))
        locations[index] = ItemLocation(loc.file, pos, nbytes, dtype, shape, crcs, data_start, piece)
        pos += nbytes

    def tensor(fqn: str, dtype: torch.dtype, size: tuple, chunks: list[tuple[tuple, tuple]]) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        metas = []
        for offsets, sizes in chunks:
            n = 1
            for s in sizes:
                n *= s
            metas.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            place(MetadataIndex(fqn, offsets), n * itemsize, str(dtype).removeprefix("torch."), sizes)
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), metas)

    tensor("model.w", torch.float32, (8, 6), [((0, 0), (4, 6)), ((4, 0), (4, 6))])
    tensor("model.b", torch.bfloat16, (37,), [((0,), (37,))])
    tensor("scalar", torch.int64, (), [((), ())])
    tensor("empty", torch.float16, (0, 3), [((0, 0), (0, 3))])
    for fqn, n in (("step", 11), ("extra.name", 0)):
        state[fqn] = BytesStorageMetadata()
        place(MetadataIndex(fqn), n, "uint8", (n,))
    md = Metadata(
        state_dict_metadata=state,
        planner_data={"model.w": ("model", "w"), "step": ("step",)},
        storage_meta=StorageMeta(checkpoint_id="/ckpt/step-7", save_id="abc", modules=["model"]),
        version="1.0.0",
    )
    raw = encode_metadata(md, locations)
    decode_metadata(raw, "seed")  # the seed itself must be valid
    return raw


def valid_header(specs: list[tuple[str, str, list[int]]]) -> bytes:
    """A data file (header + zero data) built by our own layout code."""
    entries = []
    for name, dtype, shape in specs:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        entries.append(FileEntry(name=name, kind="tensor", dtype=dtype, shape=tuple(shape), nbytes=nbytes))
    layout = plan_file(entries)
    return layout.header + bytes(layout.file_size - len(layout.header))


# ------------------------------------------------------------------------------ properties
def check_metadata(raw: bytes) -> None:
    """decode_metadata raises CheckpointFormatError or returns something consistent."""
    try:
        md, files = decode_metadata(raw, "fuzz.metadata")
    except CheckpointFormatError as exc:
        assert "fuzz.metadata" in str(exc)
        return
    for index, loc in md.storage_data.items():
        info = files[loc.file]
        assert info.data_start <= loc.offset <= loc.offset + loc.length <= info.size
        assert len(loc.crc32c) in (0, len(piece_ranges(loc)))
        assert index.fqn in md.state_dict_metadata


def check_header(data: bytes, file_size: int | None) -> None:
    """parse_header raises CheckpointFormatError or returns items that tile the data region."""
    try:
        header = parse_header(data, file_size, "fuzz.safetensors")
    except CheckpointFormatError as exc:
        assert "fuzz.safetensors" in str(exc)
        return
    size = len(data) if file_size is None else file_size
    pos = header.data_start
    for it in header.items:
        assert it.offset == pos
        pos += it.length
    assert pos == size


# ------------------------------------------------------------------------------ strategies
_ints = st.one_of(
    st.integers(min_value=-3, max_value=70000),
    st.sampled_from([0, 1, 7, 8, 4095, 4096, 4097, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63)]),
    st.integers(),
)
json_values = st.recursive(
    st.none() | st.booleans() | _ints | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _paths(doc) -> list[tuple]:
    """Every path (a tuple of keys/indices) into a JSON document."""
    out = [()]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += [(k,) + p for p in _paths(v)]
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += [(i,) + p for p in _paths(v)]
    return out


def _mutate(doc, path: tuple, action: str, value):
    if not path:
        return value if action == "replace" else doc
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if action == "replace":
        parent[last] = value
    elif action == "delete":
        del parent[last]
    elif action == "insert" and isinstance(parent, list):
        parent.insert(last, value)
    elif action == "insert" and isinstance(parent, dict):
        parent[f"{last}~"] = value
    return doc


_HUGE = st.sampled_from([2**62, 2**63 - 1, 2**63, 2**64, 2**70, 10**30])


@st.composite
def mutated_metadata(draw) -> bytes:
    doc = json.loads(valid_metadata())
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "delete", "insert", "consistent", "huge"]))
        if action == "consistent":
            # Keep a tensor self-consistent (size == its one chunk's sizes, offsets 0) while
            # changing its dims, so the decoder gets past the early checks.
            dims = draw(st.lists(_ints | _HUGE, max_size=4))
            items = doc.get("items") if isinstance(doc, dict) else None
            item = items.get("model.b") if isinstance(items, dict) else None
            if isinstance(item, dict) and isinstance(item.get("chunks"), list) and item["chunks"]:
                item["size"] = dims
                if isinstance(item["chunks"][0], dict):
                    item["chunks"][0]["sizes"] = list(dims)
                    item["chunks"][0]["offsets"] = [0] * len(dims)
                    item["chunks"][0]["length"] = draw(_ints | _HUGE)
            continue
        if action == "huge":
            doc = _mutate(doc, path, "replace", draw(_HUGE | st.lists(_HUGE, min_size=1, max_size=3)))
            continue
        doc = _mutate(doc, path, action, draw(json_values))
    raw = json.dumps(doc).encode()
    if draw(st.integers(0, 30)) == 0:  # an integer literal longer than Python parses by default
        raw = raw.replace(b'"version": 1', b'"version": ' + b"7" * 5000, 1)
    cut = draw(st.one_of(st.none(), st.integers(0, len(raw))))
    return raw if cut is None else raw[:cut]


_DTYPES = ["float32", "float16", "bfloat16", "int8", "int64", "uint8", "bool", "float64"]
_ST_DTYPES = ["F32", "F16", "BF16", "I8", "I64", "U8", "BOOL", "F64", "F4", "F6_E2M3", "C64", "X9", ""]


@st.composite
def header_files(draw) -> tuple[bytes, int | None]:
    specs = draw(
        st.lists(
            st.tuples(
                st.text(min_size=1, max_size=6),
                st.sampled_from(_DTYPES),
                st.lists(st.integers(0, 5), max_size=3),
            ),
            max_size=5,
            unique_by=lambda s: s[0],
        )
    )
    specs = [s for s in specs if s[0] != "__metadata__"]
    data = valid_header(specs)
    n = struct.unpack("<Q", data[:8])[0]
    doc = json.loads(data[8 : 8 + n])
    kind = draw(st.sampled_from(["field", "field", "length", "bytes", "size", "none"]))
    if kind == "field" and len(doc) > 1:
        name = draw(st.sampled_from(sorted(k for k in doc if k != "__metadata__")))
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        if key == "dtype":
            doc[name]["dtype"] = draw(st.sampled_from(_ST_DTYPES) | json_values)
        elif key == "shape":
            doc[name]["shape"] = draw(st.lists(_ints, max_size=4) | json_values)
        elif key == "data_offsets":
            doc[name]["data_offsets"] = draw(st.lists(_ints, min_size=0, max_size=3) | json_values)
        else:
            doc[name] = draw(json_values)
        body = json.dumps(doc).encode()
        data = struct.pack("<Q", len(body)) + body + data[8 + n :]
    elif kind == "length":
        fake = draw(st.sampled_from([0, 1, 2, n - 1, n + 1, len(data), len(data) - 7, MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1]))
        data = struct.pack("<Q", max(0, min(fake, 2**64 - 1))) + data[8:]
    elif kind == "bytes":
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        data = data[:pos] + draw(st.binary(min_size=0, max_size=8)) + data[pos + 1 :]
    file_size = None
    if kind == "size":
        file_size = draw(st.sampled_from([len(data), len(data) + 1, len(data) + 4096, 2**40]))
    elif draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return data, file_size


# ------------------------------------------------------------------------------ tests
def test_seeds_are_valid():
    check_metadata(valid_metadata())
    decode_metadata(valid_metadata(), "seed")
    data = valid_header([("a", "float32", [2, 3]), ("b", "int8", []), ("c", "bfloat16", [0])])
    header = parse_header(data, None, "seed")
    assert [it.name for it in header.items] == ["c", "a", "b"] or [it.name for it in header.items] == ["a", "b", "c"]


def test_every_truncation_of_metadata_is_a_format_error():
    raw = valid_metadata()
    for cut in range(0, len(raw) - 1, max(1, len(raw) // 300)):
        try:
            decode_metadata(raw[:cut], "cut.metadata")
        except CheckpointFormatError as exc:
            assert "cut.metadata" in str(exc)
        else:  # a prefix of a JSON object is never a complete JSON object
            raise AssertionError(f"a truncation at {cut} of {len(raw)} bytes decoded")


@QUICK
@given(st.binary(max_size=512))
def test_metadata_random_bytes(raw):
    check_metadata(raw)


@QUICK
@given(mutated_metadata())
def test_metadata_mutations(raw):
    check_metadata(raw)


@QUICK
@given(st.binary(max_size=256), st.one_of(st.none(), st.integers(0, 2**40)))
def test_header_random_bytes(data, size):
    check_header(data, size if size is None or size >= len(data) else None)


@QUICK
@given(header_files())
def test_header_mutations(case):
    check_header(*case)


# ------------------------------------------------------------------------------ stored values
_RAN: list = []


def _ran(*args):  # a pickle that reaches this ran code from the "checkpoint"
    _RAN.append(args)
    return 0


class _Payload:
    def __reduce__(self):
        return (_ran, ("payload",))


@functools.lru_cache(maxsize=None)
def valid_values() -> tuple[bytes, ...]:
    """torch.save bytes of values trainers store, and of one that would run code."""
    import io
    import pickle

    out = []
    for value in (
        {"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1], "foreach": None, "name": "adamw"},
        {"t": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": b"raw", "c": 1 + 2j, "s": {1, 2}},
        [_Payload(), 1],
    ):
        buf = io.BytesIO()
        torch.save(value, buf)
        out.append(buf.getvalue())
    out.append(pickle.dumps(_Payload(), protocol=2))  # not an archive: a raw pickle
    return tuple(out)


def check_value(raw: bytes) -> None:
    """decode_value raises one of our two errors naming the item, or returns a value; it never
    calls anything outside the allowlist."""
    before = len(_RAN)
    try:
        decode_value(raw, checkpoint="fuzz-ckpt", item="fuzz.item")
    except (CheckpointFormatError, UnsafeCheckpointError) as exc:
        assert "checkpoint fuzz-ckpt: item 'fuzz.item'" in str(exc)
    assert len(_RAN) == before, "decoding ran code from the value"


@st.composite
def mutated_values(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(valid_values())))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if action == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif action == "cut":
            del data[pos : pos + draw(st.integers(1, 64))]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


def test_value_seeds_decode_or_are_refused():
    seeds = valid_values()
    assert decode_value(seeds[0], checkpoint="c", item="i")["betas"] == (0.9, 0.95)
    assert torch.equal(decode_value(seeds[1], checkpoint="c", item="i")["t"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
    for raw in seeds[2:]:
        try:
            decode_value(raw, checkpoint="c", item="i")
        except (UnsafeCheckpointError, CheckpointFormatError):
            pass
        else:
            raise AssertionError("a value that calls a function outside the allowlist decoded")
    assert not _RAN


@QUICK
@given(st.binary(max_size=512))
def test_value_random_bytes(raw):
    check_value(raw)


@QUICK
@given(mutated_values())
def test_value_mutations(raw):
    check_value(raw)
