"""What a forked child keeps of its parent's checkpoint machinery: nothing it can use.

``os.fork`` (a DataLoader worker, ``multiprocessing``'s fork context, an evaluation child)
copies every object of the process but none of its threads. In the child, the objects that
stand for threads are dead:

- the engine and the saves in flight: a save through the parent's engine would wait forever for
  copy workers that do not exist, and destroying them would hang too (their C++ destructors join
  those threads and wait on condition variables that only the parent's threads could release).
  ``runtime`` sets them aside with ``keep_forever`` and starts empty; the child's first save or
  load starts an engine of its own. (The host cache is not even mapped in the child:
  csrc/host_cache.cpp maps it with MADV_DONTFORK.)
- thread pools: a ``ThreadPoolExecutor`` whose threads were idle at the fork counts them as idle
  in the child too and starts none, so work submitted there never runs. Every pool of the
  library is a ``ThreadPool``, made again in a forked child.
- module-level locks: one that a parent's thread held at the fork stays held in the child
  forever. Each module names its own to ``new_locks_in_child``.
- torch's intra-op thread pool (OpenMP): once the parent has run a parallel op, the child's first
  parallel op waits forever for the parent's pool threads. The packed metadata codec runs torch
  ops on the save's and the load's tables, so a child runs torch on one thread
  (``torch.set_num_threads(1)``), as PyTorch's DataLoader does for its workers.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["keep_forever", "ThreadPool", "new_locks_in_child"]


def keep_forever(obj: Any) -> None:
    """One more reference to ``obj`` that nothing ever drops: it is never destroyed in this
    process, not even when the interpreter finalizes (which would run its destructor)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def new_locks_in_child(namespace: dict, *names: str) -> None:
    """After ``os.fork``, in the child, the module-level locks ``names`` of ``namespace`` (the
    module's ``globals()``) are new, unheld ones. The module must use them by name only."""
    def renew() -> None:
        for name in names:
            namespace[name] = threading.Lock()

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=renew)


class ThreadPool:
    """A ``ThreadPoolExecutor`` of this process; a forked child gets a new one (an executor
    starts no thread until work is submitted)."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._new = lambda: ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._executor = self._new()
        _pools.add(self)

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        return self._executor.submit(fn, *args, **kwargs)

    def _forget_in_child(self) -> None:
        # The parent's stays behind, with its threads' bookkeeping.
        self._executor = self._new()


_pools: weakref.WeakSet[ThreadPool] = weakref.WeakSet()


def _forget_pools_in_child() -> None:
    for pool in list(_pools):
        pool._forget_in_child()


def _one_torch_thread_in_child() -> None:
    import torch

    if torch.get_num_threads() > 1:
        torch.set_num_threads(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)
    os.register_at_fork(after_in_child=_one_torch_thread_in_child)
