"""TorchTitan integration: ``DataStatesCheckpointManager``.

A subclass of TorchTitan's DCP ``CheckpointManager`` that saves with ``DataStatesWriter`` and
loads with ``DataStatesReader``. Everything else (interval, ``keep_latest_k``, ``load_step``,
resume from the latest step, last-step export, Hugging Face export/import) is TorchTitan's own
code. Select it in a TorchTitan config function (``--module``/``--config`` registry)::

    from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager

    def llama3_8b_datastates() -> Trainer.Config:
        config = llama3_8b()
        config.checkpoint = DataStatesCheckpointManager.Config(
            enable=True, interval=500, async_mode="async", host_cache_size="32GB", flush_threads=4,
        )
        return config

``async_mode`` defaults to ``"async"`` here (TorchTitan's own manager defaults to ``"disabled"``);
``"disabled"`` saves synchronously and says so once in the log. With ``"async"`` a save returns as soon as the copies are enqueued; forward and backward
of the next steps run while the engine copies the state into its host cache and flushes it, and
TorchTitan's ``maybe_wait_for_staging()`` (called right before ``optimizers.step()``) waits only
for the copies (``dcp_datastates.wait_staged()``). ``"async_with_pinned_mem"`` takes the same
path (the DataStates host cache is already pinned; TorchTitan's process-based stager is not used).

Supported TorchTitan: the 0.3.0 release and main (checked at the commit in
``tests/torchtitan_main_commit.txt``). Main keeps the manager only in
``torchtitan.components.checkpointer`` (pytorch/torchtitan#4184 removed the legacy
``torchtitan.components.checkpoint``); 0.3.0 has both, so the new path is tried first.

Importing this module never fails when TorchTitan is missing; using the class then raises an
``ImportError`` that says what to install, or, when TorchTitan is installed but its manager
cannot be imported, which modules were tried and why each failed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..commit import referenced_by
from ..config import DataStatesConfig
from ..format.layout import METADATA_NAME, STEP_NUMBER
from ..format.safe_unpickle import restricted_pickle_loads
from ..planners import DataStatesLoadPlanner, DataStatesSavePlanner
from ..reader import DataStatesReader
from ..runtime.inflight import wait_staged
from ..runtime.process_group import checkpoint_process_group
from ..sizes import cache_size
from ..storage import open_storage
from ..tiers.peers import wait_peer_copies
from ..tiers.restart import prepare_restart
from ..writer import DataStatesWriter
from .torchtitan_import import _import_torchtitan, _missing_error

__all__ = ["DataStatesCheckpointManager", "TORCHTITAN_AVAILABLE", "TORCHTITAN_CHECKPOINT_MODULE", "is_datastates_checkpoint"]

log = logging.getLogger("dcp_datastates")

TORCHTITAN_CHECKPOINT_MODULE, _FOUND, _TRIED = _import_torchtitan()
TORCHTITAN_AVAILABLE = _FOUND is not None
if _FOUND is not None:
    CheckpointManager, AsyncMode, DATALOADER, MODEL, GarbageCollection = _FOUND


def _missing() -> ImportError:
    """What using the manager raises when TorchTitan's could not be imported."""
    return _missing_error(_TRIED)


def is_datastates_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` holds (or is meant to hold) a DataStates checkpoint rather than a stock
    DCP one: its ``.metadata`` is JSON (stock DCP pickles it). A folder without ``.metadata`` also
    counts, so loading it reports an incomplete checkpoint clearly."""
    # Never through a symlink, never blocking on a FIFO planted as the marker.
    try:
        with open_storage(os.fspath(path)).open_read(METADATA_NAME) as f:
            head = f.read(64)
    except FileNotFoundError:
        return True
    except Exception:  # noqa: BLE001 - unreadable, or the store's own error: DataStatesReader says what is wrong
        return True
    return head.lstrip().startswith(b"{")


if TORCHTITAN_AVAILABLE:

    class DataStatesCheckpointManager(CheckpointManager):
        """TorchTitan ``CheckpointManager`` that checkpoints through DataStates.

        Overrides the storage hooks, ``dcp_save`` (DataStatesWriter and DataStatesSavePlanner,
        lazy staging with ``async_mode="async"``), ``dcp_load`` (DataStatesReader and
        DataStatesLoadPlanner; stock DCP and Hugging Face checkpoints still load through
        TorchTitan's code) and ``_maybe_wait_for_staging``, and
        besides them ``_find_load_step`` and ``close``.
        """

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            """TorchTitan's checkpoint options plus the DataStates engine's.

            Unset (None) DataStates options keep the value of ``datastates_config`` (when given)
            or the library default (see docs/configuration.md).
            """

            async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
            """TorchTitan's option, with the lazy asynchronous path as this manager's default
            (TorchTitan's own manager defaults to "disabled"). "disabled" saves synchronously
            (logged once); "async_with_pinned_mem" is the same as "async" here."""

            host_cache_size: str | None = None
            """Host memory the engine preallocates once and reuses, e.g. "16GB" or "512MiB"; a
            unitless number is GiB below 65536 and bytes from it up. Default: a quarter of the
            node's memory split between its local ranks (docs/configuration.md)."""

            pin_host_cache: bool | None = None
            """Page-lock the host cache (cudaHostRegister) when CUDA is present. Default: true."""

            copy_threads: int | None = None
            """Threads copying tensors into the host cache. Default: 2."""

            flush_threads: int | None = None
            """Threads writing the host cache to storage. Default: 2."""

            verify_checksums: bool | None = None
            """Check every item's CRC32C (recorded at save) when loading. Default: true."""

            sync_files: bool | None = None
            """fsync data files and the .metadata commit marker. Default: true."""

            dedup_replicated: bool | None = None
            """Write each replicated tensor (DTensor replicas, plain tensors several ranks hold)
            once in total. Default: true (pipeline parallelism included: DCP's planner picks the
            writer). Non-tensor values such as the per-rank dataloader state are written by
            every rank (DCP picks one copy)."""

            local_tier: str | None = None
            """A node-local folder (NVMe, tmpfs): each checkpoint is committed there first and
            drained in the background to ``checkpoint.folder``; resuming reads each file from the
            nearest verified copy (docs/how-it-works.md, Node-local tier). Default: off."""

            keep_local: int | None = None
            """Checkpoints kept in ``local_tier`` (newest first; older ones are removed once
            drained, never before). ``keep_latest_k`` still governs the durable folder. Default: 2."""

            peer_copies: int | None = None
            """With ``local_tier``: 1 copies each rank's files of every checkpoint, verified, into
            the local tier of a rank on another node, in the background (a lost node then loses
            no file the other nodes cannot serve; docs/how-it-works.md, Node-local tier).
            Default: 0 (off)."""

            incremental: bool | None = None
            """Write a tensor only when its bytes changed since the newest checkpoint in
            ``checkpoint.folder`` (frozen weights, adapters' base model: written once); every
            checkpoint still loads strictly. ``keep_latest_k`` then keeps an older checkpoint
            for as long as a kept one refers to it. With ``local_tier``, references name durable
            files (local copies hold what their save wrote). Default: off."""

            stall_timeout: float | None = None
            """Seconds a save waits on a rank that shows no progress (its node frozen or cut
            off) before it fails on every surviving rank; the async saves' gloo group times out
            after it too (docs/configuration.md, "When a node stops"). Default: 300."""

            trust_checkpoints: bool = False
            """Allow resuming from checkpoints whose values need arbitrary unpickling: stock DCP
            checkpoints (pickled .metadata) and values outside PyTorch's restricted unpickler.
            This runs code from the checkpoint: only for checkpoints you wrote or trust."""

            close_timeout: float = 600.0
            """Seconds ``close()`` waits for the checkpoint still in flight to be committed (so a
            run's last asynchronous checkpoint is not lost when the trainer exits); logged, and
            on timeout the previous checkpoint stays the newest."""

            datastates_config: str | None = None
            """Optional YAML/JSON file with a Nanotron-style ``datastates:`` block or a
            DeepSpeed-style ``datastates_ckpt`` section; the options above override it."""

            def __post_init__(self) -> None:
                # Explicit base call: zero-argument super() does not work in slots dataclasses.
                CheckpointManager.Config.__post_init__(self)
                # Reject bad options when the config is built.
                self.to_datastates_config()

            def to_datastates_config(self) -> DataStatesConfig:
                """The ``DataStatesConfig`` these options describe."""
                base = DataStatesConfig.from_file(self.datastates_config) if self.datastates_config else DataStatesConfig()
                options: dict[str, Any] = {}
                if self.host_cache_size is not None:
                    options["host_cache_size"] = cache_size(self.host_cache_size, "checkpoint.host_cache_size")
                for ours, theirs in (
                    ("pin_host_cache", "pin_host_cache"),
                    ("copy_threads", "copy_threads"),
                    ("flush_threads", "flush_threads"),
                    ("verify_checksums", "verify"),
                    ("sync_files", "sync_files"),
                    ("dedup_replicated", "dedup_replicated"),
                    ("local_tier", "local_tier"),
                    ("keep_local", "keep_local"),
                    ("peer_copies", "peer_copies"),
                    ("incremental", "incremental"),
                    ("stall_timeout", "stall_timeout"),
                ):
                    value = getattr(self, ours)
                    if value is not None:
                        options[theirs] = value
                try:
                    return DataStatesConfig.resolve(base, options)
                except ValueError as exc:
                    raise ValueError(f"checkpoint config: {exc}") from None

            @classmethod
            def from_base(cls, base: "CheckpointManager.Config", **datastates_options: Any) -> "DataStatesCheckpointManager.Config":
                """This Config with every TorchTitan option copied from ``base`` (e.g. the
                ``checkpoint`` of an existing config function), plus DataStates options."""
                values = {f.name: getattr(base, f.name) for f in fields(base) if f.init}
                values.update(datastates_options)
                return cls(**values)

        def __init__(self, config: Config, **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            self.trust_checkpoints = bool(config.trust_checkpoints)
            self.close_timeout = float(config.close_timeout)
            if not self.enable:
                return
            self.datastates_config = config.to_datastates_config()
            self.staging_completion = None
            if getattr(self, "purge_queue", None) is not None:
                _keep_referenced(self.purge_queue)
            if self.async_mode == AsyncMode.DISABLED:
                log.info(
                    "dcp_datastates: checkpoint.async_mode=disabled: saves are synchronous (training waits "
                    "for each checkpoint to be durable); set async_mode=async for lazy asynchronous saves"
                )
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                log.info(
                    "dcp_datastates: async_mode=async_with_pinned_mem uses lazy staging into the "
                    "pinned DataStates host cache (same as async_mode=async)"
                )
                self.async_mode = AsyncMode.ASYNC
            # TorchTitan's gloo group for async saves: bounded like ours.
            if self.pg is not None:
                self.pg = checkpoint_process_group(self.datastates_config)

        @torch.no_grad()
        def dcp_save(
            self,
            state_dict: dict[str, Any],
            checkpoint_id: str,
            async_mode: "AsyncMode",
            enable_garbage_collection: bool = False,
            to_hf: bool = False,
        ):
            """Save with DataStatesWriter. Returns None (synchronous) or the upload Future
            (asynchronous, what TorchTitan's ``_save`` keeps as ``save_future``)."""
            # Hugging Face export: TorchTitan's own writer.
            if to_hf:
                return CheckpointManager.dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
            # The checkpoint's own group: write results are consolidated rank -> node leader ->
            # coordinator on it, never on the training group.
            writer = DataStatesWriter(checkpoint_id, config=self.datastates_config, process_group=self.pg)
            # Our planner: steady-state saves reuse the cached plans (DCP's default planner makes
            # every save a first save, minutes on the coordinator at a thousand ranks).
            planner = DataStatesSavePlanner()
            ret = None
            if async_mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
                resp = dcp.async_save(
                    state_dict, storage_writer=writer, planner=planner, checkpoint_id=checkpoint_id, process_group=self.pg
                )
                staging = getattr(resp, "staging_completion", None)
                self.staging_completion = staging
                ret = getattr(resp, "upload_completion", resp)
            else:
                dcp.save(state_dict, storage_writer=writer, planner=planner, checkpoint_id=checkpoint_id, process_group=self.pg)
            if enable_garbage_collection:
                GarbageCollection.collect("GC collection invoked by checkpointer.")
            return ret

        def _find_load_step(self, folder: str = "") -> int:
            """With ``peer_copies``: the step every rank agrees to resume from, with the files its
            node lacks pulled from the other nodes' copies (``prepare_restart``; it also finds a
            checkpoint committed only on the nodes' local tiers). Otherwise TorchTitan's own."""
            config = getattr(self, "datastates_config", None)
            if folder or config is None or not config.peer_copies or not torch.distributed.is_initialized():
                return CheckpointManager._find_load_step(self, folder)
            path = prepare_restart(self.folder, local_tier=config.local_tier, config=config)
            if path is None:
                return -1
            match = STEP_NUMBER.search(os.path.basename(path.rstrip("/")))
            return int(match.group(1)) if match else -1

        def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
            """Load with DataStatesReader; stock DCP and Hugging Face checkpoints (an
            ``initial_load_path``, a seed checkpoint) go through TorchTitan's loader."""
            trusted = bool(getattr(self, "trust_checkpoints", False))
            if from_hf or (trusted and not is_datastates_checkpoint(checkpoint_id)):
                # Hugging Face weights (safetensors), or a stock DCP checkpoint the user trusts
                # (its .metadata is a pickle): TorchTitan's own loader.
                return CheckpointManager.dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized)
            reader = DataStatesReader(checkpoint_id, config=self.datastates_config, trusted=trusted)
            if not trusted and hasattr(state_dict.get(DATALOADER), "load_state_dict"):
                state_dict = dict(state_dict)
                state_dict[DATALOADER] = _RestrictedStateful(state_dict[DATALOADER], str(checkpoint_id))
            # Our planner: each rank's load plan compares its chunks with the saved ones near them,
            # not all of them, and a mismatch is named before any byte is read.
            dcp.load(state_dict, storage_reader=reader, planner=DataStatesLoadPlanner(), checkpoint_id=checkpoint_id)
            # The model's state is flattened into state_dict: hand it back to the model.
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(state_dict)

        def close(self) -> None:
            """Wait (at most ``close_timeout`` seconds, logged) for the checkpoint in flight to be
            committed, then release TorchTitan's resources. TorchTitan's own ``close()`` does
            not wait, so the last asynchronous checkpoint of a run would be lost at exit."""
            if getattr(self, "enable", False):
                self._wait_in_flight_at_close()
                if self.datastates_config.peer_copies and not wait_peer_copies(self.close_timeout):
                    log.warning("dcp_datastates: closing: the last checkpoint's peer copies did not end within %.0f s",
                                self.close_timeout)
            super().close()

        def _wait_in_flight_at_close(self) -> None:
            future = getattr(self, "save_future", None)
            if future is None or future.done():
                return
            timeout = getattr(self, "close_timeout", 600.0)
            log.info("dcp_datastates: closing: waiting up to %.0f s for the checkpoint in flight to be committed", timeout)
            t0 = time.monotonic()
            try:
                future.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                log.warning(
                    "dcp_datastates: the checkpoint in flight was not committed within close_timeout=%.0f s; "
                    "closing anyway (the previous checkpoint stays the newest)", timeout,
                )
                return
            except (Exception, CheckpointException) as exc:
                # DCP's error is a BaseException.
                log.error("dcp_datastates: the checkpoint in flight failed; the previous checkpoint stays the newest: %s", exc)
                self.save_future = None
                return
            self.save_future = None
            log.info("dcp_datastates: the checkpoint in flight was committed (waited %.1f s at close)", time.monotonic() - t0)

        def _maybe_wait_for_staging(self) -> None:
            """Called by the trainer right before ``optimizers.step()``: wait until every
            in-flight checkpoint's bytes are in the host cache. Errors surface from the save
            future (``maybe_wait_for_saving``), as TorchTitan expects."""
            wait_staged()
            self.staging_completion = None

    def _keep_referenced(purge_queue) -> None:
        """TorchTitan queues each folder ``keep_latest_k`` drops for its purge thread: a folder
        that a kept incremental checkpoint refers to (``referenced_by``) is not queued.
        TorchTitan lists it again at its next save and it goes once nothing refers to it. Asked
        when the folder is queued, on the caller's thread (a read of the other checkpoints'
        markers, once per save that purges): the purge thread is already waiting in the
        queue's ``get`` when this manager is built, so a check there would miss the first one.
        A save in flight builds on the newest committed checkpoint, which ``keep_latest_k`` >= 2
        keeps, so it never refers to a folder queued here."""
        put = purge_queue.put

        def put_unreferenced(path, *args: Any, **kwargs: Any) -> None:
            if path is not None:
                try:
                    users = referenced_by(path)
                except Exception as exc:  # noqa: BLE001 - unknown: keep it rather than guess
                    log.warning("dcp_datastates: keep_latest_k keeps %s: cannot tell what refers to it (%s)", path, exc)
                    return
                if users:
                    log.info("dcp_datastates: keep_latest_k keeps %s: incremental checkpoint(s) %s refer to it",
                             path, ", ".join(users))
                    return
            put(path, *args, **kwargs)

        purge_queue.put = put_unreferenced

    class _RestrictedStateful:
        """Wraps TorchTitan's dataloader for a load: its ``load_state_dict`` calls
        ``pickle.loads`` on the bytes stored per data-parallel rank, so each bytes value is first
        decoded with the restricted unpickler (numbers, strings, containers, CPU tensors): a
        value that would import anything else is refused before the dataloader sees it."""

        def __init__(self, inner: Any, checkpoint: str) -> None:
            self.inner, self.checkpoint = inner, checkpoint

        def state_dict(self) -> dict:
            return self.inner.state_dict()

        def load_state_dict(self, state_dict: dict) -> None:
            for key, value in (state_dict or {}).items():
                if isinstance(value, (bytes, bytearray)):
                    restricted_pickle_loads(bytes(value), checkpoint=self.checkpoint, item=f"item '{DATALOADER}.{key}'")
            self.inner.load_state_dict(state_dict)

else:

    class DataStatesCheckpointManager:  # type: ignore[no-redef]
        """Placeholder: TorchTitan is not importable here."""

        class Config:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise _missing()

            @classmethod
            def from_base(cls, *args: Any, **kwargs: Any):
                raise _missing()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise _missing()
