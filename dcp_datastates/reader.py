"""DataStatesReader: a DCP StorageReader for checkpoints written by DataStatesWriter.

Reads go through the engine's parallel ``pread`` workers, straight into the destination tensor
when it is a contiguous CPU tensor of the stored dtype covering a whole stored chunk, otherwise
into a temporary buffer that is then narrowed (resharding sub-boxes) and copied (dtype casts,
strides, devices) into ``planner.resolve_tensor(req)``. Every piece read is checked against the
CRC32C recorded at save time unless ``verify=False``.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from . import commit, folders, integrity, remote, safe_unpickle, tiers
from .checkpoint_format import FileInfo, ItemLocation, name_to_dtype, piece_ranges, rank_marker_name
from .config import DataStatesConfig
from .errors import CheckpointFormatError, ChecksumMismatchError, DataStatesError, IncompleteCheckpointError, record_metadata_read
from .gcpause import gc_paused
from .integrity import check_data_files, checksum_mismatch, file_size_error
from .runtime import get_engine

log = logging.getLogger("dcp_datastates")

__all__ = ["DataStatesReader"]


class _StorageIndex(dict):
    """``Metadata.storage_data``: MetadataIndex -> ItemLocation, plus the per-file table
    (kept as an attribute so it travels with the metadata when DCP broadcasts it)."""

    files: dict[str, FileInfo]


@dataclass
class _Pending:
    req: ReadItem
    loc: ItemLocation
    ptr: int  # where the stored bytes land (the destination's own memory on the direct path)
    nbytes: int  # how many are read there
    dst: torch.Tensor | None  # tensor destination (None for bytes items)
    direct: bool
    read_start: int = 0  # file offset of the byte at ptr
    src: torch.Tensor | None = None  # the requested sub-box, a view into buf (non-direct tensors)
    buf: torch.Tensor | None = None  # owns the memory at ptr when it is not the destination's

    @property
    def read_end(self) -> int:
        return self.read_start + self.nbytes


# Restores into CUDA tensors: each copy runs from a pinned buffer on a side stream per device, so
# the reading thread never blocks on it (the next reads overlap it); read_data waits once, at its end.
_h2d_streams: dict[int, Any] = {}
_h2d_used = threading.local()


def _copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a CUDA ``dst``, asynchronous: ordered after the work queued on the
    current stream (which made ``dst``) and before the work queued on it later."""
    current = torch.cuda.current_stream(dst.device)
    side = _h2d_streams.get(dst.device.index)
    if side is None:
        side = _h2d_streams.setdefault(dst.device.index, torch.cuda.Stream(dst.device))
    side.wait_stream(current)
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
    current.wait_stream(side)
    if not hasattr(_h2d_used, "streams"):
        _h2d_used.streams = {}
    _h2d_used.streams[dst.device.index] = side


def _finish_device_copies() -> None:
    """Wait for the host -> device copies this thread started (their pinned sources can go)."""
    used = getattr(_h2d_used, "streams", {})
    _h2d_used.streams = {}
    for side in used.values():
        side.synchronize()


class DataStatesReader(StorageReader):
    """Storage reader for ``dcp.load``.

    Args:
        path: checkpoint folder (``checkpoint_id`` passed to DCP retargets it).
        config: a ``DataStatesConfig``, a dict, or a YAML/JSON file path.
        trusted: decode non-tensor values with ``torch.load(weights_only=False)`` as stock DCP
            does, which RUNS CODE FROM THE CHECKPOINT. Only for checkpoints whose writer you
            trust. By default (False) every value must pass PyTorch's restricted unpickler
            (plus the few data-only types in ``safe_unpickle.EXTRA_SAFE_GLOBALS``), else the
            load raises ``UnsafeCheckpointError`` naming the item and what it would import.
        **options: ``DataStatesConfig`` fields, e.g. ``verify=False`` or ``read_threads=8``.
    """

    def __init__(
        self, path: str | os.PathLike | None = None, *, config=None, trusted: bool = False, **options: Any
    ) -> None:
        super().__init__()
        self.config = DataStatesConfig.resolve(config, options)
        self.trusted = bool(trusted)
        # The exception the last failed read_metadata raised: DCP replaces it by an
        # AssertionError (2.9: a bare one), so errors.checkpoint_error_cause recovers it from here.
        self.metadata_error: BaseException | None = None
        self.path = self.durable_path = folders.normalize(path)
        self.storage_data: _StorageIndex | None = None
        self.rank = 0
        self._folder: folders.RemoteFolder | None = None  # remote checkpoints (fsspec URLs)
        self._sizes: dict[str, int] | None = None  # remote data-object sizes, one listing per load
        # local_tier, several-rank saves: durable file name -> this node's local copy of it, and
        # how many files this load read from each tier (logged)
        self._local_files: dict[str, str] = {}
        self._pending_id: str | None = None  # reading a checkpoint committed on the local tiers only
        self.tier_reads = {"local": 0, "durable": 0}

    # ---------------------------------------------------------------------------- StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = self.durable_path = folders.normalize(checkpoint_id)
        self.storage_data = None
        self._folder = None
        self._sizes = None
        self._local_files = {}
        self._pending_id = None
        self.tier_reads = {"local": 0, "durable": 0}

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP's load reads the global metadata, then (when that failed) the rank-local one: the
        # first failure is the one that says what is wrong with the checkpoint.
        fallback = kwargs.get("rank") is not None and self.metadata_error is not None
        try:
            with gc_paused():  # decoding builds an object per item
                md = self._read_metadata(kwargs.get("rank"))
        except BaseException as exc:
            if not fallback:
                self.metadata_error = exc
            record_metadata_read(self.metadata_error)
            raise
        self.metadata_error = None
        record_metadata_read(None)
        return md

    def _read_metadata(self, rank: int | None = None) -> Metadata:
        if self.path is None:
            raise ValueError("DataStatesReader: no checkpoint path (pass path= or checkpoint_id=)")
        if self.config.local_tier is not None and rank is None:  # local_tier hook: the nearest good copy
            self.path = tiers.choose_copy(self.durable_path, self.config)
            pending = tiers.read_pending(self.durable_path, self.config.storage_options, uncommitted_only=True) \
                if self.path == self.durable_path else None
            if pending is not None:  # several ranks: committed on the local tiers, not drained yet
                md, files = pending
                log.info("dcp_datastates: %s is committed on the nodes' local tiers and not yet on the durable "
                         "tier: reading checkpoint %s from the local copies", self.durable_path, md.storage_meta.save_id)
                self._local_files = tiers.local_files(
                    tiers.local_copy(self.config.local_tier, self.durable_path), md.storage_meta.save_id)
                self._pending_id = md.storage_meta.save_id
                return self._with_index(md, files)
        if rank is None and not folders.is_remote(self.path) and dist.is_available() and dist.is_initialized():
            # A rank-local checkpoint (saved with use_collectives=False): each rank reads its own
            # commit, unless the folder holds one committed by all ranks together.
            local = os.path.join(folders.local_path(self.path), rank_marker_name(dist.get_rank()))
            if not commit.is_committed(self.path) and os.path.isfile(local):
                rank = dist.get_rank()
        md, files = integrity.read_commit(self.path, storage_options=self.config.storage_options, rank=rank)
        if self.config.local_tier is not None and self.path == self.durable_path and rank is None:
            # local_tier hook: a several-rank save leaves each node's files in its local copy
            save_id = md.storage_meta.save_id if md.storage_meta is not None else None
            self._local_files = tiers.local_files(tiers.local_copy(self.config.local_tier, self.durable_path), save_id)
        return self._with_index(md, files)

    def _with_index(self, md: Metadata, files: dict[str, FileInfo]) -> Metadata:
        index = _StorageIndex(md.storage_data)
        index.files = files
        index.checkpoint_path = self.path  # names this folder in planner errors (it may have moved)
        md.storage_data = index
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if kwargs.get("rank") is not None:
            self.rank = int(kwargs["rank"])
        elif dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        with gc_paused():  # per-item targets and views: no collection in the middle of a load
            return self._read_data(plan, planner)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        by_file: dict[str, list[tuple[ReadItem, ItemLocation]]] = defaultdict(list)
        for req in plan.items:
            loc = self._location(req)
            by_file[loc.file].append((req, loc))
        for name, items in by_file.items():
            self._read_file(name, items, planner)
        _finish_device_copies()
        if self._local_files:
            log.info("dcp_datastates: rank %d read %d data file(s) of %s from the local tier %s and %d from "
                     "the durable tier", self.rank, self.tier_reads["local"], self.durable_path,
                     self.config.local_tier, self.tier_reads["durable"])
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Local paths, ``file://`` and any URL whose protocol fsspec knows."""
        return folders.is_supported_url(checkpoint_id)

    # --------------------------------------------------------------------------------- helpers
    def _location(self, req: ReadItem) -> ItemLocation:
        try:
            return self.storage_data[req.storage_index]
        except (KeyError, TypeError):
            raise CheckpointFormatError(
                f"checkpoint {self.path}: no stored location for item {req.storage_index.fqn!r} "
                f"at offset {list(req.storage_index.offset or [])}"
            ) from None

    def _remote(self) -> folders.RemoteFolder:
        if self._folder is None or self._folder.url != self.path:
            self._folder = folders.remote_folder(self.path, self.config.storage_options)
            self._sizes = None
        return self._folder

    def _check_remote_file(self, name: str) -> None:
        """The data object exists with the recorded size (one listing of the folder per load)."""
        folder = self._remote()
        if self._sizes is None or name not in self._sizes:
            self._sizes = folder.sizes()
        size = self._sizes.get(name)
        if size is None:
            size = folder.size(name)  # listings can be partial on some stores: ask for the object itself
        info = self.storage_data.files.get(name)
        error = file_size_error(self.path, name, size, size if info is None else info.size, location=folder.url_of(name))
        if error is not None:
            raise error

    def _check_file(self, name: str) -> str:
        try:
            return self._check_durable_file(name)
        except IncompleteCheckpointError as exc:
            if self._pending_id is None:
                raise
            raise IncompleteCheckpointError(
                f"checkpoint {self._pending_id} of {self.durable_path} is committed only on the nodes' local tiers "
                f"(its drain did not finish), and rank {self.rank} needs data file {name}, which is neither on this "
                f"node's local tier ({self.config.local_tier}) nor drained yet: restart on the nodes that wrote it, "
                f"or load the newest durable checkpoint (dcp_datastates.latest_checkpoint(root) without local_tier). "
                f"({exc})"
            ) from exc

    def _check_durable_file(self, name: str) -> str:
        if folders.is_remote(self.path):
            self._check_remote_file(name)  # sizes from one listing per load
            return name
        info = self.storage_data.files.get(name)
        if info is not None:
            check_data_files(self.path, {name: info})
        return os.path.join(self.path, name)

    def _read_file(self, name: str, items: list[tuple[ReadItem, ItemLocation]], planner: LoadPlanner) -> None:
        local = self._local_files.get(name)
        full = self._check_file(name) if local is None else None
        pending = [self._target(req, loc, planner) for req, loc in items]
        reading = [p for p in pending if p.nbytes]
        ranges = [(p.ptr, p.read_start, p.nbytes) for p in reading]
        if local is not None:
            try:  # local_tier hook: this node's copy, verified; any problem reads the durable file
                info = self.storage_data.files.get(name)
                if info is not None:
                    check_data_files(os.path.dirname(local), {os.path.basename(local): info})
                if ranges:
                    self._read_local(local, reading, ranges, verify=True)
                self.tier_reads["local"] += 1
                local = None
            except (DataStatesError, OSError) as exc:
                log.warning("dcp_datastates: rank %d: the local copy %s of %s is unusable (%s); reading it from "
                            "the durable tier", self.rank, local, name, exc)
                full = self._check_file(name)
        if full is not None:
            self.tier_reads["durable"] += 1
            if ranges and folders.is_remote(self.path):
                concurrency = max(remote.READ_CONCURRENCY, self.config.read_threads)
                remote.read_ranges(self._remote(), name, ranges, concurrency=concurrency)
                if self.config.verify:
                    self._verify(reading)
            elif ranges:
                self._read_local(full, reading, ranges, verify=self.config.verify)
        for p in pending:
            if p.dst is None:
                self._load_value(p, planner)
                continue
            if not p.direct:
                if p.dst.is_cuda:
                    _copy_to_device(p.dst, p.src)
                else:
                    p.dst.copy_(p.src)
            planner.commit_tensor(p.req, p.dst)

    def _read_local(self, full: str, reading: list[_Pending], ranges: list, *, verify: bool) -> None:
        # The engine checks each piece right after reading it, while its bytes are hot.
        checks = self._checks(reading) if verify else None
        bad = get_engine(self.config).read_into(full, ranges, checks, self.config.read_threads)
        if bad is not None:
            index, off, length, expected, got = bad
            raise checksum_mismatch(os.path.dirname(full), reading[index].loc.file, reading[index].req.storage_index,
                                    off, length, expected, got)

    def _load_value(self, p: _Pending, planner: LoadPlanner) -> None:
        """Hand a stored non-tensor value to the planner. Unless trusted, it is decoded first with
        the restricted unpickler (this is where every value of every planner passes), and a
        planner of ours takes that decoded value instead of unpickling the bytes again."""
        data = ctypes.string_at(p.ptr, p.loc.length) if p.loc.length else b""
        if self.trusted:
            planner.load_bytes(p.req, io.BytesIO(data))
            return
        value = safe_unpickle.decode_value(data, checkpoint=str(self.path), item=p.req.storage_index.fqn)
        load_value = getattr(planner, "load_decoded_value", None)
        if load_value is None or not load_value(p.req, value):
            # This planner unpickles the bytes itself: they passed the restricted decode.
            planner.load_bytes(p.req, io.BytesIO(data))

    def _target(self, req: ReadItem, loc: ItemLocation, planner: LoadPlanner) -> _Pending:
        if req.type == LoadItemType.BYTE_IO:
            buf = torch.empty(loc.length, dtype=torch.uint8)
            return _Pending(req, loc, buf.data_ptr(), loc.length, None, False, loc.offset, buf=buf)
        dst = planner.resolve_tensor(req)
        direct = (
            not any(req.storage_offsets)
            and tuple(req.lengths) == loc.shape
            and dst.device.type == "cpu"
            and dst.is_contiguous()
            and dst.dtype == name_to_dtype(loc.dtype)
            and dst.nbytes == loc.length
        )
        if direct:  # read straight into the destination's memory
            return _Pending(req, loc, dst.data_ptr() if loc.length else 0, loc.length, dst, True, loc.offset)
        return self._span_target(req, loc, dst)

    def _span_target(self, req: ReadItem, loc: ItemLocation, dst: torch.Tensor) -> _Pending:
        """Read only the bytes between the first and last element of the requested sub-box
        (resharding), widened to whole checksum pieces when verifying."""
        dtype = name_to_dtype(loc.dtype)
        esize = dtype.itemsize
        strides = [1] * len(loc.shape)
        for d in range(len(loc.shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * loc.shape[d + 1]
        if any(n == 0 for n in req.lengths):
            return _Pending(req, loc, 0, 0, dst, False, loc.offset, torch.empty(tuple(req.lengths), dtype=dtype))
        first = sum(o * st for o, st in zip(req.storage_offsets, strides))
        last = sum((o + n - 1) * st for o, n, st in zip(req.storage_offsets, req.lengths, strides))
        lo, hi = loc.offset + first * esize, loc.offset + (last + 1) * esize
        if self.config.verify and loc.crc32c:
            pieces = [(a, a + n) for a, n in piece_ranges(loc) if a + n > lo and a < hi]
            lo, hi = pieces[0][0], pieces[-1][1]
        # Pad the buffer so the sub-box's first element is aligned for its dtype.
        pad = (-(loc.offset + first * esize - lo)) % 16
        raw = torch.empty(pad + hi - lo, dtype=torch.uint8, pin_memory=dst.is_cuda)  # pinned: async H2D
        buf = raw[pad:]
        begin = loc.offset + first * esize - lo
        flat = buf[begin : begin + (last - first + 1) * esize].view(dtype)
        src = torch.as_strided(flat, tuple(req.lengths), tuple(strides), flat.storage_offset())
        return _Pending(req, loc, buf.data_ptr(), buf.numel(), dst, False, lo, src, buf)

    @staticmethod
    def _checks(reading: list[_Pending]) -> list[tuple[int, int, int, int]]:
        """(range index, file offset, length, crc32c) of every stored piece each read covers
        (a resharding read may skip pieces of its item)."""
        out = []
        for i, p in enumerate(reading):
            if not p.loc.crc32c:
                continue
            start, end = p.read_start, p.read_end
            out.extend(
                (i, off, length, expected)
                for expected, (off, length) in zip(p.loc.crc32c, piece_ranges(p.loc))
                if off >= start and off + length <= end
            )
        return out

    def _verify(self, reading: list[_Pending]) -> None:
        """Check in Python the pieces ``_checks`` lists (remote reads do not go through the engine)."""
        engine = get_engine(self.config)
        for i, off, length, expected in self._checks(reading):
            p = reading[i]
            got = engine.crc32c(p.ptr + (off - p.read_start), length)
            if got != expected:
                raise self._mismatch(p, off, length, expected, got)

    def _mismatch(self, p: _Pending, off: int, length: int, expected: int, got: int) -> ChecksumMismatchError:
        return checksum_mismatch(self.path, p.loc.file, p.req.storage_index, off, length, expected, got)
