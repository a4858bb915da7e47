"""Interpreter exit with a checkpoint in flight: the process ends with the expected exit status,
without hanging or crashing, and the checkpoint is either committed and exact, or cleanly
incomplete. Each scenario is a subprocess; they run concurrently to keep the test short."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader
from dcp_datastates.errors import IncompleteCheckpointError, checkpoint_error_cause

TIMEOUT_S = 120

COMMON = textwrap.dedent(
    """
    def make_state(seed, mib):
        import torch
        g = torch.Generator().manual_seed(seed)
        n = mib * (1 << 20) // 4 // 8
        return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)}, "step": seed}
    """
)

PRELUDE = COMMON + textwrap.dedent(
    """
    import faulthandler, os, sys, time, signal, threading, warnings
    faulthandler.enable(all_threads=True)  # an abort at exit names every thread's Python stack
    # Ctrl-C raises KeyboardInterrupt as in a terminal, even when pytest itself runs where SIGINT
    # is ignored (a background job), which Python would otherwise pass on to this script.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    warnings.filterwarnings("ignore")
    import torch, torch.distributed.checkpoint as dcp
    from dcp_datastates import DataStatesWriter
    folder = sys.argv[1]

    def writer(path, **kw):
        return DataStatesWriter(path, host_cache_size=1 << 20, chunk_size=256 << 10, **kw)

    def start(mib=32, seed=1, path=None, **kw):
        resp = dcp.async_save(make_state(seed, mib), storage_writer=writer(path or folder, **kw))
        print("started", flush=True)
        return resp
    """
)

# name -> (body, expected exit status, size in MiB of the checkpoint, SIGINT delay after "started" or None)
SCENARIOS = {
    "end_of_script": ("start()", 0, 32, None),
    "sys_exit": ("start()\nsys.exit(3)", 3, 32, None),
    "exception": ("start()\nraise RuntimeError('boom in the training loop')", 1, 32, None),
    "keyboard_interrupt": ("start()\nraise KeyboardInterrupt", -signal.SIGINT, 32, None),
    # Ctrl-C while Python joins the checkpoint thread at exit (the user presses it twice). Large
    # enough that the save is still being written when the second Ctrl-C comes (128 MiB was
    # once written in under 0.15 s, and the Ctrl-C then landed in torch's own atexit hooks).
    "ctrl_c_while_exiting": ("start(mib=384)\nraise KeyboardInterrupt", -signal.SIGINT, 384, 0.15),
    # Ctrl-C while the training thread waits for the upload
    "ctrl_c_while_waiting": ("start(mib=128).upload_completion.result()", -signal.SIGINT, 128, 0.1),
    # a save that fails (injected EIO) is still in flight at exit
    "failing_save_at_exit": (
        "from dcp_datastates.runtime import get_engine\n"
        "from dcp_datastates import DataStatesConfig\n"
        "get_engine(DataStatesConfig(host_cache_size=1 << 20, chunk_size=256 << 10)).set_fault('eio', 1 << 20, folder)\n"
        "start()",
        0,
        32,
        None,
    ),
    # Ctrl-C lands while async_save starts its executor thread (inside ThreadPoolExecutor.submit):
    # the executor never registers that worker, so only the executor's collection stops it
    "ctrl_c_while_starting_the_thread": (
        "from dcp_datastates.compat import ASYNC_EXECUTOR_THREAD_PREFIX\n"
        "_start = threading.Thread.start\n"
        "def start_then_ctrl_c(self):\n"
        "    _start(self)\n"
        "    if self.name.startswith(ASYNC_EXECUTOR_THREAD_PREFIX):\n"
        "        print('started', flush=True)\n"
        "        raise KeyboardInterrupt\n"
        "threading.Thread.start = start_then_ctrl_c\n"
        "dcp.async_save(make_state(1, 32), storage_writer=writer(folder))",
        -signal.SIGINT,
        32,
        None,
    ),
    # a training loop checkpointing every step, interrupted by Ctrl-C at some point
    "ctrl_c_in_training_loop": (
        "step = 0\n"
        "while step < 100:  # bounded: a lost Ctrl-C ends the loop (and fails the test) instead of filling the disk\n"
        "    resp = dcp.async_save(make_state(step, 8), storage_writer=writer(os.path.join(folder, f'step-{step}')))\n"
        "    if step == 0: print('started', flush=True)\n"
        "    time.sleep(0.02)  # forward/backward\n"
        "    resp.upload_completion.result()\n"
        "    step += 1\n",
        -signal.SIGINT,
        8,
        0.5,
    ),
}

_ns: dict = {}
exec(COMMON, _ns)
make_state = _ns["make_state"]


def _run_all(tmp_path) -> dict:
    procs = {}
    for name, (body, _, _, _) in SCENARIOS.items():
        script = tmp_path / f"{name}.py"
        script.write_text(PRELUDE + "\n" + body + "\n")
        out = open(tmp_path / f"{name}.out", "w+")
        err = open(tmp_path / f"{name}.err", "w+")
        p = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / name)],
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
        )
        procs[name] = (p, out, err)

    def pump(name, p, out):  # forwards stdout to a file; sends SIGINT after "started" if asked
        delay = SCENARIOS[name][3]
        for line in p.stdout:
            out.write(line)
            out.flush()
            if line.strip() == "started" and delay is not None:
                time.sleep(delay)
                threading.Thread(target=interrupt, args=(p,), daemon=True).start()
                delay = None

    def interrupt(p):
        # Python drops a KeyboardInterrupt raised inside a finalizer (a weakref callback prints
        # "Exception ignored ... KeyboardInterrupt"): like a user, press Ctrl-C again if the
        # process did not react within 10 s.
        for _ in range(5):
            try:
                p.send_signal(signal.SIGINT)
                p.wait(timeout=10)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    pumps = [threading.Thread(target=pump, args=(n, p, o), daemon=True) for n, (p, o, _) in procs.items()]
    for t in pumps:
        t.start()
    results = {}
    deadline = time.monotonic() + TIMEOUT_S
    for name, (p, _out, _err) in procs.items():
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc, hung = p.wait(), True
        results[name] = {"rc": rc, "hung": hung}
    for t in pumps:
        t.join(5)
    for name, (_p, out, err) in procs.items():
        out.seek(0)
        err.seek(0)
        results[name]["stdout"] = out.read()
        results[name]["stderr"] = err.read()
        out.close()
        err.close()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shutdown")
    return tmp, _run_all(tmp)


def _outcome(folder, seed: int, mib: int) -> str:
    """'exact' or 'incomplete' (anything else fails the test)."""
    want = make_state(seed, mib)
    dest = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": None}
    marker = os.path.exists(os.path.join(folder, ".metadata"))
    try:
        dcp.load(dest, storage_reader=DataStatesReader(folder))
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        cause = checkpoint_error_cause(exc)
        assert isinstance(cause, IncompleteCheckpointError), f"{folder}: {type(cause).__name__}: {cause}"
        assert not marker and "incomplete checkpoint" in str(cause)
        return "incomplete"
    assert dest["step"] == seed
    for k, v in want["model"].items():
        assert torch.equal(dest["model"][k], v), f"{folder}: {k} differs"
    return "exact"


def _check_process(res: dict, expected_rc: int) -> None:
    assert not res["hung"], f"hung for {TIMEOUT_S} s:\n{res['stderr'][-3000:]}"
    err = res["stderr"]
    for bad in ("terminate called", "Fatal Python error", "Segmentation fault", "Aborted", "core dumped",
                "Exception ignored in atexit", "dcp_datastates: a checkpoint thread is still running"):
        assert bad not in err, f"{bad!r} at exit:\n{err[-3000:]}"
    assert res["rc"] == expected_rc, f"exit status {res['rc']}, expected {expected_rc}:\n{err[-3000:]}"
    assert "started" in res["stdout"]


@pytest.mark.parametrize(
    "name", ["end_of_script", "sys_exit", "exception", "keyboard_interrupt", "ctrl_c_while_starting_the_thread"]
)
def test_exit_drains_and_commits(runs, name):
    tmp, results = runs
    _, rc, mib, _ = SCENARIOS[name]
    _check_process(results[name], rc)
    # Python joins DCP's checkpoint thread before exiting: the save completes and commits.
    assert _outcome(tmp / name, 1, mib) == "exact"
    assert not [n for n in os.listdir(tmp / name) if ".tmp" in n]
    if name == "exception":
        assert "RuntimeError: boom in the training loop" in results[name]["stderr"]


@pytest.mark.parametrize("name", ["ctrl_c_while_exiting", "ctrl_c_while_waiting"])
def test_ctrl_c_exits_without_crash_and_checkpoint_is_exact_or_incomplete(runs, name):
    tmp, results = runs
    _, rc, mib, _ = SCENARIOS[name]
    _check_process(results[name], rc)
    assert "KeyboardInterrupt" in results[name]["stderr"]
    assert _outcome(tmp / name, 1, mib) in ("exact", "incomplete")


def test_failing_save_at_exit_leaves_incomplete(runs):
    tmp, results = runs
    _check_process(results["failing_save_at_exit"], 0)
    assert _outcome(tmp / "failing_save_at_exit", 1, 32) == "incomplete"


def test_ctrl_c_in_training_loop(runs):
    tmp, results = runs
    res = results["ctrl_c_in_training_loop"]
    _check_process(res, -signal.SIGINT)
    root = tmp / "ctrl_c_in_training_loop"
    outcomes = {}
    for name in sorted(os.listdir(root)):
        outcomes[name] = _outcome(root / name, int(name.split("-")[1]), 8)
    assert outcomes.get("step-0") == "exact", outcomes
    # only the last save can have been cut short
    steps = sorted(int(n.split("-")[1]) for n in outcomes)
    assert all(outcomes[f"step-{s}"] == "exact" for s in steps[:-1]), outcomes


def test_threads_waiting_in_the_engine_at_exit_never_abort_the_process(tmp_path):
    """Daemon threads still inside an engine call that released the GIL (here: sliced waits,
    which take the GIL back every 0.1 s) when the interpreter finalizes: the process exits with
    its own status. (With pybind11's gil_scoped_release, Python ended such a thread with
    pthread_exit inside a noexcept destructor: "terminate called without an active exception",
    SIGABRT, every time for this script.)"""
    script = tmp_path / "exit_while_waiting.py"
    script.write_text(textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import torch
        from engine_util import build_engine

        eng = build_engine(1 << 20, chunk_bytes=64 << 10)
        data = torch.zeros(256 << 10, dtype=torch.uint8)
        job = eng.submit_write({str(tmp_path / "never-named.bin")!r}, b"h" * 64, 64 + data.numel(),
                               [(data.data_ptr(), data.numel(), 64)], named=False)
        for _ in range(4):
            threading.Thread(target=job.wait_written, args=(10**9, 30.0), daemon=True).start()
        time.sleep(0.3)
        print("exiting", flush=True)
    """))
    for _ in range(3):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout == "exiting\n", (r.returncode, r.stderr[-2000:])
        assert "terminate called" not in r.stderr


def test_a_save_dcp_never_planned_frees_its_folder_and_the_exit(tmp_path):
    """``dcp.async_save`` calls ``stage()`` and may fail right after it, before any thread of
    DCP plans the save: ``AsyncCheckpointerType.PROCESS`` without a process group (ValueError),
    or with one (our writer refuses to be pickled: TypeError from the upload). Nothing will write
    or commit such a save: a later save into its folder goes ahead, and the interpreter exits
    (it used to wait for that save forever, and the folder stayed refused for 10 minutes)."""
    script = tmp_path / "never_planned.py"
    script.write_text(PRELUDE + textwrap.dedent("""
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from dcp_datastates import DataStatesReader
        try:
            dcp.async_save(make_state(1, 8), storage_writer=writer(folder),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        except ValueError as exc:
            print("refused:", type(exc).__name__, flush=True)
        resp = dcp.async_save(make_state(2, 8), storage_writer=writer(folder))
        resp.upload_completion.result()
        dest = make_state(3, 8)
        dcp.load(dest, storage_reader=DataStatesReader(folder))
        expected = make_state(2, 8)
        assert all(torch.equal(dest["model"][k], v) for k, v in expected["model"].items()) and dest["step"] == 2
        print("saved again", flush=True)
        dcp.async_save(make_state(4, 8), storage_writer=writer(os.path.join(folder, "other")),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        """))
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.stdout == "refused: ValueError\nsaved again\n", (r.stdout, r.stderr[-3000:])
    assert r.returncode == 1 and "ValueError" in r.stderr and "still being written" not in r.stderr, r.stderr[-3000:]
