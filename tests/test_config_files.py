"""The example config files shipped in examples/configs load into DataStatesConfig."""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesConfig, DataStatesReader, DataStatesWriter

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def test_nanotron_yaml():
    c = DataStatesConfig.from_file(CONFIGS / "nanotron.yaml")
    assert c.host_cache_size == 16 << 30  # a bare number is GB, as in the seeds
    assert c.copy_threads == 2  # parser_threads
    assert c.pin_host_cache is True
    assert c.flush_threads == 4
    assert c.chunk_size == 64 << 20
    assert c.sync_files is True and c.verify is True


def test_deepspeed_json():
    c = DataStatesConfig.from_file(CONFIGS / "deepspeed_config.json")
    assert c.host_cache_size == 16 << 30
    assert c.flush_threads == 4  # thread_count
    assert c.pin_host_cache is True
    assert c.copy_threads == DataStatesConfig().copy_threads  # not set: the default


def test_writer_and_reader_accept_the_files(tmp_path):
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}
    # A file path as config=, with keyword options on top (a small cache for the test machine).
    writer = DataStatesWriter(tmp_path / "ck", config=str(CONFIGS / "nanotron.yaml"), host_cache_size="64MiB")
    assert writer.config.host_cache_size == 64 << 20 and writer.config.flush_threads == 4
    dcp.save(state, storage_writer=writer, no_dist=True)
    out = {"w": torch.zeros(3, 4), "step": None}
    reader = DataStatesReader(tmp_path / "ck", config=str(CONFIGS / "deepspeed_config.json"), host_cache_size="64MiB")
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
