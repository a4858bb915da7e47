"""Which rank writes a value that several ranks hold, decided without any collective at ``stage()``.

- DTensor replicas (``Replicate()`` on some mesh dims): the mesh says exactly which ranks hold
  identical copies, so one replica per shard writes it, picked by a hash of the item's name. The
  others leave it out of their local plan, so DCP's planner sees one candidate.
- Plain tensors: DCP treats them as replicated, but whether other ranks hold the same name
  (data parallelism) or not (pipeline stages hold their own layers) cannot be known from the
  local state. They stay in every holder's local plan and DCP's planner picks one writer (its own
  dedup). That choice is learned from the plan each rank is given in ``write_data`` and cached per
  tensor structure (``Decisions``): from the next checkpoint of the same structure on, a rank
  stages only the plain tensors it was given. Before the choice is known they are staged into a
  *held* file whose flush waits for the plan (see ``held_file.py``).
- Non-tensor values (bytes) are tiny and often rank-specific: every rank stages its own and DCP's
  planner picks which copy the metadata references.
- Mirrors (``peer_copies``, ``Mirroring``): a rank's files are copied to a rank of another node
  (its *keeper*). When that keeper is itself a replica of the DTensor shards the rank writes, it
  holds the same bytes: the writer puts those shards in a file of their own (``mirrored``) and the
  keeper stages the very same file from its own memory (``kept``), at the same ``stage()`` and
  under the same lazy guarantee, so the exchange moves no bytes for it once the keeper's checksums
  match the writer's (tiers/peers.py). Both sides derive the file from the mesh alone.

A stale choice (another rank's structure changed) is safe: a plain tensor given to a rank that did
not stage it is written from the live tensor in ``write_data`` if its version counter shows no
change since ``stage()`` (else the save fails and the next one re-plans); one staged but not given
is written to the file and referenced by nothing.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

from .items import DTENSOR, PLAIN, SHARD, VALUE, ItemKey, SourceItem

__all__ = ["Mirroring", "Ownership", "DecisionKey", "Decisions", "decisions", "split_by_owner", "plain_signature"]


@dataclass(frozen=True)
class Mirroring:
    """peer_copies: the rank that keeps this rank's copies (``target``) and the ranks whose copies
    this rank keeps (``sources``), global ranks (tiers/peers.py's map)."""

    target: int | None
    sources: frozenset


class _Replicas(NamedTuple):
    #: The index, among the item's replicas, of the one that writes it.
    writer: int
    #: This rank's index among them.
    mine: int
    #: The global rank of each replica, when asked for.
    ranks: tuple | None


def _dtensor_replicas(obj, key: ItemKey, meshes: dict | None) -> _Replicas | None:
    """Which replica writes a replicated DTensor shard (one per shard, picked by a hash of the
    item's name), and this rank's place among them; None when it is not replicated. With
    ``meshes`` (a memo per mesh and replicated dims), also every replica's global rank. Raises
    LookupError when this rank is not in the mesh (it holds nothing to write)."""
    placements = obj.placements
    rep_dims = tuple(d for d, p in enumerate(placements) if p.is_replicate())
    if not rep_dims:
        return None
    mesh = obj.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise LookupError("not in the mesh")
    replicas, index = 1, 0
    for d in rep_dims:
        index = index * mesh.size(d) + coord[d]
        replicas *= mesh.size(d)
    name = f"{key[0]}@{key[1]}".encode()
    ranks = None
    if meshes is not None:
        memo = (id(mesh), rep_dims)
        ranks = meshes.get(memo)
        if ranks is None:
            found = []
            for i in range(replicas):
                # Mixed radix over the replicated dims, the last one fastest.
                at, rest = list(coord), i
                for d in reversed(rep_dims):
                    at[d], rest = rest % mesh.size(d), rest // mesh.size(d)
                found.append(int(mesh.mesh[tuple(at)]))
            ranks = meshes[memo] = tuple(found)
    return _Replicas(zlib.crc32(name) % replicas, index, ranks)


def plain_signature(items: list[SourceItem]) -> tuple:
    """The plain tensors' names, dtypes and shapes: what a learned decision depends on locally."""
    return tuple((it.key, it.entry.dtype, it.entry.shape) for it in items if it.kind == PLAIN)


@dataclass
class Ownership:
    """The items of one ``stage()`` by what happens to them.

    - ``owned``: staged and flushed at once.
    - ``held``: staged; flushed once the plan says whose.
    - ``skipped``: DTensor replicas another rank writes (out of the plan).
    - ``elsewhere``: plain tensors the cached decision gives to others.
    - ``mirrored``: owned, and the keeper holds them too.
    - ``kept``: writer rank -> its mirrored items held here.
    """

    owned: list[SourceItem] = field(default_factory=list)
    held: list[SourceItem] = field(default_factory=list)
    skipped: set = field(default_factory=set)
    elsewhere: set = field(default_factory=set)
    mirrored: list[SourceItem] = field(default_factory=list)
    kept: dict[int, list[SourceItem]] = field(default_factory=dict)


def split_by_owner(items: list[SourceItem], flat: dict, rank: int, world: int, decision: frozenset | None,
                   dedup: bool, mirroring: Mirroring | None = None) -> Ownership:
    """Split a rank's items. ``decision``: the plain-tensor keys this rank was given last time for
    this structure, or None when unknown (those tensors are then held). ``mirroring``: the
    peer-copy pairs (None: no mirrors)."""
    out = Ownership()
    if world <= 1 or not dedup:
        out.owned = list(items)
        return out
    meshes: dict | None = {} if mirroring is not None else None
    for it in items:
        if it.kind == VALUE:
            out.owned.append(it)
        elif it.kind == DTENSOR:
            try:
                replicas = _dtensor_replicas(flat[it.key[0]], it.key, meshes)
            except LookupError:
                out.skipped.add(it.key)
                continue
            if replicas is None:
                out.owned.append(it)
            elif replicas.writer == replicas.mine:
                keeper_holds = replicas.ranks is not None and mirroring.target in replicas.ranks
                (out.mirrored if keeper_holds else out.owned).append(it)
            else:
                out.skipped.add(it.key)
                writer = replicas.ranks[replicas.writer] if replicas.ranks is not None else None
                if writer is not None and writer in mirroring.sources:
                    out.kept.setdefault(writer, []).append(it)
        elif it.kind == SHARD:
            # Shards (ShardedTensor, CheckpointableTensor): each rank writes its own; DCP's
            # planner dedups any shard two ranks hold.
            out.owned.append(it)
        elif decision is None:
            out.held.append(it)
        elif it.key in decision:
            out.owned.append(it)
        else:
            out.elsewhere.add(it.key)
    return out


class DecisionKey(NamedTuple):
    """What an ownership decision is kept under; ``plain``: the structure of the plain tensors
    (names, dtypes, shapes, devices)."""

    rank: int
    world: int
    plain: tuple | None


class Decisions:
    """Process-wide: per (rank, world, plain-tensor structure), the plain-tensor keys DCP's planner
    gave this rank the last time. Bounded; dropped when a choice turns out stale."""

    _MAX = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[DecisionKey, frozenset] = {}

    def get(self, key: DecisionKey) -> frozenset | None:
        with self._lock:
            return self._table.get(key)

    def learn(self, key: DecisionKey, given: frozenset) -> None:
        with self._lock:
            self._table.pop(key, None)
            self._table[key] = given
            while len(self._table) > self._MAX:
                self._table.pop(next(iter(self._table)))

    def forget(self, key: DecisionKey) -> None:
        with self._lock:
            self._table.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._table.clear()


_decisions = Decisions()


def decisions() -> Decisions:
    return _decisions
