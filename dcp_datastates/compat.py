"""Every private name of torch (and of Python) that dcp_datastates touches, in one place.

The library uses DCP through its public protocol (StorageWriter, StorageReader, AsyncStager,
planners). Where a private name is unavoidable it is imported here, and only here, so a torch
release that moves or removes it breaks one module, and ``tests/test_compat.py`` names the
release (one test per touch point). Callers import the wrappers below, never the private names.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import ChainMap
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import default_planner as _default_planner

__all__ = [
    "TORCH_VERSION",
    "flatten_state_dict",
    "unflatten_state_dict",
    "create_write_items",
    "dcp_compat_mode",
    "cached_save_plans",
    "SavePlannerSteps",
    "global_optimizer_pre_hooks",
    "register_before_thread_join",
    "tensor_version",
    "versions_of",
    "HAS_CHECKPOINTABLE_TENSOR",
    "is_checkpointable_tensor",
    "checkpointable_global_shape",
    "ASYNC_EXECUTOR_THREAD_PREFIX",
    "default_stager_reusable",
    "is_zero_tensor",
    "on_save_failure_sent",
]

TORCH_VERSION = torch.__version__


class TorchCompatError(RuntimeError):
    """A torch private name this library relies on is gone from the installed release."""


def _missing(what: str, exc: BaseException | None = None) -> TorchCompatError:
    return TorchCompatError(
        f"dcp_datastates: torch {TORCH_VERSION} no longer provides {what}"
        + (f" ({type(exc).__name__}: {exc})" if exc else "")
        + "; this release of torch is not supported yet (see docs/torch-versions.md)"
    )


# -------------------------------------------------------------------- DCP state-dict flattening
# DCP flattens nested state dicts with these two (used by DefaultSavePlanner); the writer must
# produce exactly the same keys and mappings as the planner does.
try:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
except ImportError as _exc:  # pragma: no cover - depends on the torch release
    _flatten_error = _exc

    def flatten_state_dict(state_dict):  # type: ignore[no-redef]
        raise _missing("torch.distributed.checkpoint._nested_dict.flatten_state_dict", _flatten_error)

    def unflatten_state_dict(state_dict, mapping):  # type: ignore[no-redef]
        raise _missing("torch.distributed.checkpoint._nested_dict.unflatten_state_dict", _flatten_error)


# --------------------------------------------------------------------------- DCP write items
try:
    from torch.distributed.checkpoint.planner_helpers import _create_write_items as _cwi
except ImportError as _exc:  # pragma: no cover - depends on the torch release
    _cwi = None
    _cwi_error = _exc


def create_write_items(fqn: str, obj: Any) -> list:
    """DCP's write items of one state-dict value (the chunk offsets of a DTensor or
    ShardedTensor exactly as DefaultSavePlanner computes them)."""
    if _cwi is None:  # pragma: no cover
        raise _missing("torch.distributed.checkpoint.planner_helpers._create_write_items", _cwi_error)
    return _cwi(fqn, obj)


def dcp_compat_mode() -> str | None:
    """DCP's "derived version" switch ("2_3" when DCP emulates torch 2.3's flattening), else None."""
    from torch.distributed.checkpoint import _version  # noqa: PLC0415

    return getattr(_version, "_derived_version", None)


# -------------------------------------------------------------- CheckpointableTensor (2.14+)
# From torch 2.14 DCP saves a plain ``torch.Tensor`` that carries ``global_shape``,
# ``global_offsets``, ``local_offsets`` and ``local_sizes`` (the public, runtime-checkable
# ``torch.distributed.checkpoint.CheckpointableTensor`` protocol) as shards of a global tensor:
# its write items are SHARD items at those offsets, and loads compare ``global_shape``. The fast
# paths that take ``type(obj) is torch.Tensor`` for a whole tensor must ask this first.
try:
    from torch.distributed.checkpoint import CheckpointableTensor as _CheckpointableTensor
except ImportError:
    # torch < 2.14: no such protocol, every plain tensor is a whole tensor.
    _CheckpointableTensor = None

HAS_CHECKPOINTABLE_TENSOR = _CheckpointableTensor is not None


def is_checkpointable_tensor(obj: Any) -> bool:
    """Whether DCP treats ``obj`` as CheckpointableTensor shards (never before torch 2.14).
    Costs one attribute probe on an ordinary tensor."""
    if _CheckpointableTensor is None or not hasattr(obj, "global_offsets"):
        return False
    return isinstance(obj, torch.Tensor) and isinstance(obj, _CheckpointableTensor)


def checkpointable_global_shape(obj: Any) -> tuple:
    """The shape DCP stores and checks for ``obj``: ``global_shape`` for a CheckpointableTensor,
    else the tensor's own shape."""
    if is_checkpointable_tensor(obj):
        return tuple(obj.global_shape)
    return tuple(obj.shape)


# --------------------------------------------------------------- DCP's async executor thread
# DCP names the thread of each async_save by this prefix; the exit-time join looks for it.
ASYNC_EXECUTOR_THREAD_PREFIX = "AsyncCheckpointExecutor"


# ---------------------------------------------------------------------- DCP's DefaultStager
_stager_reusable: bool | None = None


def default_stager_reusable() -> bool:
    """Whether one ``torch.distributed.checkpoint.staging.DefaultStager`` can stage more than one
    state dict. torch 2.11's and 2.12's close their inner ``StateDictStager`` after every stage: the next
    stage fails (``KeyError: <class 'type'>``); code that reuses a stager across saves (the
    benchmark's DCP baseline) must then make one per save. Probed once (two tiny stages)."""
    global _stager_reusable
    if _stager_reusable is None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: PLC0415

        stager = DefaultStager(StagingOptions(False, False, False, False))
        try:
            for _ in range(2):
                stager.stage({"t": torch.zeros(1), "nested": {"n": 1}})
            _stager_reusable = True
        except Exception:  # noqa: BLE001 - any failure of the second stage means "not reusable"
            _stager_reusable = False
        finally:
            stager.close()
    return _stager_reusable


# ------------------------------------------------------------------------------ plan caching
def cached_save_plans() -> dict:
    """DCP's class-level cache of local save plans (key -> SavePlan), which
    ``DataStatesSavePlanner`` drops an entry of when dtypes change."""
    from torch.distributed.checkpoint.planner import SavePlanner  # noqa: PLC0415

    cache = getattr(SavePlanner, "_cached_save_plan", None)
    if not isinstance(cache, dict):
        raise _missing("SavePlanner._cached_save_plan (DCP plan caching)")
    return cache


# ------------------------------------------------------------------ global planning steps
# DefaultSavePlanner.create_global_plan (with or without its plan cache) makes a first save's
# global plan in the private ``_create_global_plan``: ``_dedup_save_plans``, the public
# ``create_default_global_save_plan``, the flattening mappings merged, then the private module
# function ``_validate_global_plan``. These are per-item Python loops over every rank's plan on
# the coordinator; ``SavePlannerSteps`` names the two replaceable steps so the planners module
# can make them cheaper without touching a private name.


class SavePlannerSteps(_default_planner.DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` whose first-save global plan runs two overridable steps:
    ``dedup_plans(all_plans)`` and ``validate_global_plan(global_plan, metadata)`` (a list of
    error messages, DCP's wording). By default both are DCP's own. ``rewrite_index_hints``
    (DCP's default: True) gives each write item of the global plan a new index holding its
    chunk's position in the metadata, a copy of every item; False keeps the ranks' items."""

    rewrite_index_hints = True

    def dedup_plans(self, all_plans: list) -> list:
        return _default_planner.DefaultSavePlanner._dedup_save_plans(self, all_plans)

    def validate_global_plan(self, global_plan: list, metadata) -> list[str]:
        validate = getattr(_default_planner, "_validate_global_plan", None)
        if validate is None:
            raise _missing("default_planner._validate_global_plan")
        return validate(global_plan, metadata)

    def _dedup_save_plans(self, all_plans: list) -> list:
        return self.dedup_plans(all_plans)

    def _create_global_plan(self, all_plans: list):
        global_plan, metadata = _default_planner.create_default_global_save_plan(
            self._dedup_save_plans(all_plans), rewrite_index_hints=self.rewrite_index_hints)
        if self.flatten_state_dict:
            # Each rank's flattening mappings, the first rank's entry winning (DCP's order).
            merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = self.validate_global_plan(global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            raise ValueError("Failed to validate global plan: "
                             + (summary if len(summary) <= 500 else summary[:500] + "... (truncated)"))
        return global_plan, metadata


# ------------------------------------------------------------------------- optimizer hooks
def global_optimizer_pre_hooks() -> dict:
    """The ordered dict of process-wide optimizer step pre-hooks (run before every optimizer's
    own pre-hooks)."""
    from torch.optim import optimizer as _optimizer  # noqa: PLC0415

    hooks = getattr(_optimizer, "_global_optimizer_pre_hooks", None)
    if not isinstance(hooks, dict):
        raise _missing("torch.optim.optimizer._global_optimizer_pre_hooks")
    return hooks


# ---------------------------------------------------------------------------- interpreter exit
def register_before_thread_join(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the interpreter starts to exit, before it joins non-daemon threads (DCP's
    async executor threads among them); later registrations run first. Python's own hook for
    this (``threading._register_atexit``) is private; where it is missing, fall back to atexit,
    which runs after that join."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython we support has it
        import atexit  # noqa: PLC0415

        atexit.register(fn)
        return
    register(fn)


# ------------------------------------------------------------------------ tensor versions
def versions_of(tensors: list) -> list:
    """``tensor_version`` of each tensor (None entries stay None), in one pass."""
    try:
        return [None if t is None else t._version for t in tensors]
    except RuntimeError:
        # An inference tensor among them: one by one.
        return [None if t is None else tensor_version(t) for t in tensors]


def tensor_version(t: torch.Tensor) -> int | None:
    """The version counter of ``t``: bumped by every in-place change of its memory (through any
    view or ``detach()`` of it). None for tensors that have none (inference tensors)."""
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return None


# -------------------------------------------------------------------------- ZeroTensor
def is_zero_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is one of autograd's ZeroTensors (``torch._efficientzerotensor``): all zeros,
    with no memory behind it (``data_ptr()`` is 0)."""
    try:
        return bool(t._is_zerotensor())
    except AttributeError as exc:  # pragma: no cover - depends on the torch release
        raise _missing("Tensor._is_zerotensor", exc) from None


# -------------------------------------------------- a collective save's failure, on every rank
# DCP fails a collective save on every rank by sending one CheckpointException (the failing
# ranks' errors) from the coordinator through its object collectives, which pickle it: the
# coordinator pickles it, every other rank unpickles it, each on the thread running that DCP
# call. That is the only moment a rank whose own part succeeded learns that the save failed
# (DCP calls nothing more on its storage writer). A reducer registered for the class (copyreg,
# Python's public hook) lets ``callback()`` run at both ends; the exception itself travels
# unchanged. What this relies on (DCP sending its failure pickled) is behaviour, not a name:
# tests/test_compat.py checks it on real ranks and names the torch release when it changes.
_failure_callbacks: list[Callable[[], None]] = []


def on_save_failure_sent(callback: Callable[[], None]) -> None:
    """Call ``callback()`` (with no argument, on the DCP thread concerned) wherever a
    ``CheckpointException`` is pickled or unpickled. Registering one callback twice is a no-op.
    A callback's own error is swallowed: it must never break DCP's collective."""
    import copyreg  # noqa: PLC0415

    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415

    if callback not in _failure_callbacks:
        _failure_callbacks.append(callback)
    copyreg.pickle(CheckpointException, _reduce_checkpoint_exception)


def _run_failure_callbacks() -> None:
    for callback in list(_failure_callbacks):
        try:
            callback()
        except Exception:  # noqa: BLE001, S110 - see on_save_failure_sent
            pass


def _reduce_checkpoint_exception(exc: BaseException):
    _run_failure_callbacks()
    return _rebuild_checkpoint_exception, (type(exc), exc.args), exc.__dict__ or None


def _rebuild_checkpoint_exception(cls, args):
    _run_failure_callbacks()
    return cls(*args)
