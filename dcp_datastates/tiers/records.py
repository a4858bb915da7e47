"""The tier's own records: the coordinator's word to each rank of a save with ``local_tier``
(``RankDrain``, ``SoloDrain``: its plan's ``storage_data``) and what a load reads (``ReadPlan``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankDrain", "SoloDrain", "ReadPlan"]


@dataclass(frozen=True)
class RankDrain:
    """local_tier with several ranks: what the coordinator's global plan tells each rank (its
    plan's ``storage_data``): the checkpoint id, the tag of the durable file names (None
    when the durable folder holds no commit), and the coordinator's global rank (peer_copies:
    it hands every node the metadata)."""

    save_id: str
    tag: str | None
    coordinator: int = 0


@dataclass(frozen=True)
class SoloDrain:
    """local_tier with one rank: the tag of the durable file names and the durable folder
    (``durable``), prepared before its files are written so that they can be copied while
    they are."""

    tag: str | None
    durable: str | None = None


@dataclass
class ReadPlan:
    """What a load reads: the folder (``path``); for a checkpoint committed only on the nodes'
    local tiers, its pending (Metadata, files); and the local copy (``local``) whose recorded
    data files this node may read instead of the durable ones (several-rank saves)."""

    path: str
    pending: tuple | None = None
    pending_id: str | None = None
    local: str | None = None
