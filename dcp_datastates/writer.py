"""DataStatesWriter: a DCP StorageWriter that is also an AsyncStager (lazy staging).

``stage()`` runs on the training thread: it takes this rank's plan of data files, derived from
the local state dict alone (``stage/pipeline.py``), hands the engine one job per file (pointers,
sizes, offsets) and returns a Future at once. The engine's copy workers fill the host cache while training goes on; its flush workers
write each chunk as soon as it is in the cache. DCP's planning, ``write_data`` and ``finish`` then
run on DCP's thread: ``write_data`` waits for the files to be durable and reports each item's
location; the coordinator's ``finish`` commits ``.metadata`` atomically.

Faults. A rank's error never skips a collective: an error at ``stage()`` is kept and raised from
``prepare_local_plan`` (inside DCP's planning collective, so every rank gets CheckpointException),
and ``write_data`` takes part in the optional consolidation before it raises. The staging Future
itself never fails (a failed one would make DCP skip every collective on that rank only).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.checkpoint.utils import find_state_dict_object

from . import checkpoint_stats, commit, drain, folders, inflight, remote, tiers
from .checkpoint_format import ItemLocation, data_file_name, name_to_dtype
from .compat import unflatten_state_dict
from .config import DataStatesConfig
from .consolidate import consolidate_results
from .errors import CheckpointWriteError
from .gcpause import gc_paused
from .held_file import HeldFile
from .planner_hooks import items_to_rewrite, overridden_data_hooks
from .runtime import get_engine
from .stage.items import ItemKey, SourceItem, flatten, item_key, source_for_resolved
from .stage.ownership import DecisionKey, decisions
from .stage.pipeline import PlannedFile, moved, on_one_device, plan_stage, planned_file, written
from .stage.request_copy import copy_small_at_request
from .staging_tracker import install_step_wait, tracker
from .version_guard import VersionGuard, torn_message

__all__ = ["DataStatesWriter"]

log = logging.getLogger("dcp_datastates")

# Waits for staging and resolves the Futures handed to DCP; never runs Python on engine threads.
_watchers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dcp-datastates-staging")


@dataclass(frozen=True)
class RankReport:
    """What each rank's writer tells the coordinator in its local plan's ``storage_data``."""

    rank: int
    path: str | None


@dataclass(frozen=True)
class RankDrain:
    """local_tier with several ranks: what the coordinator's global plan tells each rank (its
    plan's ``storage_data``): the checkpoint id, and the tag of the durable file names (None
    when the durable folder holds no commit). See tiers.py."""

    save_id: str
    tag: str | None


@dataclass(eq=False)
class _FileJob:
    """One data file written by the engine (local) or streamed to an object store (remote)."""

    index: int  # k in __<rank>_<k>
    name: str
    job: Any
    keys: Sequence[ItemKey]
    locations: Mapping[ItemKey, ItemLocation]  # shared with a cached stage plan: never mutated
    keepalive: list[Any] | None
    engine: Any
    file_size: int
    upload: Future | None = None  # remote files: resolves once the object is complete in the store

    @property
    def device(self) -> int:
        return self.job.device

    def wait_staged(self, timeout: float | None = None) -> bool:
        return self.job.wait_staged(timeout)

    def is_staged(self) -> bool:
        return self.job.is_staged()

    def is_done(self) -> bool:
        return self.job.is_done() and (self.upload is None or self.upload.done())

    def device_wait(self, stream_of) -> bool:
        if self.job.device < 0:
            return self.job.is_staged()
        stream = stream_of(self.job.device)
        return stream is not None and self.engine.device_wait(self.job, stream)

    def abort(self, reason: str) -> None:
        try:
            self.job.fail(reason)
        except Exception:  # noqa: BLE001 - a job that cannot be failed finishes on its own
            pass

    def result(self) -> dict[ItemKey, ItemLocation]:
        """Wait until the file is durable; its items' final locations (checksums included)."""
        error = None
        if self.upload is not None:
            exc = self.upload.exception()
            if exc is not None:
                error = str(exc)
        self.job.wait_done(None)
        self.keepalive = None
        error = error or self.job.error()
        if error:
            raise CheckpointWriteError(error)
        crcs = self.job.checksums()
        size = self.file_size
        return {k: written(self.locations[k], self.name, tuple(c), size) for k, c in zip(self.keys, crcs)}


@dataclass(eq=False)
class _StagedSave:
    """Everything ``stage()`` started for one checkpoint on this rank."""

    path: str | None  # None: the folder is named later (checkpoint_id given to DCP only)
    rank: int = 0
    tag: str | None = None  # file-name tag when the folder already holds a committed checkpoint
    files: list[_FileJob] = field(default_factory=list)
    held: list[HeldFile] = field(default_factory=list)
    skipped: set = field(default_factory=set)  # DTensor replicas another rank writes
    elsewhere: set = field(default_factory=set)  # plain tensors the decision gives to other ranks
    decision_key: DecisionKey | None = None
    learn: bool = False  # no decision was known: learn it from this save's plan
    plain_keys: frozenset = frozenset()
    moved_from: str | None = None  # staged into this folder, then DCP named another (reset)
    guard: VersionGuard | None = None  # the sources this rank copies
    late_guard: VersionGuard | None = None  # tensors it may have to write from live memory
    error: BaseException | None = None  # raised from prepare_local_plan
    abandoned: str | None = None  # why the save was abandoned (Ctrl-C at exit, an error): never commit
    requested: float = field(default_factory=time.monotonic)
    stall_s: float = 0.0  # the training thread's time in stage()
    staged_s: float | None = None  # request -> every byte in the host cache
    local_s: float | None = None  # local_tier: request -> the local copy committed
    rank_drain: "RankDrain | None" = None  # local_tier, several ranks: this save's drain plan
    _sealed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    finished: threading.Event = field(default_factory=threading.Event)
    planner: threading.Thread | None = None  # DCP's thread planning this save
    writing: bool = False  # DCP called write_data
    flat: dict | None = None  # the state as flattened at the request (its tensors are the sources)
    payloads: dict = field(default_factory=dict)  # fqn -> a non-tensor value's bytes, serialized at the request

    def is_over(self) -> bool:
        """Finished, or given up by DCP: the thread that ran its DCP save has ended (the save
        failed on some rank; DCP calls nothing more here)."""
        if self.finished.is_set():
            return True
        t = self.planner
        return t is not None and not t.is_alive()

    def jobs(self) -> list:
        return [*self.files, *self.held]

    def wait_staged(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for j in self.jobs():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not j.wait_staged(left):
                return False
        return True

    def device_wait(self, stream_of) -> bool:
        """True when no host wait is needed: some file copies from a GPU, and each file is staged
        or (GPU files) has the caller's stream now waiting for all its copies."""
        files = self.jobs()
        if not any(f.device >= 0 for f in files):
            return False
        return all(f.device_wait(stream_of) if isinstance(f, _FileJob) else f.is_staged() for f in files)

    def seal(self) -> None:
        """From now on the caller may change the sources: check none changed before (once)."""
        with self._lock:
            if self._sealed:
                return
            self._sealed = True
            guard, self.guard = self.guard, None
        changed = guard.first_changed() if guard is not None else None
        if changed is not None and self.error is None:
            self.error = CheckpointWriteError(torn_message(self.path or "(unnamed)", *changed))

    # The in-flight save handle (inflight.py): what Ctrl-C at exit names and abandons.
    def abandon(self, reason: str) -> None:
        """Fail every job at once: nothing of this save gets written or committed."""
        if self.abandoned is None:
            self.abandoned = reason
        for j in self.jobs():
            j.abort(reason)

    def progress(self) -> tuple[int, int]:
        jobs = [j.job for j in self.jobs()]
        return sum(int(getattr(j, "bytes_done", 0)) for j in jobs), sum(int(j.nbytes) for j in jobs)

    def done(self) -> bool:
        return self.is_over()

    def nbytes(self) -> int:
        return sum(int(j.job.nbytes) for j in self.jobs())


# Saves not finished yet, by checkpoint path (process-wide): a second save to the same folder
# waits for none of them, it is refused (its commit could describe the other's files).
_inflight: dict[str, _StagedSave] = {}
_inflight_lock = threading.Lock()


def _claim_path(path: str, staged: _StagedSave) -> None:
    with _inflight_lock:
        other = _inflight.get(path)
        if other is not None and other is not staged and not other.is_over():
            if all(j.is_done() for j in other.jobs()) and time.monotonic() - other.requested > 600:
                pass  # its data is long written and nothing finished it: it failed elsewhere
            else:
                raise CheckpointWriteError(
                    f"a save to {path} is still running; wait for its upload_completion before saving to the same path again"
                )
        _inflight[path] = staged


def _release_path(path: str | None, staged: _StagedSave) -> None:
    with _inflight_lock:
        if path is not None and _inflight.get(path) is staged:
            del _inflight[path]


def _names_in_use(path: str) -> frozenset:
    """Data files of saves into ``path`` still running in this process (never removed by a commit)."""
    with _inflight_lock:
        other = _inflight.get(path)
        if other is None or other.is_over():
            return frozenset()
        return frozenset(f.name for f in other.files) | frozenset(h.name for h in other.held if h.name)


def _planned(engine, index: int, items: list[SourceItem]) -> PlannedFile:
    """File ``index`` of ``items``, laid out, with its memory on one device."""
    device, items = on_one_device(engine.cuda_devices > 0, items)
    return planned_file(index, device, items)


def _current_stream(device: int) -> int:
    """Handle of this thread's current CUDA stream on ``device``: the engine's copies of a job
    run after the work queued on it when the job is submitted (the kernels producing the state)."""
    return torch.cuda.current_stream(device).cuda_stream


def _global_rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _new_tag() -> str:
    return uuid.uuid4().hex[:12]


# local_tier, several ranks: each rank's drain of its files (drain.drain_rank), off DCP's thread
# so the coordinator can gather while ranks drain.
_drainers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dcp-datastates-drain")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
        self.durable_path: str | None = None  # local_tier: the path drained to (self.path is the local copy)
        self.local_commit: Future = Future()  # local_tier: resolves when the local copy is committed
        self.path = self._tiered(folders.normalize(path))
        self.process_group = process_group
        self.per_process = bool(per_process)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        self.use_collectives = True
        self._retargeted = False  # a reset() named another folder: later saves defer theirs
        self._pending: list[_StagedSave] = []  # staged, waiting for their write_data (in order)
        self._current: _StagedSave | None = None  # the save DCP is planning/writing now
        self._sync_tag: str | None = None  # dcp.save into a committed folder: its file tag
        self._finishing: _StagedSave | None = None  # written, waiting for finish() (coordinator)
        self._remote_folders: dict[str, folders.RemoteFolder] = {}
        self._lock = threading.Lock()

    def __getstate__(self):
        raise TypeError(
            "DataStatesWriter cannot be sent to another process: its staging lives in this process's "
            "host cache. Use dcp.async_save with AsyncCheckpointerType.THREAD (the default)."
        )

    # ------------------------------------------------------------------------------ AsyncStager
    def stage(self, state_dict: dict) -> Future:
        """Enqueue this rank's copies and return a Future of the staged state dict at once. The
        Future never fails: errors surface from the save (``upload_completion``) on every rank."""
        t0 = time.monotonic()
        with gc_paused():  # thousands of small objects per checkpoint: no collection mid-stage
            future = self._stage(state_dict, t0)
        with self._lock:
            if self._pending:
                self._pending[-1].stall_s = time.monotonic() - t0
        return future

    def _stage(self, state_dict: dict, t0: float) -> Future:
        future: Future = Future()
        target = None if self._retargeted else self.path
        staged = _StagedSave(path=target, requested=t0)
        flat, mappings = None, None
        try:
            self._check_launch()
            flat, mappings = flatten(state_dict)
            if target is not None:
                _claim_path(target, staged)
            self._stage_into(staged, flat)
        except Exception as exc:  # noqa: BLE001 - raised from prepare_local_plan, on every rank
            staged.error = exc
            staged.abandon(f"save abandoned: {exc}")
        with self._lock:
            self._pending.append(staged)
        install_step_wait()  # every torch.optim step now waits for this save's copies
        tracker().add(staged)
        inflight.register(staged)
        if flat is None:
            future.set_result(state_dict)
            return future
        if staged.path is None and self._held_bytes(staged) > self._engine_cache_bytes() // 2:
            # The folder is named after staging (reset()); until then nothing can be flushed, so
            # a save larger than half the cache cannot be staged whole first: hand DCP the state
            # now (the version guard still fails the save if a source changes too early).
            log.warning(
                "dcp_datastates: a save larger than half the host cache whose folder is given only as "
                "checkpoint_id: staging_completion resolves before the copies end. Pass the path to "
                "DataStatesWriter(path) to keep the lazy guarantee; protect_optimizer still waits."
            )
            future.set_result(unflatten_state_dict(flat, mappings))
            _watchers.submit(self._finish_staging, staged, None)
            return future
        _watchers.submit(self._finish_staging, staged, (future, flat, mappings))
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

    def _stage_into(self, staged: _StagedSave, flat: dict) -> None:
        rank, world = _global_rank_world()
        staged.rank = rank
        dedup = world > 1 and self.config.dedup_replicated
        engine = get_engine(self.config)
        plan = plan_stage(flat, rank=rank, world=world, dedup=dedup, cuda=engine.cuda_devices > 0,
                          folder_known=staged.path is not None, hold_limit=lambda: self._engine_cache_bytes() // 2,
                          copied_at_request=self.config.copy_at_request_max_bytes)
        if self.durable_path is not None and staged.path is not None:  # local_tier hook: room for this save
            need = sum(pf.layout.file_size for pf in plan.files) + sum(it.entry.nbytes for g in plan.held for it in g.items)
            tiers.make_room(self.config.local_tier, need, staged.path, self.config.storage_options)
        if staged.path is not None:
            committed = commit.prepare_folder(staged.path, overwrite=self.config.overwrite, storage_options=self.config.storage_options)
            staged.tag = _new_tag() if committed else None
        staged.skipped, staged.elsewhere = plan.skipped, plan.elsewhere
        staged.guard, staged.late_guard = plan.guard, plan.late_guard
        staged.decision_key, staged.learn, staged.plain_keys = plan.decision_key, plan.learn, plan.plain_keys
        staged.flat, staged.payloads = flat, plan.payloads
        for pf in plan.files:
            staged.files.append(self._submit(engine, staged, self._copy_small_now(engine, pf, staged.path)))
        for group in plan.held:
            staged.held.append(self._hold(engine, group.items, known=group.known))
        if staged.files:
            plan.remember(staged.files[0].job.piece_size())

    def _held_bytes(self, staged: _StagedSave) -> int:
        return sum(h.job.nbytes for h in staged.held)

    def _engine_cache_bytes(self) -> int:
        return int(get_engine(self.config).stats()["cache_bytes"])

    def _finish_staging(self, staged: _StagedSave, resolve: tuple | None) -> None:
        try:
            staged.wait_staged(None)
            staged.staged_s = time.monotonic() - staged.requested
            staged.seal()
        finally:
            for f in staged.files:
                f.keepalive = None  # the engine copied them: release the source tensors
            tracker().discard(staged)
        if resolve is not None:
            # The staged dict: the structure as of stage() (our own flat copy of it), live tensors
            # (the engine owns their bytes now). Built here, off the training thread. It is
            # returned even when staging failed: the error is raised inside DCP's planning, so
            # every rank learns of it (a failed Future would fail this rank alone, before any
            # collective, and leave the others waiting in one).
            future, flat, mappings = resolve
            future.set_result(unflatten_state_dict(flat, mappings))

    def synchronize_staging(self) -> None:
        """Wait until every checkpoint staged by this writer is in the host cache."""
        with self._lock:
            pending = list(self._pending)
        for staged in pending:
            staged.wait_staged(None)
            staged.seal()

    def close(self) -> None:
        """Nothing to release per writer: the engine is process-wide."""

    # ---------------------------------------------------------------------------- engine submit
    def _hold(self, engine, items: list[SourceItem], known: bool) -> HeldFile:
        device, items = on_one_device(engine.cuda_devices > 0, items)
        stream = _current_stream(device) if device >= 0 else 0
        spans, keep = copy_small_at_request(engine, device, stream, [(it.ptr, it.entry.nbytes, 0) for it in items],
                                            [it.keepalive for it in items], self.config.copy_at_request_max_bytes,
                                            f"{self.path or 'checkpoint'} (held)")
        side_buffer = keep[-1] if len(keep) > len(items) else None
        if side_buffer is not None:
            items = [dataclasses.replace(it, ptr=span[0], keepalive=owner) for it, span, owner in zip(items, spans, keep)]
        held = HeldFile(engine, items, device, stream, f"{self.path or 'checkpoint'} (held)",
                        selection=None, selection_known=known, timeout=float(self.config.cache_wait_timeout))
        held.side_buffer = side_buffer  # what the items copied at the request point into
        return held

    def _copy_small_now(self, engine, pf: PlannedFile, path: str | None) -> PlannedFile:
        """At the request only (``stage()``): ``pf`` with its small items copied now
        (stage/request_copy.py). Files made later (``write_data``) need no such copy."""
        stream = _current_stream(pf.device) if pf.device >= 0 else 0
        spans, keepalive = copy_small_at_request(engine, pf.device, stream, pf.spans, pf.keepalive,
                                                 self.config.copy_at_request_max_bytes, path or "checkpoint")
        return dataclasses.replace(pf, spans=spans, keepalive=keepalive)

    def _submit(self, engine, staged: _StagedSave, pf: PlannedFile) -> _FileJob:
        """Hand one planned file to the engine: the only place a ``_FileJob`` is made."""
        job, upload, name = self._start(engine, staged, pf.index, pf.layout, pf.spans, pf.device)
        locations = pf.locations(data_file_name(staged.rank, pf.index), job.piece_size())
        return _FileJob(pf.index, name, job, pf.keys, locations, pf.keepalive, engine, pf.layout.file_size, upload)

    def _start(self, engine, staged: _StagedSave, index: int, layout, spans: list, device: int):
        """Hand one file to the engine: (job, upload Future for remote folders, file name)."""
        folder = staged.path
        name = data_file_name(staged.rank, index, staged.tag)
        stream = _current_stream(device) if device >= 0 else 0
        if self.durable_path is not None:  # local_tier hook: this rank's files change from here on
            tiers.forget_rank_files(folder, staged.rank)
        job, upload = remote.submit_data_file(
            engine, folder, name, layout.header, layout.file_size, spans, sync=self.config.sync_files,
            remote_folder=self._remote(folder) if folders.is_remote(folder) else None, device=device, stream=stream,
            unlink=lambda aside: _watchers.submit(_unlink_quietly, aside),  # old blocks freed off the training thread
        )
        return job, upload, name

    def _remote(self, folder: str) -> folders.RemoteFolder:
        """The fsspec folder of a remote checkpoint (one per URL, reused by this writer)."""
        with self._lock:
            cached = self._remote_folders.get(folder)
            if cached is None:
                cached = self._remote_folders[folder] = folders.remote_folder(folder, self.config.storage_options)
            return cached

    # ---------------------------------------------------------------------------- StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            new = self._tiered(folders.normalize(checkpoint_id))
            if new != self.path and self.path is not None:
                self._retargeted = True  # this writer is given its folder per save: defer it
            self.path = new
        self.save_id = uuid.uuid4().hex
        if self.local_commit.done():
            self.local_commit = Future()

    def _tiered(self, path: str | None) -> str | None:
        """local_tier hook: the folder this rank writes, the local copy of ``path`` (tiers.py)."""
        if self.config.local_tier is None or path is None:
            return path
        self.durable_path = path
        return tiers.local_copy(self.config.local_tier, path)

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", _global_rank_world()[0]))
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        with self._lock:
            self._current = self._pending.pop(0) if self._pending else None
        staged = self._current
        if staged is None:
            return
        staged.planner = threading.current_thread()
        for h in staged.held:
            h.watch(staged.planner)
        if staged.error is not None or self.path is None:
            return
        try:
            if staged.path is not None and staged.path != self.path:
                # Staged into the writer's previous folder, then DCP named another: the files are
                # moved there once written (held files go there directly).
                staged.moved_from = staged.path
                _release_path(staged.path, staged)
                staged.path = None
            if staged.path is None:  # the folder is known now: the held files may be written
                _claim_path(self.path, staged)
                staged.path = self.path
                committed = commit.prepare_folder(self.path, overwrite=self.config.overwrite, storage_options=self.config.storage_options)
                staged.tag = _new_tag() if committed else None
            remote_folder = self._remote(staged.path) if folders.is_remote(staged.path) else None
            if self.durable_path is not None and staged.held:  # local_tier hook: as in _start
                tiers.forget_rank_files(staged.path, staged.rank)
            for k, h in enumerate(staged.held, start=len(staged.files)):
                if h.name is None:
                    h.set_destination(staged.path, data_file_name(staged.rank, k, staged.tag),
                                      sync=self.config.sync_files, remote=remote_folder)
        except Exception as exc:  # noqa: BLE001 - raised from prepare_local_plan
            staged.error = exc
            staged.abandon(f"save abandoned: {exc}")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.durable_path or self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.path is None:
            raise ValueError("DataStatesWriter: no checkpoint path (pass path= or checkpoint_id=)")
        if self.durable_path is not None:
            self._check_tiered()
        if not self.use_collectives and commit.is_committed(self.path, storage_options=self.config.storage_options):
            # DCP's load reads the folder's global commit before any rank-local one: this save
            # would never be read back. Refuse rather than let a load return the old values.
            raise CheckpointWriteError(
                f"{self.path} holds a checkpoint committed by all ranks together; a rank-local save "
                f"(use_collectives=False) there would be shadowed by it when loading. Save rank-local "
                f"checkpoints into a folder of their own."
            )
        staged = self._current
        if staged is None:  # dcp.save: nothing staged, the folder is prepared here
            self._check_launch()
            committed = commit.prepare_folder(self.path, overwrite=self.config.overwrite, storage_options=self.config.storage_options)
            self._sync_tag = _new_tag() if committed else None
            if self.durable_path is not None:  # local_tier hook: name the durable path in the local copy
                tiers.record_durable(self.path, self.durable_path)
            return dataclasses.replace(plan, storage_data=RankReport(self.rank, self.durable_path or self.path))
        if staged.error is not None:
            raise staged.error
        if self.durable_path is not None:  # local_tier hook: as above
            tiers.record_durable(self.path, self.durable_path)
        if plan.usable and staged.skipped and self.use_collectives:
            # Leave replicated DTensor shards to the replica that staged them, so any planner's
            # dedup (DCP's default included) has exactly one candidate.
            plan = dataclasses.replace(plan, items=[i for i in plan.items if item_key(i.index) not in staged.skipped])
        return dataclasses.replace(plan, storage_data=RankReport(self.rank, self.durable_path or self.path))

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
        if self.durable_path is not None and len(plans) > 1:  # local_tier hook: each rank drains its files
            options = self.config.storage_options
            committed = commit.prepare_folder(self.durable_path, overwrite=self.config.overwrite, storage_options=options)
            # New names next to a commit, or next to a pending checkpoint whose drained files a
            # restart may still read.
            pending = tiers.read_pending(self.durable_path, options) is not None
            drain_plan = RankDrain(self.save_id, _new_tag() if committed or pending else None)
            plans = [dataclasses.replace(p, storage_data=drain_plan) for p in plans]
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        staged = self._current or _StagedSave(path=self.path, rank=self.rank, tag=self._sync_tag)
        staged.writing = True
        self._current = None
        results: list[WriteResult] = []
        error: BaseException | None = None
        staged.rank_drain = plan.storage_data if isinstance(plan.storage_data, RankDrain) else None
        try:
            results = self._write_local(staged, plan, planner)
            if staged.rank_drain is not None:
                results = self._drain_rank(staged, results, staged.rank_drain)
        except BaseException as exc:  # noqa: BLE001 - raised below, after the collectives
            error = exc
            staged.abandon(f"save abandoned: {exc}")
        if self.process_group is not None and self.use_collectives and self.config.hierarchical_consolidation \
                and dist.is_available() and dist.is_initialized():
            # Every rank enters this, a failed one with nothing to send: it raises right after,
            # and DCP's own gather then fails the save on every rank.
            results = consolidate_results(results if error is None else [], self.process_group, 0)
        if error is not None:
            self._close(staged, error=error)
            if isinstance(error, CheckpointWriteError):
                raise error
            raise CheckpointWriteError(f"saving checkpoint {self.path} failed: {type(error).__name__}: {error}") from error
        if self.use_collectives and not self.is_coordinator:
            self._close(staged)  # the coordinator commits; nothing more happens here
        else:
            self._finishing = staged
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(results)
        return fut

    def _write_local(self, staged: _StagedSave, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        if staged.error is not None:
            raise staged.error
        if staged.abandoned is not None:
            raise CheckpointWriteError(f"checkpoint {staged.path} abandoned: {staged.abandoned}")
        given = {item_key(i.index) for i in plan.items}
        for h in staged.held:
            if not h.selection_known():
                h.set_selection(frozenset(k for k in h.keys if k in given))
        staged_keys = {k for f in staged.files for k in f.keys} | {k for h in staged.held for k in h.keys}
        late = [item for item in plan.items if item_key(item.index) not in staged_keys]
        if late:
            staged.files.append(self._write_late(staged, late, planner))
        locations: dict[ItemKey, ItemLocation] = {}
        errors = []
        for f in staged.jobs():
            try:
                locations.update(f.result() if isinstance(f, _FileJob) else f.result.result())
            except CheckpointWriteError as exc:
                errors.append(str(exc))
        if errors:
            raise CheckpointWriteError(f"saving checkpoint {staged.path} failed: " + "; ".join(errors))
        if staged.abandoned is not None:  # abandoned after its files were durable: still never committed
            raise CheckpointWriteError(f"checkpoint {staged.path} abandoned: {staged.abandoned}")
        if staged.moved_from is not None:
            locations = self._relocate(staged, locations)
        if staged.flat is not None and overridden_data_hooks(planner):  # lazy save, custom planner: its hooks now
            locations.update(self._rewrite_for_planner(staged, [i for i in plan.items if item_key(i.index) in staged_keys],
                                                       planner, locations))
        staged.flat, staged.payloads = None, {}  # the save holds no reference to the state from here on
        if staged.decision_key is not None:
            if staged.learn:
                decisions().learn(staged.decision_key, frozenset(k for k in given if k in staged.plain_keys))
            elif any(item_key(i.index) in staged.elsewhere for i in late):
                decisions().forget(staged.decision_key)  # the plan changed: hold and relearn next time
        out = []
        for item in plan.items:
            loc = locations[item_key(item.index)]
            out.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
        return out

    def _drain_rank(self, staged: _StagedSave, results: list[WriteResult], plan: RankDrain) -> list[WriteResult]:
        """local_tier hook, several ranks: this rank's files are durable on the local tier. Record
        them in the local copy, then drain them on a drain thread (it reports to the coordinator,
        which commits once every rank did); the results name the durable files."""
        # The rank in the data file names (global: the coordinator waits for the writers of the
        # files it commits, tiers.file_ranks), not the rank in DCP's process group.
        locations = {r.index: r.storage_data for r in results}
        renamed = {loc.file: drain.durable_name(loc.file, plan.tag) for loc in locations.values()}
        tiers.record_rank_files(self.path, staged.rank, self.durable_path, plan.save_id, renamed)
        staged.local_s = time.monotonic() - staged.requested
        if not self.local_commit.done():
            self.local_commit.set_result(self.path)
        _drainers.submit(drain.drain_rank, self.path, self.durable_path, locations, renamed, plan.save_id, staged.rank,
                         self.config)
        return [dataclasses.replace(r, storage_data=moved(r.storage_data, renamed[r.storage_data.file])) for r in results]

    def _relocate(self, staged: _StagedSave, locations: dict[ItemKey, ItemLocation]) -> dict[ItemKey, ItemLocation]:
        """Move the files written into ``staged.moved_from`` to the folder DCP named (their new
        names follow that folder's commit state)."""
        renamed: dict[str, str] = {}
        for f in staged.files:
            new = data_file_name(staged.rank, f.index, staged.tag)
            src_remote, dst_remote = folders.is_remote(staged.moved_from), folders.is_remote(staged.path)
            if src_remote and dst_remote and self._remote(staged.moved_from).fs is self._remote(staged.path).fs:
                src, dst = self._remote(staged.moved_from), self._remote(staged.path)
                src.fs.mv(src.join(f.name), dst.join(new))
            elif src_remote or dst_remote:  # between a local folder and a store, or two stores
                self._copy_between(staged.moved_from, f.name, staged.path, new)
            else:
                src, dst = os.path.join(staged.moved_from, f.name), os.path.join(staged.path, new)
                try:
                    os.rename(src, dst)
                except OSError:  # another file system: copy, then drop the original
                    shutil.copyfile(src, dst)
                    os.unlink(src)
            renamed[f.name] = new
            f.name = new
        return {k: moved(loc, renamed.get(loc.file, loc.file)) for k, loc in locations.items()}

    def _open(self, folder: str, name: str, mode: str):
        if folders.is_remote(folder):
            remote_folder = self._remote(folder)
            return remote_folder.fs.open(remote_folder.join(name), mode)
        return open(os.path.join(folders.local_path(folder), name), mode)

    def _rewrite_for_planner(self, staged: _StagedSave, items: list, planner: SavePlanner,
                             locations: dict[ItemKey, ItemLocation]) -> dict[ItemKey, ItemLocation]:
        """A custom planner's data hooks on this lazy save (planner_hooks.py): the items whose
        data it changes go into one more file, durable before the commit; their new locations."""
        def staged_bytes(fqn: str) -> bytes | None:
            buf = staged.payloads.get(fqn)
            return None if buf is None else buf.numpy().tobytes()

        def read_back(item) -> torch.Tensor:
            loc = locations[item_key(item.index)]
            with self._open(staged.path, loc.file, "rb") as f:
                f.seek(loc.offset)
                raw = f.read(loc.length)
            if len(raw) != loc.length:
                raise CheckpointWriteError(f"{staged.path}/{loc.file}: short read of item {item.index.fqn!r} ({len(raw)} of {loc.length} bytes)")
            dtype = name_to_dtype(loc.dtype)
            if not raw:
                return torch.empty(loc.shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(loc.shape)

        rewrite = items_to_rewrite(planner, items, staged_bytes,
                                   lambda item: find_state_dict_object(staged.flat, item.index), read_back)
        if not rewrite:
            return {}
        taken: set[str] = set()
        engine = get_engine(self.config)
        sources = [source_for_resolved(item, data, taken) for item, data in rewrite]
        job = self._submit(engine, staged, _planned(engine, len(staged.files) + len(staged.held), sources))
        staged.files.append(job)
        return job.result()

    def _copy_between(self, src_folder: str, src_name: str, dst_folder: str, dst_name: str) -> None:
        """Copy a written data file to another kind of folder, then remove the original."""
        opener = self._open
        with opener(src_folder, src_name, "rb") as fin, opener(dst_folder, dst_name, "wb") as fout:
            shutil.copyfileobj(fin, fout, 16 << 20)
        if folders.is_remote(src_folder):
            self._remote(src_folder).remove(src_name)
        else:
            os.unlink(os.path.join(src_folder, src_name))

    def _write_late(self, staged: _StagedSave, late: list, planner: SavePlanner) -> _FileJob:
        """Items the plan gives this rank that it did not stage (``dcp.save``; a planner that lays
        items out differently; a plain tensor the cached decision gave elsewhere): written now
        from live memory, which for a lazy save is right only if the tensor did not change."""
        guard = staged.late_guard
        for item in late:
            changed = guard.changed(item.index.fqn) if guard is not None else None
            if changed is not None:
                if staged.decision_key is not None:
                    decisions().forget(staged.decision_key)
                raise CheckpointWriteError(
                    torn_message(staged.path or str(self.path), item.index.fqn, *changed)
                    + " (DCP's planner gave this rank a tensor another rank wrote last time: the ranks' "
                    "state structures changed; the next checkpoint plans anew.)"
                )
        taken: set[str] = set()
        sources = [source_for_resolved(item, planner.resolve_data(item), taken) for item in late]
        engine = get_engine(self.config)
        index = len(staged.files) + len(staged.held)
        return self._submit(engine, staged, _planned(engine, index, sources))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        staged = self._finishing
        self._finishing = None
        error: BaseException | None = None
        try:
            if staged is not None and staged.abandoned is not None:
                raise CheckpointWriteError(f"checkpoint {self.path} abandoned: {staged.abandoned}; not committed")
            if metadata.storage_meta is None:  # DCP's default planner does not fill it
                metadata = dataclasses.replace(metadata, storage_meta=self.storage_meta())
            locations: dict[MetadataIndex, ItemLocation] = {}
            for rank_results in results:
                for r in rank_results:
                    locations[r.index] = r.storage_data
            rank_local = None if self.use_collectives else self.rank
            if staged is not None and staged.rank_drain is not None:  # local_tier hook, several ranks
                self._commit_drained(metadata, locations, staged)
                return
            commit.write_commit(
                self.path, metadata, locations, sync=self.config.sync_files,
                storage_options=self.config.storage_options, rank_local=rank_local,
                in_use=_names_in_use(self.path) if staged is None else frozenset(),
            )
            if self.durable_path is not None:  # local_tier hook: committed locally, now drain
                if staged is not None:
                    staged.local_s = time.monotonic() - staged.requested
                self.local_commit.set_result(self.path)
                drain.drain(self.path, self.durable_path, self.config)
                # left by a killed run, under the same root (so on the store these options are for)
                drain.drain_pending_quietly(self.config.local_tier, self.config, root=tiers.root_of(self.durable_path))
                tiers.evict_drained(self.config.local_tier, self.config.keep_local, self.config.storage_options)
        except BaseException as exc:
            if self.durable_path is not None and not self.local_commit.done():
                self.local_commit.set_exception(exc)
            error = exc
            raise
        finally:
            if staged is not None:
                total = sum(r.size_in_bytes for rank_results in results for r in rank_results)
                self._close(staged, error=error, total_bytes=total, committed=error is None)

    def _commit_drained(self, metadata: Metadata, locations: dict, staged: _StagedSave) -> None:
        """local_tier, several ranks: every rank's files are on its node's local tier. Record the
        checkpoint's metadata in the durable folder (restorable from the local copies from here
        on), wait for every rank's drain report, then commit the durable folder (tiers.py)."""
        options, durable = self.config.storage_options, self.durable_path
        tiers.write_pending(durable, metadata, locations, sync=self.config.sync_files, storage_options=options)
        ranks = tiers.file_ranks(locations)
        tiers.wait_drained(durable, staged.rank_drain.save_id, ranks, self.config.drain_timeout, options)
        commit.write_commit(durable, metadata, locations, sync=self.config.sync_files, storage_options=options)
        tiers.clear_pending(durable, ranks, options)

    def _check_tiered(self) -> None:
        """local_tier hook: what the tiers support (raised inside DCP's planning, so every rank
        gets it)."""
        if not self.use_collectives:
            raise CheckpointWriteError(
                f"local_tier: rank-local saves (use_collectives=False) are not supported (saving "
                f"{self.durable_path}); save without local_tier, or with collectives"
            )

    def _close(self, staged: _StagedSave, *, error: BaseException | None = None, total_bytes: int | None = None,
               committed: bool = False) -> None:
        """The save needs nothing more from this rank: release its folder, leave the in-flight
        list, and record its figures (the coordinator's record, with the commit, is logged)."""
        staged.finished.set()
        staged.flat, staged.payloads = None, {}
        _release_path(staged.path, staged)
        inflight.unregister(staged)
        rank, world = _global_rank_world()
        try:
            checkpoint_stats.record(checkpoint_stats.CheckpointStats(
                path=str(self.durable_path or staged.path or self.path), rank=rank, world_size=world,
                bytes=total_bytes if total_bytes is not None else staged.nbytes(),
                stall_s=staged.stall_s, staged_s=staged.staged_s,
                durable_s=time.monotonic() - staged.requested if committed else None,
                coordinator=self.is_coordinator or not self.use_collectives, local_s=staged.local_s,
                error=None if error is None else str(error).splitlines()[0][:500],
            ))
        except Exception as exc:  # noqa: BLE001 - figures must never fail a save
            log.debug("dcp_datastates: could not record checkpoint figures: %s", exc)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Local paths, ``file://`` and any URL whose protocol fsspec knows."""
        return folders.is_supported_url(checkpoint_id)

