"""DataStatesConfig: every option of the engine and of the writer/reader, in one dataclass.

Accepts the spellings of the DataStates-LLM seeds: a Nanotron-style ``datastates:`` block
(``host_cache_size`` in GB when a bare number, ``parser_threads``, ``pin_host_cache``), a
DeepSpeed-style ``datastates_ckpt`` section, and sizes written as strings ("16GB", "512MiB").
Sizes are parsed by ``sizes.py``, the defaults drawn from this machine come from ``machine.py``
and config files are read by ``config_file.py``; their public names are importable from here too.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .config_file import read_config_file
from .machine import CachePlan, check_cache_fits, default_cache_plan, default_copy_threads, default_read_threads, memory_limit

# Re-exported: importable from here as before.
from .machine import local_ranks as local_ranks
from .machine import usable_cpus as usable_cpus
from .sizes import GIB_BELOW, cache_size, parse_size

__all__ = ["DataStatesConfig", "parse_size", "cache_size", "default_cache_plan", "CachePlan", "ENGINE_OPTIONS", "check_cache_fits", "memory_limit"]


# Option spellings from the seeds and from DCP's FileSystemWriter, mapped to our field names.
_ALIASES = {
    "parser_threads": "copy_threads",
    "thread_count": "flush_threads",
    "io_threads": "flush_threads",
    "verify_checksums": "verify",
    "cache_size": "host_cache_size",
}
# Keys that belong to the surrounding framework's config and mean nothing to us.
_IGNORED = {"checkpointing_engine", "single_file_per_rank", "per_thread_copy_ahead"}
# Options the process-wide engine takes when it starts (it cannot change them while it runs).
ENGINE_OPTIONS = ("host_cache_size", "chunk_size", "cache_alignment", "copy_threads", "flush_threads", "read_threads",
                  "pin_host_cache", "cache_wait_timeout")
# Environment variable giving host_cache_size when no config does (same size rule).
CACHE_SIZE_ENV = "DCP_DATASTATES_HOST_CACHE_SIZE"
# Fields that hold byte sizes; host_cache_size and gpu_cache_size follow ``cache_size``'s rule.
_GB_SIZES = {"host_cache_size", "gpu_cache_size"}
_BYTE_SIZES = {"chunk_size", "copy_at_request_max_bytes", "copy_at_request_total_bytes"}


@dataclass
class DataStatesConfig:
    """All options, with their defaults. Sizes are bytes once parsed.

    Attributes:
        host_cache_size: bytes of host memory the engine preallocates once and reuses for every
            checkpoint (the seeds' ``host_cache_size``). A number without a unit is GiB below
            65536 (``16``: 16 GiB, as in the seeds) and bytes from 65536 up, wherever it is
            written; at least 65536 bytes.
            None (default): ``$DCP_DATASTATES_HOST_CACHE_SIZE``, else a quarter of the node's
            memory split between its local ranks (``default_cache_plan``). A checkpoint larger
            than the cache streams through it.
        pin_host_cache: page-lock the cache with ``cudaHostRegister`` when CUDA is present.
        prefault_host_cache: fault the whole cache in on a background thread when the engine
            starts, so the first checkpoint pays no page faults and resident memory is flat from
            it on. None (default): only when ``host_cache_size`` was chosen (a cache of the
            built-in default size is left to fault in as checkpoints use it). A pinned cache is
            resident anyway.
        gpu_cache_size: accepted from DataStates-LLM configs and ignored (there is no device-side
            snapshot tier; a non-zero value logs a warning).
        chunk_size: unit of copy, flush and checksum (bytes). Clamped to a quarter of the cache.
        cache_alignment: alignment in bytes (a power of two, at least 512) of the host cache and
            of every chunk slot in it: 4096 suits page-granular I/O and pinned DMA.
        copy_threads: threads copying tensors into the cache (seeds: ``parser_threads``);
            default 2, or 1 where the process may use at most 2 CPUs (the training thread keeps a core).
        flush_threads: threads writing chunks to storage (DCP: ``thread_count``).
        read_threads: threads reading files on load (default min(4, 2 x CPUs)); engine-wide,
            and a reader's value also caps the workers of its own loads.
        sync_files: fsync data files and the commit marker (DCP ``FileSystemWriter`` meaning).
        direct_writes: write CPU tensors' bytes to their data files straight from the tensors'
            memory, with no copy into the host cache first: one pass over memory instead of two.
            The save is then staged (the next optimizer step may run) once the files are written
            (to the page cache, fsync'ed later), not once the bytes are in the cache. None
            (default): only where the checkpoint folder (or the local tier) is on a memory-backed
            file system (tmpfs, ramfs: ``/dev/shm``), where writing a file is itself a memory copy
            and the cache's copy doubled the work; on a disk the cache lets training go on while
            the disk is slower than memory. True: for every local folder; False: never. CUDA
            tensors and object stores always go through the host cache.
        direct_io: write synced data files (``sync_files``) from the host cache past the page
            cache (O_DIRECT): each chunk's whole pages go to the device with no kernel copy and
            no dirty pages left for the kernel to write back, which otherwise take CPU and memory
            bandwidth from training; its last partial page goes through the page cache. None
            (default): for saves that recur, i.e. whose request comes within 8 times the last
            save's duration after the previous request (checkpoints every few steps); a save
            that does not recur goes through the page cache, durable a little sooner and read
            from memory by a load right after it; so does every save into a ``local_tier``, whose
            drain reads the files back at once (``save/rhythm.py``). True: every synced save;
            False: never. Local folders that refuse O_DIRECT (at the open, or its writes with
            EINVAL), direct writes, unsynced saves and object stores write through the page cache
            as before.
        overwrite: allow saving into a folder that already holds a committed checkpoint.
        verify: verify item checksums on load.
        cache_wait_timeout: seconds a copy may wait for cache space before the save fails.
        copy_at_request_max_bytes: tensors of at most this many bytes are copied at the request,
            on the training thread (memcpy, or a device-to-device copy on the current CUDA
            stream), instead of lazily: state that the next forward changes in place without a
            version bump (BatchNorm's running statistics and its counter, other small buffers)
            is then saved at its request-time value. Default 64 KiB (BatchNorm up to 16,384 fp32
            channels); 0 turns it off. Larger buffers that forward changes need ``wait_staged()``
            before that forward (docs/how-it-works.md, "What the guard sees").
        copy_at_request_total_bytes: the most bytes of such tensors one save copies at the request
            (per rank), the smallest first: when the tensors of at most
            ``copy_at_request_max_bytes`` hold more, only those up to the largest size that still
            fits are copied at the request (a warning says so once per state structure); the rest
            are copied lazily under the version guard. It bounds the training thread's copy for
            states made of many mid-size tensors (20,000 x 53 KiB: 1 GiB copied in the call).
            Default 64 MiB: normalization statistics and counters come first and a large
            convolutional network holds under 1 MiB of them.
        dedup_replicated: write each replicated value (DTensor replicas, plain tensors and
            non-tensor values that every rank holds) from one rank only, chosen at ``stage()``.
            Turn off when ranks hold different plain tensors (pipeline parallelism).
        hierarchical_consolidation: gather write results rank -> node leader -> coordinator in
            the background instead of every rank sending to the coordinator.
        storage_options: passed to fsspec for remote URLs.
        local_tier: a node-local folder (NVMe, tmpfs): each save is committed there first, then
            drained in the background to the checkpoint path (``tiers/local_tier.py``). None: off.
        keep_local: local copies kept in ``local_tier`` (newest first); older ones are removed
            once drained, never before.
        drain_timeout: with ``local_tier`` and several ranks, the most seconds the coordinator
            waits for every rank's drain report before failing the save (the checkpoint then
            stays on the local tiers), however steadily the ranks progress; a rank that fails
            reports at once.
        stall_timeout: seconds a save waits on a rank, or a peer, that shows no sign of life
            before it fails (the one knob for a frozen or cut-off node): with ``local_tier`` and
            several ranks, a rank whose drain report has not been renewed for this long fails
            the save on every rank (each rank renews it every quarter of it, from the moment its
            drain is queued until it reports); with ``peer_copies``, the default
            ``peer_timeout``; the timeout of ``checkpoint_process_group()``. A drain that is
            alive but slow is bounded by ``drain_timeout``. docs/configuration.md, "When a node
            stops", gives the bounds.
        incremental: a tensor whose bytes are unchanged since the newest committed checkpoint
            beside this one (same parent folder) is not written again; the new checkpoint's
            metadata refers to that checkpoint's file, and stays complete for a strict load
            (``save/incremental.py``; docs/how-it-works.md, "Incremental saves"). Unchanged
            means the same name, chunk, dtype, shape and XXH64 of the bytes staged now. With
            ``local_tier``, the base and the references are the durable checkpoints.
        peer_copies: with ``local_tier`` and several ranks, 1 gives each rank's data files of
            every save a verified copy in the local tier of a rank on another node, after the
            local commit, in the background over a gloo group of the library's own
            (``tiers/peers.py``); a node lost then loses no file the other nodes cannot serve.
            Nodes are told apart by the host name, or by ``DCPDS_NODE``. 0 (default): off.
        peer_timeout: seconds a peer copy may wait for its peer before this process stops
            making peer copies (the checkpoints themselves are saved and drained as usual).
            None (default): ``stall_timeout``.
    """

    host_cache_size: int | None = None
    pin_host_cache: bool = True
    prefault_host_cache: bool | None = None
    gpu_cache_size: int = 0
    chunk_size: int = 16 << 20
    cache_alignment: int = 4096
    copy_threads: int = field(default_factory=default_copy_threads)
    flush_threads: int = 2
    read_threads: int = field(default_factory=default_read_threads)
    sync_files: bool = True
    direct_writes: bool | None = None
    direct_io: bool | None = None
    overwrite: bool = True
    verify: bool = True
    cache_wait_timeout: float = 600.0
    copy_at_request_max_bytes: int = 64 << 10
    copy_at_request_total_bytes: int = 64 << 20
    dedup_replicated: bool = True
    hierarchical_consolidation: bool = True
    storage_options: dict = field(default_factory=dict)
    local_tier: str | None = None
    keep_local: int = 2
    drain_timeout: float = 3600.0
    stall_timeout: float = 300.0
    incremental: bool = False
    peer_copies: int = 0
    peer_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.local_tier is not None:
            if not isinstance(self.local_tier, (str, os.PathLike)) or not os.fspath(self.local_tier):
                raise ValueError(f"local_tier: expected a local folder path, got {self.local_tier!r}")
            if "://" in os.fspath(self.local_tier):  # option check: the local tier is a folder of this machine
                raise ValueError(f"local_tier: must be a node-local folder, not a URL: {os.fspath(self.local_tier)!r}")
            self.local_tier = os.path.abspath(os.fspath(self.local_tier))
        if self.host_cache_size is not None:
            self.host_cache_size = cache_size(self.host_cache_size, "host_cache_size")
            _check_cache_min(self.host_cache_size, "host_cache_size")
        self.gpu_cache_size = cache_size(self.gpu_cache_size, "gpu_cache_size")
        self.chunk_size = parse_size(self.chunk_size, name="chunk_size")
        self.copy_at_request_max_bytes = parse_size(self.copy_at_request_max_bytes, name="copy_at_request_max_bytes")
        self.copy_at_request_total_bytes = parse_size(self.copy_at_request_total_bytes,
                                                      name="copy_at_request_total_bytes")
        if self.chunk_size < 4096:
            raise ValueError(f"chunk_size: must be at least 4096 bytes, got {self.chunk_size}")
        align = self.cache_alignment
        if isinstance(align, bool) or not isinstance(align, int) or align < 512 or align & (align - 1):
            raise ValueError(f"cache_alignment: expected a power of two of at least 512 bytes, got {align!r}")
        for name in ("copy_threads", "flush_threads", "read_threads", "keep_local"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if isinstance(self.drain_timeout, bool) or not isinstance(self.drain_timeout, (int, float)) \
                or not (self.drain_timeout > 0):
            raise ValueError(f"drain_timeout: expected seconds > 0, got {self.drain_timeout!r}")
        if isinstance(self.peer_copies, bool) or self.peer_copies not in (0, 1):
            raise ValueError(f"peer_copies: expected 0 or 1 (copies on other nodes), got {self.peer_copies!r}")
        if self.peer_copies and self.local_tier is None:
            raise ValueError("peer_copies: needs local_tier (the copies are kept in the other nodes' local tiers)")
        if isinstance(self.stall_timeout, bool) or not isinstance(self.stall_timeout, (int, float)) \
                or not (self.stall_timeout > 0):
            raise ValueError(f"stall_timeout: expected seconds > 0, got {self.stall_timeout!r}")
        if self.peer_timeout is not None and (isinstance(self.peer_timeout, bool)
                                              or not isinstance(self.peer_timeout, (int, float))
                                              or not (self.peer_timeout > 0)):
            raise ValueError(f"peer_timeout: expected seconds > 0, got {self.peer_timeout!r}")
        if not (self.cache_wait_timeout > 0):
            raise ValueError(f"cache_wait_timeout: expected seconds > 0, got {self.cache_wait_timeout!r}")
        for name in ("pin_host_cache", "sync_files", "overwrite", "verify", "dedup_replicated", "hierarchical_consolidation",
                     "incremental"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        for name in ("prefault_host_cache", "direct_writes", "direct_io"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}: expected true, false or null, got {value!r}")

    # ----------------------------------------------------------------- construction helpers
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, bare_sizes_in_gb: bool = True) -> "DataStatesConfig":
        """Build from a mapping: flat options, or a ``datastates:`` / ``datastates_ckpt`` block
        (the other keys of such a document, e.g. the rest of a DeepSpeed config, are ignored).

        Sizes follow ``cache_size``'s rule, as everywhere (``bare_sizes_in_gb`` is kept for
        callers of older releases and changes nothing).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"DataStatesConfig.from_dict: expected a mapping, got {type(data).__name__}")
        for block in ("datastates", "datastates_ckpt"):
            if block in data:
                inner = data[block]
                if not isinstance(inner, Mapping):
                    raise ValueError(f"'{block}' must be a mapping of options, got {type(inner).__name__}")
                return cls.from_dict(inner, bare_sizes_in_gb=bare_sizes_in_gb)
        return cls(**_normalize(data, bare_sizes_in_gb=bare_sizes_in_gb))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "DataStatesConfig":
        """Load a YAML or JSON file (by extension; JSON with ``//`` comments is accepted, as in
        the DeepSpeed tutorial)."""
        p = Path(path)
        data = read_config_file(p)
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{p}: {exc}") from exc

    @classmethod
    def resolve(cls, config: "DataStatesConfig | Mapping | str | os.PathLike | None", options: Mapping[str, Any]) -> "DataStatesConfig":
        """What the writer/reader constructors accept: a config, a dict, a file path, or None,
        then keyword options on top (sizes follow the same rule as everywhere: ``cache_size``)."""
        if config is None:
            base = cls()
        elif isinstance(config, DataStatesConfig):
            base = config
        elif isinstance(config, Mapping):
            base = cls.from_dict(config)
        elif isinstance(config, (str, os.PathLike)):
            base = cls.from_file(config)
        else:
            raise ValueError(f"config: expected DataStatesConfig, dict or file path, got {type(config).__name__}")
        if not options:
            return base
        return dataclasses.replace(base, **_normalize(options, bare_sizes_in_gb=False))

    def peer_wait(self) -> float:
        """Seconds a peer copy waits for its peer: ``peer_timeout``, else ``stall_timeout``."""
        return float(self.stall_timeout if self.peer_timeout is None else self.peer_timeout)

    def cache_plan(self) -> tuple[int, str]:
        """(host cache bytes, how they were chosen): the option, the environment, or the default."""
        if self.host_cache_size is not None:
            return self.host_cache_size, "host_cache_size"
        env = os.environ.get(CACHE_SIZE_ENV, "").strip()
        if env:
            nbytes = cache_size(env, CACHE_SIZE_ENV)
            _check_cache_min(nbytes, CACHE_SIZE_ENV)
            return nbytes, CACHE_SIZE_ENV
        plan = default_cache_plan()
        return plan.nbytes, plan.describe()

    def cache_bytes(self) -> int:
        return self.cache_plan()[0]

    def cache_was_chosen(self) -> bool:
        """True when the user chose the cache size (option or environment), not the default."""
        return self.host_cache_size is not None or bool(os.environ.get(CACHE_SIZE_ENV, "").strip())

    def prefault_enabled(self) -> bool:
        """Whether the engine should fault its cache in at start (see ``prefault_host_cache``)."""
        if self.prefault_host_cache is not None:
            return self.prefault_host_cache
        return self.cache_was_chosen()

    def engine_settings(self) -> dict:
        """The options the engine takes at start, resolved (the cache size in bytes)."""
        out = {name: getattr(self, name) for name in ENGINE_OPTIONS}
        out["host_cache_size"] = self.cache_bytes()
        return out

    def is_default_engine(self) -> bool:
        """True when no engine option differs from its default (a reader's or a bare writer's
        config): such an engine may be restarted with the next writer's settings."""
        base = DataStatesConfig()
        return not self.cache_was_chosen() and all(
            getattr(self, n) == getattr(base, n) for n in ENGINE_OPTIONS if n != "host_cache_size"
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _normalize(data: Mapping[str, Any], *, bare_sizes_in_gb: bool) -> dict:
    known = {f.name for f in fields(DataStatesConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = _ALIASES.get(key, key)
        if key in _IGNORED:
            continue
        if name not in known:
            names = sorted(known | set(_ALIASES))
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown DataStates option {key!r}{hint}; known options: {', '.join(names)}")
        if name in _GB_SIZES and value is not None:
            value = cache_size(value, name)
        elif name in _BYTE_SIZES:
            value = parse_size(value, name=name)
        out[name] = value
    return out


def _check_cache_min(nbytes: int, name: str) -> None:
    if nbytes < GIB_BELOW:
        raise ValueError(f"{name}: must be at least {GIB_BELOW} bytes, got {nbytes}")


def tool_config() -> DataStatesConfig:
    """A small engine for offline tools (verify, convert): reads go straight into tensors, the
    host cache is hardly used, so it must not reserve (and on GPU machines pin) gigabytes."""
    return DataStatesConfig(
        host_cache_size=64 << 20,
        pin_host_cache=False,
        chunk_size=16 << 20,
        read_threads=max(2, min(8, os.cpu_count() or 2)),
    )
