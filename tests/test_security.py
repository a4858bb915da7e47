"""Crafted malicious checkpoints: loading one never runs its code, never reads or writes outside
its folder, never blocks on a FIFO and never allocates what a length field claims; each is
refused with an error naming what is wrong. And what trainers really save loads without
opting in (docs/security.md)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import random
import stat
import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesWriter
from dcp_datastates.cli import main as cli_main
from dcp_datastates.commit import read_commit
from dcp_datastates.config import DataStatesConfig
from dcp_datastates.errors import CheckpointFormatError, IncompleteCheckpointError, UnsafeCheckpointError, checkpoint_error_cause
from dcp_datastates.format.document import MAX_METADATA_BYTES
from dcp_datastates.runtime import get_engine

from conftest import raises_through_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DATA = "__0_0.safetensors"
PLANNERS = [pytest.param(None, id="dcp-default-planner"), pytest.param(DataStatesLoadPlanner, id="datastates-planner")]


class Planted:
    """A value whose unpickling creates a folder (stands for ``os.system``: same mechanism, no shell)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def save(path, state):
    dcp.save(state, storage_writer=DataStatesWriter(str(path)), no_dist=True)


def load(path, state, planner=None, **reader_options):
    dcp.load(
        state,
        storage_reader=DataStatesReader(str(path), **reader_options),
        planner=planner() if isinstance(planner, type) else planner,
        no_dist=True,
    )
    return state


@pytest.fixture
def planted(tmp_path):
    """A checkpoint holding a tensor and a value that creates ``marker`` when unpickled."""
    marker = tmp_path / "MARKER"
    ckpt = tmp_path / "ckpt"
    save(ckpt, {"w": torch.arange(4.0), "evil": Planted(str(marker)), "step": 7})
    if marker.exists():
        marker.unlink()  # (saving pickles, not unpickles: never there, but be sure)
    return ckpt, marker


# -------------------------------------------------------------------------- code execution
@pytest.mark.parametrize("planner", PLANNERS)
def test_malicious_value_is_refused_and_never_runs(planted, planner):
    ckpt, marker = planted
    state = {"w": torch.zeros(4), "evil": None, "step": 0}
    with raises_through_dcp(
        rf"UnsafeCheckpointError: checkpoint {ckpt}: item 'evil' is a pickled value that would import os.makedirs "
        r"when loaded, which can run code from the checkpoint; refused\. .*trusted=True.*runs code from the checkpoint"
    ):
        load(ckpt, state, planner)
    assert not marker.exists()


@pytest.mark.parametrize("planner", PLANNERS)
def test_trusted_load_runs_it_as_stock_dcp_does(planted, planner):
    ckpt, marker = planted
    state = load(ckpt, {"w": torch.zeros(4), "evil": None, "step": 0}, planner, trusted=True)
    assert marker.exists() and state["step"] == 7 and torch.equal(state["w"], torch.arange(4.0))


def test_safe_items_of_a_malicious_checkpoint_still_load(planted):
    ckpt, marker = planted
    state = load(ckpt, {"w": torch.zeros(4), "step": 0}, DataStatesLoadPlanner)  # the bad item is not asked for
    assert state["step"] == 7 and torch.equal(state["w"], torch.arange(4.0)) and not marker.exists()


def test_malicious_value_error_cause_has_its_type(planted):
    ckpt, _ = planted
    with pytest.raises(BaseException) as info:
        load(ckpt, {"w": torch.zeros(4), "evil": None, "step": 0})
    assert isinstance(checkpoint_error_cause(info.value), UnsafeCheckpointError)


def test_legacy_raw_pickle_payload_is_refused(tmp_path):
    """Bytes items are not always torch.save archives: a raw pickle smuggled in by editing the
    data file is refused the same way."""
    marker = tmp_path / "MARKER"
    ckpt = tmp_path / "ckpt"
    payload = pickle.dumps(Planted(str(marker)), protocol=2)
    save(ckpt, {"blob": io.BytesIO(b"\0" * len(payload))})  # placeholder of the right length
    f = ckpt / DATA
    raw = f.read_bytes()
    i = raw.rindex(b"\0" * len(payload))
    # Keep the checksum honest too: an attacker writes the file and the metadata.
    f.write_bytes(raw[:i] + payload + raw[i + len(payload) :])
    with raises_through_dcp(r"(UnsafeCheckpointError|ChecksumMismatchError)"):
        load(ckpt, {"blob": None})
    # Not a torch.save archive: the restricted decoder refuses it before anything is built.
    with raises_through_dcp(r"(UnsafeCheckpointError|CheckpointFormatError): checkpoint .*: item 'blob' "):
        load(ckpt, {"blob": None}, verify=False)
    assert not marker.exists()


def run_cli(argv, capsys):
    rc = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("target", ["torch", "dcp"])
def test_cli_convert_refuses_then_trust_opts_in(planted, tmp_path, capsys, target):
    ckpt, marker = planted
    out = tmp_path / f"out-{target}"
    rc, _, err = run_cli(["convert", ckpt, out, "--to", target, "--no-progress"], capsys)
    assert rc == 1 and err.count("\n") == 1 and "item 'evil'" in err and "os.makedirs" in err and "--trust" in err
    assert not marker.exists() and not out.exists()
    rc, _, err = run_cli(["convert", ckpt, out, "--to", target, "--no-progress", "--trust"], capsys)
    assert rc == 0, err
    # --to torch decodes every value (unrestricted with --trust); --to dcp copies the stored
    # bytes verbatim, so the conversion itself runs nothing: a stock DCP load of the output would.
    assert marker.exists() == (target == "torch")


def test_cli_inspect_verify_and_hf_convert_never_unpickle(planted, tmp_path, capsys):
    ckpt, marker = planted
    assert run_cli(["inspect", ckpt], capsys)[0] == 0
    assert run_cli(["inspect", ckpt, "--json"], capsys)[0] == 0
    assert run_cli(["verify", ckpt, "--no-progress"], capsys)[0] == 0
    rc, out, err = run_cli(["convert", ckpt, tmp_path / "hf", "--to", "hf", "--no-progress"], capsys)
    assert rc == 0, err
    assert "evil (not a tensor)" in out
    assert not marker.exists()


def test_stock_dcp_marker_is_never_unpickled(tmp_path):
    """A pickled .metadata (stock DCP's format) carrying a payload: recognised, not unpickled."""
    marker = tmp_path / "MARKER"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(Planted(str(marker))))
    with pytest.raises(CheckpointFormatError, match=r"is a stock DCP checkpoint .*FileSystemReader.*nothing of it was unpickled"):
        read_commit(ckpt)
    with pytest.raises(BaseException):  # noqa: B017 - any refusal will do: what matters is that nothing ran
        load(ckpt, {"w": torch.zeros(1)})
    assert not marker.exists()


# ------------------------------------------------------------- what trainers save, no opt-in
class TrainStateLikeTorchTitan(Stateful):
    def __init__(self, step=0, ntokens_seen=0):
        self.step, self.ntokens_seen = step, ntokens_seen

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def trainer_state():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sched.step()
    np_rng = np.random.RandomState(3)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),  # param_groups: floats, tuples, bools, None, lists of ints
        "lr_scheduler": sched.state_dict(),
        "train_state": TrainStateLikeTorchTitan(12, 34567),
        # TorchTitan's dataloader: {"dp_rank_<r>": pickle.dumps(state)} bytes
        "dataloader": {"dp_rank_0": pickle.dumps({"sample_idx": 5, "epoch": 1})},
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy_legacy": np_rng.get_state(),  # a tuple holding a uint32 array
            "numpy_generator": np.random.default_rng(1).bit_generator.state,
        },
        "extra": {
            "bytesio": io.BytesIO(b"raw \x00 bytes"),
            "np_float64": np.float64(0.25),
            "np_int64": np.int64(-3),
            "np_float32": np.float32(1.5),
            "np_bool": np.bool_(True),
            "np_array": np.arange(6, dtype=np.float32).reshape(2, 3),
            "frozenset": frozenset({1, 2}),
            "ordered": __import__("collections").OrderedDict(a=1),
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "nested_tensor_value": {"t": torch.ones(2), "s": "x", "n": None, "c": 1 + 2j},
            "started": __import__("datetime").datetime(2026, 11, 27, 9, 30, tzinfo=__import__("datetime").timezone.utc),
            "budget": __import__("datetime").timedelta(hours=3),
            "out_dir": __import__("pathlib").PurePosixPath("/runs/exp-7"),
            "sampler_generator": torch.Generator().manual_seed(11),
        },
    }


def empty_like_state(state):
    """A destination with the same structure whose non-tensor values are placeholders."""
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [empty_like_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, TrainStateLikeTorchTitan):
        return TrainStateLikeTorchTitan()
    return None


@pytest.mark.parametrize("planner", PLANNERS)
def test_trainer_states_load_without_opting_in(tmp_path, planner):
    state = trainer_state()
    save(tmp_path / "ck", state)
    dest = empty_like_state(state)
    load(tmp_path / "ck", dest, planner)
    assert dest["train_state"].step == 12 and dest["train_state"].ntokens_seen == 34567
    assert pickle.loads(dest["dataloader"]["dp_rank_0"]) == {"sample_idx": 5, "epoch": 1}
    assert dest["optim"]["param_groups"] == state["optim"]["param_groups"]
    for k, v in state["optim"]["state"][0].items():
        assert torch.equal(dest["optim"]["state"][0][k], v)
    assert dest["lr_scheduler"] == {k: v for k, v in state["lr_scheduler"].items()}
    assert torch.equal(dest["rng"]["torch"], state["rng"]["torch"])
    assert dest["rng"]["python"] == state["rng"]["python"]
    got, want = dest["rng"]["numpy_legacy"], state["rng"]["numpy_legacy"]
    assert got[0] == want[0] and np.array_equal(got[1], want[1]) and got[1].dtype == np.uint32 and got[2:] == want[2:]
    assert dest["rng"]["numpy_generator"] == state["rng"]["numpy_generator"]
    extra, want = dest["extra"], state["extra"]
    assert isinstance(extra["bytesio"], io.BytesIO) and extra["bytesio"].getvalue() == b"raw \x00 bytes"
    for k in ("np_float64", "np_int64", "np_float32", "np_bool"):
        assert type(extra[k]) is type(want[k]) and extra[k] == want[k]
    assert np.array_equal(extra["np_array"], want["np_array"]) and extra["np_array"].dtype == np.float32
    assert extra["frozenset"] == frozenset({1, 2}) and extra["ordered"] == want["ordered"]
    assert extra["dtype"] is torch.bfloat16 and extra["device"] == torch.device("cpu")
    assert torch.equal(extra["nested_tensor_value"]["t"], torch.ones(2))
    assert {k: v for k, v in extra["nested_tensor_value"].items() if k != "t"} == {"s": "x", "n": None, "c": 1 + 2j}
    for k in ("started", "budget", "out_dir"):
        assert type(extra[k]) is type(want[k]) and extra[k] == want[k], k
    assert isinstance(extra["sampler_generator"], torch.Generator)
    assert torch.equal(extra["sampler_generator"].get_state(), want["sampler_generator"].get_state())


def test_torchtitan_lr_scheduler_container_state_loads(tmp_path):
    components = pytest.importorskip("torchtitan.components.optimizer")
    model = torch.nn.Linear(4, 4)
    optimizers = components.default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    sched = components.LRSchedulersContainer(optimizers, lambda step: 1.0 / (1 + step))
    sched.step()
    sched.step()
    save(tmp_path / "ck", {"lr_scheduler": sched})
    other = components.LRSchedulersContainer(optimizers, lambda step: 1.0 / (1 + step))
    load(tmp_path / "ck", {"lr_scheduler": other})
    assert other.state_dict() == sched.state_dict() and other.state_dict()["last_epoch"] == 2


@dataclasses.dataclass
class RunConfig:
    lr: float
    name: str


def test_values_outside_the_allowlist_are_named(tmp_path):
    """Which common values are not accepted without opting in: a Decimal, a class of the user's
    own (a config dataclass)."""
    import decimal

    save(tmp_path / "ck", {"dec": decimal.Decimal("1.5"), "config": RunConfig(3e-4, "exp-7")})
    with raises_through_dcp(r"UnsafeCheckpointError: .*item 'dec'.*decimal.Decimal"):
        load(tmp_path / "ck", {"dec": None})
    with raises_through_dcp(r"UnsafeCheckpointError: .*item 'config'.*test_security.RunConfig"):
        load(tmp_path / "ck", {"config": None})
    # The user's own allowlist is honoured (and left as it was).
    with torch.serialization.safe_globals([decimal.Decimal]):
        assert load(tmp_path / "ck", {"dec": None})["dec"] == decimal.Decimal("1.5")
    assert decimal.Decimal not in torch.serialization.get_safe_globals()


def test_an_allowlisted_constructor_given_bad_arguments_is_a_format_error(tmp_path):
    """A crafted Generator state (wrong size) or device: the constructor refuses it, and the
    load fails with CheckpointFormatError naming the item, as for any undecodable value."""
    from dcp_datastates.errors import CheckpointFormatError
    from dcp_datastates.format.safe_unpickle import decode_value

    g = torch.Generator()
    buf = io.BytesIO()
    torch.save(g, buf)
    data = buf.getvalue().replace(b"cpu", b"xla", 1)  # the device the pickle names
    with pytest.raises(CheckpointFormatError, match=r"item 'gen' cannot be decoded as a stored value"):
        decode_value(data, checkpoint="ck", item="gen")


def test_decoding_leaves_torch_allowlist_unchanged(tmp_path):
    save(tmp_path / "ck", {"x": np.float64(1.0)})
    before = list(torch.serialization.get_safe_globals())  # what other libraries (Megatron-core ...) added
    torch.serialization.add_safe_globals([np.dtype])
    try:
        load(tmp_path / "ck", {"x": None})
        after = torch.serialization.get_safe_globals()
        assert np.dtype in after  # theirs kept
        assert len(after) == len(before) + (np.dtype not in before)  # ours removed, nothing else added
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


# ------------------------------------------------------------------------- crafted metadata
@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    save(path, {"w": torch.arange(16.0), "step": 3})
    return path


def edit_metadata(path, mutate):
    doc = json.loads((path / ".metadata").read_text())
    mutate(doc)
    (path / ".metadata").write_text(json.dumps(doc))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", "a\\b", "x\x00y", "..", "."])
def test_data_file_names_must_be_plain_names(ckpt, name):
    def mutate(doc):
        doc["files"][name] = doc["files"].pop(DATA)
        for item in doc["items"].values():
            for entry in item.get("chunks", [item]):
                entry["file"] = name

    edit_metadata(ckpt, mutate)
    with pytest.raises(CheckpointFormatError, match=r"file names must be plain names inside the checkpoint folder"):
        read_commit(ckpt)


def outside_copy(ckpt, tmp_path):
    other = tmp_path / "outside.safetensors"
    other.write_bytes((ckpt / DATA).read_bytes())  # same bytes, same size: only the link is wrong
    return other


def test_symlinked_data_file_is_refused(ckpt, tmp_path):
    other = outside_copy(ckpt, tmp_path)
    os.unlink(ckpt / DATA)
    os.symlink(other, ckpt / DATA)
    with raises_through_dcp(rf"CheckpointFormatError: checkpoint {ckpt}: data file {DATA} is a symbolic link to '{other}'"):
        load(ckpt, {"w": torch.zeros(16), "step": 0})
    rc = cli_main(["verify", str(ckpt), "--no-progress"])
    assert rc == 1


def test_symlinked_marker_is_refused(ckpt, tmp_path):
    other = tmp_path / "elsewhere.json"
    os.replace(ckpt / ".metadata", other)
    os.symlink(other, ckpt / ".metadata")
    with pytest.raises(CheckpointFormatError, match=r"the commit marker|\.metadata is a symbolic link"):
        read_commit(ckpt)


def test_engine_read_refuses_a_symlink_swapped_in_after_the_checks(ckpt, tmp_path):
    """The engine's own open does not follow a link either (a swap after check_data_files)."""
    other = outside_copy(ckpt, tmp_path)
    os.unlink(ckpt / DATA)
    os.symlink(other, ckpt / DATA)
    engine = get_engine(DataStatesConfig(host_cache_size=16 << 20, pin_host_cache=False))
    buf = torch.empty(8, dtype=torch.uint8)
    with pytest.raises(OSError, match=r"a symbolic link, not a regular file"):
        engine.read_into(str(ckpt / DATA), [(buf.data_ptr(), 0, 8)])


def test_fifo_named_like_a_data_file_never_blocks(ckpt):
    os.unlink(ckpt / DATA)
    os.mkfifo(ckpt / DATA)
    with raises_through_dcp(rf"CheckpointFormatError: checkpoint {ckpt}: data file {DATA} is a FIFO, not a regular file"):
        load(ckpt, {"w": torch.zeros(16), "step": 0})
    engine = get_engine(DataStatesConfig(host_cache_size=16 << 20, pin_host_cache=False))
    buf = torch.empty(8, dtype=torch.uint8)
    with pytest.raises(OSError, match=r"a FIFO, not a regular file"):
        engine.read_into(str(ckpt / DATA), [(buf.data_ptr(), 0, 8)])
    from dcp_datastates.load.verify import read_header

    with pytest.raises(CheckpointFormatError, match="is a FIFO"):
        read_header(ckpt / DATA)
    assert cli_main(["verify", str(ckpt), "--no-progress"]) == 1
    assert cli_main(["inspect", str(ckpt)]) == 0


def test_fifo_named_like_the_marker_never_blocks(ckpt):
    os.unlink(ckpt / ".metadata")
    os.mkfifo(ckpt / ".metadata")
    with pytest.raises(CheckpointFormatError, match=r"the commit marker \.metadata is a FIFO, not a regular file"):
        read_commit(ckpt)


def test_device_file_named_like_a_data_file_is_refused(ckpt):
    os.unlink(ckpt / DATA)
    try:
        os.mknod(ckpt / DATA, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # like /dev/zero
    except PermissionError:
        pytest.skip("creating a device node needs privileges")
    with raises_through_dcp(rf"data file {DATA} is a character device, not a regular file"):
        load(ckpt, {"w": torch.zeros(16), "step": 0})
    engine = get_engine(DataStatesConfig(host_cache_size=16 << 20, pin_host_cache=False))
    buf = torch.empty(8, dtype=torch.uint8)
    with pytest.raises(OSError, match=r"a character device, not a regular file"):
        engine.read_into(str(ckpt / DATA), [(buf.data_ptr(), 0, 8)])


def test_engine_write_never_follows_a_planted_link_or_truncates_a_shared_inode(tmp_path):
    engine = get_engine(DataStatesConfig(host_cache_size=16 << 20, pin_host_cache=False))
    precious = tmp_path / "precious"
    precious.write_bytes(b"keep me")
    link = tmp_path / "link.safetensors"
    os.symlink(precious, link)
    hard = tmp_path / "hard.safetensors"
    os.link(precious, hard)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    for path, message in (
        (link, "a symbolic link, not a regular file"),
        (hard, "has 2 hard links; refusing to overwrite"),
        (fifo, "a FIFO, not a regular file"),
    ):
        job = engine.submit_write(str(path), b"HEADER", 6, [], sync=False)
        assert job.wait_done(timeout=60)
        assert job.error() is not None and f"{path}: " in job.error() and message in job.error()
    assert precious.read_bytes() == b"keep me"


# ---------------------------------------------------------------------------- oversize fields
def test_huge_marker_is_refused_before_reading(ckpt):
    with open(ckpt / ".metadata", "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(CheckpointFormatError, match=rf"{MAX_METADATA_BYTES + 1} bytes, more than the {MAX_METADATA_BYTES}-byte limit"):
        read_commit(ckpt)


def test_convert_checks_file_sizes_before_allocating_what_the_metadata_claims(ckpt, tmp_path, capsys):
    """A metadata that claims a 1 TiB data file and a 256 GiB tensor in it: one clear line, no
    allocation (the claim is checked against the file on disk first)."""
    size = 1 << 40

    def mutate(doc):
        doc["files"][DATA]["size"] = size
        item = doc["items"]["w"]
        item["size"] = [1 << 36]
        chunk = item["chunks"][0]
        chunk.update(sizes=[1 << 36], length=(1 << 36) * 4, crc32c=[])
        del doc["items"]["step"]  # it would share the claimed bytes (refused on its own)

    edit_metadata(ckpt, mutate)
    rc, _, err = run_cli(["convert", ckpt, tmp_path / "out.pt", "--to", "torch", "--no-progress"], capsys)
    assert rc == 1 and err.count("\n") == 1
    assert f"data file {DATA} is" in err and f"the metadata expects {size}" in err
    from dcp_datastates import check_commit

    with pytest.raises(IncompleteCheckpointError, match=rf"data file {DATA} is \d+ bytes, the metadata expects {size}"):
        check_commit(ckpt)


# ------------------------------------------------------------------------- errors say what to do
def test_run_folder_names_its_checkpoints(tmp_path):
    for step in (1, 2, 10):
        save(tmp_path / "run" / f"step-{step}", {"w": torch.ones(2)})
    (tmp_path / "run" / "step-11").mkdir()  # not committed: not listed
    reader = DataStatesReader(str(tmp_path / "run"))
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(2)}, storage_reader=reader, no_dist=True)
    cause = checkpoint_error_cause(info.value, reader)
    assert isinstance(cause, IncompleteCheckpointError)
    assert str(cause) == (
        f"incomplete checkpoint {tmp_path / 'run'}: this is a folder of checkpoints, not a checkpoint: it holds the "
        f"committed checkpoint folder(s) step-1, step-2, step-10; load one of them, e.g. the newest with "
        f"dcp_datastates.latest_checkpoint({str(tmp_path / 'run')!r})"
    )
    from dcp_datastates import latest_checkpoint

    assert latest_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "step-10")


def test_error_cause_comes_from_the_reader_on_every_release(tmp_path):
    """DCP 2.9-2.11 raise a bare AssertionError for a failed read_metadata: the reader keeps the
    original exception, checkpoint_error_cause(exc, reader) returns it."""
    reader = DataStatesReader(str(tmp_path / "nothing-here"))
    (tmp_path / "nothing-here").mkdir()
    with pytest.raises(IncompleteCheckpointError):
        reader.read_metadata()
    bare = AssertionError()  # what 2.9 raises (2.10-2.11: "metadata is None")
    cause = checkpoint_error_cause(bare, reader)
    assert isinstance(cause, IncompleteCheckpointError) and cause is reader.metadata_error
    # Without the reader: the last failed metadata read of this thread; another thread has none.
    assert checkpoint_error_cause(bare) is reader.metadata_error
    elsewhere = []
    t = threading.Thread(target=lambda: elsewhere.append(checkpoint_error_cause(bare)))
    t.start()
    t.join()
    assert elsewhere == [bare]
    # Through DCP on this release too, with and without the reader; the rank-local fallback read
    # DCP tries next does not replace the first (telling) error.
    reader = DataStatesReader(str(tmp_path / "nothing-here"))
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(1)}, storage_reader=reader, no_dist=True)
    for cause in (checkpoint_error_cause(info.value, reader), checkpoint_error_cause(info.value)):
        assert isinstance(cause, IncompleteCheckpointError) and "nothing-here" in str(cause), cause
    # A successful read clears both.
    save(tmp_path / "ok", {"w": torch.ones(1)})
    reader = DataStatesReader(str(tmp_path / "ok"))
    reader.read_metadata()
    assert reader.metadata_error is None
    assert checkpoint_error_cause(bare) is bare


def test_cli_missing_fsspec_backend_is_one_line(capsys):
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    rc, _, err = run_cli(["verify", "gcs://bucket/ckpt"], capsys)
    assert rc == 1 and err.count("\n") == 1 and err.startswith("dcp-datastates verify: error:")


def test_cli_inspect_escapes_control_characters(tmp_path, capsys):
    evil = "w\x1b]0;pwned\x07\x1b[2J\nnext"
    save(tmp_path / "ck", {evil: torch.ones(2)})
    rc, out, err = run_cli(["inspect", tmp_path / "ck"], capsys)
    assert rc == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "w\\x1b]0;pwned\\x07\\x1b[2J\\nnext" in out
    rc, out, _ = run_cli(["inspect", tmp_path / "ck", "--json"], capsys)
    assert rc == 0 and "\x1b" not in out and evil in json.loads(out)["items"]


# ------------------------------------------------------- pickles a Stateful keeps inside a value
def test_restricted_pickle_loads_takes_a_dataloader_state_and_refuses_code(tmp_path):
    """TorchTitan's dataloader stores pickle.dumps(state) as a value and pickle.loads it itself;
    restricted_pickle_loads is the drop-in that builds data only."""
    import collections

    from dcp_datastates.format.safe_unpickle import restricted_pickle_loads

    gen = torch.Generator()
    gen.manual_seed(5)
    state = {
        "_num_yielded": 7,
        "_sampler_iter_state": {"generator": gen.get_state(), "yielded": 3},
        "fetcher": collections.OrderedDict(done=False, names=["a", "b"], blob=b"\x00\x01", ratio=0.5, none=None),
        "view": torch.arange(6.0).reshape(2, 3)[:, 1:],
    }
    for protocol in (2, 4, 5):
        got = restricted_pickle_loads(pickle.dumps(state, protocol=protocol))
        assert got["_num_yielded"] == 7 and got["fetcher"] == state["fetcher"]
        assert torch.equal(got["_sampler_iter_state"]["generator"], gen.get_state())
        assert torch.equal(got["view"], state["view"])
    marker = tmp_path / "MARKER"
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt: item 'dataloader.dp_rank_0' holds pickled data that would import os\.makedirs when loaded"):
        restricted_pickle_loads(pickle.dumps({"x": Planted(str(marker))}), checkpoint="ckpt", item="item 'dataloader.dp_rank_0'")
    assert not marker.exists()
    with pytest.raises(CheckpointFormatError, match="holds damaged pickled data"):
        restricted_pickle_loads(pickle.dumps(state)[:-20])


def test_items_sharing_file_bytes_are_refused(tmp_path, capsys):
    """Chunks that tile a huge tensor but all point at the same bytes would let a small file
    claim terabytes: every stored item must have bytes of its own."""
    path = tmp_path / "ck"
    save(path, {"w": torch.arange(16.0)})

    def mutate(doc):
        item = doc["items"]["w"]
        chunk = item["chunks"][0]
        item["size"] = [16 * 1000]
        item["chunks"] = [{**chunk, "offsets": [16 * i]} for i in range(1000)]

    edit_metadata(path, mutate)
    with pytest.raises(CheckpointFormatError, match=r"items 'w' and 'w' share bytes \[\d+, \d+\) of __0_0.safetensors"):
        read_commit(path)
    rc, _, err = run_cli(["convert", path, tmp_path / "out.pt", "--to", "torch", "--no-progress"], capsys)
    assert rc == 1 and "share bytes" in err


def test_latest_checkpoint_skips_a_fifo_marker_without_blocking(tmp_path):
    save(tmp_path / "run" / "step-1", {"w": torch.ones(2)})
    (tmp_path / "run" / "step-2").mkdir()
    os.mkfifo(tmp_path / "run" / "step-2" / ".metadata")
    from dcp_datastates import is_committed, latest_checkpoint

    assert latest_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "step-1")
    assert not is_committed(tmp_path / "run" / "step-2", check_files=True)
