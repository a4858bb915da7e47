"""The multi-rank harness itself: ranks forked from a forkserver (tests/dist_harness.py) see the
test's environment as of the launch, as spawned ranks did, and a rank's failure reaches the test."""

from __future__ import annotations

import os

import pytest

from dist_harness import run_ranks

VAR = "DCP_DATASTATES_HARNESS_PROBE"


def _expect_env(rank: int, world_size: int, expected: str | None) -> None:
    assert os.environ.get(VAR) == expected, f"rank {rank}: {VAR}={os.environ.get(VAR)!r}, expected {expected!r}"
    assert os.environ["RANK"] == str(rank) and os.environ["WORLD_SIZE"] == str(world_size)


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 was told to fail")


def test_ranks_see_the_environment_of_the_launch_not_of_the_forkserver(monkeypatch):
    # The first launch of a test process starts the forkserver with the environment of that
    # moment (here with the variable, when this test runs first); later launches must not see
    # it once removed, and must see a value set after the server started.
    monkeypatch.setenv(VAR, "at the first launch")
    run_ranks(2, _expect_env, "at the first launch")
    monkeypatch.delenv(VAR)
    run_ranks(2, _expect_env, None)
    monkeypatch.setenv(VAR, "set after the server started")
    run_ranks(2, _expect_env, "set after the server started")


def test_a_failing_rank_fails_the_launch_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*ValueError: rank 1 was told to fail"):
        run_ranks(2, _fail_on_rank_1)
