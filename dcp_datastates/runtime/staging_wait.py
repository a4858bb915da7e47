"""The training thread's waits for staging: ``wait_staged``, the global optimizer step hook and
``protect_optimizer`` wait for exactly the saves the registry (``inflight.staging()``) lists as
still copying into the host cache, before the caller mutates parameters (``optimizer.step()``).

For copies from a GPU the wait is, where possible, a device-side stream wait: once every copy of
a checkpoint is queued on the engine's copy stream, the caller's current CUDA stream is made to
wait for the last of them and the Python thread goes on at once; the optimizer's kernels then run
after the copies. Otherwise (copies still waiting for cache space, CPU sources) the thread waits.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import torch

from ..compat import global_optimizer_pre_hooks
from . import inflight

__all__ = ["wait_staged", "protect_optimizer", "install_step_wait"]


def _cuda_stream(device: int) -> int | None:
    """This thread's current CUDA stream on ``device`` (an int handle), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.current_stream(device).cuda_stream


def _ordered_on_device(job: Any) -> bool:
    """True when ``job`` needs no host wait: a device-side wait now orders the caller's CUDA
    stream after its copies (or it is staged already)."""
    device_wait = getattr(job, "device_wait", None)
    return device_wait is not None and bool(device_wait(_cuda_stream))


def _wait_all(timeout: float | None, device_side: bool) -> bool:
    """Wait until every save still staging (the registry, ``inflight.staging()``) has all its
    bytes in the host cache, or (with ``device_side``) until the current CUDA stream is ordered
    after its copies. Each save is sealed on the way (its sources' version counters checked, see
    save/version_guard.py): what the caller changes after this returns cannot reach it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for save in inflight.staging():
        if device_side and _ordered_on_device(save):
            save.seal()
            continue  # stays listed: a wait from another stream must order that one too
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not save.wait_staged(left):
            return False
        save.seal()
        inflight.staged(save)
    return True


def wait_staged(timeout: float | None = None, *, device_side: bool = True) -> bool:
    """Block until every in-flight checkpoint of this process is fully staged (its bytes are in
    the host cache, so live tensors may change). Returns False if ``timeout`` seconds passed first.
    Staging errors are not raised here: they surface from the save's ``upload_completion``.

    For tensors on a GPU whose copies are all queued already, this does not block: it makes the
    current CUDA stream wait for the copies instead, so work queued on that stream afterwards
    (``optimizer.step()``) cannot change them first. Pass ``device_side=False`` to block until the
    bytes are in host memory (needed before changing the tensors from another stream or the CPU)."""
    return _wait_all(timeout, device_side)


class _StepGuard:
    """Handle returned by ``protect_optimizer``; ``remove()`` undoes what it did: nothing for a
    ``torch.optim`` optimizer (every one of them waits while a lazy save stages, see
    ``install_step_wait``), the wrapper of another object's ``step``."""

    def __init__(self, target: Any = None, original: Any = None) -> None:
        self._target = weakref.ref(target) if target is not None else None
        self._original = original

    def remove(self) -> None:
        target = self._target() if self._target is not None else None
        if target is not None and self._original is not None:
            if target.__dict__.get("step") is not None:
                del target.__dict__["step"]
            self._original = None


# The one process-wide hook that makes every torch.optim optimizer's step wait for staging.
_hook_lock = threading.Lock()
_hook_handle: Any = None


def _wait_before_step(_optimizer, _args, _kwargs):
    if inflight.staging():
        wait_staged()
    return None


def install_step_wait() -> None:
    """Make the step of every ``torch.optim`` optimizer wait while a lazy save stages (called by
    each lazy ``stage()``; cheap when installed). PyTorch runs global step pre-hooks before every
    optimizer's own, for fused and foreach kernels alike; the wait is put first among them, so it
    precedes any other pre-hook whenever that one was registered (an MoE expert-bias update, say).
    With nothing staging, the hook costs one locked copy of an empty list."""
    global _hook_handle
    from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: PLC0415

    with _hook_lock:
        hooks = global_optimizer_pre_hooks()
        if _hook_handle is None or _hook_handle.id not in hooks:
            _hook_handle = register_optimizer_step_pre_hook(_wait_before_step)
        hooks.move_to_end(_hook_handle.id, last=False)


def protect_optimizer(optimizer: Any) -> _StepGuard:
    """Make ``optimizer.step()`` wait for in-flight staging, so a checkpoint requested before the
    step holds the pre-step values. Returns a handle with ``remove()``.

    Every ``torch.optim`` optimizer (fused and foreach included) already waits while a lazy save
    stages, without this call (``install_step_wait``); for one, this only installs that hook
    early. For update code outside ``torch.optim`` (an object with a ``step()`` method that is
    not a ``torch.optim.Optimizer``), this wraps that object's ``step`` with ``wait_staged()``.

    Other in-place changes of checkpointed tensors (an EMA update, a manual ``p.add_()``, writes
    through ``.data``) need ``wait_staged()`` first: see docs/how-it-works.md, "What the guard
    sees"."""
    if isinstance(optimizer, torch.optim.Optimizer):
        install_step_wait()
        return _StepGuard()
    step = getattr(optimizer, "step", None)
    if not callable(step):
        raise TypeError(
            f"protect_optimizer: expected a torch.optim.Optimizer or an object with a step() method, "
            f"got {type(optimizer).__name__}"
        )
    if getattr(step, "_dcp_datastates_waits", False):
        return _StepGuard()

    def waiting_step(*args, **kwargs):
        wait_staged()
        return step(*args, **kwargs)

    waiting_step._dcp_datastates_waits = True  # type: ignore[attr-defined]
    try:
        optimizer.__dict__["step"] = waiting_step
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"protect_optimizer: cannot wrap step() of {type(optimizer).__name__}: {exc}") from exc
    return _StepGuard(optimizer, step)
