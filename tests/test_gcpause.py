"""The cyclic GC is paused while a save's objects live (gc_pause.py): counted pauses, deadlines,
the young collection of back-to-back saves, forked children, and a save that runs no full
collection and leaves nothing behind for the collector."""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter
from dcp_datastates.runtime import gc_pause

from conftest import raises_through_dcp


@pytest.fixture(autouse=True)
def _collector_restored():
    gc_pause._end_all_pauses()  # an earlier test's failed save may still hold one (it ends by itself in 60 s)
    gc.enable()
    yield
    gc_pause._end_all_pauses()
    gc.enable()


def _until(predicate, timeout=5.0):
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_pauses_are_counted_and_restore_the_collector_as_it_was():
    assert gc.isenabled()
    a, b = gc_pause.pause_collector(30), gc_pause.pause_collector(30)
    assert not gc.isenabled() and gc_pause.paused_count() == 2
    a.release()
    a.release()  # twice is harmless
    assert not gc.isenabled() and gc_pause.paused_count() == 1
    b.release()
    assert gc.isenabled()
    gc.disable()  # a program that turned it off keeps it off
    try:
        gc_pause.pause_collector(30).release()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_pause_ends_by_itself_at_its_deadline():
    kept, short = gc_pause.pause_collector(30), gc_pause.pause_collector(0.2)
    assert _until(lambda: not short.active)
    assert kept.active and not gc.isenabled()
    kept.release(after=0.1)
    assert _until(gc.isenabled)


class _Cycle:
    def __init__(self):
        self.me = self


def test_back_to_back_pauses_still_collect_young_cyclic_garbage(monkeypatch):
    monkeypatch.setattr(gc_pause, "YOUNG_COLLECTION_EVERY_S", 0.2)
    pause = gc_pause.pause_collector(30)
    try:
        gc_pause.pause_collector(30).release()  # wake the watchdog with the new period
        garbage = _Cycle()
        ref = weakref.ref(garbage)
        del garbage
        assert ref() is not None  # only a collection frees a cycle
        assert _until(lambda: ref() is None), "the young collection never ran"
        assert not gc.isenabled()  # and the pause held on
    finally:
        pause.release()


def test_a_program_that_turned_the_collector_off_gets_no_collections_from_us(monkeypatch):
    """TorchTitan disables the collector and collects on its own schedule: the pause changes
    nothing there, not even the young collections of a continuous pause."""
    monkeypatch.setattr(gc_pause, "YOUNG_COLLECTION_EVERY_S", 0.05)
    gc.disable()
    pause = gc_pause.pause_collector(30)
    try:
        gc_pause.pause_collector(30).release()
        garbage = _Cycle()
        ref = weakref.ref(garbage)
        del garbage
        time.sleep(0.5)
        assert ref() is not None  # nobody collected
    finally:
        pause.release()
    assert not gc.isenabled()
    gc.collect()
    assert ref() is None


def test_garbage_promoted_while_alive_is_freed_by_the_middle_collection(monkeypatch):
    """A cycle alive at a young collection moves to the middle generation; once it dies there,
    the periodic middle collection frees it, the pause still held (saves back to back)."""
    # 0.3 s apart: the cycle is seen in generation 1 and dropped before the middle collection.
    monkeypatch.setattr(gc_pause, "YOUNG_COLLECTION_EVERY_S", 0.3)
    monkeypatch.setattr(gc_pause, "MIDDLE_COLLECTION_EVERY", 3)
    monkeypatch.setattr(gc_pause, "_gc_young_collections", 0)  # the next collection is a young one
    pause = gc_pause.pause_collector(30)
    try:
        holder = [_Cycle()]
        ref = weakref.ref(holder[0])
        gc_pause.pause_collector(30).release()  # wake the watchdog with the new period
        assert _until(lambda: any(o is ref() for o in gc.get_objects(generation=1)))  # promoted
        holder.clear()
        assert _until(lambda: ref() is None), "the middle collection never ran"
        assert not gc.isenabled()
    finally:
        pause.release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_starts_with_the_collector_on():
    pause = gc_pause.pause_collector(30)
    try:
        pid = os.fork()
        if pid == 0:  # the child: a DataLoader worker forked during a save
            os._exit(0 if gc.isenabled() and gc_pause.paused_count() == 0 else 3)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert not gc.isenabled()  # the parent's pause holds
    finally:
        pause.release()


def _state(n):
    return {"model": {f"l{i // 8}.w{i % 8}": torch.full((16,), float(i)) for i in range(n)}, "step": 1}


def test_a_save_runs_no_full_collection_and_leaves_no_garbage(tmp_path):
    full = []

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    state = _state(2000)
    dcp.async_save(state, storage_writer=DataStatesWriter(str(tmp_path / "warm"))).upload_completion.result()
    assert _until(lambda: gc_pause.paused_count() == 0)
    gc.collect()
    # Make the next full collection due: promote enough young objects that Python would run
    # one at its next chance, as a long training run does.
    gc.set_threshold(10, 1, 1)
    gc.callbacks.append(on_gc)
    try:
        for k in range(3):
            resp = dcp.async_save(state, storage_writer=DataStatesWriter(str(tmp_path / f"s{k}")))
            resp.upload_completion.result()
            assert full == [], f"save {k} ran a full collection"
            del resp
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(700, 10, 10)
    assert _until(lambda: gc_pause.paused_count() == 0 and gc.isenabled())


def test_nothing_a_save_makes_keeps_the_state_in_a_reference_cycle(tmp_path):
    """Dropping the state after a save frees its tensors at once, with no collection (a cycle
    would keep them, and every object the save made, until the next one)."""
    state = _state(50)
    ref = weakref.ref(state["model"]["l0.w0"])
    gc.collect()
    gc.disable()
    try:
        resp = dcp.async_save(state, storage_writer=DataStatesWriter(str(tmp_path / "c")))
        resp.upload_completion.result()
        del resp
        assert _until(lambda: gc_pause.paused_count() == 0)
        del state
        assert ref() is None
    finally:
        gc.enable()


def test_a_save_that_fails_while_staging_ends_its_pause(tmp_path):
    folder = tmp_path / "in-the-way"
    folder.write_text("a file where the checkpoint folder should be")
    with raises_through_dcp(r"in-the-way"):
        dcp.async_save(_state(10), storage_writer=DataStatesWriter(str(folder))).upload_completion.result()
    assert _until(lambda: gc_pause.paused_count() == 0 and gc.isenabled())


def test_a_load_runs_no_full_collection_and_ends_its_pause(tmp_path):
    from dcp_datastates import DataStatesReader

    state = _state(2000)
    dcp.save(state, storage_writer=DataStatesWriter(str(tmp_path / "ckpt")))
    assert _until(lambda: gc_pause.paused_count() == 0)
    full = []

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.collect()
    gc.set_threshold(10, 1, 1)  # a full collection is due at the first chance
    gc.callbacks.append(on_gc)
    try:
        dest = _state(2000)
        for t in dest["model"].values():
            t.zero_()
        dcp.load(dest, storage_reader=DataStatesReader(str(tmp_path / "ckpt")))
        assert full == []
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(700, 10, 10)
    assert all(torch.equal(dest["model"][k], v) for k, v in state["model"].items())
    assert _until(lambda: gc_pause.paused_count() == 0 and gc.isenabled())


def test_a_load_that_fails_ends_its_pause_at_once(tmp_path):
    from dcp_datastates import DataStatesReader

    (tmp_path / "empty").mkdir()
    with raises_through_dcp("empty"):
        dcp.load(_state(3), storage_reader=DataStatesReader(str(tmp_path / "empty")))
    assert gc_pause.paused_count() == 0 and gc.isenabled()


def test_the_watchdog_ends_at_exit_before_the_interpreter_finalizes():
    """At exit the watchdog collects nothing more and ends (a collection on a daemon thread while
    the interpreter finalizes could end that thread inside a C++ destructor: an aborted exit)."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from dcp_datastates.runtime import gc_pause\n"
        "pause = gc_pause.pause_collector(60)\n"
        "time.sleep(0.1)\n"
        "assert gc_pause._gc_watchdog.is_alive()\n"
        "gc_pause._stop_gc_at_exit()\n"
        "assert not gc_pause._gc_watchdog.is_alive()\n"
        "gc_pause._ensure_gc_watchdog()\n"
        "assert not gc_pause._gc_watchdog.is_alive()  # none started at exit\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr[-2000:]
