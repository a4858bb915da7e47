"""Synced data files written from the host cache past the page cache (``direct_io=True``,
O_DIRECT): every chunk that starts on a page writes its whole pages with
O_DIRECT and its last partial page through the page cache. The bytes load back equal and match
their checksums, whatever the tensors' sizes; unsynced saves and file systems that refuse
O_DIRECT write through the page cache as before. The default (``direct_io=None``) writes past
the page cache only the saves that recur (save/rhythm.py)."""

import contextlib
import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesConfig, DataStatesReader, DataStatesWriter, engine_stats
from dcp_datastates.runtime import current_engine
from dcp_datastates.save import rhythm

from conftest import assert_state_equal, raises_through_dcp, zeros_like_state


def _odd_state(seed=0):
    """Sizes on and off page boundaries, across chunk and piece boundaries, several dtypes."""
    g = torch.Generator().manual_seed(seed)
    state = {f"t{n}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
             for n in (1, 4095, 4096, 4097, 3 * 4096 + 5, (1 << 20) + 7)}
    state["big"] = torch.randn(5 << 20, generator=g)  # 20 MiB: more than one 16 MiB chunk
    state["bf16"] = torch.randn(12345, generator=g).to(torch.bfloat16)
    state["step"] = 7
    return state


def _skip_unless_o_direct(folder) -> None:
    probe = os.path.join(folder, ".o_direct_probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError as exc:
        pytest.skip(f"{folder}: the file system refuses O_DIRECT ({exc})")
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def _direct_io_bytes() -> int:
    return int(engine_stats().get("direct_io_bytes", 0))


def _save(state, path, **options):
    dcp.async_save(state, storage_writer=DataStatesWriter(str(path), direct_writes=False, **options)
                   ).upload_completion.result(timeout=120)


def _direct(state, path, **options):
    _save(state, path, direct_io=True, **options)


@contextlib.contextmanager
def _fault(kind, path):
    """The engine's fault ``kind`` armed for files under ``path`` from the first byte, then cleared."""
    engine = current_engine()
    engine.set_fault(kind, 0, str(path))
    try:
        yield
    finally:
        engine.set_fault("none", 0, "")


def _load(like, path):
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=DataStatesReader(str(path)))
    return out


def test_a_synced_save_writes_whole_pages_past_the_page_cache_and_loads_back(tmp_path):
    _skip_unless_o_direct(tmp_path)
    state = _odd_state()
    before = _direct_io_bytes()
    _direct(state, tmp_path / "ck")
    written = _direct_io_bytes() - before
    tensor_bytes = sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
    # Whole pages only: never more than the data, and most of it on this layout.
    assert 0 < written <= tensor_bytes + 4096 * 16
    assert written >= state["big"].nbytes - (16 << 20)
    assert written % 4096 == 0
    # (The reader checks every piece's CRC32C.)
    assert_state_equal(state, _load(state, tmp_path / "ck"))


def test_the_same_state_saved_both_ways_gives_the_same_files(tmp_path):
    state = _odd_state(1)
    _save(state, tmp_path / "cached")
    _direct(state, tmp_path / "direct")
    names = sorted(n for n in os.listdir(tmp_path / "cached") if not n.startswith("."))
    assert names == sorted(n for n in os.listdir(tmp_path / "direct") if not n.startswith("."))
    for name in names:
        assert (tmp_path / "cached" / name).read_bytes() == (tmp_path / "direct" / name).read_bytes(), name


def test_unsynced_saves_and_a_save_that_does_not_recur_stay_in_the_page_cache(tmp_path):
    state = _odd_state(2)
    rhythm.forget()  # the first save of a process
    before = _direct_io_bytes()
    _save(state, tmp_path / "default")
    _direct(state, tmp_path / "unsynced", sync_files=False)
    assert _direct_io_bytes() == before
    assert_state_equal(state, _load(state, tmp_path / "default"))
    assert_state_equal(state, _load(state, tmp_path / "unsynced"))


def test_by_default_saves_that_follow_each_other_go_past_the_page_cache(tmp_path):
    _skip_unless_o_direct(tmp_path)
    rhythm.forget()
    states = [_odd_state(10 + k) for k in range(3)]
    written = []
    for k, state in enumerate(states):
        before = _direct_io_bytes()
        _save(state, tmp_path / f"ck{k}")
        written.append(_direct_io_bytes() - before)
    # The first save does not recur; the next ones come right after the last one ended.
    assert written[0] == 0
    assert written[1] >= states[1]["big"].nbytes - (16 << 20)
    assert written[2] >= states[2]["big"].nbytes - (16 << 20)
    for k, state in enumerate(states):
        assert_state_equal(state, _load(state, tmp_path / f"ck{k}"))


def test_what_decides_the_automatic_mode():
    auto, unsynced = DataStatesConfig(), DataStatesConfig(sync_files=False)
    rhythm.forget()
    assert rhythm.direct_io_for(auto, 100.0) is False  # nothing before it
    assert rhythm.direct_io_for(auto, 100.5) is False  # the first one has not ended
    rhythm.save_ended(100.0, ended=101.0)  # it took 1 s
    assert rhythm.direct_io_for(auto, 101.2) is True  # 0.7 s after the last request
    assert rhythm.direct_io_for(unsynced, 101.4) is False  # nothing to write past the cache
    # The drain reads a local tier's files back at once.
    assert rhythm.direct_io_for(DataStatesConfig(local_tier="/tmp/local-tier"), 101.4) is False
    assert rhythm.direct_io_for(auto, 101.4 + rhythm.RECURRING - 0.01) is True
    assert rhythm.direct_io_for(auto, 200.0) is False  # long after the last request: single saves
    # An explicit choice decides alone, and still counts as a request.
    assert rhythm.direct_io_for(DataStatesConfig(direct_io=True), 900.0) is True
    assert rhythm.direct_io_for(DataStatesConfig(direct_io=False), 900.1) is False
    assert rhythm.direct_io_for(auto, 900.2) is True
    rhythm.forget()


def test_a_failed_save_does_not_make_the_next_one_recur(tmp_path):
    _save({"warm": torch.zeros(4)}, tmp_path / "warm")  # the engine runs
    rhythm.forget()
    with _fault("enospc", tmp_path / "bad"), raises_through_dcp("No space left on device"):
        _save(_odd_state(6), tmp_path / "bad")
    # No save ended well: no duration to compare with.
    assert rhythm.direct_io_for(DataStatesConfig(), time.monotonic()) is False


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_direct_io_takes_true_false_or_null(value):
    with pytest.raises(ValueError, match=r"direct_io: expected true, false or null, got"):
        DataStatesConfig(direct_io=value)


def test_a_full_disk_during_a_direct_write_fails_the_save_and_keeps_the_last_checkpoint(tmp_path):
    _skip_unless_o_direct(tmp_path)
    first = _odd_state(3)
    _direct(first, tmp_path / "ck")
    # From the first chunk on, which starts on the file's (aligned) data region: a direct write.
    before = _direct_io_bytes()
    with _fault("enospc", tmp_path / "ck"), raises_through_dcp("No space left on device"):
        _direct(_odd_state(4), tmp_path / "ck")
    assert _direct_io_bytes() == before
    assert_state_equal(first, _load(first, tmp_path / "ck"))


def test_files_held_until_dcp_names_the_folder_are_written_past_the_page_cache_too(tmp_path):
    """A writer given its folder only through ``checkpoint_id``: the files wait for the plan
    (save/held_file.py) and are written with the same option."""
    state = _odd_state(5)
    before = _direct_io_bytes()
    writer = DataStatesWriter(direct_writes=False, direct_io=True)
    dcp.async_save(state, checkpoint_id=str(tmp_path / "ck"), storage_writer=writer).upload_completion.result(timeout=120)
    written = _direct_io_bytes() - before
    assert written >= state["big"].nbytes - (16 << 20)
    assert_state_equal(state, _load(state, tmp_path / "ck"))


def test_a_file_system_that_refuses_the_direct_writes_gets_them_through_the_page_cache(tmp_path):
    """O_DIRECT opens, but its writes fail with EINVAL (an alignment the file system does not
    take): each refused chunk is written again through the page cache, and so are the job's
    later chunks; the save succeeds with the same files as one through the page cache."""
    _skip_unless_o_direct(tmp_path)
    state = _odd_state(7)
    _save(state, tmp_path / "cached", direct_io=False)
    before = engine_stats()
    with _fault("direct_einval", tmp_path / "refused"):
        _direct(state, tmp_path / "refused")
    after = engine_stats()
    assert after["direct_io_bytes"] == before["direct_io_bytes"]
    assert after["direct_io_refused"] > before["direct_io_refused"]
    names = sorted(n for n in os.listdir(tmp_path / "cached") if not n.startswith("."))
    for name in names:
        assert (tmp_path / "refused" / name).read_bytes() == (tmp_path / "cached" / name).read_bytes(), name
    assert_state_equal(state, _load(state, tmp_path / "refused"))
    # The fault is for O_DIRECT writes only: a save through the page cache does not see it.
    with _fault("direct_einval", tmp_path / "plain"):
        _save(state, tmp_path / "plain", direct_io=False)
    assert_state_equal(state, _load(state, tmp_path / "plain"))
