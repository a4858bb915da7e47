"""The request: what ``stage()`` does on the training thread, the save in flight it starts
(``StagedSave``, the handle the registry of saves in flight keeps, and a ``FileJob`` per data
file the engine writes for it), and the watcher that resolves DCP's staging Future once every
byte is in the host cache.

1. flatten the state dict (``scan.flatten``) and claim the folder in the registry of saves in
   flight (a second save to the same folder is refused while the first runs);
2. plan this rank's data files from the local state alone (``planning.plan_stage``: owners,
   layout, the version guard);
3. copy the small items now (``copy_small_at_request``, below), hand each planned file to the engine unnamed
   (``start_file``: the copies start, nothing is written yet), hold the items whose writer or
   folder is not known yet (``hold``);
4. register the save and return. Off the training thread, one thread prepares the folder
   (``prepare_destination``: the tier makes room, a new file-name tag when the folder holds a
   commit, then each file is named and its writes start), and a watcher thread waits for the
   copies, seals the version guard and resolves the Future with the staged state dict.

An error here never fails the Future: it is kept on the save and raised from
``prepare_local_plan``, inside DCP's planning collective, so every rank learns of it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..channel import channel_for
from ..commit import prepare_folder
from ..compat import unflatten_state_dict
from ..errors import CheckpointWriteError
from ..forking import ThreadPool, new_locks_in_child
from ..format.layout import data_file_name, new_tag
from ..format.locations import ItemLocation, all_written
from ..runtime import gc_pause, get_engine, inflight
from ..storage import Storage
from .copy_at_request import CopyAtRequest
from .file_groups import on_one_device
from .held_file import HeldFile
from .incremental import Incremental, hint_key
from .items import ItemKey, SourceItem
from .ownership import DecisionKey
from .plan import PlanContext, PlannedFile, planned_file
from .planning import plan_stage
from .scan import flatten
from .version_guard import VersionGuard, freed_message, torn_message

__all__ = ["FileJob", "StagedSave", "request_save", "name_folder", "sync_save", "submit_file", "start_file", "prepare_destination", "hold", "claim_folder", "current_stream",
           "global_rank_world", "finish_staging", "planned", "copy_small_at_request", "give_back", "hold_limit"]

log = logging.getLogger("dcp_datastates")


# ------------------------------------------------------------------------ a save in flight
@dataclass(eq=False)
class FileJob:
    """One data file written by the engine (a local file, or streamed to an object store): a
    ``held_file.DataFileWork``, like the save's held files."""

    index: int  # k in __<rank>_<k>
    name: str | None  # None until the save's folder is prepared (request.prepare_destination)
    job: Any
    keys: Sequence[ItemKey]
    locations: Mapping[ItemKey, ItemLocation]  # shared with a cached stage plan: never mutated
    keepalive: list[Any] | None
    engine: Any
    file_size: int
    upload: Future | None = None  # object stores: resolves once the object is complete in the store
    name_it: Callable[..., None] | None = None  # names the file of a job started unnamed (Storage.start_data_file)
    side_buffer: Any = None  # the request-time copies' buffer (request.copy_small_at_request), given back once staged
    mirrors: bool = False  # peer_copies: the keeper stages this same file (save/ownership.py)
    mirror_of: int | None = None  # peer_copies: the same file as that rank's mirrored one (not this save's data)
    written: Mapping[ItemKey, ItemLocation] | None = None  # once durable: its items' final locations

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

    def wait_ended(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            ended = bool(self.job.wait_done(timeout))
        except Exception:  # noqa: BLE001 - never raises: a discard removes the file all the same
            ended = False
        if self.upload is not None:
            try:
                self.upload.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - still uploading: its object goes once it ends
                ended = False
        return ended

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
        return all_written(self.locations, self.keys, self.name, self.job.checksums(), self.file_size)


@dataclass(eq=False)
class StagedSave:
    """Everything ``stage()`` started for one checkpoint on this rank."""

    path: str | None  # None: the folder is named later (checkpoint_id given to DCP only)
    storage: Storage | None = None  # the folder ``path`` names
    rank: int = 0
    tag: str | None = None  # file-name tag when the folder already holds a committed checkpoint
    files: list[FileJob] = field(default_factory=list)
    held: list[HeldFile] = field(default_factory=list)
    skipped: set = field(default_factory=set)  # DTensor replicas another rank writes
    elsewhere: set = field(default_factory=set)  # plain tensors the decision gives to other ranks
    decision_key: DecisionKey | None = None
    learn: bool = False  # no decision was known: learn it from this save's plan
    plain_keys: frozenset = frozenset()
    moved_from: Storage | None = None  # staged into this folder, then DCP named another (reset)
    guard: VersionGuard | None = None  # the sources this rank copies
    late_guard: VersionGuard | None = None  # tensors it may have to write from live memory
    error: BaseException | None = None  # raised from prepare_local_plan
    abandoned: str | None = None  # why the save was abandoned (Ctrl-C at exit, an error): never commit
    discarded: bool = False  # what it wrote was removed (save/discard.py)
    requested: float = field(default_factory=time.monotonic)
    stall_s: float = 0.0  # the training thread's time in stage()
    staged_s: float | None = None  # request -> every byte in the host cache
    _sealed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    finished: threading.Event = field(default_factory=threading.Event)
    planner: threading.Thread | None = None  # DCP's thread planning this save
    flat: dict | None = None  # the state as flattened at the request (its tensors are the sources)
    payloads: dict = field(default_factory=dict)  # fqn -> a non-tensor value's bytes, serialized at the request
    destination: Future | None = None  # the folder prepared and the files named (request.prepare_destination)
    collector_pause: Any = None  # Python's cyclic GC paused for this save (runtime/inflight.py), ended by end_collector_pause
    incremental: Any = None  # incremental=True: the save's decisions (incremental.Incremental); None: off
    pid: int = field(default_factory=os.getpid)  # the process that requested it (not a forked child)

    def end_collector_pause(self, after: float = 0.0) -> None:
        """The save's objects are about to be freed (``after`` seconds from now, once the
        callers return): the collector may run again."""
        pause, self.collector_pause = self.collector_pause, None
        if pause is not None:
            pause.release(after)

    def is_over(self) -> bool:
        """Finished, or given up by DCP: the thread that ran its DCP save has ended (the save
        failed on some rank; DCP calls nothing more here), or no DCP thread ever took it up."""
        if self.finished.is_set():
            return True
        t = self.planner
        if t is not None:
            return not t.is_alive()
        return self._never_planned()

    def awaits_planning(self) -> bool:
        """No DCP thread has taken it up yet (and it is not finished)."""
        return self.planner is None and not self.finished.is_set()

    def _never_planned(self) -> bool:
        """Staged, not planned, and no DCP thread left that could plan it: the ``dcp.async_save``
        that called ``stage()`` failed right after it (``AsyncCheckpointerType.PROCESS``, which
        cannot take this writer; no process group). Nothing will write or commit it, so it is
        closed here: its folder, its held cache slots and its references to the state come back.
        (Before, a later save into its folder was refused and the interpreter's exit waited for
        it forever.)"""
        if os.getpid() != self.pid:
            # A forked child's copy (Megatron's async helper; its exit asks whether saves are
            # over): the parent's threads and engine are not the child's to judge or to touch.
            return False
        if not all(j.is_staged() for j in self.jobs()) or inflight.dcp_executor_running():
            return False
        self.abandon("save abandoned: DCP never planned it (the dcp.async_save that staged it failed)")
        self.close()
        return True

    def close(self, collector_after: float = 0.0) -> None:
        """Needs nothing more from this rank: finished, its references to the state dropped, the
        collector free to run again (``collector_after`` seconds from now), out of the registry."""
        self.finished.set()
        self.flat, self.payloads, self.guard = None, {}, None
        self.end_collector_pause(after=collector_after)
        inflight.unregister(self)

    def jobs(self) -> list:
        return [*self.files, *self.held]

    def all_written(self) -> bool:
        return all(j.is_done() for j in self.jobs())

    def file_names(self) -> frozenset:
        return frozenset(f.name for f in self.files) | frozenset(h.name for h in self.held if h.name)

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
        return all(f.device_wait(stream_of) for f in files)

    def seal(self) -> None:
        """From now on the caller may change the sources: check none changed before (once)."""
        with self._lock:
            if self._sealed:
                return
            self._sealed = True
            guard, self.guard = self.guard, None
        if guard is None or self.error is not None:
            return
        changed = guard.first_changed()
        if changed is not None:
            self.error = CheckpointWriteError(torn_message(self.path or "(unnamed)", *changed))
            return
        freed = guard.first_freed()
        if freed is not None:
            self.error = CheckpointWriteError(freed_message(self.path or "(unnamed)", freed))

    def fail(self, exc: BaseException) -> None:
        """An error before DCP's planning: kept to be raised from prepare_local_plan (inside the
        planning collective, so every rank learns of it); nothing of this save gets written."""
        if self.error is None:
            self.error = exc
        self.abandon(f"save abandoned: {exc}")

    # The registry's save handle (runtime/inflight.py): what Ctrl-C at exit names and abandons.
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

# A save's pause of the cyclic GC ends when the save does, or after this long (a save DCP gave
# up on before our last hook ran is never closed).
GC_PAUSE_MAX_S = 60.0

# Waits for staging and resolves the Futures handed to DCP; frees replaced files; never runs
# Python on engine threads. (runtime.engine joins threads of this name at exit.)
_watchers = ThreadPool(max_workers=2, thread_name_prefix="dcp-datastates-staging")
# Prepares folders and names the files the request started (prepare_destination), in request
# order. Its own thread, because its work never waits for the engine while the watchers' does:
# copies can wait for cache slots that only named files free.
_namer = ThreadPool(max_workers=1, thread_name_prefix="dcp-datastates-staging-folder")


def current_stream(device: int) -> int:
    """Handle of this thread's current CUDA stream on ``device``: the engine's copies of a job
    run after the work queued on it when the job is submitted (the kernels producing the state)."""
    return torch.cuda.current_stream(device).cuda_stream


def global_rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def claim_folder(path: str, staged: StagedSave) -> None:
    try:
        inflight.claim(path, staged)
    except inflight.FolderBusyError:
        raise CheckpointWriteError(
            f"a save to {path} is still running; wait for its upload_completion before saving to the same path again"
        ) from None


def request_save(state_dict: dict, *, path: str | None, storage: Storage | None, config, tier, requested: float,
                 check_launch) -> tuple[StagedSave, Future]:
    """Start the save of ``state_dict`` into ``path`` (None: named later by DCP): the save and
    the Future DCP waits on before planning."""
    # Tens of objects per tensor live until the commit: no collection sees them (runtime/inflight.py).
    pause = gc_pause.pause_collector(GC_PAUSE_MAX_S)
    try:
        staged, future = _request(state_dict, path, storage, config, tier, requested, check_launch)
    except BaseException:  # (errors are kept on the save; this is Ctrl-C and the like)
        pause.release()
        raise
    staged.collector_pause = pause
    return staged, future


def _request(state_dict: dict, path: str | None, storage: Storage | None, config, tier, requested: float,
             check_launch) -> tuple[StagedSave, Future]:
    future: Future = Future()
    staged = StagedSave(path=path, storage=storage, requested=requested)
    _decide_incrementally(staged, config, tier)
    flat, mappings = None, None
    try:
        check_launch()
        flat, mappings = flatten(state_dict)
        if path is not None:
            claim_folder(path, staged)
            if tier.folder_at_request:  # the rest of the folder work runs off this thread (prepare_destination)
                storage.make_folder()
        _stage_into(staged, flat, config, tier)
    except Exception as exc:  # noqa: BLE001 - raised from prepare_local_plan, on every rank
        staged.fail(exc)
    inflight.register(staged)  # every torch.optim step now waits for this save's copies
    if flat is None:
        future.set_result(state_dict)
        return staged, future
    if staged.path is None and sum(h.job.nbytes for h in staged.held) > hold_limit(config):
        # The folder is named after staging (reset()); until then nothing can be flushed, so a
        # save larger than half the cache cannot be staged whole first: hand DCP the state now
        # (the version guard still fails the save if a source changes too early).
        log.warning(
            "dcp_datastates: a save larger than half the host cache whose folder is given only as "
            "checkpoint_id: staging_completion resolves before the copies end. Pass the path to "
            "DataStatesWriter(path) to keep the lazy guarantee; protect_optimizer still waits."
        )
        future.set_result(unflatten_state_dict(flat, mappings))
        _watchers.submit(finish_staging, staged, None)
        return staged, future
    _watchers.submit(finish_staging, staged, (future, flat, mappings))
    return staged, future


def prepare_destination(staged: StagedSave, config, tier, need) -> None:
    """Off the training thread, before any byte of the save is written: the tier makes room for
    ``need()`` bytes, the folder is prepared (a new file-name tag when it holds a commit), then
    each file the request started is named and the engine starts writing it. An error fails the
    save (raised from prepare_local_plan, on every rank) and frees what its jobs hold."""
    try:
        if staged.error is not None:
            return
        tier.reserve(staged.path, need)
        staged.tag = new_tag() if prepare_folder(staged.storage, overwrite=config.overwrite) else None
        if staged.files:
            tier.files_changing(staged.path, staged.rank)
        for f in staged.files:
            _name_file(f, staged)
        tier.files_started(staged)
    except Exception as exc:  # noqa: BLE001 - raised from prepare_local_plan, on every rank
        staged.fail(exc)


def _files_per_group(storage, config) -> int:
    """One file per flush thread where the engine writes host tensors straight to the folder
    (each thread then has a file of its own: see ``split_for_writers``), else one."""
    if storage is not None and channel_for(storage).writes_direct(config.direct_writes):
        return config.flush_threads
    return 1


def _stage_into(staged: StagedSave, flat: dict, config, tier) -> None:
    rank, world = global_rank_world()
    staged.rank = rank
    dedup = world > 1 and config.dedup_replicated
    engine = get_engine(config)
    direct = None  # incremental: the tensors written without a hash this time (a hint)
    if staged.incremental is not None:
        durable = tier.reported(staged.path)
        direct = staged.incremental.written_directly(hint_key(durable, rank)) if durable else frozenset()
    context = PlanContext(rank, world, dedup, engine.cuda_devices > 0, tier.mirroring,
                          _files_per_group(staged.storage, config))
    copies = CopyAtRequest(config.copy_at_request_max_bytes, config.copy_at_request_total_bytes)
    plan = plan_stage(flat, context, copies, folder_known=staged.path is not None,
                      hold_limit=lambda: hold_limit(config), incremental=direct)
    staged.skipped, staged.elsewhere = plan.skipped, plan.elsewhere
    staged.guard, staged.late_guard = plan.guard, plan.late_guard
    staged.decision_key, staged.learn, staged.plain_keys = plan.decision_key, plan.learn, plan.plain_keys
    staged.flat, staged.payloads = flat, plan.payloads
    try:
        for pf in plan.files:  # (files are planned only when the folder is known)
            copied = _copy_small_now(engine, pf, staged.path, plan.copy_limit)
            staged.files.append(start_file(engine, staged, *copied, config))
        for group in plan.held:
            h = hold(engine, group.items, known=group.known, config=config, label=staged.path,
                     incremental=staged.incremental, copy_limit=plan.copy_limit)
            h.mirrors, h.mirror_of = group.mirrors, group.mirror_of
            staged.held.append(h)
    finally:
        if staged.path is not None:  # also after an error: the started jobs are named or failed there
            def need() -> int:
                return (sum(pf.layout.file_size for pf in plan.files)
                        + sum(it.entry.nbytes for g in plan.held for it in g.items))
            staged.destination = _namer.submit(prepare_destination, staged, config, tier, need)
    if staged.files:
        plan.remember(staged.files[0].job.piece_size())


def hold_limit(config) -> int:
    """The most bytes a save may hold in the host cache before writing them (held files): half
    of it; the rest keeps the other copies going."""
    return int(get_engine(config).stats()["cache_bytes"]) // 2


def name_folder(staged: StagedSave, path: str, storage: Storage, config, tier) -> None:
    """DCP named the folder (``set_up_storage_writer``): files staged into another one move here
    once written (``write.write_rank``), held files are written here."""
    if staged.path is not None and staged.path != path:
        staged.moved_from = staged.storage  # staged into the writer's previous folder
        inflight.release(staged.path, staged)
        staged.path = None
    if staged.path is None:
        claim_folder(path, staged)
        staged.path, staged.storage = path, storage
        staged.tag = new_tag() if prepare_folder(storage, overwrite=config.overwrite) else None
    if staged.held:
        tier.files_changing(staged.path, staged.rank)
    for k, h in enumerate(staged.held, start=len(staged.files)):
        if h.name is None:
            h.set_destination(storage, data_file_name(staged.rank, k, staged.tag), sync=config.sync_files,
                              direct_writes=config.direct_writes)


def sync_save(path: str, storage: Storage, rank: int, config, tier) -> StagedSave:
    """``dcp.save`` (nothing staged): the folder prepared at planning time; the save that
    ``write_data`` then writes from live memory."""
    pause = gc_pause.pause_collector(GC_PAUSE_MAX_S)  # DCP's write items live until the commit here too
    try:
        tag = new_tag() if prepare_folder(storage, overwrite=config.overwrite) else None
    except BaseException:
        pause.release()
        raise
    staged = StagedSave(path=path, storage=storage, rank=rank, tag=tag, collector_pause=pause)
    _decide_incrementally(staged, config, tier)
    return staged


def _decide_incrementally(staged: StagedSave, config, tier) -> None:
    """``incremental``: the save's decisions, made against the checkpoints beside its (durable)
    folder, which DCP may name only later."""
    if config.incremental:
        staged.incremental = Incremental(lambda: tier.references_beside() or staged.storage)


def planned(engine, index: int, items: list[SourceItem]) -> PlannedFile:
    """File ``index`` of ``items``, laid out, with its memory on one device."""
    device, items = on_one_device(engine.cuda_devices > 0, items)
    return planned_file(index, device, items)


def _copy_small_now(engine, pf: PlannedFile, path: str | None, copy_limit: int) -> tuple[PlannedFile, object]:
    """At the request only: ``pf`` with its items of up to ``copy_limit`` bytes copied now
    (``copy_small_at_request``), and the buffer they were copied into (None: nothing to copy).
    Files made later (``write_data``) need no such copy."""
    stream = current_stream(pf.device) if pf.device >= 0 else 0
    spans, keepalive, side_buffer = copy_small_at_request(engine, pf.device, stream, pf.spans, pf.keepalive,
                                                          copy_limit, path or "checkpoint")
    return dataclasses.replace(pf, spans=spans, keepalive=keepalive), side_buffer


def start_file(engine, staged: StagedSave, pf: PlannedFile, side_buffer, config) -> FileJob:
    """Hand one planned file to the engine before it is named (its copies start now): the only
    place a ``FileJob`` is made. At the request ``prepare_destination`` names it, off the
    training thread; later files are named at once (``submit_file``)."""
    stream = current_stream(pf.device) if pf.device >= 0 else 0
    untagged = pf.untagged or data_file_name(staged.rank, pf.index)
    job, upload, name_it = channel_for(staged.storage).start_data_file(
        engine, untagged, pf.layout.header, pf.layout.file_size, pf.spans, sync=config.sync_files, device=pf.device,
        stream=stream, direct_writes=config.direct_writes)
    locations = pf.locations(untagged, job.piece_size())
    return FileJob(pf.index, None, job, pf.keys, locations, pf.keepalive, engine, pf.layout.file_size, upload, name_it,
                   side_buffer, mirrors=pf.mirrors, mirror_of=pf.mirror_of)


def submit_file(engine, staged: StagedSave, pf: PlannedFile, config, tier) -> FileJob:
    """A file made once the folder is prepared (``write_data``): started and named at once."""
    tier.files_changing(staged.path, staged.rank)
    f = start_file(engine, staged, pf, None, config)
    _name_file(f, staged)
    tier.file_named(staged, f)
    return f


def _name_file(f: FileJob, staged: StagedSave) -> None:
    """Give a started file its name in the prepared folder: the engine writes it from now on."""
    f.name = data_file_name(staged.rank, f.index, staged.tag)
    f.name_it(f.name, _watchers.submit)  # an old file of that name is freed on a watcher


def hold(engine, items: list[SourceItem], *, known: bool, config, label: str | None,
         incremental: Incremental | None = None, copy_limit: int) -> HeldFile:
    """Copy ``items`` into the host cache now and write them once the plan says where (held_file.py);
    with ``incremental``, only those whose bytes changed since the base checkpoint. Items of up
    to ``copy_limit`` bytes are copied on this thread first (``copy_small_at_request``)."""
    device, items = on_one_device(engine.cuda_devices > 0, items)
    stream = current_stream(device) if device >= 0 else 0
    label = f"{label or 'checkpoint'} (held)"
    spans, keep, side_buffer = copy_small_at_request(engine, device, stream, [(it.ptr, it.entry.nbytes, 0) for it in items],
                                                     [it.keepalive for it in items], copy_limit, label)
    if side_buffer is not None:
        items = [dataclasses.replace(it, ptr=span[0], keepalive=owner) for it, span, owner in zip(items, spans, keep)]
    held = HeldFile(engine, items, device, stream, label, selection=None, selection_known=known,
                    timeout=float(config.cache_wait_timeout), incremental=incremental)
    held.side_buffer = side_buffer  # what the items copied at the request point into
    return held


def finish_staging(staged: StagedSave, resolve: tuple | None) -> None:
    """On a watcher thread: wait for every copy, seal the guard, resolve DCP's Future."""
    try:
        if staged.destination is not None:
            staged.destination.result()  # the folder is prepared and the files named (or the save failed)
        staged.wait_staged(None)
        staged.staged_s = time.monotonic() - staged.requested
        staged.seal()
    finally:
        for f in staged.files:
            f.keepalive = None  # the engine copied them: release the source tensors
            if f.side_buffer is not None and f.job.is_staged():  # no copy reads it any more
                give_back(f.side_buffer)
            f.side_buffer = None
        inflight.staged(staged)
    if resolve is not None:
        # The staged dict: the structure as of stage() (our own flat copy of it), live tensors
        # (the engine owns their bytes now). Built here, off the training thread. It is returned
        # even when staging failed: the error is raised inside DCP's planning, so every rank
        # learns of it (a failed Future would fail this rank alone, before any collective, and
        # leave the others waiting in one).
        future, flat, mappings = resolve
        future.set_result(unflatten_state_dict(flat, mappings))


# ---------------------------------------------------------------- small items copied at the request
# Copies small tensors at the request instead of lazily (``copy_at_request_max_bytes``).
#
# The lazy guarantee rests on the tensors not changing between ``stage()`` and the end of their
# copy. Parameters and optimizer state change only in ``optimizer.step()``, which waits for staging
# (the global step pre-hook, runtime/inflight.py). Forward does change some state: BatchNorm updates
# ``running_mean`` / ``running_var`` inside its kernel (no version bump, so the guard cannot see
# it) and ``num_batches_tracked`` in place. Such state is small, so it is copied right here, on the
# training thread: host memory with one memcpy per item, CUDA memory device-to-device on the
# caller's current stream, where every kernel queued later (the next forward) runs after the copy.
# The engine then copies from that side buffer lazily like any other item.
#
# Side buffers are reused: a fresh one costs a page fault per 4 KiB page on first touch, on the
# training thread (most of the call's time when such items are large). A buffer
# is given back (``give_back``) only once the engine job reading it is staged, so no copy of an
# earlier save can still read what the next request writes into it.

_ALIGN = 16
_POOL_BYTES = 256 << 20  # at most this much kept between saves (a few buffers: one per layout)
_pool: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
_pool_lock = threading.Lock()
new_locks_in_child(globals(), "_pool_lock")


def _take(device: torch.device, nbytes: int) -> torch.Tensor:
    with _pool_lock:
        buffer = _pool.pop((str(device), nbytes), None)
    return buffer if buffer is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)


def give_back(buffer: torch.Tensor) -> None:
    """Keep ``buffer`` (a side buffer no engine copy reads any more) for a later request."""
    if buffer.numel() > _POOL_BYTES:
        return
    with _pool_lock:
        _pool[(str(buffer.device), buffer.numel())] = buffer
        _pool.move_to_end((str(buffer.device), buffer.numel()))
        while sum(b.numel() for b in _pool.values()) > _POOL_BYTES:
            _pool.popitem(last=False)


def copy_small_at_request(engine, device: int, stream: int, spans: list, keepalive: list, max_bytes: int,
                          what: str) -> tuple[list, list, torch.Tensor | None]:
    """``spans`` (pointer, nbytes, file offset) with every item of 1..``max_bytes`` bytes copied
    now into one side buffer and pointing there, the keep-alives (the buffer appended, the small
    items' owners dropped), and the buffer (None: nothing to copy, the rest unchanged). The
    buffer may be one an earlier save gave back: the caller gives it back in turn once its job
    is staged."""
    if max_bytes <= 0:
        return spans, keepalive, None
    small = [i for i, span in enumerate(spans) if 0 < span[1] <= max_bytes]
    if not small:
        return spans, keepalive, None
    offsets, total = [], 0
    for i in small:
        offsets.append(total)
        total += -(-spans[i][1] // _ALIGN) * _ALIGN
    # On the device the items' memory is on (their keep-alive: a tensor or an untyped storage).
    buffer = _take(keepalive[small[0]].device, total)
    base = buffer.data_ptr()
    engine.snapshot(device, stream, base, [(spans[i][0], spans[i][1], off) for i, off in zip(small, offsets)], what)
    spans, keepalive = list(spans), list(keepalive)
    for i, off in zip(small, offsets):
        ptr, nbytes, file_offset = spans[i]
        spans[i] = (base + off, nbytes, file_offset)
        keepalive[i] = None
    keepalive.append(buffer)
    return spans, keepalive, buffer
