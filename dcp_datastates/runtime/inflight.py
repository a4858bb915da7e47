"""The one registry of saves in flight in this process, and the training thread's waits for them.

Every lazy save registers once, at ``stage()``, and leaves once it needs nothing more. The
registry answers the three questions asked about saves in flight:

- which are still staging (``staging()``): what ``wait_staged`` and every optimizer step wait
  for; a save leaves that list when all its bytes are in the host cache (``staged``);
- which folder each one writes (``claim``): a second save to the same folder is refused while
  the first runs (its commit could describe the other's files), and a commit never removes the
  files of a save still running there (``names_in_use``);
- which are unfinished (``inflight()``): what Ctrl-C at exit names and abandons.

and makes the training thread wait for the saves still staging: ``wait_staged``, the global
optimizer step pre-hook (installed when the first save registers) and ``protect_optimizer``
wait for exactly those, before the caller mutates parameters (``optimizer.step()``). For copies
from a GPU the wait is, where possible, a device-side stream wait: once every copy of a
checkpoint is queued on the engine's copy stream, the caller's current CUDA stream is made to
wait for the last of them and the Python thread goes on at once; the optimizer's kernels then
run after the copies. Otherwise (copies still waiting for cache space, CPU sources) the thread
waits.

A save handle is any object with:

- ``path: str | None``: the checkpoint folder or URL (None until DCP names it);
- ``progress() -> (bytes_durable, bytes_total)``; ``nbytes() -> int``;
- ``abandon(reason)``: fail the save at once so nothing is committed;
- ``wait_staged(timeout) -> bool``, ``seal()`` and, for copies from a GPU,
  ``device_wait(stream_of) -> bool`` (used by ``wait_staged``);
- ``file_names() -> frozenset``: the data files it writes; ``is_over() -> bool``;
  ``awaits_planning() -> bool``: no DCP thread has taken it up yet;
- optionally ``done() -> bool``: True once the save needs nothing more (it is then not listed).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Protocol

import torch

from ..compat import ASYNC_EXECUTOR_THREAD_PREFIX, global_optimizer_pre_hooks
from ..forking import keep_forever, new_locks_in_child

__all__ = ["SaveHandle", "register", "unregister", "inflight", "staging", "staged", "claim", "release",
           "names_in_use", "FolderBusyError", "wait_staged", "protect_optimizer", "install_step_wait",
           "running_threads",
           "dcp_executor_running", "awaits_planning", "settle"]


class SaveHandle(Protocol):
    path: str | None

    def progress(self) -> tuple[int, int]: ...

    def abandon(self, reason: str) -> None: ...


class FolderBusyError(Exception):
    """Another save of this process still writes the folder (the caller words the error)."""


_lock = threading.Lock()
new_locks_in_child(globals(), "_lock")
# Every save in flight, oldest first.
_saves: list[Any] = []
# The saves whose bytes are not all in the host cache yet.
_staging: list[Any] = []
# Folder -> the save writing it.
_claims: dict[str, Any] = {}


def register(save: SaveHandle) -> None:
    """Add a save in flight, as staging (its copies were just submitted); twice lists it once.
    From now on every ``torch.optim`` step waits for it (``install_step_wait``)."""
    install_step_wait()
    with _lock:
        if not any(s is save for s in _saves):
            _saves.append(save)
        if not any(s is save for s in _staging):
            _staging.append(save)


def staged(save: SaveHandle) -> None:
    """All its bytes are copied out (into the host cache, or written with direct writes):
    ``wait_staged`` no longer waits for it."""
    with _lock:
        _staging[:] = [s for s in _staging if s is not save]


def unregister(save: SaveHandle) -> None:
    """Remove a save (committed, failed or abandoned), its claim included; unknown ones are ignored."""
    with _lock:
        _saves[:] = [s for s in _saves if s is not save]
        _staging[:] = [s for s in _staging if s is not save]
        for path in [p for p, s in _claims.items() if s is save]:
            del _claims[path]


def inflight() -> list:
    """The saves in flight, oldest first."""
    with _lock:
        saves = list(_saves)
    return [s for s in saves if not _finished(s)]


def staging() -> list:
    """The saves still staging, oldest first."""
    with _lock:
        return list(_staging)


# A save whose data is long written and that nothing finished failed elsewhere: its claim lapses.
_STALE_CLAIM_S = 600.0


def claim(path: str, save: SaveHandle) -> None:
    """``save`` writes the folder ``path``; FolderBusyError when another unfinished save does."""
    while True:
        with _lock:
            other = _claims.get(path)
            if other is None or other is save:
                _claims[path] = save
                return
        # Judged outside the lock: is_over() may close a save that nothing can finish any more
        # (which leaves this registry). One that no DCP thread has taken up yet may be such a
        # save, not judged yet: it gets a moment to settle first.
        settle([other], _CLAIM_SETTLE_S)
        busy = not other.is_over() and not (other.all_written() and time.monotonic() - other.request.requested > _STALE_CLAIM_S)
        with _lock:
            if _claims.get(path) is not other:
                # Claimed or released meanwhile: look again.
                continue
            if busy:
                raise FolderBusyError(path)
            _claims[path] = save
            return


def awaits_planning(save: Any) -> bool:
    """No DCP thread has taken ``save`` up yet, and it is not over (a handle without
    ``awaits_planning`` never does)."""
    try:
        return bool(save.awaits_planning()) and not save.is_over()
    except Exception:  # noqa: BLE001 - a broken handle is not waited for
        return False


def settle(saves: list, timeout: float) -> None:
    """Wait, at most ``timeout`` seconds, until none of ``saves`` awaits planning: DCP took it
    up, or it is over. A save staged by an ``async_save`` that failed right after ``stage()``
    is judged over (and closed) only once its staging has ended and DCP's last executor thread
    (which outlives its own save by a moment) is gone; a save that DCP will plan is taken up
    as soon as its staging ends."""
    deadline = time.monotonic() + timeout
    while any(awaits_planning(s) for s in saves) and time.monotonic() < deadline:
        time.sleep(0.01)


# How long a save into a folder waits for the save it finds there to settle (``settle``).
_CLAIM_SETTLE_S = 10.0


def release(path: str | None, save: SaveHandle) -> None:
    """``save`` no longer writes ``path``."""
    with _lock:
        if path is not None and _claims.get(path) is save:
            del _claims[path]


def names_in_use(path: str) -> frozenset:
    """Data files of a save into ``path`` still running in this process (never removed by a commit)."""
    with _lock:
        other = _claims.get(path)
    if other is None or other.is_over():
        return frozenset()
    return other.file_names()


def running_threads(prefixes: tuple[str, ...]) -> list[threading.Thread]:
    """The threads whose names start with one of ``prefixes`` and still run. Judged by the
    interpreter's live thread states, not by ``Thread.is_alive()``: a join interrupted by Ctrl-C
    can mark a running thread as stopped (CPython 3.11's bpo-45274 handling releases the thread's
    own lock)."""
    import sys  # noqa: PLC0415

    live = sys._current_frames()
    me = threading.get_ident()
    return [t for t in threading.enumerate() if t.ident != me and t.ident in live and t.name.startswith(prefixes)]


def dcp_executor_running() -> bool:
    """One of DCP's ``async_save`` executor threads runs: the only threads that take a staged save
    on to its planning (each lives for its one save)."""
    return bool(running_threads((ASYNC_EXECUTOR_THREAD_PREFIX,)))


def _finished(save: Any) -> bool:
    done = getattr(save, "done", None)
    try:
        return bool(done()) if callable(done) else False
    except Exception:  # noqa: BLE001 - a broken handle counts as still in flight
        return False

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
    """Wait until every save still staging (the registry, ``staging()``) has all its
    bytes in the host cache, or (with ``device_side``) until the current CUDA stream is ordered
    after its copies. Each save is sealed on the way (its sources' version counters checked, see
    save/version_guard.py): what the caller changes after this returns cannot reach it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for save in staging():
        if device_side and _ordered_on_device(save):
            save.seal()
            # Stays listed: a wait from another stream must order that one too.
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not save.wait_staged(left):
            return False
        save.seal()
        staged(save)
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
new_locks_in_child(globals(), "_hook_lock")
_hook_handle: Any = None


def _wait_before_step(_optimizer, _args, _kwargs):
    if staging():
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




def _forget_saves_in_child() -> None:
    """A forked child has none of the parent's saves: its optimizer steps must not wait for
    them, nor its exit, nor may it destroy them (``forking``). They are kept, untouched."""
    global _saves, _staging, _claims
    keep_forever((_saves, _staging, _claims))
    _saves, _staging, _claims = [], [], {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_saves_in_child)
