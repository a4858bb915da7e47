"""Facts about this machine: its memory, the ranks sharing its node, its CPUs, and the defaults drawn from them.

The default host cache (``default_cache_plan``), the default thread counts of the engine and
the check that a cache fits the node's memory (``check_cache_fits``) are read from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CachePlan", "check_cache_fits", "default_cache_plan", "default_copy_threads", "default_read_threads",
           "local_ranks", "memory_limit", "usable_cpus"]


def memory_limit() -> int:
    """Bytes of memory this process's node can use: physical memory, or the cgroup's limit when
    that is lower (a container: pinned and resident memory count against it)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


# Environment variables that give the number of processes on this node, in order of trust.
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
# The share of the node's memory that all default-sized caches of the node take together.
CACHE_SHARE = 0.25
MIN_DEFAULT_CACHE = 256 << 20


def local_ranks() -> tuple[int, str]:
    """(processes sharing this node, where that number came from)."""
    for var in _LOCAL_SIZE_VARS:
        text = os.environ.get(var, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text), var
    return 1, "no LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class CachePlan:
    """How the default host cache size was chosen (see ``default_cache_plan``)."""

    nbytes: int
    memory: int
    local_ranks: int
    local_ranks_from: str

    def describe(self) -> str:
        return (
            f"default: {CACHE_SHARE:.0%} of {self.memory / 2**30:.1f} GiB node memory shared by "
            f"{self.local_ranks} local rank(s) ({self.local_ranks_from}); set host_cache_size to choose"
        )


def default_cache_plan() -> CachePlan:
    """The default host cache: a quarter of the node's memory (physical, or the cgroup limit),
    split between the processes of the node, at least 256 MiB. The caches of a node then take a
    quarter of its memory together, pinned or not: pinned memory must stay well below the
    node's memory, since the kernel can neither swap nor reclaim it."""
    memory = memory_limit()
    n, source = local_ranks()
    nbytes = max(MIN_DEFAULT_CACHE, int(memory * CACHE_SHARE) // n)
    nbytes -= nbytes % 4096
    return CachePlan(nbytes, memory, n, source)


def check_cache_fits(nbytes: int, name: str = "host_cache_size") -> None:
    """Raise MemoryError when a cache of ``nbytes`` cannot fit in this node's memory. Checked when
    the engine starts (``start_engine`` or the first checkpoint), not when a config is parsed: a
    config file is machine-independent and may be read on a smaller machine than it runs on."""
    memory = memory_limit()
    if nbytes > memory:
        raise MemoryError(
            f"{name}: {nbytes} bytes ({nbytes / 2**30:.1f} GiB) asked, but this machine has "
            f"{memory} bytes ({memory / 2**30:.1f} GiB) of memory; choose a smaller host_cache_size "
            f"(a unitless number is GiB below 65536 and bytes from 65536 up; '16GB' or '512MiB' are explicit)"
        )


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS tells it, else all of them)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_copy_threads() -> int:
    """2, or 1 where the process may use at most 2 CPUs: there a second copy worker takes the
    training thread's core during ``stage()`` (the call waits for its core: its wall time runs
    well past its CPU time) without staging any faster (time to durable is the same or a little
    longer; the figures are in docs/benchmarks.md, "Engine thread counts")."""
    return 1 if usable_cpus() <= 2 else 2


def default_read_threads() -> int:
    """min(4, 2 x CPUs): on 2 cores, 2 and 4 workers read a 1 GiB checkpoint equally fast, warm
    and cold (each streams its own part of the file), and more only add context switches."""
    return max(1, min(4, 2 * (os.cpu_count() or 1)))
