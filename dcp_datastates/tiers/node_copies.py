"""A load's reads from this node's local tier: each data file from its local copy while it reads well.

With ``local_tier``, this node may hold copies of the data files of the checkpoint a load reads
(its own save's local copy, a peer's copy, files pulled at a restart). The tier hands the reader
a ``NodeCopies`` (``tier.node_copies``); the reader asks it first for each file and reads the
durable file when it says no. A copy is used only when it has its recorded size and every piece
it yields verifies (always, whatever ``verify`` says: the local tier is a cache); a copy that
fails once is given up for the rest of the load, with a warning naming it.
"""

from __future__ import annotations

import logging
import os

from ..commit import check_data_files
from ..errors import DataStatesError
from ..format.locations import FileInfo
from ..load import read
from ..storage import LocalStorage

log = logging.getLogger("dcp_datastates")

__all__ = ["NodeCopies"]


class NodeCopies:
    """This node's copies of one checkpoint's data files: ``files`` maps a durable data-file name
    to the path of its local copy (empty without a local tier). ``reads`` counts the files each
    tier served (logged, and read by tests)."""

    def __init__(self, files: dict[str, str] | None = None, *, rank: int = 0) -> None:
        self.files = dict(files or {})
        self.rank = rank
        self.reads = {"local": 0, "durable": 0}
        self._given_up: set[str] = set()

    def holds(self, name: str) -> bool:
        """A copy of ``name`` is here and not given up."""
        return name in self.files and name not in self._given_up

    def usable(self, name: str, info: FileInfo | None) -> bool:
        """The copy of ``name`` exists with its recorded size (``info``); given up otherwise."""
        if not self.holds(name):
            return False
        if info is None:
            return True
        local = self.files[name]
        try:
            check_data_files(_folder(local), {os.path.basename(local): info})
        except (DataStatesError, OSError) as exc:
            self._give_up(name, exc)
            return False
        return True

    def read(self, name: str, reading: list, engine, threads: int) -> bool:
        """Fill ``reading`` (``load.read`` targets) from the copy of ``name``, every piece
        verified. False, with nothing to trust in the targets, when there is no usable copy (the
        caller reads the durable file)."""
        if not self.holds(name):
            return False
        local = self.files[name]
        try:
            read.read_targets(_folder(local), os.path.basename(local), reading, engine, verify=True,
                              threads=threads, checkpoint=os.path.dirname(local))
        except (DataStatesError, OSError) as exc:
            self._give_up(name, exc)
            return False
        return True

    def served(self, name: str) -> None:
        """Count ``name`` as read from the tier that served it last."""
        self.reads["local" if self.holds(name) else "durable"] += 1

    def log_reads(self, durable: str, local_tier: str | None) -> None:
        if self.files:
            log.info("dcp_datastates: rank %d read %d data file(s) of %s from the local tier %s and %d from "
                     "the durable tier", self.rank, self.reads["local"], durable, local_tier, self.reads["durable"])

    def _give_up(self, name: str, exc: BaseException) -> None:
        self._given_up.add(name)
        log.warning("dcp_datastates: rank %d: the local copy %s of %s is unusable (%s); reading it from "
                    "the durable tier", self.rank, self.files[name], name, exc)


def _folder(local: str) -> LocalStorage:
    """The folder of a local-tier copy."""
    return LocalStorage(os.path.dirname(local))  # the local tier is a folder of this machine
