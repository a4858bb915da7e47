"""The process-wide engine: created once, on first use, and shared by every writer and reader.

The host cache is allocated when the engine is created and reused by every checkpoint after it.
At interpreter exit in-flight checkpoints are drained before the engine shuts down.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from ..compat import ASYNC_EXECUTOR_THREAD_PREFIX, register_before_thread_join
from ..config import CACHE_SIZE_ENV, ENGINE_OPTIONS, DataStatesConfig
from ..forking import keep_forever, new_locks_in_child
from ..machine import check_cache_fits, memory_limit
from ..native import engine_module
from . import gc_pause, inflight  # noqa: F401 - gc_pause first: its atexit then runs after ours

__all__ = ["get_engine", "start_engine", "engine_stats", "shutdown_engine"]

log = logging.getLogger("dcp_datastates")

_lock = threading.Lock()
new_locks_in_child(globals(), "_lock")
_engine = None
_engine_config: DataStatesConfig | None = None
# The engine options in force, resolved (cache size in bytes).
_engine_settings: dict = {}
# Started with defaults only (e.g. by a load): the next writer may restart it.
_engine_provisional = False
# (option, asked, in force) already reported for this engine.
_warned: set = set()


def _load_extension():
    return engine_module()


# Defaults of the engine options other than the cache size (fixed for the life of the process).
_DEFAULTS = {n: getattr(DataStatesConfig(), n) for n in ENGINE_OPTIONS if n != "host_cache_size"}


# (engine option values, cache-size environment variable) -> what ``_asked`` found for them, for
# the last config seen: get_engine runs at every stage(), and the same writer asks the same.
_asked_memo: tuple = ((), {})


def _asked(config: DataStatesConfig) -> dict:
    """The engine options ``config`` sets on purpose: those that differ from the defaults, and
    the cache size when it was chosen (option or environment)."""
    global _asked_memo
    key = (tuple(getattr(config, n) for n in ENGINE_OPTIONS), os.environ.get(CACHE_SIZE_ENV))
    if _asked_memo[0] == key:
        return _asked_memo[1]
    asked = {n: getattr(config, n) for n in ENGINE_OPTIONS if n != "host_cache_size" and getattr(config, n) != _DEFAULTS[n]}
    # Never the default plan here: get_engine runs at every stage().
    if config.cache_was_chosen():
        asked["host_cache_size"] = config.cache_bytes()
    _asked_memo = (key, asked)
    return asked


def _idle(engine) -> bool:
    st = engine.stats()
    return st["jobs_submitted"] == st["jobs_done"]


def get_engine(config: DataStatesConfig):
    """Return the process-wide engine, creating it with ``config`` on first use.

    The engine's options (``ENGINE_OPTIONS``: cache size, chunk size, threads, pinning, timeout)
    are fixed while it runs. A config asking for other values either restarts it, when it was
    started with defaults only (by a load, or a writer without options) and no checkpoint is in
    flight, or is reported once per option with the value asked and the value in force.
    """
    global _engine
    with _lock:
        if _exiting and (_engine is None or _engine.is_shut_down):
            raise RuntimeError("dcp_datastates: the interpreter is exiting; no new checkpoint I/O can start")
        if _engine is not None and not _engine.is_shut_down:
            differing = {n: v for n, v in _asked(config).items() if _engine_settings.get(n) != v}
            if not differing:
                return _engine
            if _engine_provisional and _idle(_engine):
                old, _engine = _engine, None
                old.shutdown()
                log.info(
                    "dcp_datastates engine: restarting with %s (it was started with default settings, "
                    "e.g. by a load, and no checkpoint is in flight)",
                    ", ".join(f"{n}={v!r}" for n, v in differing.items()),
                )
                return _start(config)
            for name, value in differing.items():
                key = (name, value, _engine_settings.get(name))
                if key not in _warned:
                    _warned.add(key)
                    log.warning(
                        "dcp_datastates: %s=%r is ignored: the process-wide engine already runs with %s=%r "
                        "(engine options take effect when the engine starts; set them on the first writer, "
                        "or with start_engine(), or call shutdown_engine() between checkpoints to restart it)",
                        name, value, name, _engine_settings.get(name),
                    )
            return _engine
        return _start(config)


def _start(config: DataStatesConfig):
    """Create the engine (caller holds _lock). Raises MemoryError naming the option when the
    cache cannot be allocated or pinned."""
    global _engine, _engine_config, _engine_settings, _engine_provisional
    ext = _load_extension()
    cache_bytes, how = config.cache_plan()
    option = "host_cache_size" if how == "host_cache_size" or not config.cache_was_chosen() else how
    check_cache_fits(cache_bytes, option)
    try:
        engine = ext.Engine(
            cache_bytes=cache_bytes,
            chunk_bytes=config.chunk_size,
            alignment=config.cache_alignment,
            copy_threads=config.copy_threads,
            flush_threads=config.flush_threads,
            read_threads=config.read_threads,
            cache_wait_timeout_s=float(config.cache_wait_timeout),
            pin=bool(config.pin_host_cache),
            prefault=config.prefault_enabled(),
        )
    except MemoryError as exc:
        raise MemoryError(
            f"{option}: cannot allocate a host cache of {cache_bytes} bytes ({cache_bytes / 2**30:.2f} GiB); "
            f"this machine has {memory_limit()} bytes of memory. Choose a smaller host_cache_size. ({exc})"
        ) from exc
    st = engine.stats()
    if st["cuda"] and config.pin_host_cache and not st["pinned"]:
        status = engine.cuda_status
        engine.shutdown()
        raise MemoryError(
            f"{option}: cannot pin a host cache of {cache_bytes} bytes ({cache_bytes / 2**30:.2f} GiB) with "
            f"cudaHostRegister ({status}); this machine has {memory_limit()} bytes of memory. Choose a smaller "
            f"host_cache_size, or pin_host_cache=False (slower copies from GPUs)."
        )
    _engine, _engine_config = engine, config
    _engine_settings = dict(config.engine_settings(), host_cache_size=cache_bytes)
    _engine_provisional = config.is_default_engine()
    _warned.clear()
    log.info(
        "dcp_datastates engine: %s, host cache %d bytes (%.2f GiB, %s; chunk %d bytes, %d copy / %d flush "
        "threads, CRC32C: %s)",
        engine_mode(engine),
        st["cache_bytes"],
        st["cache_bytes"] / 2**30,
        how,
        st["chunk_bytes"],
        st["copy_threads"],
        st["flush_threads"],
        ext.crc32c_implementations()[0],
    )
    if not st["cuda"]:
        log.debug("dcp_datastates engine: no CUDA: %s", engine.cuda_status)
    if config.gpu_cache_size:
        log.warning(
            "dcp_datastates engine: gpu_cache_size=%d is ignored: there is no device-side snapshot tier; "
            "copies go device -> pinned host cache directly",
            config.gpu_cache_size,
        )
    return engine


def start_engine(config=None, **options) -> dict:
    """Start the process-wide engine now rather than at the first checkpoint, with ``config`` and
    ``options`` as ``DataStatesWriter`` takes them; returns ``engine_stats()``.

    Call it during setup: the host cache is allocated and (see ``prefault_host_cache``) faulted in
    on a background thread while the model and data load, so the first checkpoint stages as fast
    as the later ones. Does nothing but return the stats when the engine already runs.
    """
    get_engine(DataStatesConfig.resolve(config, options))
    return engine_stats()


def engine_mode(engine) -> str:
    """"CPU mode" or "CUDA mode (runtime <path>, N devices, host cache pinned: yes/no)"."""
    st = engine.stats()
    if not st["cuda"]:
        return "CPU mode"
    pinned = "yes" if st["pinned"] else "no"
    return f"CUDA mode (runtime {engine.cuda_runtime}, {engine.cuda_devices} devices, host cache pinned: {pinned})"


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
    global _engine, _engine_config, _engine_provisional
    with _lock:
        eng, _engine, _engine_config, _engine_provisional = _engine, None, None, False
    if eng is not None:
        eng.shutdown()


def _set_aside_in_child() -> None:
    """After ``os.fork``, in the child: the parent's engine has no threads here and can neither
    run a save nor be shut down (see ``forking``). It is kept, untouched, and the child's first
    checkpoint starts an engine of its own."""
    global _engine, _engine_config, _engine_settings, _engine_provisional
    if _engine is not None:
        keep_forever(_engine)
    _engine, _engine_config, _engine_settings, _engine_provisional = None, None, {}, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_set_aside_in_child)


# ------------------------------------------------------------------------------ interpreter exit
# Threads that may sit in an engine wait (GIL released) while a checkpoint is in flight: DCP's
# async_save executor (planning, write_data, finish) and the writer's staging watchers.
_CHECKPOINT_THREAD_PREFIXES = (ASYNC_EXECUTOR_THREAD_PREFIX, "dcp-datastates-staging")
_exiting = False


def _checkpoint_threads(prefixes: tuple[str, ...] = _CHECKPOINT_THREAD_PREFIXES) -> list[threading.Thread]:
    return inflight.running_threads(prefixes)


def _join_checkpoint_threads(timeout: float | None, prefixes: tuple[str, ...] = _CHECKPOINT_THREAD_PREFIXES) -> bool:
    """Wait until no checkpoint thread runs; True when none is left. Interruptible (Ctrl-C)."""
    import time  # noqa: PLC0415

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        threads = _checkpoint_threads(prefixes)
        if not threads:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        # Returns early if that thread ends; re-checked either way.
        threads[0].join(0.05)


def _shutdown_at_exit() -> None:
    """atexit: let in-flight checkpoints commit, then stop the engine.

    Python joins DCP's executor threads before atexit runs, so normally every checkpoint is
    committed by now. When that join was interrupted (a second Ctrl-C while exiting), the
    checkpoint threads are joined here again, then the engine drains its jobs and the threads
    get a last chance to finish (commit, or fail cleanly), so none of them wakes up inside an
    engine wait while the interpreter finalizes (which would abort the process). A further
    Ctrl-C skips the remaining waits; the checkpoint is then left incomplete (no commit).
    """
    global _exiting
    try:
        # DCP's executor threads end after their one save (as Python's own exit join assumes).
        _join_checkpoint_threads(None, _CHECKPOINT_THREAD_PREFIXES[:1])
    except KeyboardInterrupt:
        # Ctrl-C again: stop waiting; the engine still drains below.
        pass
    finally:
        # get_engine refuses from here on: no new engine threads at exit.
        _exiting = True
        shutdown_engine()
        if _checkpoint_threads():
            try:
                if not _join_checkpoint_threads(30.0):
                    log.warning("dcp_datastates: a checkpoint thread is still running at exit: %s", _checkpoint_threads())
            except KeyboardInterrupt:
                pass


atexit.register(_shutdown_at_exit)


# ------------------------------------------------------------------- Ctrl-C with a save in flight
def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _describe(saves: list) -> str:
    parts = []
    for s in saves:
        try:
            done, total = s.progress()
            parts.append(f"{s.path} ({_mib(max(0, total - done))} of {_mib(total)} left to write)")
        except Exception:  # noqa: BLE001 - a handle that cannot report still gets named
            parts.append(str(s.path))
    return "; ".join(parts)


def _pending(saves_of=None) -> list:
    """Saves still in flight whose checkpoint threads still run (a save whose threads are gone
    cannot progress; waiting for it would hang the exit)."""
    saves = (saves_of or inflight.inflight)()
    return saves if saves and _checkpoint_threads() else []


def _wait_for_inflight_before_exit() -> None:
    """Before Python joins DCP's checkpoint threads at exit: say which checkpoint is still being
    written and how much is left, then wait for it (it commits, and the exit goes on). Ctrl-C
    while waiting abandons it: its files are failed at once, nothing is committed, the last
    committed checkpoint stays the newest, and the process exits within about a second."""
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    again = "again " if getattr(sys, "last_type", None) is KeyboardInterrupt else ""
    _release_uncaught_exception()
    saves = _pending()
    if not saves:
        return
    # The next Ctrl-C may land anywhere in here, the log call included.
    try:
        # A save that nothing has planned yet gets a moment to settle first: one staged by an
        # async_save that failed right after stage() will never commit, and must not be
        # announced as "waiting for it to commit".
        inflight.settle(saves, _SETTLE_S)
        saves = _pending()
        if not saves:
            return
        log.warning(
            "dcp_datastates: checkpoint %s still being written; waiting for it to commit. Ctrl-C %sto abandon it.",
            _describe(saves),
            again,
        )
        while _pending():
            time.sleep(0.05)
        return
    except KeyboardInterrupt:
        pass
    _abandon_all(time)


# How long the exit gives saves that no DCP thread has planned to settle before naming what it waits for.
_SETTLE_S = 2.0


def _release_uncaught_exception() -> None:
    """Drop the interpreter's reference to the exception that ended the program (already
    printed) and collect what only it kept alive.

    A Ctrl-C that lands while ``async_save`` starts its executor thread (inside
    ``ThreadPoolExecutor.submit``) leaves a worker that the executor never registered: nothing
    tells it to stop but the executor's collection, and the traceback's frames keep the executor
    alive, so Python's exit join would wait for that idle worker forever."""
    import gc  # noqa: PLC0415
    import sys  # noqa: PLC0415

    if getattr(sys, "last_value", None) is None:
        return
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


def _abandon_all(time) -> None:
    """Abandon every save in flight, say so, and give their threads a second to end. Further
    Ctrl-Cs are ignored meanwhile, so the abandoning itself is never cut short."""
    import signal  # noqa: PLC0415

    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        # Not the main thread: nothing to protect.
        previous = None
    try:
        saves = inflight.inflight()
        for s in saves:
            try:
                s.abandon("interrupted (Ctrl-C) while exiting")
            except Exception as exc:  # noqa: BLE001 - abandon the others anyway
                log.debug("dcp_datastates: abandoning %s failed: %s", getattr(s, "path", s), exc)
        log.warning(
            "dcp_datastates: abandoned checkpoint %s: not committed; the last committed checkpoint is kept.",
            ", ".join(str(getattr(s, "path", s)) for s in saves),
        )
        # Time for the checkpoint threads to see the failure and end.
        deadline = time.monotonic() + 1.0
        while _pending() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


register_before_thread_join(_wait_for_inflight_before_exit)
