"""The tier protocol as a save drives it: the typed events in order, each naming the save by one
key, and a failed save's events carrying its error (tiers/plain.py, save/tier_events.py)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader, DataStatesWriter, save
from dcp_datastates.errors import CheckpointWriteError
from dcp_datastates.save.tier_events import BEFORE_PLAN, Claim, FilesNamed, RankEnded
from dcp_datastates.tiers import NoTier

from conftest import assert_state_equal, raises_through_dcp, zeros_like_state


def make_state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(128, 64, generator=g), "b": torch.randn(77, generator=g), "step": 5}


class Recorder(NoTier):
    """The plain tier, recording what it is told."""

    def __init__(self, config):
        super().__init__(config)
        self.events = []

    def claimed(self, event):
        self.events.append(("claimed", event))

    def files_named(self, event):
        self.events.append(("files_named", event))

    def global_plan(self, plans, save_id, key, moved):
        self.events.append(("global_plan", key))
        return plans

    def rank_ended(self, event):
        self.events.append(("rank_ended", event))
        return super().rank_ended(event)

    def commit(self, *args, **kwargs):
        self.events.append(("commit", args[3]))
        return super().commit(*args, **kwargs)

    def ended(self, key, error):
        self.events.append(("ended", key, error))
        return None


def recording_writer(path):
    w = DataStatesWriter(str(path))
    w.tier = Recorder(w.config)
    return w


def test_a_save_tells_its_tier_each_event_once_in_order(tmp_path):
    state = make_state()
    w = recording_writer(tmp_path / "ck")
    dcp.async_save(state, storage_writer=w).upload_completion.result(timeout=60)
    kinds = [e[0] for e in w.tier.events]
    assert kinds == ["claimed", "files_named", "global_plan", "files_named", "rank_ended", "commit", "ended"], kinds
    claim, at_request, _, at_write, ended_rank, _, ended = (e[1] if len(e) == 2 else e for e in w.tier.events)
    assert isinstance(claim, Claim) and claim.folder == str(tmp_path / "ck") and claim.rank == 0
    assert claim.need() >= state["w"].nbytes + state["b"].nbytes
    assert isinstance(at_request, FilesNamed) and at_request.plan is BEFORE_PLAN and at_request.files
    assert isinstance(at_write, FilesNamed) and at_write.plan is not BEFORE_PLAN and not at_write.moved
    assert [f.name for f in at_write.files] == [f.name for f in at_request.files]
    assert isinstance(ended_rank, RankEnded) and ended_rank.error is None and ended_rank.results
    assert ended_rank.folder == str(tmp_path / "ck") and ended_rank.rank == 0
    # One key names the save in every event; nothing else of it is handed over.
    keys = {id(at_request.key), id(at_write.key), id(ended_rank.key), id(ended[1]), id(w.tier.events[2][1]),
            id(w.tier.events[5][1])}
    assert len(keys) == 1
    assert ended[2] is None
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=DataStatesReader(str(tmp_path / "ck")))
    assert_state_equal(state, out)


def test_a_failed_write_tells_the_tier_its_error_and_commits_nothing(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise CheckpointWriteError("injected write failure")

    monkeypatch.setattr(save, "write_rank", fail)
    w = recording_writer(tmp_path / "ck")
    with raises_through_dcp("injected write failure"):
        dcp.async_save(make_state(), storage_writer=w).upload_completion.result(timeout=60)
    kinds = [e[0] for e in w.tier.events]
    assert "commit" not in kinds and kinds[-2:] == ["rank_ended", "ended"], kinds
    assert "injected write failure" in str(w.tier.events[-2][1].error)
    assert w.tier.events[-2][1].results == ()
    assert "injected write failure" in str(w.tier.events[-1][2])
    assert not (tmp_path / "ck" / ".metadata").exists()


def test_a_failed_save_fails_its_local_commit_future(tmp_path, monkeypatch):
    """local_tier: ``writer.local_commit`` fails with the save's error instead of never resolving."""
    def fail(*args, **kwargs):
        raise CheckpointWriteError("injected write failure")

    monkeypatch.setattr(save, "write_rank", fail)
    w = DataStatesWriter(str(tmp_path / "durable"), local_tier=str(tmp_path / "nvme"))
    with raises_through_dcp("injected write failure"):
        dcp.async_save(make_state(), storage_writer=w).upload_completion.result(timeout=60)
    with pytest.raises(CheckpointWriteError, match="injected write failure"):
        w.local_commit.result(timeout=5)
