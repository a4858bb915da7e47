"""DataStatesWriter: a DCP StorageWriter that is also an AsyncStager (lazy staging).

``stage()`` runs on the training thread: it lays out this rank's data file from the local state
dict alone, hands the engine one job (pointers, sizes, offsets) and returns a Future at once. The
engine's copy workers fill the host cache while training goes on; its flush workers write each
chunk as soon as it is in the cache. DCP's planning, ``write_data`` and ``finish`` then run on
DCP's background thread: ``write_data`` waits for the job to be durable and reports each item's
location; the coordinator's ``finish`` commits ``.metadata`` atomically.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from . import commit, remote, storage
from .compat import unflatten_state_dict
from .config import DataStatesConfig
from .errors import CheckpointWriteError
from .layout import data_file_name, plan_file
from .metadata import ItemLocation
from .runtime import get_engine
from .consolidate import consolidate_results
from .gcpause import gc_paused
from .ownership import RankReport, select_owned
from .stage_items import ItemKey, SourceItem, flatten, item_key, items_of_flat, source_for_resolved
from .stage_plan import build_plan, find_plan, scan_state
from .staging import tracker

__all__ = ["DataStatesWriter"]

log = logging.getLogger("dcp_datastates")

# Waits for staging and resolves the Futures handed to DCP; never runs Python on engine threads.
_watchers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dcp-datastates-staging")


@dataclass(eq=False)
class _FileJob:
    """One data file in flight: the engine job and where each item landed."""

    name: str
    job: Any
    keys: Sequence[ItemKey]
    locations: Mapping[ItemKey, ItemLocation]  # shared with a cached stage plan: never mutated
    keepalive: list[Any] | None
    data_start: int
    piece_size: int
    engine: Any = None  # the engine running ``job``
    upload: Future | None = None  # remote files: resolves once the object is complete in the store

    def wait_staged(self, timeout: float | None = None) -> bool:
        return self.job.wait_staged(timeout)

    def is_done(self) -> bool:
        """The file is complete (or failed): written, or for remote files uploaded and closed."""
        return self.job.is_done() and (self.upload is None or self.upload.done())

    def device_wait(self, stream_of) -> bool:
        """True when the caller need not wait on the host: the file is staged, or its copies are
        all queued and the caller's CUDA stream (``stream_of(device)``) now waits for them."""
        if self.job.device < 0:
            return self.job.is_staged()
        stream = stream_of(self.job.device)
        return stream is not None and self.engine.device_wait(self.job, stream)


@dataclass(eq=False)
class _StagedSave:
    """Everything stage() started for one checkpoint path on this rank."""

    path: str
    files: list[_FileJob] = field(default_factory=list)
    skipped: set = field(default_factory=set)  # replicated items another rank writes
    replicated_digest: str | None = None  # None: no stage-time dedup was applied

    def wait_staged(self, timeout: float | None = None) -> bool:
        return all(f.wait_staged(timeout) for f in self.files)

    def device_wait(self, stream_of) -> bool:
        """See ``_FileJob.device_wait``; False (wait on the host) when no file copies from a GPU."""
        return any(f.job.device >= 0 for f in self.files) and all(f.device_wait(stream_of) for f in self.files)


def _async_save_arguments() -> dict:
    """The arguments of the ``dcp.async_save`` call that is running ``stage()`` right now.

    DCP calls ``stage()`` before it retargets the writer with ``checkpoint_id`` (that happens in
    the background thread, after staging), yet flushing must start during staging. So we read the
    pending call's arguments from its frame. Returns {} when not called from ``async_save``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "async_save" and frame.f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
            return dict(frame.f_locals)
        frame = frame.f_back
    return {}


def _dcp_save_group():
    """(process group, distributed?, coordinator rank) of the DCP save running this writer, read
    from the frame of DCP's ``_save_state_dict`` (the group is never handed to storage writers)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_save_state_dict" and "distW" in frame.f_locals:
            w = frame.f_locals["distW"]
            distributed = bool(w.use_dist) and bool(frame.f_locals.get("use_collectives", True))
            return w.group, distributed, w.coordinator_rank
        frame = frame.f_back
    return None, False, 0


def _rank_of(process_group=None, no_dist: bool = False) -> int:
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(process_group)


def _world_of(process_group=None, no_dist: bool = False) -> int:
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def _by_device(items: list[SourceItem]) -> list[list[SourceItem]]:
    """The items split by the device they live on (one engine job copies from one device): a
    single list when they share one, as CPU-only states do; else host items first (small
    non-tensor values, staged at once ahead of the device copies), then by device index."""
    first = items[0].device if items else -1
    if all(it.device == first for it in items):
        return [items]
    groups: dict[int, list[SourceItem]] = {}
    for it in items:
        groups.setdefault(it.device, []).append(it)
    return [groups[d] for d in sorted(groups)]


def _on_one_device(engine, items: list[SourceItem]) -> tuple[int, list[SourceItem]]:
    """(device, items) for one engine job. CUDA items are copied to host memory now (blocking)
    when the engine has no CUDA runtime or they share a job with items of another device."""
    device = items[0].device if items else -1
    if device < 0 and all(it.device < 0 for it in items):
        return -1, items
    if engine.cuda_devices > 0 and all(it.device == device for it in items):
        return device, items
    host = []
    for it in items:
        if it.device >= 0:
            t = it.keepalive.to("cpu")
            it = dataclasses.replace(it, ptr=t.data_ptr() if it.entry.nbytes else 0, keepalive=t, device=-1)
        host.append(it)
    return -1, host


# Saves whose data files are still being written, by checkpoint path (process-wide).
_inflight: dict[str, _StagedSave] = {}
_inflight_lock = threading.Lock()


def _refuse_concurrent_save(path: str) -> None:
    """Two saves writing the same folder at once could leave one's commit describing the
    other's files; refuse the second (it fails from its futures, training goes on)."""
    with _inflight_lock:
        for done in [p for p, st in _inflight.items() if all(f.is_done() for f in st.files)]:
            del _inflight[done]
        if path in _inflight:
            raise CheckpointWriteError(
                f"a save to {path} is still writing its data; wait for its upload_completion "
                f"before saving to the same path again"
            )


def _retire_old_file(path: str) -> None:
    """Move an old data file out of the way so the engine creates a new inode (a hard link or
    symlink shared with another checkpoint must never be truncated in place). A rename is O(1)
    on the training thread; freeing a large file's blocks happens on a background thread."""
    aside = f"{path}.old-{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except OSError:
        return  # no old file (or nothing we may move): the engine's create reports real errors
    _watchers.submit(_unlink_quietly, aside)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _current_stream(device: int) -> int:
    """Handle of this thread's current CUDA stream on ``device``: the engine's copies of a job
    run after the work queued on it when the job is submitted (the kernels producing the state)."""
    return torch.cuda.current_stream(device).cuda_stream


class DataStatesWriter(StorageWriter, AsyncStager):
    """Storage writer for ``dcp.save`` / ``dcp.async_save`` with lazy asynchronous staging.

    Args:
        path: checkpoint folder (``checkpoint_id`` passed to DCP retargets it).
        config: a ``DataStatesConfig``, a dict, or a YAML/JSON file path.
        **options: any ``DataStatesConfig`` field (``host_cache_size=``, ``sync_files=``,
            ``overwrite=``, ``thread_count=`` ...), on top of ``config``.
    """

    # Staging is asynchronous: DCP must not call synchronize_staging() inside async_save.
    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike | None = None, *, config=None, **options: Any) -> None:
        super().__init__()
        self.config = DataStatesConfig.resolve(config, options)
        self.path = storage.normalize(path)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        self._staged: dict[str, _StagedSave] = {}
        self._remote_folders: dict[str, storage.RemoteFolder] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ pickling (process mode)
    def __getstate__(self):
        raise TypeError(
            "DataStatesWriter cannot be sent to another process: its staging lives in this process's "
            "host cache. Use dcp.async_save with AsyncCheckpointerType.THREAD (the default)."
        )

    # ------------------------------------------------------------------------------ AsyncStager
    def stage(self, state_dict: dict) -> Future:
        """Enqueue this rank's copies and return a Future of the staged state dict at once."""
        with gc_paused():  # thousands of small objects per checkpoint: no collection mid-stage
            return self._stage(state_dict)

    def _stage(self, state_dict: dict) -> Future:
        call = _async_save_arguments()
        checkpoint_type = call.get("async_checkpointer_type")
        if checkpoint_type is not None and getattr(checkpoint_type, "name", "") == "PROCESS":
            raise ValueError(
                "DataStatesWriter supports dcp.async_save with AsyncCheckpointerType.THREAD only: "
                "lazy staging keeps the bytes in this process's host cache, which a separate "
                "checkpoint process cannot read."
            )
        target = call.get("checkpoint_id") or self.path
        future: Future = Future()
        if target is None:
            future.set_exception(ValueError("DataStatesWriter: no checkpoint path (pass path= or checkpoint_id=)"))
            return future
        target = storage.normalize(target)
        try:
            _refuse_concurrent_save(target)
            flat, mappings = flatten(state_dict)
            group, no_dist = call.get("process_group"), bool(call.get("no_dist", False))
            rank, world = _rank_of(group, no_dist), _world_of(group, no_dist)
            dedup = world > 1 and self.config.dedup_replicated
            engine = get_engine(self.config)
            context = (rank, world, dedup, engine.cuda_devices > 0)
            scan = scan_state(flat)
            plan = find_plan(context, scan)
            if plan is not None:  # the same structure as a checkpoint before: only pointers are new
                commit.prepare_folder(target, overwrite=self.config.overwrite, storage_options=self.config.storage_options)
                staged = self._stage_planned(target, plan, scan)
            else:
                staged = self._stage_full(target, flat, rank, world, dedup, context, scan)
        except Exception as exc:  # noqa: BLE001 - surfaces from the futures, as DCP users expect
            future.set_exception(exc)
            return future
        with self._lock:
            self._staged[target] = staged
        with _inflight_lock:
            _inflight[target] = staged
        tracker().add(staged)
        _watchers.submit(self._finish_staging, staged, flat, mappings, future)
        return future

    def _stage_full(self, target: str, flat: dict, rank: int, world: int, dedup: bool, context: tuple, scan) -> _StagedSave:
        """Lay out and submit every file from the items themselves; cache what depends only on
        the structure when the scan covered the state."""
        items = items_of_flat(flat, scan.payloads if scan is not None else None)
        staged = _StagedSave(path=target)
        if dedup:
            items, staged.skipped, staged.replicated_digest = select_owned(items, flat, rank, world)
        commit.prepare_folder(target, overwrite=self.config.overwrite, storage_options=self.config.storage_options)
        record: list = []
        for k, group in enumerate(_by_device(items)):  # one engine job (and file) per device
            staged.files.append(self._submit(target, data_file_name(rank, k), group, record))
        if scan is not None and staged.files:
            piece = staged.files[0].piece_size
            build_plan(context, scan, flat, record, staged.skipped, staged.replicated_digest, piece)
        return staged

    def _stage_planned(self, target: str, plan, scan) -> _StagedSave:
        """Submit every file of a cached plan with this checkpoint's pointers."""
        staged = _StagedSave(path=target, skipped=plan.skipped, replicated_digest=plan.digest)
        engine = get_engine(self.config)
        for fp in plan.files:
            job, upload = self._start(engine, target, fp.name, fp.layout, fp.spans(scan), fp.device)
            piece = job.piece_size()
            keepalive = fp.keepalive(scan)
            staged.files.append(
                _FileJob(fp.name, job, fp.keys, fp.locations_for(piece), keepalive, fp.layout.data_start, piece, engine, upload)
            )
        return staged

    @staticmethod
    def _finish_staging(staged: _StagedSave, flat: dict, mappings: dict, future: Future) -> None:
        try:
            staged.wait_staged(None)
        finally:
            for f in staged.files:
                f.keepalive = None  # the engine copied them: release the source tensors
            tracker().discard(staged)
        errors = [f.job.error() for f in staged.files if f.job.error()]
        if errors:
            for f in staged.files:
                f.job.wait_done(None)  # let the engine wind the failed jobs down first
            future.set_exception(CheckpointWriteError("; ".join(errors)))
        else:
            # The staged dict: the structure as of stage() (our own flat copy of it), live
            # tensors (the engine owns their bytes now), non-tensor values serialized into the
            # job. Built here, off the training thread.
            future.set_result(unflatten_state_dict(flat, mappings))

    def synchronize_staging(self) -> None:
        """Wait until every checkpoint staged by this writer is in the host cache."""
        for staged in list(self._staged.values()):
            staged.wait_staged(None)

    def close(self) -> None:
        """Nothing to release per writer: the engine is process-wide."""

    # ---------------------------------------------------------------------------- engine submit
    def _submit(self, folder: str, name: str, items: list[SourceItem], record: list | None = None) -> _FileJob:
        """Lay out one file of ``items`` and submit it. ``record`` collects (name, device, layout,
        items, locations) for a stage plan."""
        engine = get_engine(self.config)
        device, items = _on_one_device(engine, items)
        layout = plan_file([it.entry for it in items])
        spans = [(it.ptr, it.entry.nbytes, off) for it, off in zip(items, layout.offsets)]
        job, upload = self._start(engine, folder, name, layout, spans, device)
        piece = job.piece_size()
        locations = {
            it.key: ItemLocation(name, off, it.entry.nbytes, it.entry.dtype, it.entry.shape, (), layout.data_start, piece)
            for it, off in zip(items, layout.offsets)
        }
        if record is not None:
            record.append((name, device, layout, items, locations))
        keepalive = [it.keepalive for it in items]
        return _FileJob(name, job, [it.key for it in items], locations, keepalive, layout.data_start, piece, engine, upload)

    def _start(self, engine, folder: str, name: str, layout, spans: list, device: int):
        """Hand one file to the engine: (job, upload Future for remote folders, else None)."""
        stream = _current_stream(device) if device >= 0 else 0
        if storage.is_remote(folder):  # streamed to the object store by an uploader thread
            return remote.submit_upload(
                engine, self._remote(folder), name, layout.header, layout.file_size, spans, device, stream
            )
        path = os.path.join(folder, name)
        _retire_old_file(path)  # a new inode: never write into a file another checkpoint links to
        job = engine.submit_write(path, layout.header, layout.file_size, spans, self.config.sync_files, device, stream)
        return job, None

    def _remote(self, folder: str) -> storage.RemoteFolder:
        """The fsspec folder of a remote checkpoint (one per URL, reused by this writer)."""
        with self._lock:
            cached = self._remote_folders.get(folder)
            if cached is None:
                cached = self._remote_folders[folder] = storage.remote_folder(folder, self.config.storage_options)
            return cached

    # ---------------------------------------------------------------------------- StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = storage.normalize(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", _rank_of()))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.path is None:
            raise ValueError("DataStatesWriter: no checkpoint path (pass path= or checkpoint_id=)")
        with self._lock:
            staged = self._staged.get(self.path)
        if staged is None:  # dcp.save: nothing staged, so the folder was not prepared yet
            commit.prepare_folder(self.path, overwrite=self.config.overwrite, storage_options=self.config.storage_options)
            return dataclasses.replace(plan, storage_data=RankReport(self.rank, None))
        if plan.usable and staged.skipped:
            # Leave replicated items to the rank that staged them, so any planner's dedup
            # (DCP's default included) has exactly one candidate.
            plan = dataclasses.replace(plan, items=[i for i in plan.items if item_key(i.index) not in staged.skipped])
        return dataclasses.replace(plan, storage_data=RankReport(self.rank, staged.replicated_digest))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: stage-time dedup of plain tensors assumed every rank holds the same
        replicated values; refuse to commit a checkpoint that would miss some of them."""
        reports = [p.storage_data for p in plans if isinstance(p.storage_data, RankReport)]
        digests = {r.replicated_digest for r in reports if r.replicated_digest is not None}
        if len(digests) > 1:
            groups: dict[str, list[int]] = {}
            for r in reports:
                groups.setdefault(str(r.replicated_digest), []).append(r.rank)
            raise CheckpointWriteError(
                f"checkpoint {self.path}: ranks hold different sets of plain (non-DTensor) tensors "
                f"(groups of ranks with the same set: {sorted(groups.values())}), so each cannot be "
                f"written by one rank chosen locally. Pass dedup_replicated=False to DataStatesWriter "
                f"(needed with pipeline parallelism); this checkpoint was not committed."
            )
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        with self._lock:
            staged = self._staged.pop(self.path, None) or _StagedSave(path=self.path)
        known: dict[ItemKey, _FileJob] = {k: f for f in staged.files for k in f.keys}
        late = [item for item in plan.items if item_key(item.index) not in known]
        if late:
            # Items no stage() call prepared (dcp.save, or a planner that lays items out
            # differently): resolve them now and write them to one more file.
            taken: set[str] = set()
            sources = [source_for_resolved(item, planner.resolve_data(item), taken) for item in late]
            extra = self._submit(self.path, data_file_name(self.rank, len(staged.files)), sources)
            staged.files.append(extra)
            known.update({k: extra for k in extra.keys})
        errors = []
        for f in staged.files:
            if f.upload is not None:  # remote: the object is complete (or the upload failed)
                exc = f.upload.exception()
                if exc is not None:
                    f.job.wait_done(None)
                    f.keepalive = None
                    errors.append(str(exc))
                    continue
            f.job.wait_done(None)
            f.keepalive = None
            if f.job.error():
                errors.append(f.job.error())
        if errors:
            raise CheckpointWriteError(f"saving checkpoint {self.path} failed: " + "; ".join(errors))
        checksums = {id(f): dict(zip(f.keys, f.job.checksums())) for f in staged.files}
        out = []
        for item in plan.items:
            key = item_key(item.index)
            f = known[key]
            loc = f.locations[key]
            final = dataclasses.replace(loc, crc32c=tuple(checksums[id(f)][key]))
            out.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=final))
        group, distributed, coordinator = _dcp_save_group()
        if distributed and self.config.hierarchical_consolidation:
            out = consolidate_results(out, group, coordinator)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(out)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if metadata.storage_meta is None:  # DCP's default planner does not fill it
            metadata = dataclasses.replace(metadata, storage_meta=self.storage_meta())
        locations: dict[MetadataIndex, ItemLocation] = {}
        for rank_results in results:
            for r in rank_results:
                locations[r.index] = r.storage_data
        commit.write_commit(
            self.path, metadata, locations, sync=self.config.sync_files, storage_options=self.config.storage_options
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Local paths, ``file://`` and any URL whose protocol fsspec knows."""
        return storage.is_supported_url(checkpoint_id)
