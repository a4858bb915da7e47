"""A fault on ONE rank of a multi-rank save reaches EVERY rank as CheckpointException within
seconds (never a hang, never an abort), keeps the previous checkpoint, and the next save works.

World 2 and world 4 on 2 simulated nodes (so write results travel rank -> node leader ->
coordinator); dcp.save and dcp.async_save; the failing rank the coordinator, the other node's
leader, a plain member; faults: an unpicklable value, EFBIG from a real RLIMIT_FSIZE, the
engine's injected EIO at write and at fsync, a failure while committing."""

from __future__ import annotations

import json

import pytest

import fault_workers as F
from dist_harness import run_ranks


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    run_ranks(2, F.run_matrix, str(root), 1, ["sync", "async"], timeout=400)
    run_ranks(4, F.run_matrix, str(root), 2, ["sync", "async"], timeout=600)
    return [r for w in (2, 4) for r in json.loads((root / f"matrix-w{w}.json").read_text())]


def test_every_rank_raises_checkpoint_exception_quickly(matrix):
    cases = {(r["api"], r["kind"], r["failing_rank"]) for r in matrix}
    assert len(cases) >= 2 * (5 + 4) , sorted(cases)  # both apis, every fault, every failing role
    bad = [r for r in matrix if r["type"] != "CheckpointException" or r["seconds"] >= 10]
    assert not bad, bad


def test_the_error_names_the_cause_on_every_rank(matrix):
    bad = [r for r in matrix if not r["cause_in_message"]]
    assert not bad, bad


def test_previous_checkpoint_intact_and_next_save_loads_bitwise(matrix):
    bad = [r for r in matrix if not (r["old_checkpoint_intact"] and r["next_save_loads"])]
    assert not bad, bad


def test_the_failed_save_leaves_no_file_on_any_rank(matrix):
    """What every rank wrote for the failed save is gone when the save raises there: the folder
    holds the previous commit's files and nothing else."""
    bad = [r for r in matrix if r["leftover"]]
    assert not bad, bad
