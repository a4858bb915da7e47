"""One DeepSpeed file's state dict as DCP items: its tensors, plus one skeleton value, and back.

DeepSpeed hands its checkpoint engine one nested state dict per file it would write
(``mp_rank_00_model_states.pt``, ``zero_pp_rank_0_mp_rank_00_optim_states.pt`` ...). DCP would
flatten such a dict into one item per leaf, pickling every small non-tensor value on its own
(a ZeRO file holds one ``fragment_address`` per parameter) and rebuilding plain dicts where
DeepSpeed had ``OrderedDict``s and tuples. Here each file becomes:

- one DCP tensor item per tensor, named ``<file>/<key>/<key>...`` (``mp_rank_00_model_states.pt/
  module/0.weight``): the tensors are staged lazily and are what the safetensors data files list;
- one non-tensor item named ``<file>``: the file's state dict with every tensor replaced by a
  ``TensorSlot`` naming its item. It keeps every container type, order and non-tensor value
  exactly, and DCP serializes it once, at the request.

Loading decodes the skeleton with PyTorch's restricted unpickler, allowing the DeepSpeed types
its checkpoints hold (``deepspeed_safe_globals``), and puts the loaded tensors back in their slots.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Mapping
from typing import Any, Iterator

import torch

__all__ = ["TensorSlot", "pack", "unpack", "skeleton_of", "deepspeed_safe_globals", "allow_deepspeed_types"]

#: The separator between the file name and the keys of a tensor's item name.
SEP = "/"


class TensorSlot:
    """Where a tensor was in a file's state dict: its DCP item name and what ``torch.save``
    would have kept of it (``nn.Parameter`` or plain, ``requires_grad``)."""

    __slots__ = ("fqn", "requires_grad", "parameter")

    def __init__(self, fqn: str, requires_grad: bool = False, parameter: bool = False) -> None:
        self.fqn, self.requires_grad, self.parameter = fqn, bool(requires_grad), bool(parameter)

    def __reduce__(self):
        # Rebuilt by a call the restricted unpickler allows (see deepspeed_safe_globals).
        return (TensorSlot, (self.fqn, self.requires_grad, self.parameter))

    def __repr__(self) -> str:
        return f"TensorSlot({self.fqn!r})"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def pack(file: str, state: Mapping) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors, skeleton)`` of one file's state dict: its tensors by item name, and the state
    with each tensor replaced by its ``TensorSlot``. A tensor object met twice (tied weights)
    gets one item and two slots naming it. Containers without tensors are kept as they are."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, TensorSlot] = {}

    def name(path: tuple) -> str:
        base = SEP.join((file, *(str(p) for p in path)))
        fqn, n = base, 1
        # Keys 0 and "0" of one dict, or "/" inside keys: never two items one name.
        while fqn in tensors:
            n += 1
            fqn = f"{base}~{n}"
        return fqn

    def walk(value: Any, path: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            slot = seen.get(id(value))
            if slot is None:
                slot = TensorSlot(name(path), value.requires_grad, isinstance(value, torch.nn.Parameter))
                tensors[slot.fqn] = value.detach()
                seen[id(value)] = slot
            return slot
        if not _holds_tensor(value):
            return value
        if isinstance(value, Mapping):
            items = [(k, walk(v, (*path, k))) for k, v in value.items()]
            try:
                out = type(value)()
            except TypeError:
                # A mapping type that needs arguments: a plain dict keeps the items.
                out = {}
            for k, v in items:
                out[k] = v
            return out
        items = [walk(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, list):
            return items
        if hasattr(value, "_fields"):
            # A namedtuple.
            return type(value)(*items)
        return type(value)(items)

    if not isinstance(state, Mapping):
        raise TypeError(f"DeepSpeed state for {file} must be a dict, got {type(state).__name__}")
    return tensors, walk(state, ())


def skeleton_of(value: Any) -> Iterator[TensorSlot]:
    """Every ``TensorSlot`` in a skeleton."""
    if isinstance(value, TensorSlot):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from skeleton_of(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from skeleton_of(v)


def unpack(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The state dict ``pack`` took apart: each slot replaced by its loaded tensor (one tensor
    object for slots naming the same item)."""
    made: dict[str, torch.Tensor] = {}

    def tensor(slot: TensorSlot) -> torch.Tensor:
        t = made.get(slot.fqn)
        if t is None:
            if slot.fqn not in tensors:
                raise KeyError(f"the checkpoint has no tensor item {slot.fqn!r} that its state refers to")
            t = tensors[slot.fqn]
            if slot.parameter:
                t = torch.nn.Parameter(t, requires_grad=slot.requires_grad)
            elif slot.requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            made[slot.fqn] = t
        return t

    def walk(value: Any) -> Any:
        if isinstance(value, TensorSlot):
            return tensor(value)
        if isinstance(value, Mapping):
            # A decoded skeleton: its dicts are this call's own.
            for k in list(value.keys()):
                v = value[k]
                w = walk(v)
                if w is not v:
                    value[k] = w
            return value
        if isinstance(value, list):
            for i, v in enumerate(value):
                value[i] = walk(v)
            return value
        if isinstance(value, tuple):
            items = [walk(v) for v in value]
            if all(a is b for a, b in zip(items, value)):
                # No slot inside (torch.Size, betas): kept as decoded.
                return value
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    return walk(skeleton)


# Classes DeepSpeed's checkpoints hold outside PyTorch's weights_only allowlist. Each is plain
# data: an int enum, a dataclass of two ints, loss-scaler objects whose state is numbers and
# flags, argparse.Namespace (the client state of Megatron-DeepSpeed scripts).
_DEEPSPEED_TYPES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def deepspeed_safe_globals() -> list:
    """``TensorSlot``, ``argparse.Namespace`` and the DeepSpeed classes of ``_DEEPSPEED_TYPES``
    that this DeepSpeed has: what decoding a DeepSpeed checkpoint's values may build."""
    found: list = [TensorSlot, argparse.Namespace]
    for module, name in _DEEPSPEED_TYPES:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            # Another DeepSpeed release: refused if a value needs it.
            continue
    return found


@contextlib.contextmanager
def allow_deepspeed_types() -> Iterator[None]:
    """Allow ``deepspeed_safe_globals`` in PyTorch's restricted unpickler for the duration (the
    allowlist is process-wide; only what was not allowed already is added and later removed)."""
    present = set(torch.serialization.get_safe_globals())
    ours = [g for g in deepspeed_safe_globals() if g not in present]
    with torch.serialization.safe_globals(ours):
        yield
