"""DeepSpeed integration: DataStates as DeepSpeed's checkpoint engine, turned on by ``datastates_ckpt``.

A DeepSpeed config with the DataStates-LLM section checkpoints lazily through this library::

    {"zero_optimization": {"stage": 1}, ..., "datastates_ckpt": {"host_cache_size": 16}}

    from dcp_datastates.integrations import deepspeed as ds_datastates

    engine, optimizer, _, scheduler = ds_datastates.initialize(model=model, config="ds_config.json",
                                                               model_parameters=model.parameters())
    engine.save_checkpoint("ckpt", tag="global_step100")  # returns once the copies are requested
    ...                                                    # the next optimizer step waits for the copies only
    engine.load_checkpoint("ckpt")                          # the tag `latest` names: committed, durable

``initialize`` is ``deepspeed.initialize`` with this library's ``DataStatesCheckpointEngine``
built for a config that has a ``datastates_ckpt`` section (DeepSpeed's own class of that name
needs the external DataStates-LLM package, which owns the ``datastates`` module name). Each tag is
one DataStates checkpoint in ``<save_dir>/<tag>/`` (safetensors data files, CRC32C, the atomic
``.metadata`` commit; the node-local tier when configured); DeepSpeed's file names there are small
JSON pointers; ``latest`` is written once the tag is committed. ``to_deepspeed`` (``dcp-datastates
convert --to deepspeed``) writes DeepSpeed's own ``torch.save`` layout, for ``zero_to_fp32`` and
the universal-checkpoint tools.

Importing this module never fails when DeepSpeed is missing; using it then raises an
``ImportError`` that says what to install.
"""

from .convert import to_deepspeed
from .engine import DEEPSPEED_AVAILABLE, ENGINE_NAME, DataStatesCheckpointEngine, engine_config, load_file
from .launch import datastates_engine, initialize

__all__ = [
    "initialize",
    "datastates_engine",
    "DataStatesCheckpointEngine",
    "DEEPSPEED_AVAILABLE",
    "ENGINE_NAME",
    "engine_config",
    "load_file",
    "to_deepspeed",
]
