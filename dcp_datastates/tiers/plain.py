"""The tier protocol and the plain tier (``NoTier``): every checkpoint written and read where its
path says. ``LocalTier`` (``layered.py``, ``local_tier=DIR``) fills the same methods to put the
node-local tier in front of the durable path. The writer and the reader get theirs from
``tiers.tier_for`` and never ask which one they hold.

A writer asks ``destination(path)`` once per checkpoint path and calls ``new_save`` per save.
A save in flight then tells its tier of a few typed events (``save/tier_events.py``), in order:
``claimed`` (a rank is about to write into its folder), ``files_named`` (files named and being
written: at the request, at the start of ``write_data`` with the coordinator's word, and for each
file made later), ``rank_ended`` (this rank's files durable, or its part failed), and ``ended``
(the save's outcome on this rank; it answers the seconds until its local copy was committed).
Two steps of DCP's protocol pass through it: the coordinator's ``global_plan`` and ``commit``.
A save that fails has what it wrote removed through ``discard``. A tier keeps what it needs of
each save itself, under the events' ``key``; the save carries nothing for it. A load asks
``choose`` (which copy to read) and ``node_copies`` (this node's copies of its data files,
which the load asks first for each file: ``node_copies.py``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from ..commit import write_commit
from ..save.tier_events import Claim, Destination, FilesNamed, RankEnded
from ..storage import Storage
from .node_copies import NodeCopies
from .records import ReadPlan

log = logging.getLogger("dcp_datastates")

__all__ = ["NoTier"]


class NoTier:
    """The plain save and load: every checkpoint is written and read where its path says."""

    #: local_tier: the durable path of the checkpoint written or read last (None: no tier).
    durable_path: str | None = None

    def __init__(self, config, *, saving: bool = False) -> None:
        self.config = config
        # Resolves when the local copy is committed (LocalTier only).
        self.local_commit: Future = Future()
        # resolves with what the save's peer copies did (LocalTier with peer_copies, several ranks)
        self.peer_copy: Future = Future()

    # ---------------------------------------------------------------------------------- save
    def destination(self, path: str | None) -> Destination:
        """Where the saves of checkpoint ``path`` go."""
        return Destination(path, path)

    def new_save(self) -> None:
        """A writer starts its next save: the Futures it shows are that save's."""
        if self.local_commit.done():
            self.local_commit = Future()
        if self.peer_copy.done():
            self.peer_copy = Future()

    def claimed(self, event: Claim) -> None:
        pass

    def files_named(self, event: FilesNamed) -> None:
        pass

    def global_plan(self, plans: list, save_id: str, key: object, moved: bool) -> list:
        """Coordinator: DCP's global plan, with the tier's word to each rank in its
        ``storage_data`` (``key``: the coordinator's own save; ``moved``: staged elsewhere)."""
        return plans

    def rank_ended(self, event: RankEnded) -> list:
        """The write results this rank reports (those of ``event``: none when it failed)."""
        return list(event.results)

    def commit(self, storage: Storage, metadata, locations, key: object, requested: float | None, *,
               rank_local: int | None, in_use: frozenset) -> dict:
        """Coordinator: the checkpoint committed; the data files the commit lists."""
        return write_commit(storage, metadata, locations, sync=self.config.sync_files, rank_local=rank_local,
                            in_use=in_use)

    def ended(self, key: object, error: BaseException | None) -> float | None:
        """The save ``key`` ended on this rank (``error``: it failed; ``key`` None: a commit of
        nothing this rank staged). Seconds from its request until its local copy was committed
        (None: no local copy, or not committed)."""
        return None

    def discard(self, key: object, folder: str | None, rank: int, remove_files) -> None:
        """The save failed: what it wrote goes (``remove_files()``: its data files where it wrote
        them), with what the tier keeps of it elsewhere."""
        remove_files()

    # ---------------------------------------------------------------------------------- load
    def choose(self, path: str) -> ReadPlan:
        return ReadPlan(path)

    def node_copies(self, plan: ReadPlan, save_id: str | None, rank: int) -> NodeCopies:
        """The copies this node holds of checkpoint ``save_id``'s data files: where the load
        asks first for each file (``rank`` names it in messages)."""
        return NodeCopies(rank=rank)
