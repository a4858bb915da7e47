"""DataStates planners: DCP's default planners plus the checks and policies this backend adds.

The writer and reader work with DCP's default planners too; these add what a user of a serious
checkpoint library expects: a load that names the item whose shape or dtype does not match.
"""

from __future__ import annotations

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from .errors import CheckpointMismatchError

__all__ = ["DataStatesSavePlanner", "DataStatesLoadPlanner"]


class DataStatesSavePlanner(DefaultSavePlanner):
    """Save planner. Currently DCP's default planning (flattening, dedup of replicated values)."""


class DataStatesLoadPlanner(DefaultLoadPlanner):
    """Load planner that checks keys, shapes and dtypes against the checkpoint before reading.

    Args:
        strict_dtype: raise when a destination tensor's dtype differs from the stored dtype
            (default False: DCP casts on copy, as with the default planner).
    """

    def __init__(self, *args, strict_dtype: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.strict_dtype = strict_dtype

    def create_local_plan(self) -> LoadPlan:
        where = getattr(self.metadata.storage_meta, "checkpoint_id", None) or "the checkpoint"
        missing = [k for k in self.state_dict if k not in self.metadata.state_dict_metadata]
        if missing and not self.allow_partial_load:
            raise CheckpointMismatchError(
                f"{where} has no item(s) {', '.join(map(repr, missing[:10]))}"
                + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            )
        for fqn, value in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or not hasattr(value, "shape"):
                continue
            if tuple(value.shape) != tuple(md.size):
                raise CheckpointMismatchError(
                    f"{where}: item {fqn!r} has shape {list(md.size)} in the checkpoint, "
                    f"the state dict expects {list(value.shape)}"
                )
            if self.strict_dtype and value.dtype != md.properties.dtype:
                raise CheckpointMismatchError(
                    f"{where}: item {fqn!r} is {md.properties.dtype} in the checkpoint, "
                    f"the state dict expects {value.dtype}"
                )
        return super().create_local_plan()
