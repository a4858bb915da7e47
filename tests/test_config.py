import json
import logging
import os

import pytest

from dcp_datastates import DataStatesConfig, DataStatesReader, DataStatesWriter, parse_size
from dcp_datastates.config import default_cache_plan, memory_limit


def test_parse_size_units():
    assert parse_size("16GB") == 16 * 1000**3
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == int(1.5 * 1000**3)
    assert parse_size(4096) == 4096
    assert parse_size(16, bare_unit=1 << 30) == 16 << 30
    assert parse_size("16", bare_unit=1 << 30) == 16 << 30


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-3GB", True, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_defaults_are_documented_values(monkeypatch):
    monkeypatch.delenv("DCP_DATASTATES_HOST_CACHE_SIZE", raising=False)
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    c = DataStatesConfig()
    assert c.host_cache_size is None  # auto: sized per node when the engine starts
    nbytes, how = c.cache_plan()
    assert nbytes == max(256 << 20, memory_limit() // 4) // 4096 * 4096
    assert "25% of" in how and "1 local rank" in how
    assert c.pin_host_cache is True and c.sync_files is True and c.verify is True and c.overwrite is True
    assert c.gpu_cache_size == 0
    assert c.read_threads == min(4, 2 * (os.cpu_count() or 1))


def test_nanotron_yaml_block(tmp_path):
    p = tmp_path / "nanotron.yaml"
    p.write_text("checkpointing_engine: datastates\ndatastates:\n  host_cache_size: 16\n  parser_threads: 3\n  pin_host_cache: false\n")
    c = DataStatesConfig.from_file(p)
    assert c.host_cache_size == 16 << 30  # bare number = GB, as in the seeds
    assert c.copy_threads == 3
    assert c.pin_host_cache is False


def test_deepspeed_json_section_with_comments(tmp_path):
    p = tmp_path / "ds_config.json"
    p.write_text('{\n  // other DeepSpeed options\n  "train_batch_size": 8,\n  "datastates_ckpt": {"host_cache_size": 2}\n}\n')
    c = DataStatesConfig.from_file(p)
    assert c.host_cache_size == 2 << 30


def test_size_strings_and_aliases():
    c = DataStatesConfig.from_dict({"host_cache_size": "512MiB", "thread_count": 3, "chunk_size": "8MiB"})
    assert c.host_cache_size == 512 << 20 and c.flush_threads == 3 and c.chunk_size == 8 << 20


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="unknown DataStates option 'host_cache'"):
        DataStatesConfig.from_dict({"host_cache": 3})


def test_a_misspelt_option_names_the_closest_known_one():
    with pytest.raises(ValueError, match=r"unknown DataStates option 'flush_thread' \(did you mean 'flush_threads'\?\)"):
        DataStatesWriter("ckpt", flush_thread=2)
    with pytest.raises(ValueError, match=r"unknown DataStates option 'zzz'; known options: "):  # nothing close: no guess
        DataStatesConfig.from_dict({"zzz": 1})


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="flush_threads"):
        DataStatesConfig(flush_threads=0)
    with pytest.raises(ValueError, match="host_cache_size"):
        DataStatesConfig(host_cache_size="tiny")


def test_bad_file_names_the_file(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        DataStatesConfig.from_file(p)


def test_writer_keyword_options_are_bytes_and_override_config(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"datastates": {"host_cache_size": 1, "sync_files": True}}))
    w = DataStatesWriter(tmp_path / "ck", config=str(cfg), sync_files=False, host_cache_size=64 << 20)
    assert w.config.sync_files is False
    assert w.config.host_cache_size == 64 << 20


def test_prefault_host_cache_auto_follows_an_explicit_cache_size(tmp_path):
    assert DataStatesConfig().prefault_host_cache is None
    assert DataStatesConfig().prefault_enabled() is False  # the built-in size is a guess per process
    assert DataStatesConfig(host_cache_size="64MiB").prefault_enabled() is True
    assert DataStatesConfig(host_cache_size="64MiB", prefault_host_cache=False).prefault_enabled() is False
    assert DataStatesConfig(prefault_host_cache=True).prefault_enabled() is True
    p = tmp_path / "c.yaml"
    p.write_text("datastates:\n  host_cache_size: 1\n  prefault_host_cache: false\n")
    assert DataStatesConfig.from_file(p).prefault_enabled() is False
    with pytest.raises(ValueError, match="prefault_host_cache"):
        DataStatesConfig(prefault_host_cache="yes")


def test_engine_prefaults_an_explicitly_sized_cache(small_engine, tmp_path):
    import time

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import engine_stats

    cache = 32 << 20
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c", host_cache_size=cache)).upload_completion.result()
    deadline = time.monotonic() + 30
    while engine_stats()["cache_prefaulted_bytes"] < cache and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_stats()["cache_prefaulted_bytes"] == cache


def test_start_engine_at_setup_prefaults_before_the_first_checkpoint(small_engine, tmp_path):
    import time

    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import engine_stats, start_engine

    cache = 16 << 20
    st = start_engine(host_cache_size=cache)
    assert st["cache_bytes"] == cache
    deadline = time.monotonic() + 30
    while engine_stats()["cache_prefaulted_bytes"] < cache and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_stats()["cache_prefaulted_bytes"] == cache
    assert start_engine()["cache_address"] == st["cache_address"]  # the running engine, reused
    state = {"w": torch.ones(100)}
    dcp.async_save(state, storage_writer=DataStatesWriter(tmp_path / "c", host_cache_size=cache)).upload_completion.result()
    assert engine_stats()["cache_address"] == st["cache_address"] and engine_stats()["jobs_done"] == 1


# ---------------------------------------------------------------- default cache sized per node
@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_default_cache_is_a_quarter_of_the_node_split_between_local_ranks(monkeypatch, ranks):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    plan = default_cache_plan()
    assert plan.local_ranks == ranks and plan.local_ranks_from == "LOCAL_WORLD_SIZE"
    assert plan.nbytes == max(256 << 20, memory_limit() // 4 // ranks) // 4096 * 4096
    # all ranks of the node together stay within a quarter of its memory (unless at the floor)
    assert plan.nbytes * ranks <= memory_limit() // 4 or plan.nbytes == 256 << 20
    assert f"{ranks} local rank(s) (LOCAL_WORLD_SIZE)" in plan.describe()


def test_default_cache_counts_ranks_per_host_without_torchrun(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    plan = default_cache_plan()
    assert (plan.local_ranks, plan.local_ranks_from) == (4, "OMPI_COMM_WORLD_LOCAL_SIZE")


# ------------------------------------------------------ one meaning for a size, every entry point
# A unitless number is GiB below 65536 and bytes from 65536 up; units mean what they say.
SIZE_CASES = [(16, 16 << 30), ("16", 16 << 30), (0.5, 512 << 20), (64 << 20, 64 << 20), ("67108864", 64 << 20),
              ("16GB", 16 * 1000**3), ("512MiB", 512 << 20)]


@pytest.mark.parametrize("written,nbytes", SIZE_CASES)
def test_a_size_means_the_same_in_every_entry_point(tmp_path, monkeypatch, written, nbytes):
    assert DataStatesConfig(host_cache_size=written).host_cache_size == nbytes
    assert DataStatesWriter(tmp_path / "w", host_cache_size=written).config.host_cache_size == nbytes
    assert DataStatesReader(tmp_path / "w", host_cache_size=written).config.host_cache_size == nbytes
    assert DataStatesConfig.from_dict({"host_cache_size": written}).host_cache_size == nbytes
    assert DataStatesConfig.from_dict({"datastates": {"host_cache_size": written}}).host_cache_size == nbytes
    y = tmp_path / "c.yaml"
    y.write_text(f"datastates:\n  host_cache_size: {json.dumps(written)}\n")
    assert DataStatesConfig.from_file(y).host_cache_size == nbytes
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"datastates_ckpt": {"host_cache_size": written}}))
    assert DataStatesConfig.from_file(j).host_cache_size == nbytes
    monkeypatch.setenv("DCP_DATASTATES_HOST_CACHE_SIZE", str(written))
    assert DataStatesConfig().cache_plan() == (nbytes, "DCP_DATASTATES_HOST_CACHE_SIZE")


def test_a_size_in_bytes_reads_back_as_itself():
    import dataclasses

    c = DataStatesConfig(host_cache_size=65536)
    assert dataclasses.replace(c, flush_threads=3).host_cache_size == 65536
    with pytest.raises(ValueError, match="host_cache_size: must be at least 65536 bytes, got 4096"):
        DataStatesConfig(host_cache_size="4KiB")


def test_a_cache_larger_than_the_machine_fails_at_engine_start_naming_the_option(small_engine):
    from dcp_datastates import start_engine

    too_big = memory_limit() + (1 << 30)
    with pytest.raises(MemoryError) as err:
        start_engine(host_cache_size=too_big)
    text = str(err.value)
    assert "host_cache_size" in text and str(too_big) in text and str(memory_limit()) in text


# --------------------------------------------- engine settings are never ignored without a word
def _engine_records():
    records: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record)

    return records, Grab(level=logging.INFO)


def _save(tmp_path, name, **options):
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(8.0)}, storage_writer=DataStatesWriter(tmp_path / name, **options), no_dist=True)


def test_a_load_does_not_fix_the_engine_the_next_writer_restarts_it(small_engine, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import engine_stats

    _save(tmp_path, "a", host_cache_size="2MiB")
    from dcp_datastates import shutdown_engine

    shutdown_engine()  # a new process: it resumes by loading first
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=DataStatesReader(tmp_path / "a"), no_dist=True)
    assert torch.equal(out["w"], torch.arange(8.0))
    assert engine_stats()["flush_threads"] == DataStatesConfig().flush_threads  # started by the load
    _save(tmp_path, "b", host_cache_size="4MiB", flush_threads=3)
    st = engine_stats()
    assert (st["cache_bytes"], st["flush_threads"]) == (4 << 20, 3)


def test_a_setting_the_running_engine_cannot_take_is_reported_once(small_engine, tmp_path):
    from dcp_datastates import engine_stats

    records, handler = _engine_records()
    logger = logging.getLogger("dcp_datastates")
    logger.addHandler(handler)
    try:
        _save(tmp_path, "a", host_cache_size="2MiB", flush_threads=2)
        _save(tmp_path, "b", host_cache_size="2MiB", flush_threads=4)
        _save(tmp_path, "c", host_cache_size="2MiB", flush_threads=4)
    finally:
        logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "flush_threads=4 is ignored" in warnings[0] and "runs with flush_threads=2" in warnings[0]
    assert engine_stats()["flush_threads"] == 2


def test_the_start_up_line_says_how_the_cache_was_chosen(small_engine, tmp_path, monkeypatch):
    from dcp_datastates import shutdown_engine, start_engine

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("DCP_DATASTATES_HOST_CACHE_SIZE", raising=False)
    records, handler = _engine_records()
    logger = logging.getLogger("dcp_datastates")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        start_engine(prefault_host_cache=False)
        shutdown_engine()
        start_engine(host_cache_size="3MiB")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    lines = [r.getMessage() for r in records if "host cache" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "8 local rank(s) (LOCAL_WORLD_SIZE)" in lines[0] and str(default_cache_plan().nbytes) in lines[0]
    assert f"host cache {3 << 20} bytes" in lines[1] and "host_cache_size" in lines[1]


def test_default_copy_threads_leave_the_training_thread_a_core_on_two_cpus(monkeypatch):
    """One copy worker where the process may use at most 2 CPUs, 2 elsewhere; set, it is kept."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert DataStatesConfig().copy_threads == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert DataStatesConfig().copy_threads == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert DataStatesConfig().copy_threads == 2
    assert DataStatesConfig(copy_threads=3).copy_threads == 3
