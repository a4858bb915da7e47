"""Multi-rank protocol cases (2 ranks, gloo): rank-local saves load each rank's own values,
ranks naming different folders and a tensor torn on one rank fail the save on every rank."""

from __future__ import annotations

import json

import pytest

import fault_workers as F
from dist_harness import run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    run_ranks(2, F.run_protocol, str(root), timeout=300)
    return json.loads((root / "protocol.json").read_text())


def test_rank_local_saves_load_each_ranks_own_values(results):
    for r in results:
        assert r["local_sync"] is True and r["local_async"] is True, r
        assert r["local_over_global"] is True, r


def test_ranks_naming_different_paths_all_raise_and_nothing_commits(results):
    for r in results:
        assert r["paths"] is True and r["paths_s"] < 10 and r["paths_committed"] is False, r
        assert r["paths_cached"] is True, r


def test_a_tensor_torn_on_one_rank_fails_the_save_everywhere_and_keeps_the_old_one(results):
    for r in results:
        assert r["torn"] is True and r["torn_kept_old"] is True, r


def test_a_storage_freed_on_one_rank_fails_the_save_everywhere_and_keeps_the_old_one(results):
    for r in results:
        assert r["freed"] is True and r["freed_s"] < 30 and r["freed_kept_old"] is True, r
