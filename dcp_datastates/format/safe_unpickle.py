"""Decoding a checkpoint's non-tensor values without running code from the checkpoint.

DCP stores every non-tensor value as ``torch.save`` bytes and its default load planner decodes
them with ``torch.load(weights_only=False)``: a value whose ``__reduce__`` names ``os.system``
would run it. The reader therefore decodes each value first with PyTorch's restricted
unpickler (``torch.load(weights_only=True)``), which only builds numbers, strings, bytes,
containers, tensors, torch's safe types and whatever the user allowlisted with
``torch.serialization.add_safe_globals`` / ``safe_globals``. On top of that this module allows a
few types trainers save and that construct nothing but data (``EXTRA_SAFE_GLOBALS``).

A value the restricted unpickler refuses raises ``UnsafeCheckpointError`` naming the checkpoint,
the item and the classes or functions it would import, unless the load is ``trusted``.
"""

from __future__ import annotations

import datetime
import io
import pathlib
import pickle
import re
import threading
import warnings
from typing import Any

import torch

from ..errors import CheckpointFormatError, UnsafeCheckpointError
from ..forking import new_locks_in_child

__all__ = ["EXTRA_SAFE_GLOBALS", "decode_value", "restricted_pickle_loads", "TRUST_HINT"]

TRUST_HINT = (
    "if you trust whoever wrote this checkpoint, load it with DataStatesReader(..., trusted=True) "
    "(command line: --trust), which runs code from the checkpoint; or allow just these names with "
    "torch.serialization.add_safe_globals([...])"
)


def _extra_safe_globals() -> dict[bytes, list]:
    """Types beyond torch's defaults that trainers save and that build only data, keyed by a
    byte string their pickled names contain: BytesIO values (DCP stores them pickled), a few
    side-effect-free builtins, ``datetime`` and ``pathlib`` values, ``torch.Generator``, numpy
    scalars and numeric arrays (numpy's legacy RNG state is a tuple holding one). numpy is
    optional."""
    groups: dict[bytes, list] = {b"BytesIO": [io.BytesIO], b"frozenset": [frozenset], b"range": [range], b"slice": [slice]}
    # Constructors of plain data that trainers keep in their state (a run's start time, its output
    # folder, a sampler's generator): none of them touches files, imports or calls anything else.
    groups[b"datetime"] = [datetime.datetime, datetime.date, datetime.time, datetime.timedelta, datetime.timezone]
    groups[b"pathlib"] = [pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath]
    # A generator's state is a uint8 tensor, checked by set_state.
    groups[b"Generator"] = [torch.Generator]
    try:
        import numpy as np  # noqa: PLC0415
    except ImportError:
        return groups
    core = getattr(np, "_core", None) or np.core
    scalar, reconstruct = core.multiarray.scalar, core.multiarray._reconstruct
    numpy = [np.dtype, np.ndarray, scalar, reconstruct]
    # Pickles from numpy 1.x name numpy.core, numpy 2.x numpy._core: accept both spellings.
    for prefix in ("numpy.core.multiarray", "numpy._core.multiarray"):
        numpy += [(scalar, f"{prefix}.scalar"), (reconstruct, f"{prefix}._reconstruct")]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in dir(dtypes):
            cls = getattr(dtypes, name)
            # Numeric and boolean dtype classes only (not ObjectDType / StringDType / VoidDType).
            if isinstance(cls, type) and name.endswith("DType") and not name.startswith(("Object", "String", "Void")):
                numpy.append(cls)
    groups[b"numpy"] = numpy
    return groups


_EXTRA_GROUPS = _extra_safe_globals()
EXTRA_SAFE_GLOBALS: list = [g for group in _EXTRA_GROUPS.values() for g in group]

# torch keeps the allowlist in one process-wide set: add our extras for the duration of a
# decode, and only those the user had not added already (so leaving never removes theirs).
_allow_lock = threading.Lock()
new_locks_in_child(globals(), "_allow_lock")


def _restricted_load(data: bytes) -> Any:
    with warnings.catch_warnings():
        # A crafted value draws torch's "unexpected pickle protocol" warning: the error says enough.
        warnings.simplefilter("ignore", UserWarning)
        return _restricted_load_quiet(data)


def _restricted_load_quiet(data: bytes) -> Any:
    # Only the groups whose names occur in the bytes (pickles spell module and class names out;
    # torch.save stores its pickle uncompressed): a longer allowlist slows every lookup, and
    # most values need none. Missing a group can only refuse a value, never admit one.
    wanted = [g for key, group in _EXTRA_GROUPS.items() if key in data for g in group]
    if not wanted:
        return torch.load(io.BytesIO(data), weights_only=True)
    with _allow_lock:
        present = set(torch.serialization.get_safe_globals())
        ours = [g for g in wanted if g not in present]
        # safe_globals removes exactly ``ours`` on exit.
        with torch.serialization.safe_globals(ours):
            return torch.load(io.BytesIO(data), weights_only=True)


def _refused_names(data: bytes, message: str) -> list[str]:
    """The globals the value would import: from a static scan of its pickle when it is a
    ``torch.save`` archive, else from the restricted unpickler's message."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - not a zip archive, or unreadable: fall back to the message
        names = []
    extra = {f"{g.__module__}.{g.__qualname__}" if not isinstance(g, tuple) else g[1] for g in EXTRA_SAFE_GLOBALS}
    names = sorted(n for n in names if n not in extra)
    if names:
        return names
    found = re.findall(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>|unrecognized function ([\w.<>]+)", message)
    return sorted({next(x for x in m if x) for m in found})


def decode_value(data: bytes, *, checkpoint: str, item: str) -> Any:
    """Decode one stored non-tensor value with the restricted unpickler.

    Raises UnsafeCheckpointError when decoding would import anything not allowlisted, and
    CheckpointFormatError when the bytes are not a decodable value at all."""
    try:
        return _restricted_load(data)
    except pickle.UnpicklingError as exc:
        names = _refused_names(data, str(exc))
        what = ", ".join(names) if names else "objects outside the allowlist"
        raise UnsafeCheckpointError(
            f"checkpoint {checkpoint}: item {item!r} is a pickled value that would import {what} when "
            f"loaded, which can run code from the checkpoint; refused. {TRUST_HINT[0].upper()}{TRUST_HINT[1:]}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the restricted decoder runs no checkpoint code: any failure is bad bytes
        text = " ".join(str(exc).split())[:300]
        raise CheckpointFormatError(
            f"checkpoint {checkpoint}: item {item!r} cannot be decoded as a stored value: {text or type(exc).__name__}"
        ) from None


# ------------------------------------------------------------------ plain pickles inside values
# Some Stateful objects pickle part of their state themselves and store the bytes as a value
# (TorchTitan's dataloader: ``pickle.dumps(StatefulDataLoader.state_dict())``), then unpickle it
# in ``load_state_dict``. ``restricted_pickle_loads`` is the drop-in for that ``pickle.loads``.


def _tensor_from_bytes(blob: bytes):
    """What ``torch.storage._load_from_bytes`` does for a pickled tensor's storage (a legacy
    ``torch.save`` blob), with the restricted unpickler."""
    return torch.load(io.BytesIO(blob), weights_only=True)


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """A pickled tensor's view of its storage, built with public API (``set_`` checks bounds)."""
    t = torch.empty((0,), dtype=storage.dtype).set_(storage, storage_offset, tuple(size), tuple(stride))
    t.requires_grad_(bool(requires_grad))
    return t


_PLAIN_PICKLE_GLOBALS = {
    "collections.OrderedDict": __import__("collections").OrderedDict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.bytearray": bytearray,
    "builtins.slice": slice,
    "builtins.range": range,
    # Protocol 2 spells bytes this way.
    "_codecs.encode": __import__("codecs").encode,
    "torch.storage._load_from_bytes": _tensor_from_bytes,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
}


class _PlainRestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Every GLOBAL / STACK_GLOBAL / INST lands here.
        found = _PLAIN_PICKLE_GLOBALS.get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")
        return found


def restricted_pickle_loads(data: bytes, *, checkpoint: str = "the checkpoint", item: str = "a value") -> Any:
    """``pickle.loads`` for pickle bytes stored inside a checkpoint value: builds only numbers,
    strings, bytes, containers, ``OrderedDict``, sets and CPU tensors; anything else raises
    UnsafeCheckpointError naming what it would import."""
    try:
        return _PlainRestrictedUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        names = re.findall(r"GLOBAL ([\w.]+)", str(exc))
        if names:
            raise UnsafeCheckpointError(
                f"checkpoint {checkpoint}: {item} holds pickled data that would import {', '.join(names)} when "
                f"loaded, which can run code from the checkpoint; refused. {TRUST_HINT[0].upper()}{TRUST_HINT[1:]}"
            ) from None
        raise CheckpointFormatError(f"checkpoint {checkpoint}: {item} holds damaged pickled data: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - only allowlisted constructors ran: any failure is bad bytes
        text = " ".join(str(exc).split())[:300]
        raise CheckpointFormatError(
            f"checkpoint {checkpoint}: {item} holds damaged pickled data: {text or type(exc).__name__}"
        ) from None
