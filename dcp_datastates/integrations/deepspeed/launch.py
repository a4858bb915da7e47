"""Turning DataStates on from a DeepSpeed config: ``initialize``, a drop-in for ``deepspeed.initialize``.

With a ``"datastates_ckpt"`` section in the config (the DataStates-LLM tutorial's spelling),
DeepSpeed 0.19.8 builds its own ``DataStatesCheckpointEngine``, which imports the external
``datastates`` package (DataStates-LLM) and fails without it. ``initialize`` runs
``deepspeed.initialize`` unchanged, with one difference: while it runs, DeepSpeed's checkpoint
engine factory builds this library's ``DataStatesCheckpointEngine`` for such a config. Configs
without the section, or with a ``checkpoint.writer`` section (which DeepSpeed gives precedence),
get DeepSpeed's own engines. The engine's ``save_checkpoint`` and ``load_checkpoint`` are then
wrapped: a save is one lazy DataStates checkpoint of the tag (``DataStatesCheckpointEngine``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from .engine import DataStatesCheckpointEngine, require_deepspeed

__all__ = ["initialize", "datastates_engine"]

_factory_lock = threading.Lock()


def initialize(*args: Any, trusted: bool = False, close_timeout: float = 600.0, **kwargs: Any):
    """``deepspeed.initialize(*args, **kwargs)``, checkpointing through DataStates when the
    DeepSpeed config has a ``datastates_ckpt`` section. Returns what ``deepspeed.initialize``
    returns (engine, optimizer, dataloader, lr_scheduler).

    ``trusted``: loads decode stored values without the restricted unpickler (runs code from
    the checkpoint). ``close_timeout``: seconds ``engine.destroy()`` waits for the checkpoint
    in flight."""
    require_deepspeed()
    import deepspeed
    import deepspeed.runtime.engine as ds_engine

    own = ds_engine.create_checkpoint_engine

    def create_checkpoint_engine(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state):
        from deepspeed.runtime.model_checkpointing.constants import CHECKPOINT_WRITER

        writer = config_params.checkpoint_config.get(CHECKPOINT_WRITER) if config_params is not None else None
        section = getattr(config_params, "datastates_config", None)
        if writer is None and section is not None and section.enabled:
            return DataStatesCheckpointEngine(config_params, trusted=trusted, close_timeout=close_timeout)
        return own(config_params, groups, zero_stage, has_moe_layers, optimize_dp_state)

    # DeepSpeed looks the factory up in its engine module while it builds one.
    with _factory_lock:
        ds_engine.create_checkpoint_engine = create_checkpoint_engine
        try:
            result = deepspeed.initialize(*args, **kwargs)
        finally:
            ds_engine.create_checkpoint_engine = own
    engine = result[0]
    if isinstance(getattr(engine, "checkpoint_engine", None), DataStatesCheckpointEngine):
        _wrap(engine)
    return result


def datastates_engine(engine) -> DataStatesCheckpointEngine:
    """The ``DataStatesCheckpointEngine`` of a DeepSpeed engine made by ``initialize`` (its
    ``wait()`` returns once the checkpoint in flight is committed and named by ``latest``)."""
    found = getattr(engine, "checkpoint_engine", None)
    if not isinstance(found, DataStatesCheckpointEngine):
        raise TypeError(
            f"{type(engine).__name__} does not checkpoint through DataStates: build it with "
            "dcp_datastates.integrations.deepspeed.initialize and a 'datastates_ckpt' config section "
            f"(its checkpoint engine is {type(found).__name__})"
        )
    return found


def _wrap(engine) -> None:
    """On this instance: ``save_checkpoint`` makes one lazy DataStates save per tag, and
    ``load_checkpoint`` first waits for the save in flight."""
    ckpt: DataStatesCheckpointEngine = engine.checkpoint_engine
    save_checkpoint = engine.save_checkpoint

    @functools.wraps(save_checkpoint)
    def save_lazily(*args: Any, **kwargs: Any):
        ckpt.begin()
        try:
            saved = save_checkpoint(*args, **kwargs)
        except BaseException:
            ckpt.drop_files()
            raise
        ckpt.submit()
        return saved

    load_checkpoint = engine.load_checkpoint

    @functools.wraps(load_checkpoint)
    def load_after_save(*args: Any, **kwargs: Any):
        # A save in flight first: `latest` then names it, as after DeepSpeed's own saves.
        ckpt.wait()
        return load_checkpoint(*args, **kwargs)

    engine.save_checkpoint = save_lazily
    engine.load_checkpoint = load_after_save
