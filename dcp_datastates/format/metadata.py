"""The ``.metadata`` commit marker: encoded by the codec that suits the checkpoint, decoded by
the codec its version names.

Version 1 (2 when it refers to earlier checkpoints' files) writes one JSON object per chunk
(``format.items_codec``); version 3 writes the chunk table as packed columns (``format.packed``). A
commit of at least ``PACK_FROM_CHUNKS`` chunks is written as version 3: below that, the JSON
objects cost little and any tool reads them. Both are JSON documents, never a pickle, and
both decoders check everything they read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from .checks import _Check
from .document import PACKED_VERSION, parse_document
from .items_codec import decode_items, encode_items
from .locations import FileInfo, ItemLocation
from .packed import decode_packed
from .packed_encode import encode_packed
from .results import CommitLocations

__all__ = ["encode_commit", "encode_metadata", "decode_metadata", "PACK_FROM_CHUNKS"]

# The number of chunks from which a commit is packed (version 3); the environment variable
# DCP_DATASTATES_PACK_FROM_CHUNKS overrides it (1: every commit, e.g. to test version 3 everywhere).
PACK_FROM_CHUNKS = int(os.environ.get("DCP_DATASTATES_PACK_FROM_CHUNKS", "") or 20_000)


def _packed(locations: Mapping, packed: bool | None) -> bool:
    if packed is not None:
        return packed
    count = locations.result_count() if isinstance(locations, CommitLocations) else len(locations)
    return count >= PACK_FROM_CHUNKS


def encode_commit(md: Metadata, locations: Mapping[MetadataIndex, ItemLocation], source: str, *,
                  packed: bool | None = None) -> tuple[bytes, dict[str, FileInfo]]:
    """The ``.metadata`` document of a commit and the data files it lists, after the checks the
    decoder makes (names, ranges inside the data region, one checksum per piece, chunks tiling
    their tensor, no shared bytes), made on the values themselves as they are encoded. Raises
    CheckpointFormatError naming ``source`` and the item. ``packed``: version 3 (True), version
    1/2 (False), or by the number of chunks (None)."""
    c = _Check(source)
    return encode_packed(md, locations, c) if _packed(locations, packed) else encode_items(md, locations, c)


def encode_metadata(md: Metadata, locations: Mapping[MetadataIndex, ItemLocation], *,
                    packed: bool | None = None) -> bytes:
    """The document alone, unchecked (a commit re-encoding locations it already checked)."""
    return (encode_packed(md, locations, None) if _packed(locations, packed) else encode_items(md, locations, None))[0]


def decode_metadata(raw: bytes, source: str) -> tuple[Metadata, dict[str, FileInfo]]:
    """Parse and check a ``.metadata`` document: DCP's ``Metadata`` and the data files it lists.
    ``source`` names it in error messages."""
    c = _Check(source)
    doc, version, files = parse_document(raw, c)
    md = decode_packed(doc, c, files) if version == PACKED_VERSION else decode_items(doc, c, files)
    return md, files
