"""Runs a function on N CPU ranks (gloo) in spawned processes, for multi-rank tests.

Each rank calls ``fn(rank, world_size, *args)``; an exception on any rank fails the test with
that rank's traceback. Processes are always joined or killed.

Ranks are forked from a forkserver that imported torch once (``_PRELOAD``) instead of spawned:
a spawned rank spends ~2-3 s of CPU importing torch and DCP, and the suite launches ranks about a
hundred times on 2 cores. A forked rank starts from the server's state, not the test's, so
``_entry`` first takes the test process's environment (tests set variables such as
``DCP_DATASTATES_RANKS_PER_NODE`` right before launching); dcp_datastates itself is not preloaded
and reads its variables when called, as in a real launch.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once in the forkserver; every rank forks from it. Not dcp_datastates (see above).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(rank, world_size, port, fn, args, errors, environ):
    os.environ.clear()
    os.environ.update(environ)
    # A rank that dies from a signal (SIGABRT from C++, SIGSEGV) prints every thread's Python stack.
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - report every failure, including CheckpointException
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A clean rank leaves without interpreter finalization: torch 2.13's gloo worker thread can
    # still be dropping the last reference to a finished collective's Python-created tensor
    # (an AsyncBarrierWork holding an all_gather's work) when the interpreter finalizes; taking
    # the GIL then ends that thread with pthread_exit through a noexcept frame and the rank
    # aborts ("terminate called without an active exception", seen in 2-8 % of fixture runs).
    # Our own exit path (the engine drain at exit) is covered by tests/test_shutdown.py.
    from dcp_datastates.runtime import shutdown_engine

    shutdown_engine()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn, *args, timeout: float = 240.0) -> None:
    """Run ``fn`` on ``world_size`` spawned ranks. A launch whose rendezvous port was taken in
    the meantime (another test run on the machine) is retried on a new port."""
    for attempt in range(3):
        failure = _launch(world_size, fn, args, timeout)
        if failure is None:
            return
        if "EADDRINUSE" in failure and attempt < 2:
            continue
        raise AssertionError(failure)


def _launch(world_size: int, fn, args, timeout: float) -> str | None:
    import time

    ctx = _context()
    errors = ctx.SimpleQueue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, errors, environ), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        first_error = None
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            if first_error is None and not errors.empty():
                first_error = errors.get()
                # the others should raise too within seconds; do not wait out the timeout for them
                deadline = min(deadline, time.monotonic() + 30)
            time.sleep(0.05)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        if first_error is None and not errors.empty():
            first_error = errors.get()
        if first_error is not None:
            rank, tb = first_error
            return f"rank {rank} failed:\n{tb}"
        if hung:
            return f"ranks {hung} did not finish within {timeout} s"
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            return f"ranks exited abnormally: {bad}"
        return None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
