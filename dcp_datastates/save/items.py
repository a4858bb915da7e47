"""Turns a state dict into the rank-local list of items to write, the way DCP's planners see it.

Used by ``planning`` on a plan-cache miss (on the training thread, so it must cost time
proportional to the number of tensors, never to their bytes) and by ``write_data`` for items a planner asks for
that were not staged (``dcp.save`` without staging). Keys are ``(fqn, offsets)`` exactly as in
the planner's ``WriteItem.index``, so the two always agree.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_tensor_shard

from ..compat import HAS_CHECKPOINTABLE_TENSOR, create_write_items, is_checkpointable_tensor, is_zero_tensor
from ..errors import CheckpointWriteError
from ..format.layout import FileEntry, dtype_to_name

__all__ = ["ItemKey", "SourceItem", "bytes_source", "items_of_flat", "item_key", "source_for_resolved",
           "classify"]

log = logging.getLogger("dcp_datastates")

ItemKey = tuple  # (fqn, offsets tuple or None)


@dataclass
class SourceItem:
    """One item with the memory its bytes come from. ``keepalive`` holds the tensor or buffer
    that owns that memory until the engine has copied it. ``device``: the CUDA device index
    ``ptr`` points into; -1 for host memory. ``copied``: the bytes were copied at stage() already
    (views, other devices)."""

    key: ItemKey
    entry: FileEntry
    ptr: int
    keepalive: Any
    device: int = -1
    copied: bool = False
    # What the value is, decided once (``items_of_flat``): "plain" (a tensor every rank may hold),
    # "dtensor" (a DTensor's local shard), "shard" (ShardedTensor, CheckpointableTensor: each
    # rank's own) or "value" (a non-tensor value, serialized). Ownership and planning read this.
    kind: str = "plain"


PLAIN, DTENSOR, SHARD, VALUE = "plain", "dtensor", "shard", "value"


def item_key(index) -> ItemKey:
    return (index.fqn, None if index.offset is None else tuple(index.offset))


def item_keys(items) -> list[ItemKey]:
    """``item_key`` of each DCP ``WriteItem`` of ``items``, in one call (a save's items pass here once)."""
    return [(i.index.fqn, None if i.index.offset is None else tuple(i.index.offset)) for i in items]


def _tensor_source(key: ItemKey, name: str, tensor: torch.Tensor, kind: str = PLAIN) -> SourceItem:
    t = tensor.detach()
    device = -1
    original = t
    if t.device.type != "cpu":
        if t.device.type == "cuda":
            # The engine copies device memory itself (lazily, on its own stream): keep the pointer.
            device = t.device.index if t.device.index is not None else torch.cuda.current_device()
        else:
            # Other devices: copy now.
            t = t.to("cpu")
    if t.is_conj() or t.is_neg():
        # A lazy conjugate or negative view (``x.conj()``, ``x.conj().imag``): its memory holds
        # the values before the conjugation or negation, which torch applies only when reading.
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        # Views: one copy here, on the training thread (rare in state dicts).
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes and not t.data_ptr():
        t = _zeros_with_memory(t, name)
    entry = FileEntry(name=name, kind="tensor", dtype=dtype_to_name(t.dtype), shape=tuple(t.shape), nbytes=nbytes)
    return SourceItem(key=key, entry=entry, ptr=t.data_ptr() if nbytes else 0, keepalive=t, device=device,
                      copied=t is not original, kind=kind)


def _zeros_with_memory(t: torch.Tensor, name: str) -> torch.Tensor:
    """The values of a tensor that has no memory behind it: autograd's ZeroTensor is all zeros
    (stock DCP refuses it: "ZeroTensor is not serializable"); anything else is refused by name."""
    if is_zero_tensor(t):
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    raise CheckpointWriteError(
        f"item {name!r}: a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device} has no memory "
        f"(data_ptr() is 0 for {t.numel() * t.element_size()} bytes); nothing to save from"
    )


def bytes_source(key: ItemKey, name: str, data: bytes) -> SourceItem:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return _bytes_item(key, name, buf)


def _bytes_item(key: ItemKey, name: str, buf: torch.Tensor) -> SourceItem:
    n = buf.numel()
    entry = FileEntry(name=name, kind="bytes", dtype="uint8", shape=(n,), nbytes=n)
    return SourceItem(key=key, entry=entry, ptr=buf.data_ptr() if n else 0, keepalive=buf, kind=VALUE)


def _unique_name(fqn: str, offsets: tuple | None, taken: set[str]) -> str:
    name = fqn
    if name in taken or name == "__metadata__":
        name = f"{fqn}@{','.join(map(str, offsets or ()))}"
    taken.add(name)
    return name


def _whole(obj: Any) -> bool:
    """A dense tensor (or a Parameter of one): one item, no DCP write items needed."""
    return type(obj) is torch.Tensor or (isinstance(obj, torch.nn.Parameter) and type(obj.data) is torch.Tensor)


def classify(obj: Any) -> str:
    """What a state-dict value is (``SourceItem.kind``): the one place that asks."""
    if _whole(obj):
        # (2.14+: shards of a global tensor)
        return SHARD if HAS_CHECKPOINTABLE_TENSOR and is_checkpointable_tensor(obj) else PLAIN
    if not isinstance(obj, torch.Tensor):
        return VALUE
    if hasattr(obj, "placements") and hasattr(obj, "device_mesh"):
        return DTENSOR
    if type(obj).__name__ == "ShardedTensor" or is_checkpointable_tensor(obj):
        return SHARD
    # Another tensor subclass: DCP's own write items, replicated like a plain tensor.
    return PLAIN


def items_of_flat(flat: dict, serialized: dict[int, torch.Tensor], kinds: list[str] | None = None) -> list[SourceItem]:
    """The items of a flat state dict, in its order, each with its ``kind``. Plain tensors take a
    fast path; DTensor and ShardedTensor (and CheckpointableTensor shards, torch 2.14+) go through
    DCP's own ``_create_write_items`` so their chunk offsets are exactly DCP's. ``serialized``:
    every non-tensor value's bytes (a uint8 tensor), serialized in this stage(), by position;
    ``kinds``: each value's kind when the scan classified them already."""
    items: list[SourceItem] = []
    taken: set[str] = set()
    for pos, (fqn, obj) in enumerate(flat.items()):
        kind = kinds[pos] if kinds is not None else classify(obj)
        if kind == PLAIN and _whole(obj):
            key = (fqn, (0,) * obj.dim())
            items.append(_tensor_source(key, _unique_name(fqn, None, taken), obj))
        elif kind != VALUE:
            for wi in create_write_items(fqn, obj):
                key = item_key(wi.index)
                local = find_tensor_shard(obj, wi.index)
                items.append(_tensor_source(key, _unique_name(fqn, key[1], taken), local, kind))
        else:
            key = (fqn, None)
            name = _unique_name(fqn, None, taken)
            items.append(_bytes_item(key, name, serialized[pos]))
    return items


def source_for_resolved(item: WriteItem, data: Any, taken: set[str]) -> SourceItem:
    """A SourceItem for what ``planner.resolve_data(item)`` returned (the unstaged path)."""
    key = item_key(item.index)
    name = _unique_name(item.index.fqn, key[1], taken)
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        return bytes_source(key, name, raw)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner.resolve_data returned {type(data).__name__} for tensor item {item.index.fqn!r}")
    return _tensor_source(key, name, data)
