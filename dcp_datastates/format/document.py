"""The ``.metadata`` document every format version shares: its versions, its head and its parsing.

``.metadata`` is a JSON document (never a pickle) that DCP's ``Metadata`` is encoded into and
decoded from, with every item's file, offset, length, dtype, shape and checksums. Every version's
document starts with the same head (format, version, DCP's metadata fields and the data files);
the codec of its version (``format.items_codec``, ``format.packed``) writes and reads its items.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .checks import _Check, _check_file, _DuplicateKey, _no_duplicate_keys, _short
from .layout import FORMAT_NAME
from .locations import FileInfo

__all__ = [
    "FORMAT_VERSION", "REFERENCES_VERSION", "PACKED_VERSION", "MAX_METADATA_BYTES",
    "document_head", "parse_document", "decode_planner_data", "decode_storage_meta",
]

FORMAT_VERSION = 1
# A commit whose items refer to data files of earlier checkpoints under the same root
# (incremental saves): its document says version 2, so a reader that does not follow references
# (dcp_datastates before them) refuses it by name instead of looking for those files here.
REFERENCES_VERSION = 2
# Chunk tables as packed columns (format/packed.py): what a commit of many chunks writes.
PACKED_VERSION = 3
_READABLE_VERSIONS = (FORMAT_VERSION, REFERENCES_VERSION, PACKED_VERSION)
# A marker this large is not one (a million chunks encode to ~200 MB): refuse before reading it.
MAX_METADATA_BYTES = 1 << 30


def document_head(md: Metadata, version: int, files: dict[str, FileInfo]) -> dict:
    """The fields every version's document starts with: format, version, DCP's metadata fields
    and the data files; the codec of the version adds its items."""
    storage_meta = None
    if md.storage_meta is not None:
        sm = md.storage_meta
        storage_meta = {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        }
    return {
        "format": FORMAT_NAME,
        "version": version,
        "dcp_version": md.version,
        "storage_meta": storage_meta,
        "planner_data": _jsonable_planner_data(md.planner_data),
        "files": {name: {"size": v.size, "data_start": v.data_start, "piece_size": v.piece_size}
                  for name, v in files.items()},
    }


def _jsonable_planner_data(data: Any) -> Any:
    """DefaultSavePlanner's planner_data, which maps flat keys to object paths (tuples of str and
    int; ``json.dumps`` writes them as arrays), or None for anything else. The types are gathered
    in C loops and each distinct one checked once (an order of magnitude faster than a check per
    entry on a large state dict)."""
    if not isinstance(data, dict):
        return None
    paths = data.values()
    if (all(issubclass(t, str) for t in set(map(type, data)))
            and all(issubclass(t, (tuple, list)) for t in set(map(type, paths)))
            and all(issubclass(t, (str, int)) for t in set(map(type, itertools.chain.from_iterable(paths))))):
        return data
    return None


def parse_document(raw: bytes, c: _Check) -> tuple[dict, int, dict[str, FileInfo]]:
    """The parsed ``.metadata`` document, its format version and its data files, checked: JSON
    (no duplicate keys), this library's format marker, a version this release reads, and every
    file's entry. The items are decoded by the codec of the version (``format.metadata``)."""
    if not isinstance(raw, (bytes, bytearray, memoryview, str)):
        raise c.fail(f"metadata must be bytes, got {type(raw).__name__}")
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    if not raw:
        raise c.fail("empty metadata file (truncated or never written)")
    try:
        doc = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as exc:
        raise c.fail(f"duplicate key {exc.args[0]!r} in a JSON object (corrupted metadata)") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integer literals.
        raise c.fail(f"not a dcp_datastates metadata file (invalid JSON: {_short(exc)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise c.fail("not a dcp_datastates metadata file (missing format marker)")
    version = c.get(doc, "version", int, "the document")
    if version not in _READABLE_VERSIONS:
        raise c.fail(
            f"unknown format version {version}; this dcp_datastates reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))} (upgrade dcp_datastates to load newer checkpoints)"
        )
    files: dict[str, FileInfo] = {}
    for name, info in c.get(doc, "files", dict, "the document").items():
        where = f"files[{name!r}]"
        files[name] = FileInfo(
            size=c.nonneg(info, "size", where),
            data_start=c.nonneg(info, "data_start", where),
            piece_size=c.nonneg(info, "piece_size", where),
        )
        _check_file(c, name, files[name], where, references=version >= REFERENCES_VERSION)
    return doc, version, files


def decode_planner_data(c: _Check, doc: dict) -> Any:
    planner_data = doc.get("planner_data")
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise c.fail("planner_data must be a mapping")
        for k, v in planner_data.items():
            if not isinstance(v, list) or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v):
                raise c.fail(f"planner_data[{k!r}] must be a list of strings and integers (an object path)")
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    return planner_data


def decode_storage_meta(c: _Check, doc: dict) -> StorageMeta | None:
    sm = doc.get("storage_meta")
    if sm is None:
        return None
    if not isinstance(sm, dict):
        raise c.fail(f"storage_meta must be a mapping or null, found {type(sm).__name__}")
    modules = sm.get("modules") or []
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise c.fail("storage_meta.modules must be a list of strings")
    return StorageMeta(
        checkpoint_id=c.optional_str(sm, "checkpoint_id", "storage_meta"),
        save_id=c.optional_str(sm, "save_id", "storage_meta"),
        load_id=c.optional_str(sm, "load_id", "storage_meta"),
        modules=list(modules),
    )
