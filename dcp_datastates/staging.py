"""Tracks checkpoints whose staging (copies into the host cache) is still in flight, so the
training loop can wait for exactly that before it mutates parameters (``optimizer.step()``).

For copies from a GPU the wait is, where possible, a device-side stream wait: once every copy of
a checkpoint is queued on the engine's copy stream, the caller's current CUDA stream is made to
wait for the last of them and the Python thread goes on at once; the optimizer's kernels then run
after the copies. Otherwise (copies still waiting for cache space, CPU sources) the thread waits.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

__all__ = ["wait_staged", "protect_optimizer", "StagingTracker"]


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


class StagingTracker:
    """The set of in-flight staging jobs (objects with ``wait_staged(timeout) -> bool`` and,
    for copies from a GPU, ``device_wait(stream_of) -> bool``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: set[Any] = set()

    def add(self, job: Any) -> None:
        with self._lock:
            self._jobs.add(job)

    def discard(self, job: Any) -> None:
        with self._lock:
            self._jobs.discard(job)

    def pending(self) -> list[Any]:
        with self._lock:
            return list(self._jobs)

    def wait(self, timeout: float | None = None, device_side: bool = True) -> bool:
        """Wait until every job staged so far has all its bytes in the host cache, or (with
        ``device_side``) until the current CUDA stream is ordered after its copies."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self.pending():
            if device_side and _ordered_on_device(job):
                continue  # stays tracked: a wait from another stream must order that one too
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.wait_staged(left):
                return False
            self.discard(job)
        return True


_tracker = StagingTracker()


def tracker() -> StagingTracker:
    return _tracker


def wait_staged(timeout: float | None = None, *, device_side: bool = True) -> bool:
    """Block until every in-flight checkpoint of this process is fully staged (its bytes are in
    the host cache, so live tensors may change). Returns False if ``timeout`` seconds passed first.
    Staging errors are not raised here: they surface from the save's ``upload_completion``.

    For tensors on a GPU whose copies are all queued already, this does not block: it makes the
    current CUDA stream wait for the copies instead, so work queued on that stream afterwards
    (``optimizer.step()``) cannot change them first. Pass ``device_side=False`` to block until the
    bytes are in host memory (needed before changing the tensors from another stream or the CPU)."""
    return _tracker.wait(timeout, device_side)


class _StepGuard:
    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def remove(self) -> None:
        self._handle.remove()


def protect_optimizer(optimizer: torch.optim.Optimizer) -> _StepGuard:
    """Make ``optimizer.step()`` wait for in-flight staging, so a checkpoint requested before the
    step holds the pre-step values. Returns a handle with ``remove()``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"protect_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")

    def _wait_before_step(_opt, _args, _kwargs):
        wait_staged()
        return None

    return _StepGuard(optimizer.register_step_pre_hook(_wait_before_step))
