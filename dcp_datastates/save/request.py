"""The request: what ``stage()`` does on the training thread, and the watcher that resolves DCP's Future.

It starts the save in flight (``in_flight.StagedSave``, a ``FileJob`` per data file the engine
writes for it); the watcher resolves DCP's staging Future once every byte is in the host cache.

1. flatten the state dict (``scan.flatten``) and claim the folder in the registry of saves in
   flight (a second save to the same folder is refused while the first runs);
2. plan this rank's data files from the local state alone (``planning.plan_stage``: owners,
   layout, the version guard);
3. copy the small items now (``side_buffers.copy_small_at_request``), hand each planned file to
   the engine unnamed (``start_file``: the copies start, nothing is written yet), hold the items
   whose writer or folder is not known yet (``hold``);
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
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from ..channel import channel_for
from ..commit import prepare_folder
from ..compat import unflatten_state_dict
from ..errors import CheckpointWriteError
from ..forking import ThreadPool
from ..format.layout import data_file_name, new_tag
from ..runtime import gc_pause, get_engine, inflight
from ..storage import Storage, open_storage
from . import rhythm
from .copy_at_request import CopyAtRequest
from .file_groups import on_one_device
from .held_file import HeldFile
from .in_flight import FileJob, SaveRequest, StagedSave
from .incremental import Incremental, hint_key
from .items import SourceItem
from .plan import PlanContext, PlannedFile, planned_file
from .planning import plan_stage
from .scan import flatten
from .side_buffers import copy_small_at_request, give_back
from .tier_events import Claim, Destination, FilesNamed

__all__ = ["request_save", "name_folder", "sync_save", "submit_file", "start_file", "prepare_destination", "hold",
           "claim_folder", "current_stream", "global_rank_world", "finish_staging", "planned", "hold_limit"]

log = logging.getLogger("dcp_datastates")


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


def request_save(state_dict: dict, *, path: str | None, storage: Storage | None, config, tier, dest: Destination,
                 requested: float, check_launch) -> tuple[StagedSave, Future]:
    """Start the save of ``state_dict`` into ``path`` (None: named later by DCP; ``dest``: the
    tier's word on the writer's checkpoint path): the save and the Future DCP waits on before
    planning."""
    # Tens of objects per tensor live until the commit: no collection sees them (runtime/inflight.py).
    pause = gc_pause.pause_collector(GC_PAUSE_MAX_S)
    try:
        staged, future = _request(state_dict, path, storage, config, tier, dest, requested, check_launch)
    except BaseException:
        # Errors are kept on the save; this is Ctrl-C and the like.
        pause.release()
        raise
    staged.collector_pause = pause
    return staged, future


def _request(state_dict: dict, path: str | None, storage: Storage | None, config, tier, dest: Destination,
             requested: float, check_launch) -> tuple[StagedSave, Future]:
    future: Future = Future()
    staged = StagedSave(path=path, storage=storage, request=SaveRequest(
        requested=requested, direct_io=rhythm.direct_io_for(config, requested)))
    _decide_incrementally(staged, config, tier)
    flat, mappings = None, None
    try:
        check_launch()
        flat, mappings = flatten(state_dict)
        if path is not None:
            claim_folder(path, staged)
            if dest.folder_at_request:
                # The rest of the folder work runs off this thread (prepare_destination).
                storage.make_folder()
        _stage_into(staged, flat, config, tier, dest)
    except Exception as exc:  # noqa: BLE001 - raised from prepare_local_plan, on every rank
        staged.fail(exc)
    # Every torch.optim step now waits for this save's copies.
    inflight.register(staged)
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
        tier.claimed(Claim(staged.path, staged.request.rank, need))
        staged.tag = new_tag() if prepare_folder(staged.storage, overwrite=config.overwrite) else None
        for f in staged.files:
            _name_file(f, staged)
        tier.files_named(FilesNamed(staged, staged.storage, tuple(staged.files)))
    except Exception as exc:  # noqa: BLE001 - raised from prepare_local_plan, on every rank
        staged.fail(exc)


def _files_per_group(storage, config) -> int:
    """One file per flush thread where the engine writes host tensors straight to the folder
    (each thread then has a file of its own: see ``split_for_writers``), else one."""
    if storage is not None and channel_for(storage).writes_direct(config.direct_writes):
        return config.flush_threads
    return 1


def _stage_into(staged: StagedSave, flat: dict, config, tier, dest: Destination) -> None:
    rank, world = global_rank_world()
    staged.request = dataclasses.replace(staged.request, rank=rank)
    dedup = world > 1 and config.dedup_replicated
    engine = get_engine(config)
    # Incremental: the tensors written without a hash this time (a hint).
    direct = None
    if staged.request.incremental is not None:
        durable = dest.durable if staged.path is not None else None
        direct = staged.request.incremental.written_directly(hint_key(durable, rank)) if durable else frozenset()
    context = PlanContext(rank, world, dedup, engine.cuda_devices > 0, dest.mirroring,
                          _files_per_group(staged.storage, config))
    copies = CopyAtRequest(config.copy_at_request_max_bytes, config.copy_at_request_total_bytes)
    plan = plan_stage(flat, context, copies, folder_known=staged.path is not None,
                      hold_limit=lambda: hold_limit(config), incremental=direct)
    staged.request = staged.request.with_plan(plan)
    staged.guard, staged.late_guard = plan.guard, plan.late_guard
    staged.flat, staged.payloads = flat, plan.payloads
    try:
        # (Files are planned only when the folder is known.)
        for pf in plan.files:
            copied = _copy_small_now(engine, pf, staged.path, plan.copy_limit)
            staged.files.append(start_file(engine, staged, *copied, config))
        for group in plan.held:
            h = hold(engine, group.items, known=group.known, config=config, label=staged.path,
                     incremental=staged.request.incremental, copy_limit=plan.copy_limit)
            h.mirrors, h.mirror_of = group.mirrors, group.mirror_of
            staged.held.append(h)
    finally:
        if staged.path is not None:
            # Also after an error: the started jobs are named or failed there.
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
        # Staged into the writer's previous folder.
        staged.moved_from = staged.storage
        inflight.release(staged.path, staged)
        staged.path = None
    if staged.path is None:
        claim_folder(path, staged)
        staged.path, staged.storage = path, storage
        tier.claimed(Claim(path, staged.request.rank))
        staged.tag = new_tag() if prepare_folder(storage, overwrite=config.overwrite) else None
    for k, h in enumerate(staged.held, start=len(staged.files)):
        if h.name is None:
            h.set_destination(storage, data_file_name(staged.request.rank, k, staged.tag), sync=config.sync_files,
                              direct_writes=config.direct_writes, direct_io=staged.request.direct_io)


def sync_save(path: str, storage: Storage, rank: int, config, tier) -> StagedSave:
    """``dcp.save`` (nothing staged): the folder prepared at planning time; the save that
    ``write_data`` then writes from live memory."""
    # DCP's write items live until the commit here too.
    pause = gc_pause.pause_collector(GC_PAUSE_MAX_S)
    try:
        tier.claimed(Claim(path, rank))
        tag = new_tag() if prepare_folder(storage, overwrite=config.overwrite) else None
    except BaseException:
        pause.release()
        raise
    staged = StagedSave(path=path, storage=storage, tag=tag, collector_pause=pause,
                        request=SaveRequest(rank=rank, direct_io=rhythm.direct_io_for(config, time.monotonic())))
    _decide_incrementally(staged, config, tier)
    return staged


def _decide_incrementally(staged: StagedSave, config, tier) -> None:
    """``incremental``: the save's decisions, made against the checkpoints beside its (durable)
    folder, which DCP may name only later."""
    if config.incremental:
        # With local_tier, beside the durable checkpoints: the references name their files.
        staged.request = dataclasses.replace(staged.request, incremental=Incremental(
            lambda: open_storage(tier.durable_path, config.storage_options) if tier.durable_path else staged.storage))


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
    untagged = pf.untagged or data_file_name(staged.request.rank, pf.index)
    job, upload, name_it = channel_for(staged.storage).start_data_file(
        engine, untagged, pf.layout.header, pf.layout.file_size, pf.spans, sync=config.sync_files, device=pf.device,
        stream=stream, direct_writes=config.direct_writes, direct_io=staged.request.direct_io)
    locations = pf.locations(untagged, job.piece_size())
    return FileJob(pf.index, None, job, pf.keys, locations, pf.keepalive, engine, pf.layout.file_size, upload, name_it,
                   side_buffer, mirrors=pf.mirrors, mirror_of=pf.mirror_of)


def submit_file(engine, staged: StagedSave, pf: PlannedFile, config, named) -> FileJob:
    """A file made once the folder is prepared (``write_data``): started and named at once
    (``named(files)`` tells the save's tier)."""
    f = start_file(engine, staged, pf, None, config)
    _name_file(f, staged)
    named((f,))
    return f


def _name_file(f: FileJob, staged: StagedSave) -> None:
    """Give a started file its name in the prepared folder: the engine writes it from now on."""
    f.name = data_file_name(staged.request.rank, f.index, staged.tag)
    # An old file of that name is freed on a watcher.
    f.name_it(f.name, _watchers.submit)


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
    # What the items copied at the request point into.
    held.side_buffer = side_buffer
    return held


def finish_staging(staged: StagedSave, resolve: tuple | None) -> None:
    """On a watcher thread: wait for every copy, seal the guard, resolve DCP's Future."""
    try:
        if staged.destination is not None:
            # The folder is prepared and the files named (or the save failed).
            staged.destination.result()
        staged.wait_staged(None)
        staged.staged_s = time.monotonic() - staged.request.requested
        staged.seal()
    finally:
        for f in staged.files:
            # The engine copied them: release the source tensors.
            f.keepalive = None
            if f.side_buffer is not None and f.job.is_staged():
                # No copy reads it any more.
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
