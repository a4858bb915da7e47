"""The files of a checkpoint folder: their names, and the safetensors layout of each data file.

Data files. Each rank's data file is a valid safetensors file: an 8-byte little-endian header
length, a JSON header, then the items back to back (safetensors rejects holes between tensors).
The header is padded with spaces so the data region starts on a 4 KiB boundary. The C++ engine
receives the offsets computed here and never computes a layout of its own; it writes every byte
(header, data, zeros) of every data file, local or remote.

Beside the data files, a checkpoint folder holds its commit marker, ``.metadata``
(``format.metadata``), or one per rank for a rank-local save (``rank_marker_name``).
"""

from __future__ import annotations

import json
import re
import struct
import uuid
from dataclasses import dataclass

import torch

__all__ = [
    "FileEntry", "FileLayout", "plan_file", "data_file_name", "data_file_parts", "new_tag", "dtype_to_name", "name_to_dtype",
    "safetensors_dtype", "DATA_ALIGNMENT", "FORMAT_NAME",
    "METADATA_NAME", "PENDING_NAME", "rank_marker_name", "STEP_NUMBER",
]



# =========================================================================== data files
FORMAT_NAME = "dcp_datastates"
DATA_ALIGNMENT = 4096

# torch dtype <-> the name we record in our metadata (stable, independent of torch's repr).
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
        "complex64", "complex128",
    )
    if hasattr(torch, name)
}
#: dtype -> its name in the metadata (``dtype_to_name`` says which dtypes have none).
DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

# The safetensors spelling of each dtype it supports. Others are stored as raw U8 bytes (shape
# [nbytes]); our metadata keeps their real dtype and shape.
_SAFETENSORS = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "complex64": "C64",
}


def dtype_to_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be checkpointed by dcp_datastates") from None


def name_to_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r} in checkpoint metadata") from None


def safetensors_dtype(name: str) -> str | None:
    return _SAFETENSORS.get(name)


def data_file_name(rank: int, index: int = 0, tag: str | None = None) -> str:
    """Name of a rank's data file, relative to the checkpoint folder. ``tag`` (a save's id) makes
    the names of a save into a folder that holds a committed checkpoint differ from that one's."""
    return f"__{rank}_{index}.safetensors" if tag is None else f"__{rank}_{index}.{tag}.safetensors"


_DATA_FILE_NAME = re.compile(r"^__(\d+)_(\d+)(?:\.[0-9a-f]+)?\.safetensors$")


def new_tag() -> str:
    """The file-name tag of a save into a folder that already holds a commit (its files get new
    names, so the old checkpoint stays whole until the new one is committed)."""
    return uuid.uuid4().hex[:12]


def data_file_parts(name: str) -> tuple[int, int] | None:
    """(rank, index) of a ``data_file_name``; None for any other name."""
    m = _DATA_FILE_NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class FileEntry:
    """One item to place in a data file. ``kind`` is "tensor" or "bytes"; ``dtype`` is our dtype
    name ("uint8" for bytes items)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileLayout:
    """Where ``plan_file`` puts a data file's entries. ``header`` is the 8-byte length + JSON +
    padding: the data region starts at ``len(header)``. ``offsets`` holds the absolute file
    offset of each entry, in entry order."""

    header: bytes
    offsets: tuple[int, ...]
    file_size: int

    @property
    def data_start(self) -> int:
        return len(self.header)


def plan_file(entries: list[FileEntry], file_metadata: dict[str, str] | None = None) -> FileLayout:
    """Lay out entries back to back after a safetensors header, in the order given."""
    header: dict[str, object] = {}
    meta = {"format": FORMAT_NAME}
    meta.update(file_metadata or {})
    raw_dtypes: dict[str, list] = {}
    begin = 0
    rel: list[int] = []
    for e in entries:
        st = safetensors_dtype(e.dtype) if e.kind == "tensor" else "U8"
        shape = list(e.shape)
        if st is None:
            # E.g. complex128: raw bytes in the file, the real dtype in our metadata.
            st, shape = "U8", [e.nbytes]
            raw_dtypes[e.name] = [e.dtype, list(e.shape)]
        if e.kind == "bytes":
            shape = [e.nbytes]
        header[e.name] = {"dtype": st, "shape": shape, "data_offsets": [begin, begin + e.nbytes]}
        rel.append(begin)
        begin += e.nbytes
    if raw_dtypes:
        meta["raw_dtypes"] = json.dumps(raw_dtypes, separators=(",", ":"))
    header["__metadata__"] = meta
    body = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces (allowed by the format) so the data region is 4 KiB aligned.
    pad = -(8 + len(body)) % DATA_ALIGNMENT
    body += b" " * pad
    head = struct.pack("<Q", len(body)) + body
    start = len(head)
    return FileLayout(header=head, offsets=tuple(start + r for r in rel), file_size=start + begin)


# ================================================================ the checkpoint folder
METADATA_NAME = ".metadata"
# Several ranks with a local tier: the metadata of a checkpoint committed on the nodes' local tiers
# and not yet on the durable one (tiers/local_tier.py); never read by DCP.
PENDING_NAME = ".pending.metadata"
# The step number of a checkpoint folder's name: its last run of digits (``step-100``, ``ckpt_7``).
STEP_NUMBER = re.compile(r"(\d+)(?!.*\d)")


def rank_marker_name(rank: int) -> str:
    """The commit marker of one rank's rank-local save (``use_collectives=False``)."""
    return f"__{rank}{METADATA_NAME}"
