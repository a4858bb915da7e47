"""The tiers as seen by the writer and the reader: one object each, with fixed hooks called at
fixed points of every save and load. ``NoTier`` (no ``local_tier``) does nothing at each hook;
``LocalTier`` (``layered.py``) puts the node-local tier in front of the durable path. The writer
and the reader get theirs from ``tiers.tier_for`` and never ask which one they hold.

Save hooks, in call order: ``folder`` (which folder this rank writes), ``reserve`` (room for the
staged bytes), ``files_changing`` (before a rank rewrites its files), ``files_started`` (the
request's files are named, off the training thread, before DCP plans), ``check_local_plan``,
``global_plan`` (coordinator), ``planned`` (a rank starts ``write_data`` with the coordinator's
word), ``writing`` (its staged files are named), ``file_named`` (a file started during
``write_data``), ``rank_written`` (a rank's files are durable where it wrote them),
``rank_failed`` (its ``write_data`` failed), ``commit`` (coordinator: the checkpoint is
committed where the tier wants it), ``failed``,
``discard`` (the save failed on some rank: what this rank wrote goes, save/discard.py),
``local_seconds`` (the save's figure: when its local copy was committed). A tier keeps what it
needs of each save in flight itself (``LocalTier``: a ``_SaveCopies`` per save); the save carries
nothing for it. Load hooks: ``choose`` (which copy to read), ``node_copies`` (this node's copies
of its data files, which the load asks first for each file: ``node_copies.py``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

from ..commit import write_commit
from ..storage import Storage
from .node_copies import NodeCopies

log = logging.getLogger("dcp_datastates")

__all__ = ["NoTier", "RankDrain", "SoloDrain", "ReadPlan"]

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
    """local_tier with one rank: the tag of the durable file names, the durable folder
    (``durable``) prepared before its files are written, so that they can be copied while they
    are (``files_started``; ``writing`` for files named later)."""

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


class NoTier:
    """The plain save and load: every checkpoint is written and read where its path says."""

    durable_path: str | None = None
    # The request makes the save's folder on the training thread, so that it exists when the
    # call returns (TorchTitan's ``keep_latest_k`` lists it right after); the rest of the folder
    # work runs later, off that thread. A plain attribute, not a hook: the request reads it
    # without entering this module.
    folder_at_request = True
    # peer_copies: who keeps whose copies, for the mirrored files the request plans
    # (save/ownership.py); a plain attribute too.
    mirroring = None

    def __init__(self, config, *, saving: bool = False) -> None:
        self.config = config
        # Resolves when the local copy is committed (LocalTier only).
        self.local_commit: Future = Future()
        # resolves with what the save's peer copies did (LocalTier with peer_copies, several ranks)
        self.peer_copy: Future = Future()

    # ---------------------------------------------------------------------------------- save
    def folder(self, path: str | None) -> str | None:
        return path

    def reported(self, path: str | None) -> str | None:
        """The checkpoint path ranks report and the metadata records (the durable one)."""
        return path

    def new_save(self) -> None:
        if self.local_commit.done():
            self.local_commit = Future()
        if self.peer_copy.done():
            self.peer_copy = Future()

    def reserve(self, folder: str, need) -> None:
        """Room for a save of ``need()`` bytes (computed only by a tier that keeps copies)."""

    def files_changing(self, folder: str, rank: int) -> None:
        pass

    def files_started(self, staged) -> None:
        """Off the training thread, at the request: the files it started are named and being
        written (``staged.files``); DCP has not planned yet."""

    def check_local_plan(self, folder: str, use_collectives: bool) -> None:
        pass

    def global_plan(self, plans: list, save_id: str, staged=None) -> list:
        """Coordinator; ``staged``: its own save."""
        return plans

    def planned(self, staged, plan) -> None:
        """A rank starts ``write_data`` with what the coordinator's ``global_plan`` told it
        (``plan``: the plan's ``storage_data``; None: nothing)."""

    def writing(self, staged) -> None:
        """A rank starts ``write_data``: the files it staged are named and being written."""

    def file_named(self, staged, f) -> None:
        """A file started and named during ``write_data``."""

    def rank_written(self, staged, results: list) -> list:
        return results

    def rank_failed(self, staged) -> None:
        """This rank's ``write_data`` failed (the save fails on every rank)."""

    def discard(self, staged, remove_files) -> None:
        """The save failed: what it wrote goes (``remove_files()``: its data files where it wrote
        them), with what the tier keeps of it elsewhere."""
        remove_files()

    def commit(self, storage: Storage, metadata, locations, staged, *, rank_local: int | None,
               in_use: frozenset) -> dict:
        """The data files the commit lists."""
        return write_commit(storage, metadata, locations, sync=self.config.sync_files, rank_local=rank_local,
                            in_use=in_use, references_beside=self.references_beside())

    def references_beside(self) -> Storage | None:
        """The checkpoint folder an incremental save's references resolve beside, when it is not
        the folder written (None: that folder's own neighbours)."""
        return None

    def failed(self, exc: BaseException) -> None:
        pass

    def local_seconds(self, staged) -> float | None:
        """Seconds from the request until the save's local copy was committed (None: no local
        copy, or not committed)."""
        return None

    # ---------------------------------------------------------------------------------- load
    def choose(self, path: str) -> ReadPlan:
        return ReadPlan(path)

    def node_copies(self, plan: ReadPlan, save_id: str | None, rank: int) -> NodeCopies:
        """The copies this node holds of checkpoint ``save_id``'s data files: where the load
        asks first for each file (``rank`` names it in messages)."""
        return NodeCopies(rank=rank)
