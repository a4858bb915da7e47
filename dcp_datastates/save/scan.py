"""The flat state and its scan: the state dict flattened as DCP does, then read in one pass.

``flatten`` gives DCP's flat state dict; ``scan_state`` reads, per value, what the plan cache keys
on (names, dtypes, shapes, devices, shardings: the structure's signature) and what this checkpoint
copies (the memory, what keeps it alive, the non-tensor values' bytes serialized now, the version
counters). States the scan does not cover (non-contiguous views, other devices, ShardedTensor,
CheckpointableTensor shards, tensor subclasses) have no ``Scan``: they take the plan-cache miss
path (``planning``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..compat import HAS_CHECKPOINTABLE_TENSOR, dcp_compat_mode, flatten_state_dict, is_checkpointable_tensor, versions_of
from .items import DTENSOR, PLAIN, VALUE
from .values import serialize_object

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch builds without distributed
    DTensor = None

__all__ = ["flatten", "Scan", "scan_state"]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


class _NeedsDcpFlatten(Exception):
    """A value ``_flatten`` leaves to DCP's own traversal (lists)."""


def _flatten(state_dict: dict) -> tuple[dict, dict]:
    """Exactly ``flatten_state_dict(state_dict)`` (same keys, order, paths and duplicate-key
    error), computed directly for nested mappings: faster than DCP's generic traversal, which
    matters on the training thread with tens of thousands of tensors. States
    holding lists (whose traversal depends on their contents) and DCP's 2.3 compatibility mode
    go through DCP itself."""
    if dcp_compat_mode() == "2_3":
        return flatten_state_dict(state_dict)
    flat: dict = {}
    mappings: dict = {}
    try:
        _walk(flat, mappings, "", (), state_dict)
    except _NeedsDcpFlatten:
        return flatten_state_dict(state_dict)
    return flat, mappings


def _walk(flat: dict, mappings: dict, prefix: str, path: tuple, node: Mapping) -> None:
    # A module-level function, not a closure calling itself: such a closure is a reference
    # cycle, which would keep the flat dict (and every tensor in it) alive until a collection.
    # Exact-type tests first: a plain tensor leaf (nearly every value) costs no ABC check.
    for k, v in node.items():
        if type(k) is not str:
            k = str(k)
        tv = type(v)
        if tv is not _Tensor and (tv is dict or isinstance(v, Mapping)):
            _walk(flat, mappings, prefix + k + ".", path + (k,), v)
            continue
        if tv is list or (tv is not _Tensor and isinstance(v, list)):
            raise _NeedsDcpFlatten
        name = prefix + k
        if name in flat:
            raise ValueError(f"duplicated flatten key {name}")
        flat[name] = v
        mappings[name] = path + (k,)


def flatten(state_dict: dict) -> tuple[dict, dict]:
    """(flat state dict, mappings), exactly as DCP's ``flatten_state_dict``."""
    return _flatten(state_dict)


@dataclass
class Scan:
    """One pass over the flat state dict: the structure signature and, per value in flat order,
    the pointer to copy from and what keeps that memory alive.

    - ``devices``: CUDA device index per value; -1 for host memory.
    - ``payloads``: the non-tensor values' bytes (uint8), serialized now, by flat position.
    - ``names``: flat keys, in order.
    - ``tensors``: per value: the tensor the bytes come from (a DTensor's local shard); None for values.
    - ``versions``: per value: that tensor's version counter now (``version_guard.VersionGuard``);
      None for values.
    - ``kinds``: per value: what it is (``items.classify``'s answer, decided here once).
    """

    signature: list
    ptrs: list[int]
    keeps: list
    devices: list[int]
    payloads: dict[int, torch.Tensor]
    names: list[str]
    tensors: list
    versions: list
    kinds: list

    def plain_signature(self) -> tuple:
        """Names, dtypes, shapes and devices of the plain tensors (what ownership decisions key on)."""
        return tuple(e for e in self.signature if len(e) == 5 and e[4] is None)


def _host_or_cuda(t: torch.Tensor) -> int | None:
    """-1 on the CPU, the device index on CUDA, None elsewhere (the full path copies those)."""
    if t.is_cpu:
        return -1
    return t.get_device() if t.is_cuda else None


def _dtensor_entry(v) -> tuple | None:
    """(local tensor, signature element) of a DTensor whose shard is a plain dense tensor."""
    local = v.to_local()
    if type(local) is not _Tensor:
        return None
    return local, (v.dtype, v.shape, v.placements, v.device_mesh, local.shape)


def scan_state(flat: dict) -> Scan | None:
    """The signature of ``flat``'s structure and its memory, or None when the state holds values
    the scan does not cover (see the module docstring). Costs a few attribute reads per tensor.

    The signature holds, per value: its name, then dtype, shape and device of a tensor (and the
    global shape, placements and mesh of a DTensor), or the length of a non-tensor value's bytes.
    """
    sig: list = []
    ptrs: list[int] = []
    keeps: list = []
    devices: list[int] = []
    payloads: dict[int, torch.Tensor] = {}
    tensors: list = []
    kinds: list[str] = []
    for i, (name, v) in enumerate(flat.items()):
        tp = type(v)
        if tp is _Tensor or (tp is _Parameter and type(v.data) is _Tensor):
            if HAS_CHECKPOINTABLE_TENSOR and is_checkpointable_tensor(v):
                # Shards of a global tensor (torch 2.14+): DCP's write items.
                return None
            t, extra = v, None
            kinds.append(PLAIN)
        elif DTensor is not None and tp is DTensor:
            entry = _dtensor_entry(v)
            if entry is None:
                return None
            t, extra = entry
            kinds.append(DTENSOR)
        elif isinstance(v, _Tensor):
            # ShardedTensor, subclasses: DCP's own write items, every time.
            return None
        else:
            buf = payloads[i] = serialize_object(v)
            sig.append((name, buf.numel()))
            ptrs.append(buf.data_ptr() if buf.numel() else 0)
            keeps.append(buf)
            devices.append(-1)
            tensors.append(None)
            kinds.append(VALUE)
            continue
        dev = _host_or_cuda(t)
        dtype = t.dtype
        # Views whose memory is not their values (strided; a negative bit; a conjugate bit, which
        # changes nothing in a real tensor) and tensors with no memory (ZeroTensor) take the full
        # path: items.py makes their bytes.
        if dev is None or not t.is_contiguous() or t.is_neg() or (dtype.is_complex and t.is_conj()):
            return None
        ptr = t.data_ptr()
        if not ptr and t.numel():
            return None
        sig.append((name, dtype, t.shape, dev, extra))
        ptrs.append(ptr)
        # The memory itself, even if the tensor's .data is swapped.
        keeps.append(t.untyped_storage())
        devices.append(dev)
        tensors.append(t)
    return Scan(sig, ptrs, keeps, devices, payloads, list(flat), tensors, versions_of(tensors), kinds)
