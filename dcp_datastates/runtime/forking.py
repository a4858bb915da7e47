"""What a forked child keeps of its parent's checkpoint machinery: nothing it can use.

``os.fork`` (a DataLoader worker, ``multiprocessing``'s fork context, an evaluation child)
copies the engine's objects but none of its threads. In the child those objects are dead:
a save through the parent's engine would wait forever for copy workers that do not exist, and
destroying them would hang too: their C++ destructors join those threads and wait on condition
variables that only the parent's threads could release. So after a fork, ``engine`` and
``inflight`` set the parent's objects aside with ``keep_forever`` and start empty; the child's
first save or load starts an engine of its own. (The host cache itself is not even mapped in the
child: csrc/host_cache.cpp maps it with MADV_DONTFORK.)
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["keep_forever"]


def keep_forever(obj: Any) -> None:
    """One more reference to ``obj`` that nothing ever drops: it is never destroyed in this
    process, not even when the interpreter finalizes (which would run its destructor)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
