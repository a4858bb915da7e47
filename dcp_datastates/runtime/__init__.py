"""The process-wide runtime: the C++ engine and its host cache (``engine``), the one registry
of saves in flight and the training thread's waits for those still staging (``inflight``), the
checkpoint's own process group (``process_group``), and what happens at interpreter exit. Nothing here knows how a save is planned or written."""

# inflight first: its atexit hook (the GC pause's watchdog stops) then runs after the engine's,
# which lets in-flight checkpoints commit (atexit runs hooks last-registered first).
from . import inflight  # noqa: F401  (isort: skip)
from .engine import current_engine, engine_mode, engine_stats, get_engine, shutdown_engine, start_engine

__all__ = ["get_engine", "current_engine", "engine_mode", "engine_stats", "shutdown_engine", "start_engine"]
