"""The checkpoint's own process group: a gloo group for DCP's collectives whose waits end after
``stall_timeout`` instead of gloo's default 30 minutes.

DCP runs its collectives (the planning gather and scatter, the write results' gather, the
commit's broadcast) on the group given to ``dcp.save`` / ``dcp.async_save``. A rank that stops
before it reaches one of them (its node frozen or cut off) holds every other rank there for that
group's timeout: nothing in the storage writer can end that wait. With this group every
surviving rank's save fails within ``stall_timeout``; the library's own waits (drain reports,
peer copies) are bounded by the same knob. See docs/configuration.md, "When a node stops".

Each of DCP's collectives on this group waits only for the other ranks to arrive, after their
staging (``async_save``) or their writing (``dcp.save`` writes inside its write step): choose
``stall_timeout`` above the longest time one rank may take for those (the default, 300 s, is
far above a healthy rank's). Every rank must call this, in the same order (a group is made
collectively), typically once after ``init_process_group``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..config import DataStatesConfig

__all__ = ["checkpoint_process_group"]


def checkpoint_process_group(config: Any = None, **options: Any) -> dist.ProcessGroup:
    """A new gloo group of every rank whose collectives time out after the configuration's
    ``stall_timeout`` seconds (``config`` and ``options`` as ``DataStatesWriter`` takes them).
    Pass it to ``dcp.async_save(..., process_group=...)`` and to
    ``DataStatesWriter(..., process_group=...)``."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("checkpoint_process_group: call torch.distributed.init_process_group() first")
    stall = DataStatesConfig.resolve(config, options).stall_timeout
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=stall))
