"""dcp_datastates: lazy asynchronous multi-level checkpointing (DataStates-LLM) for PyTorch DCP.

    import torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter, DataStatesReader, protect_optimizer

    protect_optimizer(optimizer)
    resp = dcp.async_save(state, storage_writer=DataStatesWriter("ckpt/step-100"))
    dcp.load(state, storage_reader=DataStatesReader("ckpt/step-100"))
"""

from .commit import check_commit, is_committed, referenced_by
from .config import DataStatesConfig
from .errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointWriteError,
    ChecksumMismatchError,
    DataStatesError,
    IncompleteCheckpointError,
    RestartError,
    UnsafeCheckpointError,
    checkpoint_error_cause,
)
from .load.verify import validate_checkpoint, validate_data_file
from .planners import DataStatesLoadPlanner, DataStatesSavePlanner
from .reader import DataStatesReader
from .runtime import engine_stats, shutdown_engine, start_engine
from .runtime.inflight import protect_optimizer, wait_staged
from .runtime.process_group import checkpoint_process_group
from .save.checkpoint_stats import CheckpointStats, recent_checkpoints
from .sizes import parse_size
from .tiers.local_tier import latest_checkpoint
from .tiers.peers import wait_peer_copies
from .tiers.restart import prepare_restart
from .writer import DataStatesWriter

__version__ = "0.1.0"

__all__ = [
    "DataStatesWriter",
    "DataStatesReader",
    "DataStatesSavePlanner",
    "DataStatesLoadPlanner",
    "DataStatesConfig",
    "parse_size",
    "protect_optimizer",
    "wait_staged",
    "checkpoint_process_group",
    "latest_checkpoint",
    "prepare_restart",
    "wait_peer_copies",
    "is_committed",
    "check_commit",
    "referenced_by",
    "validate_checkpoint",
    "validate_data_file",
    "checkpoint_error_cause",
    "engine_stats",
    "CheckpointStats",
    "recent_checkpoints",
    "start_engine",
    "shutdown_engine",
    "DataStatesError",
    "IncompleteCheckpointError",
    "CheckpointFormatError",
    "ChecksumMismatchError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "UnsafeCheckpointError",
    "RestartError",
]
