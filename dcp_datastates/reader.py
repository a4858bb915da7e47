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
import os
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .config import DataStatesConfig
from .errors import ChecksumMismatchError, CheckpointFormatError, IncompleteCheckpointError
from .layout import name_to_dtype
from .metadata import METADATA_NAME, FileInfo, ItemLocation, decode_metadata, piece_ranges
from .runtime import get_engine

__all__ = ["DataStatesReader"]


class _StorageIndex(dict):
    """``Metadata.storage_data``: MetadataIndex -> ItemLocation, plus the per-file table
    (kept as an attribute so it travels with the metadata when DCP broadcasts it)."""

    files: dict[str, FileInfo]


@dataclass
class _Pending:
    req: ReadItem
    loc: ItemLocation
    buf: torch.Tensor  # where the stored bytes land (the destination itself on the direct path)
    dst: torch.Tensor | None  # tensor destination (None for bytes items)
    direct: bool


class DataStatesReader(StorageReader):
    """Storage reader for ``dcp.load``.

    Args:
        path: checkpoint folder (``checkpoint_id`` passed to DCP retargets it).
        config: a ``DataStatesConfig``, a dict, or a YAML/JSON file path.
        **options: ``DataStatesConfig`` fields, e.g. ``verify=False`` or ``read_threads=8``.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, config=None, **options: Any) -> None:
        super().__init__()
        self.config = DataStatesConfig.resolve(config, options)
        self.path = None if path is None else os.fspath(path)
        self.storage_data: _StorageIndex | None = None
        self.rank = 0

    # ---------------------------------------------------------------------------- StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.storage_data = None

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ValueError("DataStatesReader: no checkpoint path (pass path= or checkpoint_id=)")
        marker = os.path.join(self.path, METADATA_NAME)
        try:
            with open(marker, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            if not os.path.isdir(self.path):
                raise FileNotFoundError(f"no checkpoint at {self.path}: the folder does not exist") from None
            raise IncompleteCheckpointError(
                f"incomplete checkpoint {self.path}: there is no {METADATA_NAME} commit marker "
                f"(the save did not finish or is still running)"
            ) from None
        md, files = decode_metadata(raw, marker)
        index = _StorageIndex(md.storage_data)
        index.files = files
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
        by_file: dict[str, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            by_file[self._location(req).file].append(req)
        for name, reqs in by_file.items():
            self._read_file(name, reqs, planner)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        s = os.fspath(checkpoint_id)
        return "://" not in s or s.startswith("file://")

    # --------------------------------------------------------------------------------- helpers
    def _location(self, req: ReadItem) -> ItemLocation:
        try:
            return self.storage_data[req.storage_index]
        except (KeyError, TypeError):
            raise CheckpointFormatError(
                f"checkpoint {self.path}: no stored location for item {req.storage_index.fqn!r} "
                f"at offset {list(req.storage_index.offset or [])}"
            ) from None

    def _check_file(self, name: str) -> str:
        full = os.path.join(self.path, name)
        info = self.storage_data.files.get(name)
        try:
            size = os.stat(full).st_size
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"checkpoint {self.path}: data file {name} is missing") from None
        if info is not None and size != info.size:
            raise IncompleteCheckpointError(
                f"checkpoint {self.path}: data file {name} is {size} bytes, the metadata expects {info.size} "
                f"(truncated or replaced)"
            )
        return full

    def _read_file(self, name: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        full = self._check_file(name)
        pending: list[_Pending] = []
        ranges = []
        for req in reqs:
            loc = self._location(req)
            p = self._target(req, loc, planner)
            pending.append(p)
            if loc.length:
                ranges.append((p.buf.data_ptr(), loc.offset, loc.length))
        if ranges:
            get_engine(self.config).read_into(full, ranges)
        for p in pending:
            if self.config.verify and p.loc.crc32c:
                self._verify(p)
            if p.dst is None:
                planner.load_bytes(p.req, io.BytesIO(ctypes.string_at(p.buf.data_ptr(), p.loc.length) if p.loc.length else b""))
                continue
            if not p.direct:
                src = p.buf.view(name_to_dtype(p.loc.dtype)).reshape(p.loc.shape)
                for dim, (off, length) in enumerate(zip(p.req.storage_offsets, p.req.lengths)):
                    src = src.narrow(dim, off, length)
                p.dst.copy_(src)
            planner.commit_tensor(p.req, p.dst)

    def _target(self, req: ReadItem, loc: ItemLocation, planner: LoadPlanner) -> _Pending:
        if req.type == LoadItemType.BYTE_IO:
            return _Pending(req, loc, torch.empty(loc.length, dtype=torch.uint8), None, False)
        dst = planner.resolve_tensor(req)
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(loc.shape)
        direct = (
            whole
            and dst.device.type == "cpu"
            and dst.is_contiguous()
            and dst.dtype == name_to_dtype(loc.dtype)
            and dst.numel() * dst.element_size() == loc.length
        )
        if direct:
            buf = dst.view(-1).view(torch.uint8) if loc.length else torch.empty(0, dtype=torch.uint8)
            return _Pending(req, loc, buf, dst, True)
        return _Pending(req, loc, torch.empty(loc.length, dtype=torch.uint8), dst, False)

    def _verify(self, p: _Pending) -> None:
        engine = get_engine(self.config)
        base = p.buf.data_ptr()
        for expected, (off, length) in zip(p.loc.crc32c, piece_ranges(p.loc)):
            got = engine.crc32c(base + (off - p.loc.offset), length)
            if got != expected:
                raise ChecksumMismatchError(
                    f"checkpoint {self.path}: checksum mismatch in {p.loc.file}, item "
                    f"{p.req.storage_index.fqn!r} (chunk offsets {list(p.req.storage_index.offset or [])}), "
                    f"bytes [{off}, {off + length}): stored crc32c {expected:#010x}, read {got:#010x}"
                )
