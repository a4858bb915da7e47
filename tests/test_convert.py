"""dcp_datastates.convert as a library: each format loads back bitwise equal to what was saved,
bad outputs and damaged checkpoints are refused with a message naming what is wrong, and nothing
is created when the checkpoint cannot be read. (tests/test_cli.py covers the command line.)"""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from dcp_datastates import ChecksumMismatchError, DataStatesWriter, convert
from dcp_datastates.commit import read_commit

from conftest import assert_state_equal, tensors_equal_bitwise, zeros_like_state


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"a": torch.randn(40, 8, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
                  "layers": [{"w": torch.randn(3, 3, generator=g)}]},
        "ids": torch.arange(5),
        "step": 11,
    }


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    state = _state()
    dcp.save(state, storage_writer=DataStatesWriter(path), no_dist=True)
    return str(path), state


class _Bar:
    def __init__(self, seen):
        self.seen = seen

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.seen.append(n)


def test_to_torch_loads_back_bitwise_with_its_nesting(saved, tmp_path):
    path, state = saved
    seen: list[int] = []
    done = convert.to_torch(path, str(tmp_path / "out.pt"), progress=lambda total, desc: _Bar(seen))
    assert done.items == 5 and done.nbytes == sum(seen) > 0
    assert_state_equal(torch.load(tmp_path / "out.pt", weights_only=True), state)


def test_to_dcp_loads_with_the_stock_reader(saved, tmp_path):
    path, state = saved
    convert.to_dcp(path, str(tmp_path / "stock"))
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=FileSystemReader(tmp_path / "stock"), no_dist=True)
    assert_state_equal(dest, state)


def test_to_hf_shards_tensors_under_a_prefix(saved, tmp_path):
    path, state = saved
    out = tmp_path / "hf"
    done = convert.to_hf(path, str(out), max_shard_size=200, prefix="model.")
    # 'a' (1280 bytes) alone, then 'b' and 'layers.0.w' (50 bytes) together
    assert done.files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"a", "b", "layers.0.w"}
    loaded = {}
    for name in done.files:
        loaded.update(load_file(out / name))
    assert set(load_file(out / done.files[0])) == {"a"} and index["weight_map"]["b"] == done.files[1]
    assert tensors_equal_bitwise(loaded["a"], state["model"]["a"])
    assert tensors_equal_bitwise(loaded["b"], state["model"]["b"])
    assert tensors_equal_bitwise(loaded["layers.0.w"], state["model"]["layers"][0]["w"])


def test_to_hf_names_what_it_skips(saved, tmp_path):
    done = convert.to_hf(saved[0], str(tmp_path / "hf"))
    assert done.skipped == ["step (not a tensor)"] and done.files == ["model.safetensors"]


def test_bad_outputs_are_refused_by_name(saved, tmp_path):
    path, _ = saved
    taken = tmp_path / "taken.pt"
    taken.write_bytes(b"x")
    with pytest.raises(ValueError, match=f"output file {taken} exists"):
        convert.to_torch(path, str(taken))
    assert taken.read_bytes() == b"x"
    with pytest.raises(ValueError, match="the output must not be the checkpoint itself"):
        convert.to_dcp(path, path)
    with pytest.raises(ValueError, match="no tensors to convert under prefix 'nope.'"):
        convert.to_hf(path, str(tmp_path / "hf"), prefix="nope.")
    with pytest.raises(ValueError, match="max_shard_size must be positive"):
        convert.to_hf(path, str(tmp_path / "hf"), max_shard_size=0)


def test_a_damaged_checkpoint_creates_no_output(saved, tmp_path):
    path, _ = saved
    md, _files = read_commit(path)
    loc = next(loc for index, loc in md.storage_data.items() if index.fqn == "model.a")
    with open(os.path.join(path, loc.file), "r+b") as f:
        f.seek(loc.offset)
        f.write(b"\xff\xff\xff\xff")
    out = tmp_path / "out.pt"
    with pytest.raises(BaseException) as info:
        convert.to_torch(path, str(out))
    cause = info.value
    while not isinstance(cause, ChecksumMismatchError) and getattr(cause, "failures", None):
        cause = next(iter(cause.failures.values()))[0]
    assert isinstance(cause, ChecksumMismatchError) and "'model.a'" in str(cause)
    assert not out.exists()


def test_checkpoint_items_lists_every_entry(saved):
    md, _ = read_commit(saved[0])
    items = {i.fqn: i for i in convert.checkpoint_items(md)}
    assert set(items) == {"model.a", "model.b", "model.layers.0.w", "ids", "step"}
    assert (items["model.b"].dtype, items["model.b"].shape, items["model.b"].nbytes) == ("bfloat16", (7,), 14)
    assert items["step"].kind == "bytes" and items["step"].chunks[0]["length"] == items["step"].nbytes
