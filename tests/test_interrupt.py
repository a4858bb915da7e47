"""Ctrl-C while a checkpoint is in flight, with real SIGINTs sent to a subprocess.

The first Ctrl-C says which checkpoint is still being written, how much is left, and that a
second one abandons it; the second abandons it (nothing committed, the last committed checkpoint
kept) and the process exits.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from dcp_datastates import latest_checkpoint
from dcp_datastates.runtime import inflight

EXIT_TIMEOUT = 30  # generous: only a hang fails it (the stalled save would hold the exit forever)


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default action, so Python installs its
    Ctrl-C handler even when this test runs with SIGINT ignored (a background job of a
    non-interactive shell ignores it, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Child:
    """A Python subprocess whose stdout and stderr lines are collected as they come."""

    def __init__(self, script: str, *args: str, cwd=None):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
            preexec_fn=_default_sigint,
        )
        self.lines: queue.Queue = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, store in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, store), daemon=True).start()

    def _pump(self, stream, store):
        for line in stream:
            store.append(line)
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 60) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"{text!r} never appeared; stdout={''.join(self.out)!r} stderr={''.join(self.err)[-3000:]!r}") from None
            if text in line:
                return line

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the process did not exit; stderr={''.join(self.err)[-3000:]!r}") from None


# A save double: a thread named like DCP's executor thread waits until the save completes (a file
# appears) or is abandoned, as DCP's background thread waits for the writer's jobs.
DOUBLE = """
    import os, sys, threading, time
    from dcp_datastates.runtime import inflight

    class Save:
        path = "ckpt/step-200"
        def __init__(self):
            self.abandoned = threading.Event()
        def progress(self):
            return (3 << 20, 8 << 20)
        def abandon(self, reason):
            print("abandoned:", reason, flush=True)
            self.abandoned.set()

    save = Save()
    inflight.register(save)
    finish_file = sys.argv[1]

    def executor():
        while not save.abandoned.is_set() and not os.path.exists(finish_file):
            time.sleep(0.01)
        print("committed" if not save.abandoned.is_set() else "failed", flush=True)
        inflight.unregister(save)

    threading.Thread(target=executor, name="AsyncCheckpointExecutor_0").start()
    print("READY", flush=True)
    time.sleep(120)  # the training loop, interrupted here
"""


def test_first_ctrl_c_names_the_checkpoint_and_waits_for_its_commit(tmp_path):
    child = Child(DOUBLE, str(tmp_path / "finish"))
    child.wait_for("READY")
    child.interrupt()
    line = child.wait_for("Ctrl-C again to abandon it")
    assert "ckpt/step-200 (5.0 MiB of 8.0 MiB left to write)" in line
    (tmp_path / "finish").write_text("")  # the save completes on its own
    child.finish()
    assert "committed\n" in child.out and not any("abandoned" in x for x in child.out)
    assert sum("still being written" in x for x in child.err) == 1  # one line, once


def test_second_ctrl_c_abandons_the_checkpoint_and_exits(tmp_path):
    child = Child(DOUBLE, str(tmp_path / "never"))
    child.wait_for("READY")
    child.interrupt()
    child.wait_for("Ctrl-C again to abandon it")
    child.interrupt()
    rc = child.finish()
    assert rc != 0  # KeyboardInterrupt
    assert "abandoned: interrupted (Ctrl-C) while exiting\n" in child.out and "failed\n" in child.out
    assert any("abandoned checkpoint ckpt/step-200: not committed" in x for x in child.err)


# A real save: the engine's "stall" fault holds the second checkpoint's writes, so it stays in
# flight until it is abandoned.
REAL = """
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter
    from dcp_datastates.runtime import inflight
    from dcp_datastates.runtime import current_engine

    root = sys.argv[1]
    opts = dict(host_cache_size="1MiB", chunk_size="64KiB")
    state = {"w": torch.randn(1 << 20)}  # 4 MiB through a 1 MiB cache
    dcp.async_save(state, storage_writer=DataStatesWriter(f"{root}/step-1", **opts)).upload_completion.result()
    current_engine().set_fault("stall", 0, "step-2")
    resp = dcp.async_save(state, storage_writer=DataStatesWriter(f"{root}/step-2", **opts))
    assert [s.path for s in inflight.inflight()] == [f"{root}/step-2"]  # the writer registered it
    print("READY", flush=True)
    resp.upload_completion.result()
"""


def test_second_ctrl_c_abandons_a_real_save_and_keeps_the_last_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    child = Child(REAL, root)
    child.wait_for("READY")
    child.interrupt()
    line = child.wait_for("Ctrl-C again to abandon it")
    assert f"{root}/step-2 (" in line and "of 4.0 MiB left to write" in line
    child.interrupt()
    rc = child.finish()
    assert rc != 0
    err = "".join(child.err)
    assert f"abandoned checkpoint {root}/step-2: not committed" in err
    assert not os.path.exists(os.path.join(root, "step-2", ".metadata"))
    assert os.listdir(os.path.join(root, "step-2")) == []  # the abandoned save's files went with it
    assert latest_checkpoint(root) == os.path.join(root, "step-1")
    assert "Fatal Python error" not in err and "terminate called" not in err


def test_registry_lists_saves_until_unregistered_or_done():
    class Save:
        path = "p"
        finished = False

        def progress(self):
            return (0, 1)

        def abandon(self, reason):
            pass

        def done(self):
            return self.finished

    a, b = Save(), Save()
    try:
        inflight.register(a)
        inflight.register(a)
        inflight.register(b)
        assert inflight.inflight() == [a, b]
        b.finished = True
        assert inflight.inflight() == [a]
        inflight.unregister(a)
        inflight.unregister(a)  # unknown now: ignored
        assert inflight.inflight() == []
    finally:
        inflight.unregister(a)
        inflight.unregister(b)


# A save that no DCP thread has planned: it settles (leaves the registry, as a save staged by a
# failed ``async_save`` closes itself) ``argv[1]`` seconds after the program ends, while a thread
# named like DCP's executor (the one of an earlier save, ending a moment after its save resolved)
# still runs.
UNPLANNED = """
    import sys, threading, time
    from dcp_datastates.runtime import inflight

    settle_s = float(sys.argv[1])

    class Save:
        path = "ckpt/unplanned"
        settled = False
        def progress(self):
            return (0, 8 << 20)
        def abandon(self, reason):
            pass
        def awaits_planning(self):
            return not self.settled
        def is_over(self):
            return self.settled

    save = Save()
    inflight.register(save)

    def lingering_executor():
        time.sleep(settle_s)
        save.settled = True
        inflight.unregister(save)
        print("settled", flush=True)

    threading.Thread(target=lingering_executor, name="AsyncCheckpointExecutor_0").start()
    print("READY", flush=True)
"""


def test_a_save_nothing_planned_that_settles_at_exit_is_not_announced():
    """The exit does not announce "still being written; waiting for it to commit" for a save
    that no DCP thread took up and that settles within a moment (it will never commit)."""
    child = Child(UNPLANNED, "0.5")
    child.wait_for("settled")
    assert child.finish() == 0
    assert not any("still being written" in x for x in child.err), child.err


def test_a_save_nothing_planned_that_does_not_settle_is_announced_and_waited_for():
    """One still unplanned after the grace is named once, and the exit still waits for it."""
    child = Child(UNPLANNED, "3.5")
    line = child.wait_for("still being written", timeout=30)
    assert "ckpt/unplanned (8.0 MiB of 8.0 MiB left to write)" in line
    child.wait_for("settled")
    assert child.finish() == 0
    assert sum("still being written" in x for x in child.err) == 1


class _UnplannedSave:
    """A save in a folder that no DCP thread has taken up: after ``settle_s`` it is either over
    (an ``async_save`` that failed right after ``stage()``: its staging ended) or, with
    ``taken_up``, planned by DCP (a save still running)."""

    path = "ckpt/latest"
    requested = 0.0

    def __init__(self, settle_s: float, taken_up: bool):
        self.at = threading.Timer(settle_s, lambda: None)
        self.at.start()
        self.taken_up = taken_up

    def awaits_planning(self):
        return self.at.is_alive()

    def is_over(self):
        return not self.at.is_alive() and not self.taken_up

    def all_written(self):
        return False


def test_a_folder_claim_waits_for_a_save_nothing_planned_to_settle():
    """A second save into the folder goes ahead once the first, which DCP never took up,
    turns out to be over (before: refused at once while the first was still staging, "a save
    to ... is still running"); a save that DCP takes up keeps the folder busy."""
    import time

    first, second = _UnplannedSave(0.3, taken_up=False), object()
    inflight.claim("ckpt/latest", first)
    try:
        t = time.monotonic()
        inflight.claim("ckpt/latest", second)  # no FolderBusyError
        assert 0.2 < time.monotonic() - t < 5
    finally:
        inflight.release("ckpt/latest", first)
        inflight.release("ckpt/latest", second)
    running = _UnplannedSave(0.3, taken_up=True)
    inflight.claim("ckpt/other", running)
    try:
        with pytest.raises(inflight.FolderBusyError):
            inflight.claim("ckpt/other", object())
    finally:
        inflight.release("ckpt/other", running)
