"""Tracks checkpoints whose staging (copies into the host cache) is still in flight, so the
training loop can wait for exactly that before it mutates parameters (``optimizer.step()``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

__all__ = ["wait_staged", "protect_optimizer", "StagingTracker"]


class StagingTracker:
    """The set of in-flight staging jobs (objects with ``wait_staged(timeout) -> bool``)."""

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

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every job staged so far has all its bytes in the host cache."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self.pending():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.wait_staged(left):
                return False
            self.discard(job)
        return True


_tracker = StagingTracker()


def tracker() -> StagingTracker:
    return _tracker


def wait_staged(timeout: float | None = None) -> bool:
    """Block until every in-flight checkpoint of this process is fully staged (its bytes are in
    the host cache, so live tensors may change). Returns False if ``timeout`` seconds passed first.
    Staging errors are not raised here: they surface from the save's ``upload_completion``."""
    return _tracker.wait(timeout)


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
