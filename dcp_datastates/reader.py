"""DataStatesReader: a DCP StorageReader for checkpoints written by DataStatesWriter.

This module only answers DCP; the load reads top to bottom:

1. ``read_metadata``: the tier chooses the copy to read (``tiers``: the node-local copy
   when complete and verified, else the durable one), the commit protocol reads and checks its
   marker (``commit.read_commit``);
2. ``read_data``: for each data file this rank needs, its size is checked
   (``commit.check_data_files``), then ``load.read``: targets, reads through the storage with
   every piece verified, delivery to DCP's planner. The tier's ``NodeCopies`` is asked first
   for each file (this node's local copy, when the local tier holds one for the same
   checkpoint); the durable file is read when it says no.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .commit import by_folder, data_file, file_size_error, is_committed, read_commit
from .config import DataStatesConfig
from .errors import CheckpointFormatError, IncompleteCheckpointError, record_metadata_read
from .format.dcp_plans import wire_load_plan
from .format.layout import rank_marker_name
from .format.locations import FileInfo, ItemLocation
from .load import read
from .runtime import get_engine
from .runtime.gc_pause import gc_paused, pause_collector
from .runtime.inflight import wait_staged
from .save import global_rank_world
from .storage import is_supported_url, normalize, open_storage
from .tiers import ReadPlan, tier_for
from .tiers.node_copies import NodeCopies

log = logging.getLogger("dcp_datastates")

# A load's pause of the cyclic GC ends after read_data, or after this long: a load DCP gave up on
# between read_metadata and read_data, or a caller that reads the metadata alone (Megatron's
# integration does) must not keep the collector paused (young collections still run meanwhile,
# runtime/gc_pause.py). Planning between the two takes DCP's default load planner tens of
# seconds at thousands of ranks (it makes an object per saved chunk of every tensor, and full
# collections walking them would add to that); a longer one merely loses the pause.
LOAD_GC_PAUSE_MAX_S = 120.0

__all__ = ["DataStatesReader"]


class _StorageIndex(dict):
    """``Metadata.storage_data``: MetadataIndex -> ItemLocation, plus the per-file table
    (kept as an attribute so it travels with the metadata when DCP broadcasts it)."""

    files: dict[str, FileInfo]


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
        self.tier = tier_for(self.config)
        # The exception the last failed read_metadata raised: DCP replaces it by an
        # AssertionError (2.9: a bare one), so errors.checkpoint_error_cause recovers it from here.
        self.metadata_error: BaseException | None = None
        self.path = self.durable_path = normalize(path)
        self.storage_data: _StorageIndex | None = None
        self.rank = 0
        # Python's cyclic GC paused for the load in progress (runtime/inflight.py).
        self._load_pause = None
        # As FileSystemReader: one per load, in storage_meta.load_id.
        self.load_id = uuid.uuid4().hex
        self._reset_load()

    def _reset_load(self) -> None:
        self._plan = ReadPlan(self.path) if self.path is not None else None
        self._storage = None
        # Where references resolve when not beside self.path (_read_metadata).
        self._beside = None
        # The durable data files' sizes, read once per read_data.
        self._sizes: dict[str, int] = {}
        # This node's copies of the data files (the tier's: node_copies).
        self._copies = NodeCopies()

    @property
    def tier_reads(self) -> dict[str, int]:
        """How many data files this load read from each tier ("local", "durable")."""
        return self._copies.reads

    # ---------------------------------------------------------------------------- StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = self.durable_path = normalize(checkpoint_id)
        self.storage_data = None
        self.load_id = uuid.uuid4().hex
        self._reset_load()

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP's load reads the global metadata, then (when that failed) the rank-local one: the
        # first failure is the one that says what is wrong with the checkpoint.
        fallback = kwargs.get("rank") is not None and self.metadata_error is not None
        # The load's objects (the decoded metadata, DCP's load plan, our read items: several per
        # item) live until dcp.load returns: no collection sees them (runtime/inflight.py). Ended after
        # read_data, or here when the load fails.
        self._end_load_pause()
        self._load_pause = pause_collector(LOAD_GC_PAUSE_MAX_S)
        try:
            md = self._read_metadata(kwargs.get("rank"))
        except BaseException as exc:
            self._end_load_pause()
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
        if rank is None:
            self._plan = self.tier.choose(self.durable_path)
            self.path = self._plan.path
        self._storage = open_storage(self.path, self.config.storage_options)
        # An incremental save's references name files of the durable checkpoints beside the
        # durable path, also when this is a node-local copy.
        self._beside = None if self.path == self.durable_path else open_storage(self.durable_path,
                                                                                self.config.storage_options)
        if self._plan.pending is not None:
            # Several ranks: committed on the local tiers, not drained yet.
            md, files = self._plan.pending
            self._copies = self.tier.node_copies(self._plan, self._plan.pending_id, global_rank_world()[0])
            return self._with_index(md, files)
        if rank is None and dist.is_available() and dist.is_initialized():
            # A rank-local checkpoint (saved with use_collectives=False): each rank reads its own
            # commit, unless the folder holds one committed by all ranks together.
            own = rank_marker_name(dist.get_rank())
            if not is_committed(self._storage) and self._storage.has(own):
                rank = dist.get_rank()
        md, files = read_commit(self._storage, rank=rank)
        if rank is None:
            self._copies = self.tier.node_copies(self._plan, md.storage_meta.save_id if md.storage_meta else None,
                                                 global_rank_world()[0])
        return self._with_index(md, files)

    def _with_index(self, md: Metadata, files: dict[str, FileInfo]) -> Metadata:
        index = md.storage_data
        if type(index) is dict:
            # Version 1/2 decode; a packed table's mapping already is one.
            index = _StorageIndex(index)
        index.files = files
        # Names this folder in planner errors (it may have moved).
        index.checkpoint_path = self.path
        md.storage_data = index
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        # Stock DCP's readers say which load read the metadata.
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        if kwargs.get("rank") is not None:
            self.rank = int(kwargs["rank"])
        elif dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
        if self._storage is None:
            # DCP broadcast the metadata: this rank read none.
            self._storage = open_storage(self.path, self.config.storage_options)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # DCP gathers it at the coordinator, pickled: packed (format/dcp_plans.py).
        return wire_load_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # DCP scatters them to the ranks, pickled: packed.
        return [wire_load_plan(p) for p in plans]

    def _end_load_pause(self, after: float = 0.0) -> None:
        pause, self._load_pause = self._load_pause, None
        if pause is not None:
            pause.release(after)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        try:
            return self._read_data(plan, planner)
        finally:
            # DCP's plan is freed once dcp.load returns, right after.
            self._end_load_pause(after=0.25)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        # The targets may be the very tensors a lazy save of this process still copies (a restore
        # right after a save): the reads below would change them under that save, bumping no
        # version its guard could see. Wait for its staging first, as an optimizer step does.
        wait_staged()
        # read_metadata's pause may be over (a reader used outside dcp.load).
        with gc_paused():
            by_file: dict[str, list[tuple[ReadItem, ItemLocation]]] = defaultdict(list)
            for req in plan.items:
                loc = self._location(req)
                by_file[loc.file].append((req, loc))
            # The sizes of the durable files this rank reads: one listing on an object store, one
            # lstat per file here (never the other ranks' files).
            self._sizes = self._file_sizes([n for n in by_file if not self._copies.holds(n)])
            staging = read.DeviceStaging()
            for name, items in by_file.items():
                self._read_file(name, items, planner, staging)
            staging.finish()
        self._copies.log_reads(self.durable_path, self.config.local_tier)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Local paths, ``file://`` and any URL whose protocol fsspec knows."""
        return is_supported_url(checkpoint_id)

    # ------------------------------------------------------------------------------ one file
    def _location(self, req: ReadItem) -> ItemLocation:
        try:
            return self.storage_data[req.storage_index]
        except (KeyError, TypeError):
            raise CheckpointFormatError(
                f"checkpoint {self.path}: no stored location for item {req.storage_index.fqn!r} "
                f"at offset {list(req.storage_index.offset or [])}"
            ) from None

    def _read_file(self, name: str, items: list[tuple[ReadItem, ItemLocation]], planner: LoadPlanner,
                   staging: read.DeviceStaging) -> None:
        if not self._copies.usable(name, self.storage_data.files.get(name)):
            # Before any buffer is allocated for what the metadata claims.
            self._check_file(name)
        pending = read.targets(items, planner, verify=self.config.verify)
        host = [p for p in pending if not p.staged]
        self._read(name, [p for p in host if p.nbytes])
        read.deliver(host, planner, trusted=self.trusted, checkpoint=str(self.path))
        # The staged ones: CUDA destinations.
        for batch in staging.batches([p for p in pending if p.staged]):
            self._read(name, batch)
            staging.copy(batch, planner)
        self._copies.served(name)

    def _read(self, name: str, reading: list) -> None:
        """Fill ``reading`` from this node's copy of data file ``name`` while it reads well
        (the tier's ``NodeCopies``), else from the durable file."""
        engine = get_engine(self.config)
        if self._copies.read(name, reading, engine, self.config.read_threads):
            return
        self._check_file(name)
        # A reference: an earlier checkpoint's file.
        folder, own = data_file(self._storage, name, self._beside)
        read.read_targets(folder, own, reading, engine, verify=self.config.verify,
                          threads=self.config.read_threads, checkpoint=self.path)

    def _file_sizes(self, names: list[str]) -> dict[str, int]:
        """Sizes of the durable data files ``names`` (as the metadata lists them): one listing per
        folder on an object store, one lstat per file here."""
        sizes: dict[str, int] = {}
        for folder, own in by_folder(self._storage, names, self._beside):
            sizes.update((own[n], size) for n, size in folder.sizes(own).items())
        return sizes

    def _check_file(self, name: str) -> None:
        """The durable data file exists with its recorded size (``read_data`` read the sizes)."""
        info = self.storage_data.files.get(name)
        if info is None:
            return
        if name not in self._sizes:
            # A local copy that failed, or absent: ask for this one.
            self._sizes.update(self._file_sizes([name]))
        folder, own = data_file(self._storage, name, self._beside)
        exc = file_size_error(self.path, name, self._sizes.get(name), info.size, location=folder.where(own))
        if exc is not None:
            if self._plan.pending_id is None:
                raise exc
            raise IncompleteCheckpointError(
                f"checkpoint {self._plan.pending_id} of {self.durable_path} is committed only on the nodes' local tiers "
                f"(its drain did not finish), and rank {self.rank} needs data file {name}, which is neither on this "
                f"node's local tier ({self.config.local_tier}) nor drained yet: restart on the nodes that wrote it, "
                f"or load the newest durable checkpoint (dcp_datastates.latest_checkpoint(root) without local_tier). "
                f"({exc})"
            ) from exc

