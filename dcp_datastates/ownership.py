"""Which rank writes a replicated value: a deterministic policy computed from the local state
dict, rank and world size alone, so ``stage()`` can start flushing before any planning collective.

- DTensor replicas (``Replicate()`` on some mesh dims): provably identical across the replica
  group, so exactly one replica writes each shard, picked by a hash of the item's name.
- Plain tensors: DCP treats them as replicated on every rank. They are spread over all ranks by
  a greedy size balance over a canonical order, so every rank computes the same assignment. The
  coordinator checks each round that all ranks hold the same set (a digest per rank, a few
  bytes) and fails the save loudly otherwise (pipeline parallelism, where ranks hold different
  plain tensors, needs ``dedup_replicated=False``).
- Non-tensor values are tiny and often rank-specific (a dataloader state per data-parallel rank):
  every rank writes its own and DCP's planner picks which copy the metadata references.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

import torch

from .compat import is_checkpointable_tensor
from .stage_items import ItemKey, SourceItem

__all__ = ["RankReport", "select_owned"]


@dataclass(frozen=True)
class RankReport:
    """What each rank's writer tells the coordinator in its local plan's ``storage_data``."""

    rank: int
    replicated_digest: str | None  # None: this rank applied no stage-time dedup


def _dtensor_owned(obj, key: ItemKey, rank: int) -> bool:
    placements = obj.placements
    rep_dims = [d for d, p in enumerate(placements) if p.is_replicate()]
    if not rep_dims:
        return True
    mesh = obj.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing to write
        return False
    replicas, index = 1, 0
    for d in rep_dims:
        index = index * mesh.size(d) + coord[d]
        replicas *= mesh.size(d)
    name = f"{key[0]}@{key[1]}".encode()
    return zlib.crc32(name) % replicas == index


def select_owned(items: list[SourceItem], flat: dict, rank: int, world: int) -> tuple[list[SourceItem], set, str]:
    """Split items into those this rank writes and the replicated ones it leaves to another rank.

    Returns (owned items, skipped keys, digest of this rank's plain/bytes item set).
    """
    owned: list[SourceItem] = []
    skipped: set = set()
    shared: list[SourceItem] = []
    for it in items:
        obj = flat.get(it.key[0])
        if isinstance(obj, torch.Tensor) and hasattr(obj, "placements") and hasattr(obj, "device_mesh"):
            if _dtensor_owned(obj, it.key, rank):
                owned.append(it)
            else:
                skipped.add(it.key)
        elif it.entry.kind == "bytes" or type(obj).__name__ == "ShardedTensor" or is_checkpointable_tensor(obj):
            # Shards (ShardedTensor, CheckpointableTensor): each rank writes its own; DCP's
            # planner dedups any shard two ranks hold.
            owned.append(it)
        else:
            shared.append(it)

    # Canonical order: largest first, then by name; ties in load go to the lowest rank.
    order = sorted(shared, key=lambda it: (-it.entry.nbytes, it.key[0]))
    load = [0] * world
    h = hashlib.blake2b(digest_size=16)
    for it in order:
        target = min(range(world), key=lambda r: (load[r], r))
        load[target] += max(it.entry.nbytes, 1)
        if target == rank:
            owned.append(it)
        else:
            skipped.add(it.key)
        h.update(repr((it.key[0], it.entry.dtype, it.entry.shape)).encode())
    return owned, skipped, h.hexdigest()

