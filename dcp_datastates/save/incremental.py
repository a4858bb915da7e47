"""Incremental saves (``incremental=True``): which tensors of this save are unchanged since the
checkpoint it builds on, and where their bytes already are.

The base is the newest committed checkpoint beside this one (same parent folder, highest step
number in the name, this folder excluded), looked up once per save, off the training thread,
when the first held file is about to be written (so a save never refers to a checkpoint that
was not committed by then). Its metadata records an XXH64 per item written by an earlier
incremental save; a base without them (or none at all) makes this save a full one that records
them.

An item is unchanged when the base has an item of the same name and chunk offsets, with the
same dtype, shape and length, whose recorded XXH64 equals the XXH64 of the bytes this save
staged into the host cache (``held_file.HeldFile``: the engine copied them at ``stage()``; the
hash is taken there, never from live memory that may already have moved on). Nothing else is
trusted: no version counter, no ``requires_grad``, no pointer; so a tensor changed through
``.data`` or by a kernel that bumps no version is written again like any changed one.

Which tensors are held for that decision (the candidates) is a hint, never the decision: every
tensor at this process's first incremental save into a folder of checkpoints and at every
``PROBE_EVERY``-th one after it; between those, the tensors whose bytes differed from the base at
the last decision are written directly (copied and flushed as any file, no hash), since what
changed once (trainable parameters, optimizer state) almost always changes again. A tensor that
stops changing is found at the next probe. A tensor that is not a candidate is always written.

An unchanged item gets the base's location with its file named as a reference
(``format.locations.reference_name``: ``../<base>/<file>``); a base item that was itself a
reference keeps the checkpoint it names, so a reference is always one hop to the checkpoint
that wrote the bytes. The commit checks that every referenced file is there with its size.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from ..commit import check_data_files, step_folders
from ..errors import CheckpointFormatError, DataStatesError
from ..forking import new_locks_in_child
from ..format.document import MAX_METADATA_BYTES
from ..format.layout import METADATA_NAME, FileEntry
from ..format.locations import ItemLocation, moved, reference_name, split_reference
from ..format.metadata import decode_metadata
from ..native import engine_module
from ..storage import Storage, root_of
from .items import ItemKey, item_key

# For hash64: a base's marker is decoded again only when its bytes changed.
_engine = engine_module()

__all__ = ["Incremental", "Base", "PROBE_EVERY", "hint_key"]

log = logging.getLogger("dcp_datastates")

# Every tensor is a candidate at this save of a folder of checkpoints and at every PROBE_EVERY-th
# one after it (the module docstring).
PROBE_EVERY = 8
# (folder of checkpoints, rank) -> (saves decided so far, the tensors written without a hash next
# time: those that changed at the last decision or were written directly then).
_hints: dict[tuple[str, int], tuple[int, frozenset]] = {}
_hints_lock = threading.Lock()


def hint_key(path: str, rank: int) -> tuple[str, int]:
    """The key of this rank's hints for checkpoint ``path`` (its folder of checkpoints)."""
    return (root_of(path), rank)


@dataclasses.dataclass(frozen=True)
class Base:
    """The checkpoint a save builds on: its folder's name and, per item that carries a hash, its
    location as the new checkpoint names it (a reference); ``files``: its marker's file table."""

    name: str
    items: dict[ItemKey, ItemLocation]
    files: dict = dataclasses.field(default_factory=dict, repr=False)


class Incremental:
    """One save's decisions. ``storage()`` gives the save's folder once DCP named it."""

    def __init__(self, storage) -> None:
        self._storage = storage
        self._lock = threading.Lock()
        self._base: Base | None = None
        self._looked = False
        self._key: tuple[str, int] | None = None
        self._count = 0
        # Written without a hash this time (a hint).
        self.direct: frozenset = frozenset()
        # Found changed by their hash this time.
        self._changed: set = set()

    def written_directly(self, key: tuple[str, int]) -> frozenset:
        """At the request: the tensors this save writes without holding and hashing them (see
        the module docstring); the save's outcome becomes the hint of ``key`` (``learn``)."""
        with _hints_lock:
            count, changed = _hints.get(key, (0, frozenset()))
        self._key, self._count = key, count
        self.direct = frozenset() if count % PROBE_EVERY == 0 else changed
        return self.direct

    def learn(self) -> None:
        """The save is durable: its outcome is the next save's hint."""
        if self._key is None:
            return
        with self._lock:
            changed = frozenset(self._changed) | self.direct
        with _hints_lock:
            _hints[self._key] = (self._count + 1, changed)

    def base(self) -> Base | None:
        with self._lock:
            if not self._looked:
                self._looked = True
                self._base = find_base(self._storage())
            return self._base

    def unchanged(self, key: ItemKey, entry: FileEntry, digest: int) -> ItemLocation | None:
        """The base's location of item ``key`` when its bytes are these (same dtype, shape,
        length and XXH64 ``digest``); None when it must be written."""
        base = self.base()
        if base is None or entry.kind != "tensor" or entry.nbytes == 0:
            return None
        loc = base.items.get(key)
        if loc is None:
            # New, or written without a hash last time: a candidate again next time.
            return None
        if (loc.hash64 != digest or loc.length != entry.nbytes or loc.dtype != entry.dtype
                or tuple(loc.shape) != tuple(entry.shape)):
            with self._lock:
                self._changed.add(key)
            return None
        return loc


def find_base(storage: Storage) -> Base | None:
    """The newest committed checkpoint beside ``storage`` whose data files are all present with
    their sizes, as a ``Base``; None when there is none (the save writes everything)."""
    own = storage.name
    for name in step_folders(storage.parent()):
        if name == own:
            continue
        folder = storage.sibling(name)
        try:
            return _base(folder, name, own)
        except (DataStatesError, OSError) as exc:
            log.debug("dcp_datastates: %s is not a base for an incremental save: %s", folder.location, exc)
    return None


# The bases decoded last ({(folder, own): (XXH64 of its marker, Base)}): consecutive saves build
# on the same few checkpoints, and decoding a large marker holds the GIL for a long time.
_decoded: dict[tuple[str, str], tuple[int, Base]] = {}
_decoded_lock = threading.Lock()
new_locks_in_child(globals(), "_hints_lock", "_decoded_lock")
_MAX_DECODED = 4


def _base(folder: Storage, name: str, own: str) -> Base:
    """The checkpoint in ``folder`` as a base (its marker read; decoded unless its bytes are the
    ones decoded last time); raises when it is not a complete committed checkpoint."""
    try:
        raw = folder.read_small(METADATA_NAME, limit=MAX_METADATA_BYTES, what="the commit marker")
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointFormatError(f"{folder.location}: no commit marker") from None
    digest, key = _engine.hash64(raw), (folder.location, own)
    with _decoded_lock:
        known = _decoded.get(key)
    if known is not None and known[0] == digest:
        base = known[1]
    else:
        md, files = decode_metadata(raw, folder.where(METADATA_NAME))
        base = Base(name, _references(md.storage_data, name, own), files)
        with _decoded_lock:
            _decoded.pop(key, None)
            _decoded[key] = (digest, base)
            while len(_decoded) > _MAX_DECODED:
                _decoded.pop(next(iter(_decoded)))
    # Still all there: one listing per save.
    check_data_files(folder, base.files)
    return base


def _references(storage_data: dict, base: str, own: str) -> dict[ItemKey, ItemLocation]:
    """The base's hashed items, each located as the new checkpoint names it."""
    out: dict[ItemKey, ItemLocation] = {}
    for index, loc in storage_data.items():
        if loc.hash64 is None or not loc.length:
            continue
        ref = split_reference(loc.file)
        if ref is None:
            name = reference_name(base, loc.file)
        elif ref[0] == own:
            # Bytes of the folder being saved into: replaced by this save.
            continue
        else:
            # Already one hop to the checkpoint that wrote them.
            name = loc.file
        # Its file's recorded size and the hash kept.
        out[item_key(index)] = moved(loc, name)
    return out
