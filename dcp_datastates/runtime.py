"""The process-wide engine: created once, on first use, and shared by every writer and reader.

The host cache is allocated when the engine is created and reused by every checkpoint after it.
At interpreter exit in-flight checkpoints are drained before the engine shuts down.
"""

from __future__ import annotations

import atexit
import logging
import threading

from .config import DataStatesConfig

__all__ = ["get_engine", "engine_stats", "shutdown_engine"]

log = logging.getLogger("dcp_datastates")

_lock = threading.Lock()
_engine = None
_engine_config: DataStatesConfig | None = None


def _load_extension():
    try:
        from . import _engine  # noqa: PLC0415 - the compiled extension
    except ImportError as exc:  # pragma: no cover - only when the package was not built
        raise ImportError(
            "dcp_datastates' C++ engine (dcp_datastates._engine) is not built; "
            "install the package with `pip install .` (or `pip install -e .`)"
        ) from exc
    return _engine


def get_engine(config: DataStatesConfig):
    """Return the process-wide engine, creating it with ``config`` on first use.

    Later configs reuse the existing engine (its host cache is never reallocated); a request for a
    larger cache than the running engine has is logged once, not honoured, so memory stays bounded.
    """
    global _engine, _engine_config
    with _lock:
        if _engine is not None and not _engine.is_shut_down:
            if config.host_cache_size > _engine_config.host_cache_size:
                log.warning(
                    "dcp_datastates: engine already running with a %d-byte host cache; a config asked "
                    "for %d bytes. The existing cache is reused (call shutdown_engine() first to resize).",
                    _engine_config.host_cache_size,
                    config.host_cache_size,
                )
            return _engine
        ext = _load_extension()
        _engine = ext.Engine(
            cache_bytes=config.host_cache_size,
            chunk_bytes=config.chunk_size,
            copy_threads=config.copy_threads,
            flush_threads=config.flush_threads,
            read_threads=config.read_threads,
            cache_wait_timeout_s=float(config.cache_wait_timeout),
        )
        _engine_config = config
        st = _engine.stats()
        log.info(
            "dcp_datastates engine: CPU mode, host cache %d bytes (chunk %d bytes, %d copy / %d flush "
            "threads, hardware CRC32C: %s)",
            st["cache_bytes"],
            st["chunk_bytes"],
            st["copy_threads"],
            st["flush_threads"],
            bool(st["hw_crc32c"]),
        )
        return _engine


def current_engine():
    """The running engine, or None (never creates one)."""
    with _lock:
        return _engine if _engine is not None and not _engine.is_shut_down else None


def engine_stats() -> dict:
    """Statistics of the running engine (empty when none runs): cache size and address, number of
    cache allocations (1 for the engine's lifetime), bytes staged/flushed/read, jobs, waits."""
    eng = current_engine()
    return dict(eng.stats()) if eng is not None else {}


def shutdown_engine() -> None:
    """Drain in-flight checkpoints and stop the engine. Idempotent; the next use starts a new one."""
    global _engine, _engine_config
    with _lock:
        eng, _engine, _engine_config = _engine, None, None
    if eng is not None:
        eng.shutdown()


atexit.register(shutdown_engine)
