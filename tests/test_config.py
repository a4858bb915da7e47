import json
import os

import pytest

from dcp_datastates import DataStatesConfig, DataStatesWriter, parse_size


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


def test_defaults_are_documented_values():
    c = DataStatesConfig()
    assert 256 << 20 <= c.host_cache_size <= 8 << 30
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
