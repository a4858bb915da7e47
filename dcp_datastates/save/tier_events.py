"""What a save tells its tier: where a checkpoint goes and the typed events of a save in flight,
each holding what the tier needs of it and no more (the tiers, one layer up, consume them).

A save tells its tier, in order: ``Claim`` (a rank is about to write into its folder),
``FilesNamed`` (some of its files are named and being written; ``plan`` says whether DCP has
planned yet), ``RankEnded`` (this rank's files are durable, or its part failed). The records
name the save by ``key``, an object the tier may keep per-save state under and never reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Destination", "Claim", "FilesNamed", "RankEnded", "BEFORE_PLAN"]


@dataclass(frozen=True)
class Destination:
    """Where a writer's saves of one checkpoint path go.

    - ``folder``: the folder this rank writes (the local copy with ``local_tier``).
    - ``durable``: the checkpoint path ranks report and the metadata records.
    - ``folder_at_request``: the request makes ``folder`` on the training thread, so that it
      exists when the call returns (TorchTitan's ``keep_latest_k`` lists it right after); else
      the tier makes it after making room for it, off that thread.
    - ``rank_local_refused``: why saves without collectives (``use_collectives=False``) are
      refused (None: they are supported).
    - ``mirroring``: peer_copies, who keeps whose copies (save/ownership.py); None without.
    """

    folder: str | None
    durable: str | None
    folder_at_request: bool = True
    rank_local_refused: str | None = None
    mirroring: Any = None


@dataclass(frozen=True)
class Claim:
    """A rank is about to write the files of a save into ``folder``, none of them named yet:
    the tier makes room for ``need()`` bytes (None: unknown, nothing reserved) and forgets
    what it recorded of the rank's previous files there."""

    folder: str
    rank: int
    need: Callable[[], int] | None = None


class _BeforePlan:
    def __repr__(self) -> str:
        return "BEFORE_PLAN"


#: ``FilesNamed.plan`` at the request: DCP has not planned the save yet.
BEFORE_PLAN = _BeforePlan()


@dataclass(frozen=True)
class FilesNamed:
    """Files of a save are named in ``storage``'s folder and being written by the engine.

    - ``plan``: ``BEFORE_PLAN`` at the request; from ``write_data`` on, what the coordinator's
      ``global_plan`` told this rank (its plan's ``storage_data``, None: nothing). The event
      at the start of ``write_data`` carries every file staged so far (possibly none).
    - ``moved``: the files were staged into another folder and move into this one once written.
    """

    key: object
    storage: Any
    files: tuple
    plan: Any = BEFORE_PLAN
    moved: bool = False


@dataclass(frozen=True)
class RankEnded:
    """This rank's part of a save ended: ``results`` (DCP's write results, every file durable
    in ``folder``) or ``error`` (the save fails on every rank).

    - ``files``: the save's file jobs (name, ``written`` locations, ``mirrors``/``mirror_of``).
    - ``requested``: the request's ``time.monotonic()``.
    """

    key: object
    folder: str | None
    rank: int
    requested: float
    files: tuple = ()
    results: tuple = ()
    error: BaseException | None = None
