"""DataStates planners: DCP's default planners plus the checks and policies this backend adds.

The writer and reader work with DCP's default planners too; these add what a user of a serious
checkpoint library expects: a load that names the item whose shape or dtype does not match.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from .compat import SavePlannerSteps, cached_save_plans, checkpointable_global_shape
from .errors import CheckpointMismatchError
from .format import metadata as metadata_codec
from .format.packed import PackedItems, unpack_items
from .format.packed_encode import pack_items
from .runtime.gc_pause import gc_paused
from .save import global_plan as coordinator_plan

__all__ = ["DataStatesSavePlanner", "DataStatesLoadPlanner"]


# dtype signature of the last successfully planned local plan, per planner cache key.
_LOCAL_DTYPES: dict[str, tuple] = {}


def _dtype_signature(state_dict: dict) -> tuple:
    """What DCP's plan comparison leaves out: the dtype of every tensor."""
    return tuple((fqn, str(v.dtype)) for fqn, v in state_dict.items() if isinstance(v, torch.Tensor))


class DataStatesSavePlanner(SavePlannerSteps):
    """Save planner with plan caching that also notices dtype changes.

    - Flattening is DCP's. With ``DataStatesWriter`` a replicated DTensor shard reaches planning
      from one rank only (the writer's stage-time policy); plain replicated values (an optimizer's
      ``step``, its param groups) come from every rank and are deduplicated as DCP does.
    - A first save's global plan gives DCP's results at a C-level cost per item
      (``save.global_plan``): dedup looks only at items whose hash repeats, and DCP's validation
      runs only on the tensors whose chunks may not tile them. Its items are the ranks' own:
      DCP would copy every one to give it its position hint, and its plan cache would keep the
      copies; ``DataStatesWriter``'s commit finds each chunk by its offsets instead. The
      collector is paused meanwhile: the plan makes objects per item.
    - The local plan, the global plan and the metadata are cached while names, shapes, shardings
      and dtypes are unchanged: a steady-state checkpoint sends an empty, unusable plan instead of
      its items. DCP's own cache comparison ignores dtypes, so a dtype change here drops the
      cached local plan (the rank re-sends it) and re-sends that rank's global plan.
    - A save planned from the cache keeps its own ``storage_data`` (the storage writer's word
      for this save; DCP's cache would hand back the first save's).

    Args:
        enable_plan_caching: default True.
        cache_key: plans are cached per key (class-wide by default); give different keys to
            planners of different state dicts saved alternately (e.g. model-only and full).
    """

    rewrite_index_hints = False

    def __init__(self, *args, enable_plan_caching: bool = True, cache_key: str | None = None, **kwargs) -> None:
        super().__init__(*args, enable_plan_caching=enable_plan_caching, **kwargs)
        if cache_key is not None:
            self._cached_plans_key = f"{self.__class__.__name__}:{cache_key}"

    def create_local_plan(self) -> SavePlan:
        key = self._cached_plans_key
        self._pending_dtypes = _dtype_signature(self.state_dict)
        if self._enable_plan_caching and _LOCAL_DTYPES.get(key) != self._pending_dtypes:
            # Forces a usable (re-sent) plan.
            cached_save_plans().pop(key, None)
        return super().create_local_plan()

    def dedup_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return coordinator_plan.dedup_plans(all_plans, self.dedup_save_to_lowest_rank)

    def validate_global_plan(self, plans: list[SavePlan], metadata: Metadata) -> list[str]:
        suspects = coordinator_plan.suspect_tensors(metadata, len(plans) > 1)
        if not suspects:
            return []
        items = metadata.state_dict_metadata
        return super().validate_global_plan(plans, Metadata({fqn: items[fqn] for fqn in suspects}))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with gc_paused():
            deltas, metadata = super().create_global_plan(all_plans)
        items = metadata.state_dict_metadata
        if not isinstance(items, _SentPacked) and \
                sum(len(getattr(v, "chunks", ())) for v in items.values()) >= metadata_codec.PACK_FROM_CHUNKS:
            # DCP sends this metadata to every rank after each save: packed, not an object per chunk.
            # (In place: DCP's plan cache hands the same object to the next save.)
            metadata.state_dict_metadata = _SentPacked(items)
        if self._enable_plan_caching:
            # A rank that re-sent its plan gets its full global plan back: DCP's comparison of
            # global plans ignores dtypes and would otherwise hand it a stale cached plan.
            deltas = [g if local.usable else d for local, d, g in zip(all_plans, deltas, self.global_plan)]
            # The storage writer's per-rank report (its checkpoint path, checked by the
            # coordinator) rides on every local plan, cached or not: keep it on the deltas.
            deltas = [d if d.storage_data is not None else dataclasses.replace(d, storage_data=local.storage_data)
                      for local, d in zip(all_plans, deltas)]
        return deltas, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        if plan is not new_plan and new_plan.storage_data is not None:
            # DCP's cache hands back the first save's plan, its storage_data included. The storage
            # writer's word for this save (a local tier's: the save's id, its file names' tag)
            # rides on the delta: keep it.
            plan = self.plan = dataclasses.replace(plan, storage_data=new_plan.storage_data)
        if self._enable_plan_caching:
            _LOCAL_DTYPES[self._cached_plans_key] = self._pending_dtypes
        return plan


class _SentPacked(dict):
    """The global metadata's items as DCP sends them to every rank once a save is committed (it
    broadcasts the metadata, pickled): packed columns (``format.packed_encode.pack_items``),
    received as a ``PackedItems`` whose objects are made when asked for. On the coordinator, the
    dict DCP planned; a copy of it is a plain dict."""

    def __reduce__(self):
        return unpack_items, pack_items(self)

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo) -> dict:
        return copy.deepcopy(dict(self), memo)


class DataStatesLoadPlanner(DefaultLoadPlanner):
    """Load planner that checks keys, shapes and dtypes against the checkpoint before reading.

    Every destination value is checked before a byte is read, and the first problem raises
    ``CheckpointMismatchError`` naming the checkpoint and the item:

    - a key of the state dict that the checkpoint does not hold (unless ``allow_partial_load``);
    - a tensor in the checkpoint where the state dict holds a non-tensor value, or the reverse;
    - a tensor whose (global) shape differs;
    - with ``strict_dtype=True``, a tensor whose dtype differs.

    Keys the checkpoint holds but the state dict does not are not an error (loading a subset).

    Args:
        strict_dtype: raise when a destination tensor's dtype differs from the stored dtype
            (default False: DCP casts on copy, as with the default planner).
    """

    def __init__(self, *args, strict_dtype: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.strict_dtype = strict_dtype

    def _checkpoint_name(self) -> str:
        # The reader records the folder it read; the save-time id is the fallback.
        path = getattr(self.metadata.storage_data, "checkpoint_path", None)
        if path is None and self.metadata.storage_meta is not None:
            path = self.metadata.storage_meta.checkpoint_id
        return f"checkpoint {path}" if path is not None else "the checkpoint"

    def create_local_plan(self) -> LoadPlan:
        where = self._checkpoint_name()
        stored = self.metadata.state_dict_metadata
        missing = [k for k in self.state_dict if k not in stored]
        if missing and not self.allow_partial_load:
            # DCP's wording first (code and people match on it), our details after it.
            raise CheckpointMismatchError(
                f"Missing key in checkpoint state_dict: {missing[0]}. {where} has no item(s) "
                f"{', '.join(map(repr, missing[:10]))}"
                + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
                + f" (it holds {len(stored)} items; pass allow_partial_load=True to skip missing ones)"
            )
        describe = stored.described if isinstance(stored, PackedItems) else stored.get
        for fqn, value in self.state_dict.items():
            md = describe(fqn)
            if md is None:
                continue
            is_tensor = isinstance(value, torch.Tensor)
            if isinstance(md, TensorStorageMetadata) and not is_tensor:
                raise CheckpointMismatchError(
                    f"{where}: item {fqn!r} is a tensor {list(md.size)} of {md.properties.dtype} in the checkpoint, "
                    f"the state dict holds a {type(value).__name__} there"
                )
            if isinstance(md, BytesStorageMetadata) and is_tensor:
                raise CheckpointMismatchError(
                    f"{where}: item {fqn!r} is a non-tensor value in the checkpoint, the state dict holds a "
                    f"tensor {list(value.shape)} of {value.dtype} there"
                )
            if not isinstance(md, TensorStorageMetadata):
                continue
            shape = checkpointable_global_shape(value)
            if shape != tuple(md.size):
                raise CheckpointMismatchError(
                    f"Size mismatch between saved {md.size} and current: {value.size()} for {fqn}. "
                    f"{where}: item {fqn!r} has shape {list(md.size)} in the checkpoint, "
                    f"the state dict expects {list(shape)}"
                )
            if self.strict_dtype and value.dtype != md.properties.dtype:
                raise CheckpointMismatchError(
                    f"{where}: item {fqn!r} is {md.properties.dtype} in the checkpoint, "
                    f"the state dict expects {value.dtype} (strict_dtype=True)"
                )
        if not isinstance(stored, PackedItems):
            return super().create_local_plan()
        if self.flatten_state_dict and any(k not in self.state_dict for k in stored):
            # DCP then checks for keys of checkpoints before torch 2.4: its own planning decides.
            return self._plan_through_dcp(stored)
        return self._plan_near(stored)

    def _plan_near(self, stored: PackedItems) -> LoadPlan:
        """DCP's default local load plan (``create_default_local_load_plan``) for a packed table:
        each tensor's chunks are compared, by DCP's resharding, with this rank's own chunks, but
        only with those of the checkpoint that lie near them (``PackedItems.narrowed``), so the
        cost follows this rank's chunks, not the world size."""
        requests = []
        for fqn, obj in self.state_dict.items():
            boxes = None
            if isinstance(obj, torch.Tensor) and fqn in stored and not (
                    isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None):
                local = obj.__create_chunk_list__() if hasattr(obj, "__create_chunk_list__") else None
                boxes = _boxes(obj, local)
                near = stored.narrowed(fqn, boxes) if boxes is not None else None
                if near is not None:
                    items = create_read_items_for_chunk_list(fqn, near[0], local or [_whole(obj)])
                    requests += _with_positions(items, near[1])
                    continue
            requests += create_default_local_load_plan({fqn: obj}, self.metadata, not self.allow_partial_load).items
        return LoadPlan(requests)

    def _plan_through_dcp(self, stored: PackedItems) -> LoadPlan:
        near = _NearItems(stored, self)
        self.metadata = dataclasses.replace(self.metadata, state_dict_metadata=near)
        try:
            plan = super().create_local_plan()
        finally:
            self.metadata = dataclasses.replace(self.metadata, state_dict_metadata=stored)
        return dataclasses.replace(plan, items=[
            _with_positions([item], near.positions[item.storage_index.fqn])[0]
            if item.storage_index.fqn in near.positions else item for item in plan.items])

    def load_decoded_value(self, read_item, value) -> bool:
        """Take a non-tensor value the reader already decoded with the restricted unpickler
        (``load_bytes`` would unpickle its bytes a second time). False when a subclass overrides
        ``load_bytes``: it decodes its own values, the reader hands it the bytes instead."""
        if type(self).load_bytes is not DefaultLoadPlanner.load_bytes:
            return False
        if self.flatten_state_dict:
            _set_at_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
        else:
            self.state_dict[read_item.dest_index.fqn] = value
        return True


class _NearItems(Mapping):
    """The checkpoint's items as DCP's own load planning sees them with a packed table: each
    tensor lists only its chunks near the planner's value (``PackedItems.narrowed``), whose
    positions among all are kept in ``positions``."""

    def __init__(self, items: PackedItems, planner: DefaultLoadPlanner):
        self._items = items
        self._planner = planner
        self.positions: dict[str, list[int]] = {}

    def __getitem__(self, fqn: str):
        obj = self._planner.state_dict.get(fqn)
        local = obj.__create_chunk_list__() if hasattr(obj, "__create_chunk_list__") else None
        boxes = _boxes(obj, local) if isinstance(obj, torch.Tensor) else None
        near = None if boxes is None else self._items.narrowed(fqn, boxes)
        if near is None:
            self.positions.pop(fqn, None)
            return self._items[fqn]
        self.positions[fqn] = near[1]
        return near[0]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, fqn) -> bool:
        return fqn in self._items


def _whole(tensor: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.size())


def _boxes(obj: torch.Tensor, local: list | None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of each chunk of ``obj`` this rank loads: its chunk list (a DTensor's, a
    checkpointable tensor's) or the whole tensor."""
    if local is None:
        return [((0,) * obj.dim(), tuple(obj.shape))]
    return [(tuple(ch.offsets), tuple(ch.sizes)) for ch in local]


def _with_positions(items: list[ReadItem], positions: list[int]) -> list[ReadItem]:
    """Read items made against a tensor's nearby chunks, pointing at those chunks' positions
    among all its chunks (the storage index's hint, which the reader's lookup relies on)."""
    out = []
    for item in items:
        index = item.storage_index
        if index.offset is not None and index.index is not None:
            item = dataclasses.replace(item, storage_index=MetadataIndex(index.fqn, index.offset,
                                                                         positions[index.index]))
        out.append(item)
    return out


def _set_at_path(root, path: tuple, value) -> None:
    """``root[p0][p1]...[pn] = value`` along an object path of DCP's flattening (str keys, int
    list indices); the containers exist already (they are the state dict being loaded)."""
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
