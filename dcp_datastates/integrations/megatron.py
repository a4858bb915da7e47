"""Megatron-core integration: DataStates as a ``megatron.core.dist_checkpointing`` backend.

A save strategy and a load strategy for Megatron-core's distributed checkpointing (tested with
megatron-core 0.16.1). They translate Megatron's ``ShardedTensor`` / ``ShardedObject`` state dict
into DCP's form with Megatron's own helpers and planners, then save with ``DataStatesWriter``
(``dcp.async_save`` for an asynchronous save, ``dcp.save`` for a synchronous one) and load with
``DataStatesReader``. Importing this module registers both under the backend name
``"datastates"``; a checkpoint saved with it records that name in Megatron's ``metadata.json``,
so ``dist_checkpointing.load`` picks the load strategy by itself::

    from megatron.core import dist_checkpointing
    from dcp_datastates.integrations.megatron import register_strategies

    ckpt_group = torch.distributed.new_group(backend="gloo")   # on every rank
    save_strategy, _ = register_strategies(process_group=ckpt_group, host_cache_size="32GB")

    request = dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=save_strategy,
                                      async_sharded_save=True)
    ...  # schedule it on Megatron's AsyncCallsQueue (CUDA only), or request.execute_sync()
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)

Checkpoint collectives run on their own gloo group (``process_group``; one is created on every
rank at the first save or load when none is given). They must not share a group with
Megatron's: an asynchronous save plans and commits on DCP's thread while Megatron's main
thread runs ``barrier()`` on the default group, and on one group the two calls pair up wrongly
and hang.

The ``AsyncRequest`` of an asynchronous save carries no data: the copies are already enqueued in
this process's engine when ``async_save`` returns. Its ``async_fn`` only waits for the upload to
finish, so it can run in the process that made the save (``execute_sync``) or in the helper
process Megatron's ``AsyncCallsQueue`` forks or spawns (there it watches for a flag file this
process writes when the upload finishes; ``wait_in_async_fn=False`` leaves ``async_fn`` None, so
no helper process is started and the finalize function waits instead). Its finalize function
re-raises the save's error, if any, on every rank, before Megatron writes ``metadata.json``.

Importing this module never fails when Megatron-core is missing; using the classes then raises an
``ImportError`` that says what to install.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import tempfile
import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from .. import DataStatesReader, DataStatesWriter
from ..forking import new_locks_in_child

__all__ = [
    "BACKEND",
    "VERSION",
    "MEGATRON_AVAILABLE",
    "DataStatesSaveShardedStrategy",
    "DataStatesLoadShardedStrategy",
    "register_strategies",
]

log = logging.getLogger("dcp_datastates")

#: The sharded backend name Megatron records in metadata.json.
BACKEND = "datastates"
VERSION = 1

# Megatron-core is optional.
try:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import CheckpointingException, ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as _mcore_dcp
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.base import (
        AsyncSaveShardedStrategy,
        LoadShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )

    _IMPORT_ERROR: BaseException | None = None
except Exception as _exc:  # noqa: BLE001 - ImportError, or a megatron-core incompatible with this torch
    _IMPORT_ERROR = _exc
    # Placeholders: the classes refuse to be made.
    AsyncSaveShardedStrategy = LoadShardedStrategy = object

MEGATRON_AVAILABLE = _IMPORT_ERROR is None


def _require() -> None:
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "dcp_datastates.integrations.megatron needs megatron-core, which could not be imported "
            f"({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}). Install it next to your torch with "
            '`pip install "dcp_datastates[megatron]"` (megatron-core==0.16.1 and psutil).'
        )


# ------------------------------------------------------------------------------ process group
_group_lock = threading.Lock()
new_locks_in_child(globals(), "_group_lock")
_shared_group: Any = None


def _checkpoint_group(given):
    """The group the checkpoint's collectives run on: ``given``, or one gloo group for all
    strategies of this process, created at the first save or load (every rank gets there at the
    same point of the run, as ``new_group`` needs)."""
    global _shared_group
    if given is not None:
        return given
    with _group_lock:
        if _shared_group is None:
            _shared_group = dist.new_group(backend="gloo")
            log.info("dcp_datastates: Megatron checkpoints use a new gloo process group for their collectives")
        return _shared_group


# ------------------------------------------------------------------------------ async requests
# Token -> upload future, in the saving process.
_uploads: dict[str, concurrent.futures.Future] = {}


def _flag_path(token: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"dcp-datastates-megatron-{token}.done")


def _touch(path: str) -> None:
    try:
        with open(path, "wb"):
            pass
    except OSError as exc:
        # The helper process then waits until the owner is gone.
        log.warning("dcp_datastates: cannot write the upload flag %s: %s", path, exc)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_upload(token: str, owner_pid: int, poll_s: float = 0.05) -> None:
    """``async_fn`` of the ``AsyncRequest``: return once the save ``token`` has finished uploading
    (committed or failed; the finalize function tells which). In the saving process it waits on
    the upload future; in another process (Megatron's ``AsyncCallsQueue`` runs ``async_fn`` in a
    forked or spawned one) it waits for the flag file the saving process writes on completion,
    and stops waiting when that process is gone."""
    if os.getpid() == owner_pid:
        future = _uploads.get(token)
        if future is not None:
            concurrent.futures.wait([future])
        return
    flag = _flag_path(token)
    while not os.path.exists(flag):
        if not _process_alive(owner_pid):
            return
        time.sleep(poll_s)


def _tracked_request(response, *, rank: int, wait_in_async_fn: bool) -> AsyncRequest:
    """An ``AsyncRequest`` for the upload of ``response`` (``dcp.async_save``'s result)."""
    upload = getattr(response, "upload_completion", response)
    # No helper process: the finalize function waits for the upload.
    if not wait_in_async_fn:
        return AsyncRequest(None, (), [upload.result])
    token = f"{os.getpid()}-{rank}-{uuid.uuid4().hex}"
    flag = _flag_path(token)
    flagged = threading.Event()
    _uploads[token] = upload

    def on_done(_) -> None:
        _touch(flag)
        flagged.set()

    upload.add_done_callback(on_done)

    def finalize() -> None:
        try:
            # Raises the save's CheckpointException, on every rank.
            upload.result()
        finally:
            # the future wakes its waiters before it runs its callbacks: let on_done write the
            # flag before it is removed
            flagged.wait(60)
            _uploads.pop(token, None)
            _remove(flag)

    return AsyncRequest(wait_for_upload, (token, os.getpid()), [finalize])


# ------------------------------------------------------------------------------ strategies
class DataStatesSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Megatron save strategy writing with ``DataStatesWriter``.

    Args:
        backend, version: what Megatron records in ``metadata.json`` (the load strategy must be
            registered under the same pair where the checkpoint is loaded).
        process_group: the group for the checkpoint's collectives: a dedicated gloo group, never
            the default group (see the module docstring). None: one is created at the first save.
        wait_in_async_fn: True (default): the ``AsyncRequest``'s ``async_fn`` waits for the upload,
            so Megatron's ``AsyncCallsQueue`` (which runs it in a helper process) reports the
            save done only once it is durable, and its non-blocking polls do not wait. False:
            ``async_fn`` is None (the queue starts no process) and the finalize function waits
            instead, so the first poll after the save blocks until the upload is done.
        config, **options: ``DataStatesConfig`` for the writer (e.g. ``host_cache_size="32GB"``).
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, process_group=None,
                 wait_in_async_fn: bool = True, config=None, **options: Any):
        _require()
        super().__init__(backend, version)
        self.process_group = process_group
        self.wait_in_async_fn = bool(wait_in_async_fn)
        self.config = config
        self.options = options

    @property
    def can_handle_sharded_objects(self) -> bool:
        # ShardedObjects travel as DCP byte items, one per rank.
        return True

    def _prepare(self, sharded_state_dict, checkpoint_dir):
        group = _checkpoint_group(self.process_group)
        if group is dist.group.WORLD:
            raise ValueError(
                "DataStatesSaveShardedStrategy needs a process group of its own (e.g. "
                "torch.distributed.new_group(backend='gloo')): on the default group Megatron's "
                "barrier() and DCP's background collectives hang"
            )
        # Megatron's translation: ShardedTensors become DCP-checkpointable tensors keyed by their
        # global key (only main replicas, so each shard is written once), ShardedObjects bytes.
        by_key, _, _ = _mcore_dcp._replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        state = _mcore_dcp.mcore_to_pyt_state_dict(by_key, False)
        planner = _mcore_dcp.MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
        writer = DataStatesWriter(os.fspath(checkpoint_dir), config=self.config, process_group=group, **self.options)
        return state, writer, planner, group

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        """Enqueue the copies (lazy staging) and the upload; return a request that waits for it."""
        state, writer, planner, group = self._prepare(sharded_state_dict, checkpoint_dir)
        response = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=group)
        return _tracked_request(response, rank=dist.get_rank(), wait_in_async_fn=self.wait_in_async_fn)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        """Save synchronously (``dcp.save``): the checkpoint is committed on return."""
        state, writer, planner, group = self._prepare(sharded_state_dict, checkpoint_dir)
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group)


class DataStatesLoadShardedStrategy(LoadShardedStrategy):
    """Megatron load strategy reading with ``DataStatesReader`` (any sharding, any world size).

    Args:
        backend, version: the backend and version this strategy accepts in ``metadata.json``.
        process_group: group for the load's collectives (None: the shared checkpoint group).
        trusted: passed to ``DataStatesReader``: unpickle ShardedObjects without the restricted
            unpickler (runs code from the checkpoint; only for checkpoints you trust).
        config, **options: ``DataStatesConfig`` for the reader (e.g. ``read_threads=8``).
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, process_group=None, trusted: bool = False,
                 config=None, **options: Any):
        _require()
        super().__init__()
        self.backend = backend
        self.version = version
        self.process_group = process_group
        self.trusted = trusted
        self.config = config
        self.options = options

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend) -> None:
        if loaded_backend != self.backend:
            raise CheckpointingException(
                f"checkpoint saved with the {loaded_backend!r} backend; DataStatesLoadShardedStrategy reads {self.backend!r} ones"
            )

    def check_version_compatibility(self, loaded_version) -> None:
        if loaded_version != self.version:
            raise CheckpointingException(f"{self.backend!r} checkpoint version {loaded_version} is not supported (only {self.version})")

    def _reader(self, checkpoint_dir) -> DataStatesReader:
        return DataStatesReader(os.fspath(checkpoint_dir), config=self.config, trusted=self.trusted, **self.options)

    def load(self, sharded_state_dict, checkpoint_dir):
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        planner = _mcore_dcp.MCoreLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
        )
        by_key, flat_mapping, rename_mapping = _mcore_dcp._replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        state = _mcore_dcp.mcore_to_pyt_state_dict(by_key, True)
        dcp.load(state, storage_reader=self._reader(checkpoint_dir), planner=planner,
                 process_group=_checkpoint_group(self.process_group))
        # back to Megatron's layout: tensors (or the unpickled objects) under the caller's keys
        loaded = {key: _mcore_dcp._unwrap_pyt_sharded_tensor(value) for key, value in state.items()}
        result = _mcore_dcp._replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _mcore_dcp._restore_dict_types(result, sharded_state_dict)
        return result

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        """Global shape and dtype of every tensor (``ShardedTensor``s without data)."""
        metadata = metadata if metadata is not None else self._reader(checkpoint_dir).read_metadata()
        out = {}
        for key, item in metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                empty = torch.empty(item.size, dtype=item.properties.dtype, device="meta")
                out[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir):
        """``load_tensors_metadata`` plus the ShardedObjects (byte items), without data."""
        metadata = self._reader(checkpoint_dir).read_metadata()
        out = {}
        for key, item in metadata.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out


def register_strategies(*, backend: str = BACKEND, version: int = VERSION, process_group=None, config=None,
                        trusted: bool = False, wait_in_async_fn: bool = True, **options: Any):
    """Register a DataStates save and load strategy as Megatron's defaults for ``(backend, version)``
    and return them ``(save, load)``. ``dist_checkpointing.save(..., sharded_strategy=(backend,
    version))`` or the returned save strategy saves with DataStates; ``dist_checkpointing.load``
    picks the load strategy from the checkpoint's ``metadata.json``. Importing this module already
    registered defaults (own gloo group made on first use, library default options); call this
    on every rank to pass a process group or options."""
    _require()
    save = DataStatesSaveShardedStrategy(backend, version, process_group=process_group, wait_in_async_fn=wait_in_async_fn,
                                         config=config, **options)
    load = DataStatesLoadShardedStrategy(backend, version, process_group=process_group, trusted=trusted, config=config, **options)
    register_default_strategy(StrategyAction.SAVE_SHARDED, backend, version, save)
    register_default_strategy(StrategyAction.LOAD_SHARDED, backend, version, load)
    return save, load


if MEGATRON_AVAILABLE:
    register_strategies()
