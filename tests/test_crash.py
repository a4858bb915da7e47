"""Crash consistency: saves killed with SIGKILL at random moments (scripts/crash_test.py does
the killing in a subprocess; this test then re-checks every folder from this process)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, latest_checkpoint
from dcp_datastates.errors import IncompleteCheckpointError, checkpoint_error_cause

from conftest import raises_through_dcp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "crash_test.py")

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork and SIGKILL")


def _script_module():
    spec = importlib.util.spec_from_file_location("dcpds_crash_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its forked savers/verifiers share the group: kill all on timeout
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"crash_test.py hung for {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def test_sigkill_during_saves_never_yields_wrong_values(tmp_path):
    root = tmp_path / "ckpts"
    report_path = tmp_path / "report.json"
    res = _run(["--kills", "12", "--sync-every", "3", "--seed", "7", "--root", str(root), "--keep",
                "--json", str(report_path)], timeout=240)
    report = json.loads(report_path.read_text())
    assert res.returncode == 0, f"violations: {report['violations']}\n{res.stdout[-4000:]}"
    assert report["violations"] == []
    assert report["kills"] == 12 and report["sync_kills"] == 4
    outcomes = report["outcomes"]
    # The kills really interrupted saves (not only landed after them), new folders and re-saves.
    assert outcomes["incomplete"] + outcomes["absent"] >= 1, outcomes
    assert outcomes["overwrite_kept_old"] >= 1, outcomes  # a killed re-save left the old one loading
    assert outcomes["exact"] + outcomes["incomplete"] + outcomes["absent"] == 12

    # Independent check from this process: every folder holds its round exactly, or it has no
    # commit marker and says "incomplete"; the newest complete one is what latest_checkpoint says.
    crash = _script_module()
    complete = []
    names = sorted(os.listdir(root))
    assert "rolling" in names and sum(n.startswith("step-") for n in names) >= 6
    for name in names:
        folder = root / name
        tag = int(name.split("-")[1]) if name.startswith("step-") else report["rolling_tag"]
        dest = crash.empty_like(crash.expected_state(0))
        marker = (folder / ".metadata").exists()
        try:
            dcp.load(dest, storage_reader=DataStatesReader(folder))
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            cause = checkpoint_error_cause(exc)
            assert isinstance(cause, IncompleteCheckpointError), f"{folder}: {type(cause).__name__}: {cause}"
            assert not marker, f"{folder} has a commit marker but does not load: {cause}"
            assert "incomplete checkpoint" in str(cause)
            continue
        assert marker
        assert tag is not None and crash.same(crash.expected_state(tag), dest), f"{folder}: wrong values"
        if name.startswith("step-"):
            complete.append((tag, str(folder)))
    assert latest_checkpoint(root) == max(complete)[1] == report["latest"]


def test_incomplete_after_kill_reads_as_incomplete_through_dcp(tmp_path):
    """The message a user sees for a killed save (DCP 2.13 turns the reader's error into an
    AssertionError inside CheckpointException: the message says 'incomplete checkpoint')."""
    crash = _script_module()
    folder = tmp_path / "step-1"
    folder.mkdir()
    (folder / "__0_0.safetensors").write_bytes(b"\0" * 100)  # data of a save that never committed
    with raises_through_dcp(f"incomplete checkpoint {folder}: there is no .metadata commit marker") as ctx:
        dcp.load(crash.empty_like(crash.expected_state(0)), storage_reader=DataStatesReader(folder))
    cause = checkpoint_error_cause(ctx.value)
    assert isinstance(cause, IncompleteCheckpointError)
    assert str(cause).startswith(f"incomplete checkpoint {folder}")
    assert latest_checkpoint(tmp_path) is None
