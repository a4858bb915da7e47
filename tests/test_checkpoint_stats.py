"""Per-checkpoint figures: the coordinator's INFO line and recent_checkpoints()."""

import dataclasses
import logging

import pytest

import dcp_datastates
from dcp_datastates import CheckpointStats, recent_checkpoints
from dcp_datastates.save.checkpoint_stats import HISTORY, _clear, record


@pytest.fixture(autouse=True)
def fresh():
    _clear()
    yield
    _clear()


@pytest.fixture
def lines():
    got: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, r):
            got.append(r)

    h = Grab(level=logging.DEBUG)
    logger = logging.getLogger("dcp_datastates")
    old = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    yield got
    logger.removeHandler(h)
    logger.setLevel(old)


def stats(**kw):
    base = dict(path="ckpt/step-100", rank=0, world_size=8, bytes=3_000_000_000, stall_s=0.0125, staged_s=0.5, durable_s=2.0)
    base.update(kw)
    return CheckpointStats(**base)


def test_exported_from_the_package():
    assert dcp_datastates.CheckpointStats is CheckpointStats
    assert dcp_datastates.recent_checkpoints is recent_checkpoints


def test_gb_per_s_is_derived_and_none_until_durable():
    assert stats().gb_per_s == pytest.approx(1.5)
    assert stats(durable_s=None).gb_per_s is None
    assert stats(error="disk full").gb_per_s is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats().bytes = 1


def test_coordinator_logs_one_info_line_with_every_figure(lines):
    record(stats())
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and lines[0].name == "dcp_datastates"
    assert lines[0].getMessage() == (
        "dcp_datastates: checkpoint ckpt/step-100: 3.000 GB, training stalled 12.5 ms, staged in 0.500 s, "
        "durable in 2.000 s (1.50 GB/s), 8 rank(s)"
    )


def test_other_ranks_and_uncommitted_records_do_not_log(lines):
    record(stats(rank=3))
    record(stats(path="ckpt/step-200", durable_s=None))
    assert lines == []
    record(stats(rank=3, coordinator=True, path="ckpt/step-300"))  # a coordinator other than rank 0
    assert len(lines) == 1 and "ckpt/step-300" in lines[0].getMessage()


def test_a_failed_checkpoint_logs_a_warning(lines):
    record(stats(durable_s=None, error="No space left on device"))
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "ckpt/step-100 FAILED: No space left on device" in lines[0].getMessage()


def test_recent_checkpoints_returns_the_last_n_oldest_first():
    for step in range(5):
        record(stats(path=f"ckpt/step-{step}", rank=1))
    assert [s.path for s in recent_checkpoints(2)] == ["ckpt/step-3", "ckpt/step-4"]
    assert len(recent_checkpoints()) == 5 and recent_checkpoints(0) == []
    with pytest.raises(ValueError, match="non-negative integer"):
        recent_checkpoints(-1)


def test_a_record_at_staged_is_replaced_by_the_one_at_commit(lines):
    record(stats(durable_s=None))
    record(stats(durable_s=2.0))
    assert [s.durable_s for s in recent_checkpoints()] == [2.0]
    assert len(lines) == 1


def test_history_is_bounded():
    for step in range(HISTORY + 10):
        record(stats(path=f"ckpt/step-{step}", rank=1))
    kept = recent_checkpoints()
    assert len(kept) == HISTORY and kept[0].path == "ckpt/step-10"


def test_bad_figures_are_refused():
    with pytest.raises(ValueError, match="CheckpointStats.stall_s"):
        stats(stall_s=-1.0)
    with pytest.raises(ValueError, match="CheckpointStats.bytes"):
        stats(bytes=-5)
    with pytest.raises(TypeError, match="expected CheckpointStats"):
        record({"path": "x"})


def test_a_save_records_its_figures_and_the_coordinator_logs_one_line(tmp_path, caplog):
    import logging

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter, recent_checkpoints
    from dcp_datastates.save import checkpoint_stats

    checkpoint_stats._clear()
    state = {"w": torch.randn(256 * 1024), "step": 3}
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "s1")).upload_completion.result(timeout=60)
    (rec,) = recent_checkpoints(1)
    assert rec.path == str(tmp_path / "s1") and rec.committed and rec.error is None
    assert rec.bytes >= 1024 * 1024  # the tensor's bytes at least
    assert 0 <= rec.stall_s <= rec.durable_s and rec.staged_s is not None and rec.staged_s <= rec.durable_s
    lines = [r.getMessage() for r in caplog.records if "checkpoint" in r.getMessage() and "durable in" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "s1") in lines[0] and "training stalled" in lines[0]
