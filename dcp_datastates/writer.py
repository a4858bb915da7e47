"""DataStatesWriter: a DCP StorageWriter that is also an AsyncStager (lazy staging).

This module only answers DCP: each callback delegates to one named step of the save.

- ``stage()`` (training thread): ``save.request_save``: plan this rank's data files from
  the local state alone, hand the engine one job per file, return a Future at once.
- ``set_up_storage_writer`` / ``prepare_local_plan`` / ``prepare_global_plan`` (DCP's thread):
  name the folder, report it, let the tier adjust the plan.
- ``write_data``: the tier hears the coordinator's word (``FilesNamed``), ``save.write_rank``:
  every file durable, each item's location; then the tier's ``RankEnded``; the results packed
  for the coordinator (``format.results.pack_write_results``) and the optional hierarchical
  consolidation.
- ``finish`` (coordinator): every rank's results as one ``CommitLocations``, then the tier's
  ``commit``: ``commit.write_commit`` for a plain save.

Storage is chosen once per checkpoint path (``storage.open_storage``); the node-local tier is
one object (``tiers.tier_for``; ``tiers/plain.py`` names its protocol) told of each save's
events (``save/tier_events.py``). Faults: a rank's error never skips
a collective: an error at ``stage()`` is kept and raised from ``prepare_local_plan`` (inside
DCP's planning collective, so every rank gets CheckpointException), and ``write_data`` takes part
in the optional consolidation before it raises. The staging Future itself never fails.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from . import save
from .config import DataStatesConfig
from .errors import CheckpointWriteError
from .format.dcp_plans import wire_save_plan, wire_save_plans
from .format.results import CommitLocations, pack_write_results
from .save.tier_events import FilesNamed, RankEnded
from .storage import is_supported_url, normalize, open_storage
from .tiers import tier_for

__all__ = ["DataStatesWriter"]


@dataclass(frozen=True)
class RankReport:
    """What each rank's writer tells the coordinator in its local plan's ``storage_data``."""

    rank: int
    path: str | None


class DataStatesWriter(StorageWriter, AsyncStager):
    """Storage writer for ``dcp.save`` / ``dcp.async_save`` with lazy asynchronous staging.

    Args:
        path: checkpoint folder (a ``checkpoint_id`` given to DCP retargets it).
        config: a ``DataStatesConfig``, a dict, or a YAML/JSON file path.
        process_group: the checkpoint's process group (the one given to ``dcp.save`` /
            ``async_save``). With it, write results are consolidated rank -> node leader ->
            coordinator on that group; without it, DCP's own gather carries them.
        per_process: allow a save from a process started with ``WORLD_SIZE`` > 1 but no
            process group (each process saves alone; give each its own path).
        **options: any ``DataStatesConfig`` field (``host_cache_size=``, ``sync_files=``,
            ``overwrite=``, ``thread_count=`` ...), on top of ``config``.
    """

    # Staging is asynchronous: DCP must not call synchronize_staging() inside async_save.
    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike | None = None, *, config=None, process_group=None,
                 per_process: bool = False, **options: Any) -> None:
        super().__init__()
        self.config = DataStatesConfig.resolve(config, options)
        self.tier = tier_for(self.config, saving=True)
        # The tier's word on the checkpoint path (set by _target).
        self._dest = self.tier.destination(None)
        self._storages: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.path = self._target(path)
        self.process_group = process_group
        self.per_process = bool(per_process)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        self.use_collectives = True
        # A reset() named another folder: later saves defer theirs.
        self._retargeted = False
        # Staged saves waiting for their write_data (in order).
        self._pending: list = []
        # When this rank's last local plan was handed to DCP (the coordinator times its planning).
        self._local_planned_at: float | None = None
        # The save DCP is planning/writing now.
        self._current = None
        # Written, waiting for finish() (coordinator).
        self._finishing = None

    def __getstate__(self):
        raise TypeError(
            "DataStatesWriter cannot be sent to another process: its staging lives in this process's "
            "host cache. Use dcp.async_save with AsyncCheckpointerType.THREAD (the default)."
        )

    @property
    def durable_path(self) -> str | None:
        """local_tier: the path drained to (``path`` is then the local copy)."""
        return self.tier.durable_path

    @property
    def local_commit(self) -> Future:
        """local_tier: resolves when the local copy is committed."""
        return self.tier.local_commit

    @property
    def peer_copy(self) -> Future:
        """peer_copies: resolves when this rank's peer copies of the last save are made
        ({"sent": ..., "kept": ...}: file names), or fails saying why they are not."""
        return self.tier.peer_copy

    def _target(self, path: str | os.PathLike | None) -> str | None:
        """The folder this writer writes for checkpoint ``path`` (the tier's choice); its storage
        is opened here, once per path."""
        self._dest = self.tier.destination(normalize(path))
        folder = self._dest.folder
        if folder is not None:
            self._storage(folder)
        return folder

    def _storage(self, path: str):
        """The storage of ``path``, chosen once per path and reused by this writer."""
        with self._lock:
            storage = self._storages.get(path)
            if storage is None:
                storage = self._storages[path] = open_storage(path, self.config.storage_options)
            return storage

    # ------------------------------------------------------------------------------ AsyncStager
    def stage(self, state_dict: dict) -> Future:
        """Enqueue this rank's copies and return a Future of the staged state dict at once. The
        Future never fails: errors surface from the save (``upload_completion``) on every rank."""
        t0 = time.monotonic()
        target = None if self._retargeted else self.path
        staged, future = save.request_save(
            state_dict, path=target, storage=None if target is None else self._storage(target), config=self.config,
            tier=self.tier, dest=self._dest, requested=t0, check_launch=self._check_launch)
        with self._lock:
            self._pending.append(staged)
        staged.stall_s = time.monotonic() - t0
        return future

    def _check_launch(self) -> None:
        """A multi-process launch without a process group would have every process save as rank 0
        of 1 into the same folder: refuse before writing anything."""
        if self.per_process or (dist.is_available() and dist.is_initialized()):
            return
        world = os.environ.get("WORLD_SIZE", "1")
        if world.isdigit() and int(world) > 1:
            raise CheckpointWriteError(
                f"WORLD_SIZE={world} in the environment but torch.distributed is not initialized: every "
                f"process would save alone as rank 0 and overwrite the others' files. Call "
                f"torch.distributed.init_process_group() before saving, or pass per_process=True to "
                f"DataStatesWriter (each process then saves alone; give each its own path)."
            )

    def synchronize_staging(self) -> None:
        """Wait until every checkpoint staged by this writer is in the host cache."""
        with self._lock:
            pending = list(self._pending)
        for staged in pending:
            staged.wait_staged(None)
            staged.seal()

    def close(self) -> None:
        """Nothing to release per writer: the engine is process-wide."""

    # ---------------------------------------------------------------------------- StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            new = self._target(checkpoint_id)
            if new != self.path and self.path is not None:
                # This writer is given its folder per save: defer it.
                self._retargeted = True
            self.path = new
        self.save_id = uuid.uuid4().hex
        self.tier.new_save()

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", save.global_rank_world()[0]))
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        with self._lock:
            self._current = self._pending.pop(0) if self._pending else None
        staged = self._current
        if staged is None:
            return
        staged.planner = threading.current_thread()
        # A failure DCP sends to this thread removes what it wrote.
        save.watch(staged, self.tier)
        for h in staged.held:
            h.watch(staged.planner)
        if staged.error is not None or self.path is None:
            return
        try:
            save.name_folder(staged, self.path, self._storage(self.path), self.config, self.tier)
        except Exception as exc:  # noqa: BLE001 - raised from prepare_local_plan
            staged.fail(exc)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._dest.durable, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            return self._prepare_local_plan(plan)
        except BaseException as exc:
            staged = self._current
            if staged is not None:
                save.discard(staged, f"save abandoned: {exc}", self.tier)
                save.unwatch(staged)
                # DCP stops here: nothing closes the save.
                staged.end_collector_pause()
                self.tier.ended(staged, exc)
            raise

    def _prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.path is None:
            raise ValueError("DataStatesWriter: no checkpoint path (pass path= or checkpoint_id=)")
        if not self.use_collectives:
            save.check_rank_local(self._storage(self.path), self.path)
        staged = self._current
        if staged is not None and staged.error is not None:
            raise staged.error
        if not self.use_collectives and self._dest.rank_local_refused:
            # Raised inside DCP's planning, so every rank gets it.
            raise CheckpointWriteError(self._dest.rank_local_refused)
        if staged is None:
            # dcp.save: nothing staged, the folder is prepared here.
            self._check_launch()
            staged = self._current = save.sync_save(self.path, self._storage(self.path), self.rank, self.config,
                                                    self.tier)
            staged.planner = threading.current_thread()
            save.watch(staged, self.tier)
        report = RankReport(self.rank, self._dest.durable)
        if self.use_collectives:
            plan = save.skip_replicas(staged, plan)
        # DCP gathers it at the coordinator, pickled: packed (format/dcp_plans.py).
        plan = wire_save_plan(dataclasses.replace(plan, storage_data=report))
        self._local_planned_at = time.monotonic()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: every rank must be saving the same checkpoint."""
        paths: dict[str, list[int]] = {}
        for p in plans:
            if isinstance(p.storage_data, RankReport):
                paths.setdefault(str(p.storage_data.path), []).append(p.storage_data.rank)
        if len(paths) > 1:
            listing = "; ".join(f"{path}: ranks {ranks}" for path, ranks in sorted(paths.items()))
            raise CheckpointWriteError(
                f"the ranks of one save name different checkpoint paths ({listing}); every rank must pass "
                f"the same path (or checkpoint_id). Nothing was committed."
            )
        if self._local_planned_at is not None:
            save.warn_if_planning_is_slow(self.path, time.monotonic() - self._local_planned_at, plans,
                                     self.config.stall_timeout)
        current = self._current
        plans = self.tier.global_plan(plans, self.save_id, current, current is not None and current.moved_from is not None)
        # DCP scatters them to the ranks, pickled: packed (format/dcp_plans.py).
        return wire_save_plans(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        staged = self._current
        self._current = None
        results: list[WriteResult] = []
        error: BaseException | None = None
        try:
            # The coordinator's word first (a failed rank still takes its part in the tier's exchanges).
            self.tier.files_named(FilesNamed(staged, staged.storage, tuple(staged.files), plan.storage_data,
                                             staged.moved_from is not None))
            results = save.write_rank(staged, plan, planner, self.config, self.tier)
            results = pack_write_results(self.tier.rank_ended(self._rank_ended(staged, results=tuple(results))))
        except BaseException as exc:  # noqa: BLE001 - raised below, after the collectives
            error = exc
            staged.abandon(f"save abandoned: {exc}")
            self.tier.rank_ended(self._rank_ended(staged, error=exc))
            save.discard(staged, f"save abandoned: {exc}", self.tier)
            save.unwatch(staged)
        if self.process_group is not None and self.use_collectives and self.config.hierarchical_consolidation \
                and dist.is_available() and dist.is_initialized():
            # Every rank enters this, a failed one with nothing to send: it raises right after,
            # and DCP's own gather then fails the save on every rank.
            results = save.consolidate_results(results if error is None else [], self.process_group, 0)
        if error is not None:
            self._close(staged, self.tier.ended(staged, error), error=error)
            if isinstance(error, CheckpointWriteError):
                raise error
            raise CheckpointWriteError(f"saving checkpoint {self.path} failed: {type(error).__name__}: {error}") from error
        if self.use_collectives and not self.is_coordinator:
            # The coordinator commits; nothing more happens here.
            self._close(staged, self.tier.ended(staged, None))
        else:
            self._finishing = staged
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        staged = self._finishing
        self._finishing = None
        # What DCP sends every rank once this returns.
        broadcast = metadata
        error: BaseException | None = None
        try:
            if staged is not None and staged.abandoned is not None:
                raise CheckpointWriteError(f"checkpoint {self.path} abandoned: {staged.abandoned}; not committed")
            if metadata.storage_meta is None:
                # DCP's default planner does not fill it.
                metadata = dataclasses.replace(metadata, storage_meta=self.storage_meta())
            locations = CommitLocations(results, metadata)
            self.tier.commit(self._storage(self.path), metadata, locations, staged,
                             None if staged is None else staged.request.requested,
                             rank_local=None if self.use_collectives else self.rank,
                             in_use=save.names_in_use(self.path) if staged is None else frozenset())
            # The other ranks learn that it is committed.
            broadcast.storage_data = save.CommitNotice()
        except BaseException as exc:
            error = exc
            # Before the discard: peers waiting for this coordinator's metadata learn there is none.
            local_s = self.tier.ended(staged, exc)
            if staged is not None:
                save.discard(staged, f"not committed: {exc}", self.tier)
            raise
        else:
            local_s = self.tier.ended(staged, None)
        finally:
            save.unwatch(staged)
            if staged is not None:
                total = sum(r.size_in_bytes for rank_results in results for r in rank_results)
                self._close(staged, local_s, error=error, total_bytes=total, committed=error is None)

    @staticmethod
    def _rank_ended(staged, **outcome) -> RankEnded:
        return RankEnded(staged, staged.path, staged.request.rank, staged.request.requested, tuple(staged.jobs()),
                         **outcome)

    def _close(self, staged, local_s: float | None, **figures) -> None:
        """``local_s``: the tier's answer to the save's ``ended`` event."""
        save.close_save(staged, path=self._dest.durable or staged.path,
                        coordinator=self.is_coordinator or not self.use_collectives, local_s=local_s, **figures)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Local paths, ``file://`` and any URL whose protocol fsspec knows."""
        return is_supported_url(checkpoint_id)
