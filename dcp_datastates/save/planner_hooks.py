"""A custom save planner's data hooks, honoured on the lazy path as on ``dcp.save``.

DCP writes each item as ``planner.resolve_data(item)``, which for DCP's ``DefaultSavePlanner`` is
``transform_object(item, lookup_object(index))``. The lazy path stages bytes at ``stage()``,
before DCP has even built the planner, so it writes what DCP's default hooks would: the tensor's
own bytes, and ``torch.save`` of a non-tensor value. A planner that overrides a hook may want
something else: Megatron-core's, for one, packs objects into ``io.BytesIO`` itself and its
``transform_object`` passes them through, so the file must hold the packed bytes, not a pickle
of the BytesIO.

So once DCP hands the planner to ``write_data``, the items whose data such a planner changes
are written again, from request-time values: a non-tensor value decoded from the bytes staged at
the request, a tensor read back from the file the lazy save just made durable. The commit then
points at the new bytes. With DCP's own planners (and ours) nothing here runs.

What cannot be honoured at request-time values: a planner whose ``resolve_data`` or
``lookup_object`` builds a different tensor from the live state (it would read the state as it
is now, after the step). Such a save fails with an error naming the planner and the item; use
``dcp.save``, or override ``transform_object`` instead.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ..errors import CheckpointWriteError

__all__ = ["overridden_data_hooks", "items_to_rewrite"]

_DATA_HOOKS = ("resolve_data", "lookup_object", "transform_object")


def overridden_data_hooks(planner: SavePlanner) -> frozenset[str]:
    """The data hooks ``planner``'s class defines differently from DCP's ``DefaultSavePlanner``
    (``resolve_data`` for any planner that is not one)."""
    if not isinstance(planner, DefaultSavePlanner):
        return frozenset({"resolve_data"})
    cls = type(planner)
    return frozenset(name for name in _DATA_HOOKS if getattr(cls, name) is not getattr(DefaultSavePlanner, name))


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"expected io.BytesIO or bytes for a BYTE_IO item, got {type(data).__name__}")


def _same_tensor(a: Any, b: Any) -> bool:
    """True when ``a`` is the very memory ``b`` is (what DCP's default hooks hand back)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_conj() != b.is_conj() or a.is_neg() != b.is_neg():
        # The same memory read as other values.
        return False
    return a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride())


def _label(planner: SavePlanner, item: WriteItem) -> str:
    return f"planner {type(planner).__module__}.{type(planner).__qualname__}, item {item.index.fqn!r}"


def items_to_rewrite(planner: SavePlanner, items: list[WriteItem], staged_bytes: Callable[[str], bytes | None],
                     staged_tensor: Callable[[WriteItem], Any],
                     read_back: Callable[[WriteItem], torch.Tensor]) -> list[tuple[WriteItem, Any]]:
    """(item, data to write) for each staged item whose data ``planner`` changes.

    ``staged_bytes(fqn)``: the bytes a non-tensor value was serialized to at the request (None if
    not staged here); ``staged_tensor(item)``: the tensor its bytes were staged from (what DCP's
    default lookup finds); ``read_back(item)``: a staged tensor item as the checkpoint holds it."""
    hooks = overridden_data_hooks(planner)
    if not hooks:
        return []
    transform_only = hooks == {"transform_object"}
    out: list[tuple[WriteItem, Any]] = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            staged = staged_bytes(item.index.fqn)
            if staged is None:
                continue
            if transform_only:
                # The request-time value: decoded from the bytes this process serialized it to.
                value = torch.load(io.BytesIO(staged), weights_only=False)
                data = planner.transform_object(item, value)
            else:
                # Its own lookup: the state DCP was handed.
                data = planner.resolve_data(item)
            try:
                new = _as_bytes(data)
            except TypeError as exc:
                raise CheckpointWriteError(f"{_label(planner, item)}: {exc}") from None
            if new != staged:
                out.append((item, io.BytesIO(new)))
            continue
        resolved = planner.resolve_data(item)
        if _same_tensor(resolved, staged_tensor(item)):
            # The tensor itself: the staged bytes are what the planner writes.
            continue
        if not transform_only:
            raise CheckpointWriteError(
                f"{_label(planner, item)}: its resolve_data/lookup_object returns a tensor other than the state's, "
                f"which on the lazy path could only be built from the live state after the request. Use dcp.save "
                f"with this planner, or transform tensors in transform_object (applied to the request-time value)."
            )
        out.append((item, planner.transform_object(item, read_back(item))))
    return out
