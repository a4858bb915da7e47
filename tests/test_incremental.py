"""Incremental saves (``incremental=True``): unchanged tensors are written once, every checkpoint
still loads strictly and bitwise, references are checked, followed and kept safe."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import (
    CheckpointFormatError,
    CheckpointWriteError,
    ChecksumMismatchError,
    DataStatesReader,
    DataStatesWriter,
    IncompleteCheckpointError,
    checkpoint_error_cause,
    referenced_by,
)
from dcp_datastates.config import tool_config
from dcp_datastates.load.verify import verify_checkpoint
from dcp_datastates.runtime import get_engine

from conftest import assert_state_equal, clone_state, zeros_like_state
from dist_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Adapted(torch.nn.Module):
    """A model 95 % frozen: a large frozen embedding and tower, a small trainable adapter."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        self.tower = torch.nn.Linear(64, 64)
        self.adapter = torch.nn.Linear(64, 8)
        for p in (*self.embed.parameters(), *self.tower.parameters()):
            p.requires_grad_(False)

    def forward(self, idx):
        return self.adapter(torch.tanh(self.tower(self.embed(idx))))


def own_bytes(path) -> int:
    """Bytes of the data files a checkpoint wrote itself (its references are other folders' files)."""
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    idx, y = torch.randint(0, 512, (16,), generator=g), torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(model(idx), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def save(state, path, *, lazy=True, **options):
    writer = DataStatesWriter(path, incremental=True, **options)
    if lazy:
        dcp.async_save(state, storage_writer=writer).upload_completion.result(timeout=120)
    else:
        dcp.save(state, storage_writer=writer, no_dist=True)


def load(path, like):
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=DataStatesReader(path), no_dist=True)
    return out


def load_error(path, like):
    """The library's error (DCP wraps it) of a strict load of ``path``."""
    with pytest.raises(BaseException) as info:
        dcp.load(zeros_like_state(like), storage_reader=DataStatesReader(path), no_dist=True)
    return checkpoint_error_cause(info.value)


def test_a_model_95_percent_frozen_writes_its_frozen_bytes_once_and_resumes_bitwise(tmp_path):
    torch.manual_seed(0)
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert frozen > 19 * trainable
    written, saved = [], {}
    for step in range(1, 21):
        train(model, opt, step)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        path = tmp_path / f"step-{step}"
        save(state, path, lazy=step % 4 != 0)  # dcp.save every 4th step: the same decisions
        written.append(own_bytes(path))
        saved[step] = clone_state(state)
    assert written[0] > frozen
    # Every later save: the adapter, its AdamW moments, the small values; never the frozen bytes.
    assert max(written[1:]) < frozen // 4, written
    for step in (1, 2, 11, 20):
        path = tmp_path / f"step-{step}"
        assert_state_equal(saved[step], load(path, saved[step]))
    # A fresh model and optimizer resume from the newest one, strictly.
    model2 = Adapted()
    opt2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    train(model2, opt2, 0)  # the optimizer's state exists, as when resuming a run
    state2 = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0}
    dcp.load(state2, storage_reader=DataStatesReader(tmp_path / "step-20"), no_dist=True)
    opt2.load_state_dict(state2["optim"])
    assert_state_equal(saved[20]["model"], model2.state_dict())
    train(model, opt, 21)
    train(model2, opt2, 21)
    assert_state_equal(model.state_dict(), model2.state_dict())
    md = json.loads((tmp_path / "step-20" / ".metadata").read_text())
    assert md["version"] == 2
    refs = {name.split("/")[1] for name in md["files"] if name.startswith("../")}
    assert refs == {"step-1"}, refs  # one hop to the checkpoint that wrote them


def test_frozen_tensors_changed_in_place_are_written(tmp_path, monkeypatch):
    from dcp_datastates.save import incremental

    monkeypatch.setattr(incremental, "PROBE_EVERY", 1)  # every tensor hashed at every save (no hint)
    g = torch.Generator().manual_seed(3)
    frozen = torch.nn.Parameter(torch.randn(256, 64, generator=g), requires_grad=False)
    other = torch.randn(128, 64, generator=g)
    scale = torch.randn(1000, generator=g)

    def state():
        return {"frozen": frozen, "other": other, "scale": scale}

    save(state(), tmp_path / "step-1")
    version = frozen._version
    frozen.data[3, 5] += 1.0  # through .data: no version bump on the parameter
    assert frozen._version == version
    save(state(), tmp_path / "step-2")
    with torch.no_grad():
        other.copy_(other * 2)  # copy_ under no_grad
    save(state(), tmp_path / "step-3", lazy=False)
    torch.ops.aten.mul_.Tensor(scale, 3.0)  # any kernel, any counter: the bytes decide
    save(state(), tmp_path / "step-4")
    save(state(), tmp_path / "step-5")  # nothing changed: no data file at all
    for step, expect in ((2, {"frozen"}), (3, {"other"}), (4, {"scale"}), (5, set())):
        md = json.loads((tmp_path / f"step-{step}" / ".metadata").read_text())
        own = {fqn for fqn, item in md["items"].items() for c in item["chunks"] if not c["file"].startswith("../")}
        assert own == expect, (step, own)
    assert own_bytes(tmp_path / "step-5") == 0
    expected = clone_state(state())
    assert_state_equal(expected, load(tmp_path / "step-5", expected))


def test_dtype_or_shape_changes_are_written(tmp_path):
    t = torch.zeros(64, 32)
    save({"t": t}, tmp_path / "step-1")
    save({"t": t.view(32, 64)}, tmp_path / "step-2")  # same bytes, another shape
    save({"t": t.view(torch.int32)}, tmp_path / "step-3")  # same bytes, another dtype
    for step in (2, 3):
        md = json.loads((tmp_path / f"step-{step}" / ".metadata").read_text())
        assert not md["items"]["t"]["chunks"][0]["file"].startswith("../"), step
    assert_state_equal({"t": t.view(torch.int32)}, load(tmp_path / "step-3", {"t": t.view(torch.int32)}))


def test_full_parameter_training_skips_nothing(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, 4):
        x = torch.randn(8, 64)
        model(x).sum().backward()
        opt.step()
        save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / f"step-{step}")
        md = json.loads((tmp_path / f"step-{step}" / ".metadata").read_text())
        refs = [fqn for fqn, item in md["items"].items() if item["type"] == "tensor"
                for c in item["chunks"] if c["file"].startswith("../")]
        assert refs == [], (step, refs)


def test_the_first_save_or_a_base_without_hashes_writes_everything(tmp_path):
    t = torch.randn(100, 100)
    dcp.save({"t": t}, storage_writer=DataStatesWriter(tmp_path / "step-1"), no_dist=True)  # not incremental
    save({"t": t}, tmp_path / "step-2")
    assert own_bytes(tmp_path / "step-2") > t.numel() * 4
    save({"t": t}, tmp_path / "step-3")
    assert own_bytes(tmp_path / "step-3") == 0
    assert referenced_by(tmp_path / "step-2") == [str(tmp_path / "step-3")]
    assert referenced_by(tmp_path / "step-1") == []


def test_a_corrupted_referenced_byte_fails_the_load_naming_both(tmp_path):
    t = torch.randn(300, 300)
    save({"t": t, "u": torch.randn(10)}, tmp_path / "step-1")
    save({"t": t, "u": torch.randn(10)}, tmp_path / "step-2")
    base = tmp_path / "step-1" / "__0_0.safetensors"
    raw = bytearray(base.read_bytes())
    raw[-100] ^= 0x01
    base.write_bytes(bytes(raw))
    err = load_error(tmp_path / "step-2", {"t": t, "u": torch.zeros(10)})
    assert isinstance(err, ChecksumMismatchError), err
    text = str(err)
    assert f"checkpoint {tmp_path / 'step-2'}" in text
    assert "data file __0_0.safetensors of the earlier checkpoint step-1, which this incremental checkpoint refers to" in text
    assert "item 't'" in text
    report = verify_checkpoint(tmp_path / "step-2", engine=get_engine(tool_config()))
    assert len(report.problems) == 1 and "../step-1/__0_0.safetensors" in report.problems[0]


def test_a_missing_referenced_file_fails_the_load_naming_both(tmp_path):
    t = torch.randn(300, 300)
    save({"t": t}, tmp_path / "step-1")
    save({"t": t}, tmp_path / "step-2")
    shutil.rmtree(tmp_path / "step-1")
    err = load_error(tmp_path / "step-2", {"t": t})
    assert isinstance(err, IncompleteCheckpointError), err
    text = str(err)
    assert f"incomplete checkpoint {tmp_path / 'step-2'}: data file ../step-1/__0_0.safetensors" in text
    assert "an earlier checkpoint's file that this incremental checkpoint refers to) is missing" in text
    # The next save finds no usable base with those bytes: it writes them again.
    save({"t": t}, tmp_path / "step-3")
    assert own_bytes(tmp_path / "step-3") > t.numel() * 4


def test_the_commit_refuses_a_reference_whose_file_vanished(tmp_path, monkeypatch):
    from dcp_datastates.save import incremental

    t = torch.randn(200, 200)
    save({"t": t}, tmp_path / "step-1")
    found = incremental.find_base

    def base_then_lost(storage):
        base = found(storage)
        shutil.rmtree(tmp_path / "step-1")  # retention, another job: gone before this save commits
        return base

    monkeypatch.setattr(incremental, "find_base", base_then_lost)
    with pytest.raises(BaseException) as err:
        save({"t": t}, tmp_path / "step-2", lazy=False)
    cause = checkpoint_error_cause(err.value)
    assert isinstance(cause, CheckpointWriteError), cause
    text = str(cause)
    assert "committing checkpoint" in text and "../step-1/__0_0.safetensors" in text and "is missing" in text
    assert not (tmp_path / "step-2" / ".metadata").exists()


@pytest.mark.parametrize("name", ["../../x/__0_0.safetensors", "../a/b/__0_0.safetensors", "../../__0_0.safetensors",
                                  "../a/..", "../../etc", "/etc/passwd", "..\\a\\f", "../a/"])
def test_the_decoder_refuses_references_outside_the_root(tmp_path, name):
    t = torch.randn(10)
    save({"t": t}, tmp_path / "step-1")
    save({"t": t}, tmp_path / "step-2")
    marker = tmp_path / "step-2" / ".metadata"
    doc = json.loads(marker.read_text())
    (old,) = doc["files"]
    doc["files"] = {name: doc["files"][old]}
    doc["items"]["t"]["chunks"][0]["file"] = name
    marker.write_text(json.dumps(doc))
    err = load_error(tmp_path / "step-2", {"t": t})
    assert isinstance(err, CheckpointFormatError), err
    assert "files[" in str(err) and ("reference must name" in str(err) or "plain names" in str(err)), err


def test_a_version_1_document_cannot_hold_references(tmp_path):
    t = torch.randn(10)
    save({"t": t}, tmp_path / "step-1")
    save({"t": t}, tmp_path / "step-2")
    marker = tmp_path / "step-2" / ".metadata"
    doc = json.loads(marker.read_text())
    doc["version"] = 1
    marker.write_text(json.dumps(doc))
    err = load_error(tmp_path / "step-2", {"t": t})
    assert isinstance(err, CheckpointFormatError) and "file names must be plain names inside the checkpoint" in str(err)


def test_a_bad_hash_field_is_refused(tmp_path):
    save({"t": torch.randn(10)}, tmp_path / "step-1")
    marker = tmp_path / "step-1" / ".metadata"
    doc = json.loads(marker.read_text())
    doc["items"]["t"]["chunks"][0]["hash64"] = "xyz"
    marker.write_text(json.dumps(doc))
    err = load_error(tmp_path / "step-1", {"t": torch.zeros(10)})
    assert isinstance(err, CheckpointFormatError)
    assert "field 'hash64' in item 't' chunk 0 should be 16 hex digits, found 'xyz'" in str(err)


def test_inspect_and_convert_follow_references(tmp_path):
    t, u = torch.randn(200, 50), torch.randn(7)
    save({"t": t, "u": u}, tmp_path / "step-1")
    u2 = u + 1
    save({"t": t, "u": u2}, tmp_path / "step-2")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "inspect", "--json", str(tmp_path / "step-2")],
                       capture_output=True, text=True, env=env, check=True)
    doc = json.loads(r.stdout)
    assert doc["version"] == 2
    assert doc["references"] == {"step-1": ["../step-1/__0_0.safetensors"]}
    assert doc["files"]["../step-1/__0_0.safetensors"]["size_on_disk"] == doc["files"]["../step-1/__0_0.safetensors"]["size"]
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "inspect", str(tmp_path / "step-2")],
                       capture_output=True, text=True, env=env, check=True)
    assert "references: 1 file(s) of earlier checkpoint(s) step-1 (incremental save;" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "verify", "--no-progress", str(tmp_path / "step-2")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "1 of the files are earlier checkpoints' (step-1), checked too" in r.stdout, r
    r = subprocess.run([sys.executable, "-m", "dcp_datastates", "convert", "--to", "torch", "--no-progress",
                        str(tmp_path / "step-2"), str(tmp_path / "out.pt")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_state_equal({"t": t, "u": u2}, out)


def test_with_a_local_tier_references_name_durable_files_and_each_copy_holds_its_own(tmp_path, caplog):
    import logging

    durable, nvme = tmp_path / "durable", tmp_path / "nvme"
    frozen, moving = torch.randn(256, 256), torch.zeros(64)
    saved = {}
    for step in (1, 2, 3):
        moving += 1
        state = {"frozen": frozen, "moving": moving, "step": step}
        writer = DataStatesWriter(durable / f"step-{step}", incremental=True, local_tier=str(nvme), keep_local=2)
        dcp.async_save(state, storage_writer=writer).upload_completion.result(timeout=120)
        saved[step] = clone_state(state)
    md = json.loads((durable / "step-3" / ".metadata").read_text())
    assert md["items"]["frozen"]["chunks"][0]["file"] == "../step-1/" + md["items"]["frozen"]["chunks"][0]["file"][10:]
    assert md["items"]["frozen"]["chunks"][0]["file"].startswith("../step-1/")
    assert own_bytes(durable / "step-3") < frozen.numel() * 4 // 8  # the drain copied the small file only
    copies = sorted(os.listdir(nvme))
    assert len(copies) == 2 and copies[-1].startswith("step-3-")  # keep_local=2: step-1's copy evicted
    assert own_bytes(nvme / copies[-1]) < frozen.numel() * 4 // 8  # a local copy holds its own files only
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        out = load_with(durable / "step-3", saved[3], local_tier=str(nvme))
    assert "from the local tier" in caplog.text
    assert_state_equal(saved[3], out)
    assert_state_equal(saved[3], load(durable / "step-3", saved[3]))  # the durable copy alone
    assert referenced_by(durable / "step-1") == [str(durable / "step-2"), str(durable / "step-3")]


def load_with(path, like, **options):
    out = zeros_like_state(like)
    dcp.load(out, storage_reader=DataStatesReader(path, **options), no_dist=True)
    return out


def test_a_state_larger_than_half_the_cache_writes_the_rest_every_time(tmp_path, small_engine):
    # 1 MiB cache: at most 512 KiB held for hashing per save; the other tensors are written.
    state = {f"t{i}": torch.randn(64, 1024) for i in range(4)}  # 4 x 256 KiB
    save(state, tmp_path / "step-1", host_cache_size=small_engine)
    save(state, tmp_path / "step-2", host_cache_size=small_engine)
    md = json.loads((tmp_path / "step-2" / ".metadata").read_text())
    refs = sorted(fqn for fqn, item in md["items"].items() if item["chunks"][0]["file"].startswith("../"))
    assert 1 <= len(refs) <= 2, refs
    assert_state_equal(state, load(tmp_path / "step-2", state))


def test_two_ranks_fsdp2_hf_model_96_percent_frozen_20_saves_resharded_strict_load(tmp_path):
    pytest.importorskip("transformers")
    import incremental_workers as W

    run_ranks(2, W.save_frozen_llama, str(tmp_path))
    written = json.loads((tmp_path / "written.json").read_text())
    assert len(written) == W.SAVES and all(written["1"] > 4 * n for s, n in written.items() if s != "1"), written
    for step in (W.SAVES // 2, W.SAVES):
        run_ranks(2, W.load_and_compare, str(tmp_path), step)  # FSDP2, model and optimizer, bitwise
    W.load_and_compare(0, 1, str(tmp_path), W.SAVES)  # one process: resharded across the references


def test_an_object_store_root_refers_and_loads_in_place(s3):
    root = f"s3://{s3.bucket()}/run"
    frozen, moving = torch.randn(256, 256), torch.zeros(64)
    for step in (1, 2):
        moving += 1
        state = {"frozen": frozen, "moving": moving}
        writer = DataStatesWriter(f"{root}/step-{step}", incremental=True, storage_options=s3.options)
        dcp.async_save(state, storage_writer=writer).upload_completion.result(timeout=120)
    with s3.fs.open(f"{root[5:]}/step-2/.metadata", "rb") as f:
        md = json.loads(f.read())
    assert md["items"]["frozen"]["chunks"][0]["file"].startswith("../step-1/")
    assert not md["items"]["moving"]["chunks"][0]["file"].startswith("../")
    out = {"frozen": torch.zeros(256, 256), "moving": torch.zeros(64)}
    dcp.load(out, storage_reader=DataStatesReader(f"{root}/step-2", storage_options=s3.options), no_dist=True)
    assert_state_equal({"frozen": frozen, "moving": moving}, out)
    assert referenced_by(f"{root}/step-1", storage_options=s3.options) == [f"{root}/step-2"]


def test_a_base_whose_marker_changed_is_read_again(tmp_path):
    a, b = torch.zeros(128, 128), torch.ones(128, 128)
    save({"t": a}, tmp_path / "step-1")
    save({"t": a}, tmp_path / "step-2")  # builds on step-1 (its decoded marker is kept)
    dcp.save({"t": b}, storage_writer=DataStatesWriter(tmp_path / "step-1", incremental=True), no_dist=True)
    save({"t": b}, tmp_path / "step-2")  # step-1 now holds b: found unchanged there, not a's hash
    md = json.loads((tmp_path / "step-2" / ".metadata").read_text())
    assert md["items"]["t"]["chunks"][0]["file"].startswith("../step-1/"), md["items"]["t"]
    assert_state_equal({"t": b}, load(tmp_path / "step-2", {"t": b}))


def test_overwriting_a_referenced_checkpoint_keeps_the_files_later_ones_need(tmp_path):
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    save({"t": a}, tmp_path / "step-1")
    save({"t": a}, tmp_path / "step-2")  # refers to step-1's file
    dcp.save({"t": b}, storage_writer=DataStatesWriter(tmp_path / "step-1"), no_dist=True)  # step-1 replaced
    assert_state_equal({"t": b}, load(tmp_path / "step-1", {"t": b}))
    assert_state_equal({"t": a}, load(tmp_path / "step-2", {"t": a}))  # its bytes are still there
    shutil.rmtree(tmp_path / "step-2")
    dcp.save({"t": a}, storage_writer=DataStatesWriter(tmp_path / "step-1"), no_dist=True)  # nothing refers now
    assert sorted(n for n in os.listdir(tmp_path / "step-1") if n.endswith(".safetensors")) == [
        next(n for n in os.listdir(tmp_path / "step-1") if n.endswith(".safetensors"))]  # the old files went


def test_what_changed_is_written_without_a_hash_until_the_next_probe(tmp_path, monkeypatch):
    from dcp_datastates.save import held_file, incremental

    hashed = []
    real = held_file._engine

    class Counting:
        def hash64_segments(self, items):
            hashed.append(len(items))
            return real.hash64_segments(items)

    monkeypatch.setattr(held_file, "_engine", Counting())
    frozen, moving = torch.randn(64, 64), torch.zeros(32, 32)
    probe = incremental.PROBE_EVERY
    per_save = []
    for step in range(1, probe + 4):
        if step <= 3:
            moving += 1  # changes at saves 1-3, then never again
        hashed.clear()
        save({"frozen": frozen, "moving": moving}, tmp_path / f"step-{step}")
        per_save.append(sum(hashed))
        md = json.loads((tmp_path / f"step-{step}" / ".metadata").read_text())
        if step > 1:
            assert md["items"]["frozen"]["chunks"][0]["file"].startswith("../step-1/"), step  # always found
    # Save 1 (the first: a probe) and 2 hash both tensors; 3..probe write `moving` without a hash
    # (it changed at save 2); save probe+1 probes again (both hashed: `moving` unchanged since 3, but
    # its base has no hash for it), and from then on `moving` is found unchanged too.
    assert per_save[:3] == [2, 2, 1] and set(per_save[2:probe]) == {1}, per_save
    assert per_save[probe] == 2, per_save
    md = json.loads((tmp_path / f"step-{probe + 3}" / ".metadata").read_text())
    assert md["items"]["moving"]["chunks"][0]["file"].startswith(f"../step-{probe + 1}/"), md["items"]["moving"]
    assert_state_equal({"frozen": frozen, "moving": moving},
                       load(tmp_path / f"step-{probe + 3}", {"frozen": frozen, "moving": moving}))
