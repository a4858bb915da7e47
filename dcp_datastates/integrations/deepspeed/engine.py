"""``DataStatesCheckpointEngine``: DeepSpeed's checkpoint engine interface on the DataStates engine.

DeepSpeed's ``save_checkpoint`` calls ``create(info)``, then ``save(state_dict, path)`` once per
file this rank writes; the wrapper that ``initialize`` puts around ``save_checkpoint`` then calls
``submit()``, which hands all of this rank's files of the tag to ``dcp.async_save`` as one
checkpoint in ``<save_dir>/<tag>/`` (every rank takes part, on the engine's own gloo group).
``submit`` returns once the copies are requested: forward and backward of the next steps run
while the engine copies the state into its host cache and flushes it. The engine is *decoupled*
(``is_decoupled()``): DeepSpeed calls ``commit`` right before the next optimizer step, and there
the step waits for the copies only (``wait_staged``), never for storage. When the checkpoint is
durable and committed, rank 0 makes the pointer files durable and writes ``latest`` (DeepSpeed
itself never writes it for this engine: the commit info it gets says ``save_latest=False``).

``load(path)`` reads one DeepSpeed file's state back from the tag's checkpoint (CRC32C checked,
values decoded with the restricted unpickler plus DeepSpeed's own types), or, for a file DeepSpeed
wrote itself, ``torch.load`` with the same allowlist.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...config import DataStatesConfig
from ...errors import CheckpointWriteError, IncompleteCheckpointError
from ...reader import DataStatesReader
from ...runtime.inflight import wait_staged
from ...runtime.process_group import checkpoint_process_group
from ...writer import DataStatesWriter
from . import files
from .state import SEP, allow_deepspeed_types, pack, unpack

__all__ = ["DataStatesCheckpointEngine", "engine_config", "ENGINE_NAME"]

log = logging.getLogger("dcp_datastates")

ENGINE_NAME = "DataStatesCheckpointEngine"

# DeepSpeed is optional.
try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

    _IMPORT_ERROR: BaseException | None = None
except Exception as _exc:  # noqa: BLE001 - ImportError, or a DeepSpeed that fails with this torch
    _IMPORT_ERROR = _exc
    # A placeholder: the class refuses to be made.
    CheckpointEngine = object
    CheckpointCommitInfo = None

DEEPSPEED_AVAILABLE = _IMPORT_ERROR is None


def require_deepspeed() -> None:
    """Raise an ImportError saying what to install when DeepSpeed cannot be imported."""
    if _IMPORT_ERROR is not None:
        raise ImportError(
            "dcp_datastates.integrations.deepspeed needs DeepSpeed, which could not be imported "
            f"({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}). Install it next to your torch with "
            '`pip install "dcp_datastates[deepspeed]"` (deepspeed==0.19.8; it builds no ops at install).'
        )


def engine_config(section: Any) -> DataStatesConfig:
    """The ``DataStatesConfig`` of a DeepSpeed config's ``datastates_ckpt`` section (the seed's
    keys ``host_cache_size``, ``parser_threads``, ``pin_host_cache``, and every other option).
    ``dedup_replicated`` is off: each DeepSpeed file is one rank's, nothing is replicated."""
    if section is None or section is True:
        section = {}
    if not isinstance(section, dict):
        raise ValueError(f"DeepSpeed config: 'datastates_ckpt' must be a section of options, got {section!r}")
    try:
        config = DataStatesConfig.from_dict(section)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"DeepSpeed config 'datastates_ckpt': {exc}") from None
    config.dedup_replicated = False
    return config


class _Save:
    """One tag's checkpoint in flight: its upload future and the end of what follows the commit."""

    def __init__(self, info, folder: str, names: list[str], upload: concurrent.futures.Future) -> None:
        self.info, self.folder, self.names, self.upload = info, folder, names, upload
        # Set once `latest` is written (or the save failed).
        self.finished = threading.Event()
        self.error: BaseException | None = None


class DataStatesCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` saving lazily through DataStates.

    Args:
        config_params: DeepSpeed's ``DeepSpeedConfig`` (its ``datastates_ckpt`` section configures
            the engine), or None.
        config: a ``DataStatesConfig`` instead of the section.
        process_group: a gloo group of every rank for the checkpoint's collectives (None: one is
            made here, collectively: every rank builds its engine in ``deepspeed.initialize``).
        trusted: decode stored values without the restricted unpickler (runs code from the
            checkpoint: only for checkpoints you trust).
        close_timeout: seconds ``cleanup()`` (``engine.destroy()``) waits for the checkpoint in
            flight to be committed.
    """

    def __init__(self, config_params=None, *, config: DataStatesConfig | None = None, process_group=None,
                 trusted: bool = False, close_timeout: float = 600.0) -> None:
        require_deepspeed()
        super().__init__(config_params)
        self.name = ENGINE_NAME
        if config is None:
            section = getattr(getattr(config_params, "datastates_config", None), "config", None)
            config = engine_config(section)
        self.config = config
        self.trusted = bool(trusted)
        self.close_timeout = float(close_timeout)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = process_group
        if self.group is None and dist.is_initialized():
            self.group = checkpoint_process_group(self.config)
        # The CheckpointCommitInfo of the tag being saved.
        self._info = None
        # True inside save_checkpoint (set by the wrapper).
        self._collecting = False
        # File name -> (tensors, skeleton).
        self._files: dict[str, tuple[dict, Any]] = {}
        # Handed to DeepSpeed once per save, for the step's wait.
        self._to_commit = None
        self._inflight: _Save | None = None
        self._last: _Save | None = None
        log.info("dcp_datastates: DeepSpeed checkpoints are saved lazily by the DataStates engine")

    # ---------------------------------------------------------------- DeepSpeed's interface
    def create(self, info) -> None:
        """Start the files of ``info.tag`` (DeepSpeed calls this first in ``save_checkpoint``)."""
        self._info = info
        self._files = {}

    def save(self, state_dict, path: str) -> None:
        """Inside ``save_checkpoint``: take the file's state apart and keep it for ``submit``;
        its pointer file is written now. Elsewhere (``save_16bit_model``): ``torch.save``,
        synced, as DeepSpeed's default engine writes such exports."""
        folder = self._folder()
        path = os.fspath(path)
        if self._collecting and folder is not None and os.path.dirname(os.path.abspath(path)) == folder:
            name = os.path.basename(path)
            if name in self._files:
                raise ValueError(f"DeepSpeed saved {path} twice in one checkpoint")
            self._files[name] = pack(name, state_dict)
            files.write_pointer(path)
            return
        files.write_atomically(path, lambda f: torch.save(state_dict, f), sync=self.config.sync_files)

    def load(self, path: str, map_location=None):
        """The state DeepSpeed saved as ``path``: from the tag's DataStates checkpoint when
        ``path`` is one of its pointers, else DeepSpeed's own ``torch.save`` file."""
        path = os.fspath(path)
        folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
        inflight = self._inflight
        if inflight is not None and inflight.folder == folder:
            # Loading the tag being saved: once it is committed.
            self.wait()
        if files.read_pointer(path) is None:
            return _torch_load(path, map_location, self.trusted)
        return _move(load_file(folder, name, config=self.config, trusted=self.trusted), map_location)

    def commit(self, info) -> bool:
        """DeepSpeed calls this right before the optimizer step after a save: the step waits
        here until every copy is in the host cache (storage is not waited for)."""
        wait_staged()
        if info is self._to_commit:
            self._to_commit = None
        return True

    def get_commit_info(self):
        """The save DeepSpeed should ``commit`` before its next optimizer step (None: none).
        Its ``save_latest`` is False: ``latest`` is this engine's to write, after the commit."""
        return self._to_commit

    def is_decoupled(self) -> bool:
        """True: DeepSpeed does not commit inside ``save_checkpoint`` nor write ``latest``; it
        commits right before the next optimizer step (and ``destroy()`` calls ``cleanup``)."""
        return True

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed then hands over views as they are instead of cloning each tensor on
        the training thread; every item is written with its own bytes anyway."""
        return False

    def cleanup(self) -> None:
        """Wait (at most ``close_timeout`` s, logged) for the checkpoint in flight, so that the
        run's last checkpoint is committed and ``latest`` names it (``engine.destroy()``)."""
        if self._inflight is None:
            return
        try:
            self.wait(timeout=self.close_timeout)
        except concurrent.futures.TimeoutError:
            log.warning("dcp_datastates: DeepSpeed checkpoint %s not committed within %.0f s; `latest` keeps the "
                        "previous tag", self._inflight.info.tag, self.close_timeout)
        except Exception as exc:  # noqa: BLE001 - logged: cleanup runs at shutdown
            log.error("dcp_datastates: %s", exc)

    # ---------------------------------------------------------------- the save itself
    def _folder(self) -> str | None:
        if self._info is None:
            return None
        return os.path.abspath(os.path.join(self._info.save_dir, str(self._info.tag)))

    def begin(self) -> None:
        """Called by the ``save_checkpoint`` wrapper before DeepSpeed's own code: the previous
        checkpoint must have ended (its failure is raised here, naming it)."""
        self.wait()
        self._collecting = True

    def drop_files(self) -> None:
        """DeepSpeed's ``save_checkpoint`` raised: nothing of the tag is submitted."""
        self._collecting = False
        self._files = {}

    def submit(self) -> None:
        """Called by the ``save_checkpoint`` wrapper after DeepSpeed's own code, on every rank:
        one lazy ``dcp.async_save`` of this rank's files of the tag. Returns once the copies are
        requested."""
        self._collecting = False
        info, folder = self._info, self._folder()
        if info is None or folder is None:
            return
        state: dict[str, Any] = {}
        for name, (tensors, skeleton) in self._files.items():
            state.update(tensors)
            # A tuple is one DCP value: DCP does not walk into it.
            state[name] = (skeleton,)
        names = sorted(self._files)
        self._files = {}
        names_everywhere = _gather_names(names, self.group)
        writer = DataStatesWriter(folder, config=self.config, process_group=self.group)
        response = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        upload = getattr(response, "upload_completion", response)
        save = _Save(info, folder, names_everywhere, upload)
        self._inflight = save
        self._to_commit = CheckpointCommitInfo(tag=info.tag, save_dir=info.save_dir, save_latest=False)
        upload.add_done_callback(lambda _f, s=save: self._after_upload(s))

    def _after_upload(self, save: _Save) -> None:
        """On DCP's thread once the upload ended: on rank 0 of a committed checkpoint, the
        pointers made durable, then ``latest``."""
        try:
            try:
                save.upload.result()
            except (Exception, CheckpointException) as exc:
                # DCP's error is a BaseException.
                save.error = exc
                log.error("dcp_datastates: DeepSpeed checkpoint %s failed; `latest` keeps the previous tag: %s",
                          save.info.tag, exc)
                return
            if self.rank == 0:
                files.sync_pointers(save.folder, save.names)
                if save.info.save_latest:
                    files.write_latest(save.info.save_dir, str(save.info.tag))
        except Exception as exc:  # noqa: BLE001 - reported by wait()
            save.error = exc
            log.error("dcp_datastates: DeepSpeed checkpoint %s: writing `latest` failed: %s", save.info.tag, exc)
        finally:
            save.finished.set()

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait for the checkpoint in flight: its tag once it is committed (on rank 0, also once
        ``latest`` names it; None when none was in flight). A failed save raises
        ``CheckpointWriteError`` naming the tag (once; ``latest`` still names the previous tag)."""
        save = self._inflight
        if save is None:
            return None
        t0 = time.monotonic()
        try:
            save.upload.result(timeout)
        except concurrent.futures.TimeoutError:
            raise
        except (Exception, CheckpointException):  # noqa: BLE001 - recorded by _after_upload
            pass
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        if not save.finished.wait(left):
            raise concurrent.futures.TimeoutError(f"DeepSpeed checkpoint {save.info.tag} still in flight")
        self._inflight, self._last = None, save
        if save.error is not None:
            raise CheckpointWriteError(
                f"DeepSpeed checkpoint {save.info.tag!r} in {save.info.save_dir} failed, `latest` still names the "
                f"previous tag: {save.error}"
            ) from save.error
        return str(save.info.tag)


def _gather_names(names: list[str], group) -> list[str]:
    """Every rank's file names of the tag, for rank 0's pointer sync. On the engine's own group,
    from the training thread: no save of this engine is in flight now (``begin`` waited)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(names)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, names, group=group)
    return sorted({n for part in out for n in part})


def load_file(folder: str, name: str, *, config: DataStatesConfig | None = None, trusted: bool = False):
    """One DeepSpeed file's state from the DataStates checkpoint in ``folder`` (CPU tensors;
    this rank alone, no collectives). IncompleteCheckpointError when the folder has no commit."""
    reader = DataStatesReader(folder, config=config, trusted=trusted)
    md = reader.read_metadata()
    if name not in md.state_dict_metadata:
        raise IncompleteCheckpointError(
            f"DeepSpeed checkpoint {folder}: the committed checkpoint holds no file {name!r} "
            f"(it holds {', '.join(sorted(k for k in md.state_dict_metadata if SEP not in k)) or 'none'})"
        )
    prefix = name + SEP
    template: dict[str, Any] = {name: None}
    for fqn, item in md.state_dict_metadata.items():
        if fqn.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            template[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    with allow_deepspeed_types():
        dcp.load(template, storage_reader=DataStatesReader(folder, config=config, trusted=trusted),
                 planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    wrapped = template.pop(name)
    if not (isinstance(wrapped, (tuple, list)) and len(wrapped) == 1):
        raise IncompleteCheckpointError(f"DeepSpeed checkpoint {folder}: item {name!r} is not a DeepSpeed file's state")
    return unpack(wrapped[0], template)


def _torch_load(path: str, map_location, trusted: bool):
    """A file DeepSpeed wrote itself (an older checkpoint): ``torch.load`` with PyTorch's
    restricted unpickler and DeepSpeed's types allowed, or unrestricted when trusted."""
    if trusted:
        return torch.load(path, map_location=map_location, weights_only=False)
    with allow_deepspeed_types():
        return torch.load(path, map_location=map_location, weights_only=True)


def _move(state: Any, map_location) -> Any:
    """Apply ``torch.load``'s ``map_location`` to freshly loaded CPU tensors."""
    if map_location is None:
        return state
    if callable(map_location):
        def target(t: torch.Tensor):
            moved = map_location(t.untyped_storage(), "cpu")
            return None if moved is None else moved.device
    else:
        where = map_location.get("cpu", "cpu") if isinstance(map_location, dict) else map_location
        device = torch.device(where)

        def target(t: torch.Tensor):
            return device

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            device = target(value)
            if device is None or device == value.device:
                return value
            moved = value.detach().to(device)
            if isinstance(value, torch.nn.Parameter):
                return torch.nn.Parameter(moved, requires_grad=value.requires_grad)
            return moved
        if isinstance(value, dict):
            for k in list(value):
                value[k] = walk(value[k])
            return value
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(state)
