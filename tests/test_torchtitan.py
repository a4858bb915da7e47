"""TorchTitan integration: DataStatesCheckpointManager with TorchTitan's real CheckpointManager,
OptimizersContainer and LRSchedulersContainer, in a one-process gloo group (CPU).

TorchTitan is optional: the tests that need it are skipped only when ``torchtitan`` is not
installed. Installed but unusable (its manager imports by neither module path) is a failure:
a TorchTitan release that moves the manager must not turn these tests into silent skips.

Two layouts are checked: the installed TorchTitan (0.3.0 in CI), also with its legacy module
path hidden as on TorchTitan main; and TorchTitan main itself, at the commit in
tests/torchtitan_main_commit.txt, when DCPDS_TORCHTITAN_MAIN names a snapshot of it
(scripts/torchtitan_main.sh makes one; CI cannot reach GitHub, so there it is skipped, saying so).
"""

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from conftest import raises_through_dcp, tensors_equal_bitwise


def test_module_imports_without_torchtitan():
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"
        "from dcp_datastates.integrations import torchtitan as tt\n"
        "assert tt.TORCHTITAN_AVAILABLE is False\n"
        "for make in (lambda: tt.DataStatesCheckpointManager.Config(enable=True), lambda: tt.DataStatesCheckpointManager(None)):\n"
        "    try:\n"
        "        make()\n"
        "    except ImportError as exc:\n"
        "        assert 'TorchTitan' in str(exc) and 'pip install' in str(exc), exc\n"
        "        assert 'not installed (tried torchtitan.components.checkpointer, torchtitan.components.checkpoint)' in str(exc), exc\n"
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ------------------------------------------------------------------------------- fixtures
def require_torchtitan():
    """The integration module, with TorchTitan's manager resolved. Skips only when ``torchtitan``
    is not installed; installed but unusable fails with the import errors (a skip would hide a
    TorchTitan that moved its modules, as main did in pytorch/torchtitan#4184)."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("TorchTitan is not installed (optional: pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3)")
    from dcp_datastates.integrations import torchtitan as integration

    if not integration.TORCHTITAN_AVAILABLE:
        pytest.fail(f"TorchTitan is installed but unusable here: {integration._missing()}", pytrace=False)
    try:
        import torchtitan.components.optimizer  # noqa: F401 - the tests build TorchTitan's optimizers
    except Exception as exc:  # noqa: BLE001 - any import error of an installed TorchTitan fails
        pytest.fail(f"TorchTitan is installed but torchtitan.components.optimizer does not import: "
                    f"{type(exc).__name__}: {exc}", pytrace=False)
    return integration


@pytest.fixture(scope="module")
def tt():
    integration = require_torchtitan()
    created = False
    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="dcp_ds_tt_store_", delete=False)
        store.close()
        os.unlink(store.name)
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        created = True
    yield integration
    if created:
        dist.destroy_process_group()


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def build(tt, folder, seed=0, hidden=64, **options):
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 8))
    optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0 / (1 + step))
    train_state = TrainState()
    config = tt.DataStatesCheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        **{"interval": 2, "keep_latest_k": 2, "async_mode": "async", "host_cache_size": "64MiB", **options},
    )
    manager = config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=str(folder),
    )
    return model, optimizers, lr_schedulers, train_state, manager


def snapshot(model, optimizers):
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in optimizers.state_dict().items():
        if isinstance(v, torch.Tensor):
            state[f"optim.{k}"] = v.detach().clone()
    return state


def train(model, optimizers, lr_schedulers, train_state, manager, steps, snapshots=None, start=1):
    g = torch.Generator().manual_seed(123)
    for step in range(start, start + steps):
        train_state.step = step
        loss = model(torch.randn(16, 32, generator=g)).square().mean()
        loss.backward()
        manager.maybe_wait_for_staging()  # what TorchTitan's trainer calls before optimizers.step()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        if manager.save(step) and snapshots is not None:
            snapshots[step] = snapshot(model, optimizers)  # the values the checkpoint must hold


def assert_matches(snap, model, optimizers):
    now = snapshot(model, optimizers)
    assert set(now) == set(snap)
    for k, v in snap.items():
        assert tensors_equal_bitwise(v, now[k]), k


# ---------------------------------------------------------------------------------- tests
def test_async_lazy_save_keep_latest_k_and_resume(tt, tmp_path, monkeypatch):
    waits = []
    real_wait = tt.wait_staged
    monkeypatch.setattr(tt, "wait_staged", lambda timeout=None: waits.append(1) or real_wait(timeout))

    model, optimizers, lrs, ts, manager = build(tt, tmp_path)
    from torchtitan.components.checkpointer import AsyncMode

    assert isinstance(manager, tt.DataStatesCheckpointManager) and manager.async_mode == AsyncMode.ASYNC
    snaps = {}
    train(model, optimizers, lrs, ts, manager, steps=7, snapshots=snaps)
    assert sorted(snaps) == [2, 4, 6]
    assert len(waits) == 7  # every step's maybe_wait_for_staging went to the engine's wait
    manager.maybe_wait_for_saving()
    manager.close()  # joins the purge thread: keep_latest_k has been applied

    root = tmp_path / "checkpoint"
    assert sorted(os.listdir(root)) == ["step-4", "step-6"]
    for step in (4, 6):
        folder = root / f"step-{step}"
        doc = json.loads((folder / ".metadata").read_bytes())  # JSON commit marker, not a pickle
        assert doc["format"] == "dcp_datastates"
        assert "__0_0.safetensors" in os.listdir(folder)

    # A fresh run in the same folder resumes from the latest committed step (.metadata discovery).
    model2, opt2, lrs2, ts2, manager2 = build(tt, tmp_path, seed=99)
    assert manager2.load() is True
    assert ts2.step == 6
    assert_matches(snaps[6], model2, opt2)
    # Training continues from there.
    train(model2, opt2, lrs2, ts2, manager2, steps=2, start=7)
    manager2.maybe_wait_for_saving()
    manager2.close()
    assert sorted(os.listdir(root)) == ["step-6", "step-8"]


def test_incremental_keep_latest_k_keeps_what_kept_checkpoints_refer_to(tt, tmp_path, caplog):
    model, optimizers, lrs, ts, manager = build(tt, tmp_path, incremental=True)
    model[0].requires_grad_(False)  # a frozen first layer: written by step-2 only
    assert manager.datastates_config.incremental is True
    snaps = {}
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        train(model, optimizers, lrs, ts, manager, steps=7, snapshots=snaps)
        manager.maybe_wait_for_saving()
        manager.close()
    root = tmp_path / "checkpoint"
    # keep_latest_k=2 keeps step-4 and step-6, and step-2 too: both refer to its frozen layer.
    assert sorted(os.listdir(root)) == ["step-2", "step-4", "step-6"]
    assert "keep_latest_k keeps" in caplog.text and "step-2" in caplog.text
    doc = json.loads((root / "step-6" / ".metadata").read_bytes())
    assert doc["items"]["0.weight"]["chunks"][0]["file"].startswith("../step-2/")
    assert not doc["items"]["2.weight"]["chunks"][0]["file"].startswith("../")
    model2, opt2, lrs2, ts2, manager2 = build(tt, tmp_path, seed=99, incremental=True)
    model2[0].requires_grad_(False)
    assert manager2.load() is True and ts2.step == 6
    assert_matches(snaps[6], model2, opt2)
    train(model2, opt2, lrs2, ts2, manager2, steps=2, start=7)
    manager2.maybe_wait_for_saving()
    manager2.close()
    # step-4 is no longer kept and nothing refers to it: deleted; step-2 still referred to.
    assert sorted(os.listdir(root)) == ["step-2", "step-6", "step-8"]


def test_local_tier_option_commits_locally_drains_and_resumes_from_the_local_copy(tt, tmp_path, caplog):
    nv = tmp_path / "nvme"
    model, optimizers, lrs, ts, manager = build(tt, tmp_path, local_tier=str(nv), keep_local=1)
    assert manager.datastates_config.local_tier == str(nv) and manager.datastates_config.keep_local == 1
    snaps = {}
    train(model, optimizers, lrs, ts, manager, steps=7, snapshots=snaps)
    manager.maybe_wait_for_saving()
    manager.close()
    root = tmp_path / "checkpoint"
    # keep_latest_k on the durable tier: TorchTitan purges the committed folders beyond k when a
    # save is issued; step-6 was still draining then, so step-2 goes at the next save.
    assert {"step-4", "step-6"} <= set(os.listdir(root)) <= {"step-2", "step-4", "step-6"}
    # keep_local=1 on the local tier: only the newest copy stays, and it is tied to step-6.
    copies = os.listdir(nv)
    assert len(copies) == 1 and copies[0].startswith("step-6-")
    from dcp_datastates import commit

    assert commit.checkpoint_id(str(nv / copies[0])) == commit.checkpoint_id(str(root / "step-6"))
    model2, opt2, lrs2, ts2, manager2 = build(tt, tmp_path, seed=99, local_tier=str(nv))
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        assert manager2.load() is True
    assert ts2.step == 6 and "from the local tier" in caplog.text
    assert_matches(snaps[6], model2, opt2)
    manager2.close()


def test_load_step_and_incomplete_checkpoint_is_skipped(tt, tmp_path):
    model, optimizers, lrs, ts, manager = build(tt, tmp_path, keep_latest_k=0)
    snaps = {}
    train(model, optimizers, lrs, ts, manager, steps=4, snapshots=snaps)
    manager.maybe_wait_for_saving()
    manager.close()
    # A crashed save: a step folder with data but no commit marker is not a checkpoint.
    crashed = tmp_path / "checkpoint" / "step-10"
    crashed.mkdir()
    (crashed / "__0_0.safetensors").write_bytes(b"partial")

    model2, opt2, lrs2, ts2, manager2 = build(tt, tmp_path, seed=5, keep_latest_k=0)
    assert manager2.load(step=2) is True
    assert ts2.step == 2
    assert_matches(snaps[2], model2, opt2)
    assert manager2.load() is True  # latest *committed*: step 4, not the crashed step 10
    assert ts2.step == 4
    assert_matches(snaps[4], model2, opt2)
    manager2.close()


def test_close_waits_for_the_checkpoint_in_flight_and_is_bounded(tt, tmp_path, caplog):
    """TorchTitan's own close() does not wait: the last asynchronous checkpoint of a run would be
    lost at exit. Ours waits (logged), at most close_timeout seconds."""
    import threading

    from dcp_datastates.runtime import get_engine

    model, optimizers, lrs, ts, manager = build(tt, tmp_path / "a", keep_latest_k=0)
    engine = get_engine(manager.datastates_config)
    step2 = tmp_path / "a" / "checkpoint" / "step-2"
    engine.set_fault("stall", 0, str(step2))  # its flushes wait until released below
    train(model, optimizers, lrs, ts, manager, steps=2)
    release = threading.Timer(0.5, lambda: engine.set_fault("none", 0, ""))
    release.start()
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        manager.close()  # no maybe_wait_for_saving() first: the trainer just exits
    release.join()
    assert (step2 / ".metadata").exists()
    assert "checkpoint in flight was committed" in caplog.text

    model, optimizers, lrs, ts, manager = build(tt, tmp_path / "b", keep_latest_k=0, close_timeout=0.3)
    step2 = tmp_path / "b" / "checkpoint" / "step-2"
    engine.set_fault("stall", 0, str(step2))
    train(model, optimizers, lrs, ts, manager, steps=2)
    pending = manager.save_future
    try:
        with caplog.at_level(logging.INFO, logger="dcp_datastates"):
            manager.close()
        assert "not committed within close_timeout=0 s" in caplog.text
        assert not (step2 / ".metadata").exists()
    finally:
        engine.set_fault("none", 0, "")
    pending.result(timeout=60)  # released: it commits after all


def test_sync_mode_and_pinned_mode(tt, tmp_path):
    from torchtitan.components.checkpointer import AsyncMode

    model, optimizers, lrs, ts, manager = build(tt, tmp_path / "sync", async_mode="disabled", keep_latest_k=0)
    snaps = {}
    train(model, optimizers, lrs, ts, manager, steps=2, snapshots=snaps)
    assert manager.save_future is None
    manager.close()
    model2, opt2, lrs2, ts2, manager2 = build(tt, tmp_path / "sync", seed=3, keep_latest_k=0)
    assert manager2.load() and ts2.step == 2
    assert_matches(snaps[2], model2, opt2)
    manager2.close()

    *_, pinned = build(tt, tmp_path / "pinned", async_mode="async_with_pinned_mem", keep_latest_k=0)
    assert pinned.async_mode == AsyncMode.ASYNC  # lazy staging into the pinned DataStates cache
    pinned.close()


def test_steady_saves_send_cached_plans_and_a_mismatched_resume_names_the_item(tt, tmp_path, monkeypatch):
    """The manager plans with the library's planners. Saves after the first send every rank's
    cached plan (DCP's default planner would re-plan every save: minutes on the coordinator at
    a thousand ranks), and resuming into a model of other shapes fails naming the checkpoint and
    the item, before a byte is read."""
    from dcp_datastates import DataStatesSavePlanner

    gathered = []
    real = DataStatesSavePlanner.create_global_plan

    def spy(self, all_plans):
        gathered.append([p.usable for p in all_plans])
        return real(self, all_plans)

    monkeypatch.setattr(DataStatesSavePlanner, "create_global_plan", spy)
    model, optimizers, lrs, ts, manager = build(tt, tmp_path, keep_latest_k=0)
    snaps = {}
    train(model, optimizers, lrs, ts, manager, steps=6, snapshots=snaps)
    manager.maybe_wait_for_saving()
    manager.close()
    # Saves at steps 2, 4, 6: the first sends its plan (unless an earlier test of this process
    # saved the same state dict: the cache is process-wide), the next two their cached ones.
    assert len(gathered) == 3 and gathered[1:] == [[False], [False]], gathered
    model2, opt2, lrs2, ts2, manager2 = build(tt, tmp_path, seed=7, keep_latest_k=0)
    assert manager2.load() and ts2.step == 6
    assert_matches(snaps[6], model2, opt2)
    manager2.close()

    model3, opt3, lrs3, ts3, manager3 = build(tt, tmp_path, seed=5, hidden=48, keep_latest_k=0)
    before = snapshot(model3, opt3)
    with raises_through_dcp(r"checkpoint \S*step-6: item '0\.(weight|bias)' has shape \[64(, 32)?\] in the checkpoint, "
                            r"the state dict expects \[48(, 32)?\]"):
        manager3.load()
    assert_matches(before, model3, opt3)
    manager3.close()


def test_resumes_from_a_stock_torchtitan_checkpoint(tt, tmp_path):
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    lrs = LRSchedulersContainer(optimizers, lambda step: 1.0 / (1 + step))
    ts = TrainState()
    stock = CheckpointManager.Config(enable=True, folder="checkpoint", interval=3, keep_latest_k=0).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lrs,
        states={"train_state": ts}, sd_adapter=None, base_folder=str(tmp_path),
    )
    snaps = {}
    train(model, optimizers, lrs, ts, stock, steps=3, snapshots=snaps)
    stock.close()
    assert (tmp_path / "checkpoint" / "step-3" / ".metadata").read_bytes()[:1] != b"{"  # a pickle

    # By default a stock DCP checkpoint (its .metadata is a pickle) is refused, never unpickled.
    model2, opt2, lrs2, ts2, manager = build(tt, tmp_path, seed=7, keep_latest_k=0)
    with raises_through_dcp("is a stock DCP checkpoint .* nothing of it was unpickled"):
        manager.load()
    manager.close()
    # A user who trusts it opts in: TorchTitan's own loader reads it.
    model2, opt2, lrs2, ts2, manager = build(tt, tmp_path, seed=7, keep_latest_k=0, trust_checkpoints=True)
    assert manager.load() and ts2.step == 3
    assert_matches(snaps[3], model2, opt2)
    manager.close()


def test_config_options_validation_and_cli_override(tt, tmp_path):
    Config = tt.DataStatesCheckpointManager.Config
    c = Config(enable=True, host_cache_size="1GiB", flush_threads=3, copy_threads=1, pin_host_cache=False,
               verify_checksums=False, sync_files=False)
    ds = c.to_datastates_config()
    assert (ds.host_cache_size, ds.flush_threads, ds.copy_threads) == (1 << 30, 3, 1)
    assert (ds.pin_host_cache, ds.verify, ds.sync_files) == (False, False, False)
    assert Config(enable=True, host_cache_size="2").to_datastates_config().host_cache_size == 2 << 30  # bare = GB

    seeds = tmp_path / "ds.json"
    seeds.write_text('{"train_batch_size": 8, "datastates_ckpt": {"host_cache_size": 1, "thread_count": 5}}')
    ds = Config(enable=True, datastates_config=str(seeds), flush_threads=2).to_datastates_config()
    assert ds.host_cache_size == 1 << 30 and ds.flush_threads == 2  # explicit options win over the file

    with pytest.raises(ValueError, match="host_cache_size"):
        Config(enable=True, host_cache_size="lots")
    with pytest.raises(ValueError, match="flush_threads"):
        Config(enable=True, flush_threads=0)

    from torchtitan.components.checkpointer import CheckpointManager

    base = CheckpointManager.Config(enable=True, interval=250, keep_latest_k=3, async_mode="async")
    derived = Config.from_base(base, host_cache_size="4GB")
    assert (derived.interval, derived.keep_latest_k, derived.async_mode, derived.host_cache_size) == (250, 3, "async", "4GB")

    # Selecting the manager from a TorchTitan config and overriding it from the command line,
    # the way TorchTitan's ConfigManager parses `--checkpoint.*` (tyro).
    from dataclasses import dataclass, field

    import tyro  # a TorchTitan dependency: missing is a failure, as for TorchTitan itself
    from torchtitan.components.checkpointer import BaseCheckpointManager
    from torchtitan.config import Configurable
    from torchtitan.config.manager import ConfigManager, custom_registry

    class Job(Configurable):
        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)

    ConfigManager()  # registers TorchTitan's tyro rules
    default = Job.Config(checkpoint=Config(enable=True, async_mode="async", host_cache_size="8GB"))
    parsed = tyro.cli(
        Job.Config,
        args=["--checkpoint.host_cache_size", "2GB", "--checkpoint.flush_threads", "4", "--checkpoint.interval", "7"],
        default=default,
        registry=custom_registry,
    )
    assert type(parsed.checkpoint) is Config and parsed.checkpoint._owner is tt.DataStatesCheckpointManager
    assert (parsed.checkpoint.host_cache_size, parsed.checkpoint.flush_threads, parsed.checkpoint.interval) == ("2GB", 4, 7)


TRAIN_STATE = '''
class TS:
    step = 0
    def state_dict(self):
        return {"step": self.step}
    def load_state_dict(self, sd):
        self.step = sd["step"]
'''


TWO_RANKS = '''
import os, sys, torch, torch.distributed as dist
rank, root, store = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager


class Loader:  # like TorchTitan's ParallelAwareDataloader: one key per data-parallel rank
    def __init__(self):
        self.pos = 0
    def state_dict(self):
        return {f"dp_rank_{rank}": self.pos, "world_size": 2}
    def load_state_dict(self, sd):
        self.pos = sd[f"dp_rank_{rank}"]


''' + TRAIN_STATE + '''

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    fully_shard(model)  # FSDP2: parameters and optimizer state are DTensor shards
    opt = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    lrs = LRSchedulersContainer(opt, lambda s: 1.0)
    ts, dl = TS(), Loader()
    cfg = DataStatesCheckpointManager.Config(
        enable=True, interval=2, async_mode="async", keep_latest_k=2, host_cache_size="64MiB")
    mgr = cfg.build(dataloader=dl, model_parts=[model], optimizers=opt, lr_schedulers=lrs,
                    states={"train_state": ts}, sd_adapter=None, base_folder=root)
    return model, opt, lrs, ts, dl, mgr


model, opt, lrs, ts, dl, mgr = build(0)
g = torch.Generator().manual_seed(rank)
for step in range(1, 5):
    ts.step, dl.pos = step, step * 10 + rank
    model(torch.randn(8, 32, generator=g)).square().mean().backward()
    mgr.maybe_wait_for_staging()
    opt.step(); lrs.step(); opt.zero_grad()
    mgr.save(step)
    if step == 4:
        snap = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
mgr.maybe_wait_for_saving()
mgr.close()
model2, opt2, lrs2, ts2, dl2, mgr2 = build(1)
assert mgr2.load()
assert (ts2.step, dl2.pos) == (4, 40 + rank), (ts2.step, dl2.pos)
for k, v in model2.state_dict().items():
    assert torch.equal(v.full_tensor(), snap[k]), k
mgr2.close()
dist.destroy_process_group()
print("ok")
# Leave without interpreter finalization, as tests/dist_harness.py does (torch 2.13's gloo
# worker thread can abort a finalizing rank: "terminate called without an active exception").
from dcp_datastates import shutdown_engine
shutdown_engine()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''


def test_two_ranks_fsdp2_per_rank_dataloader_state(tt, tmp_path):
    """Two processes, FSDP2 shards, a dataloader state that differs per rank: save lazily,
    resume, and get every rank's own state back."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    root, store = str(tmp_path / "out"), str(tmp_path / "store")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), root, store], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results):
        # the last line: torch 2.10's gloo prints "[Gloo] Rank 0 is connected to ..." to stdout
        assert p.returncode == 0 and out.strip().splitlines()[-1:] == ["ok"], (out[-1000:], err[-3000:])
    assert sorted(os.listdir(os.path.join(root, "checkpoint"))) == ["step-2", "step-4"]
    files = sorted(os.listdir(os.path.join(root, "checkpoint", "step-4")))
    assert files == [".metadata", "__0_0.safetensors", "__1_0.safetensors"]


def test_the_manager_defaults_to_lazy_async_saves_and_says_when_it_is_synchronous(tt, tmp_path, caplog):
    import logging

    from torchtitan.components.checkpointer import AsyncMode

    assert tt.DataStatesCheckpointManager.Config(enable=True).async_mode == "async"
    with caplog.at_level(logging.INFO, logger="dcp_datastates"):
        *_, manager = build(tt, tmp_path / "a", async_mode=tt.DataStatesCheckpointManager.Config(enable=True).async_mode)
        assert manager.async_mode == AsyncMode.ASYNC
        manager.close()
        assert not any("synchronous" in r.getMessage() for r in caplog.records)
        *_, sync = build(tt, tmp_path / "s", async_mode="disabled")
        sync.close()
    lines = [r.getMessage() for r in caplog.records if "synchronous" in r.getMessage()]
    assert len(lines) == 1 and "async_mode=disabled: saves are synchronous" in lines[0]


def test_sizes_in_the_torchtitan_config_follow_the_one_rule(tt):
    Config = tt.DataStatesCheckpointManager.Config
    for written, nbytes in [("16", 16 << 30), ("0.5", 512 << 20), ("67108864", 64 << 20), ("512MiB", 512 << 20)]:
        assert Config(enable=True, host_cache_size=written).to_datastates_config().host_cache_size == nbytes


def test_dataloader_state_is_decoded_restricted_before_torchtitan_unpickles_it(tt):
    """TorchTitan's dataloader calls pickle.loads on its stored bytes: the manager's load checks
    them with the restricted unpickler first."""
    import os
    import pickle

    from dcp_datastates.errors import UnsafeCheckpointError

    class Loader:
        def __init__(self):
            self.loaded = None

        def state_dict(self):
            return {"dp_rank_0": b"", "world_size": 1}

        def load_state_dict(self, sd):
            self.loaded = {k: pickle.loads(v) if isinstance(v, bytes) else v for k, v in sd.items()}

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    inner = Loader()
    proxy = tt._RestrictedStateful(inner, "ckpt/step-1")
    proxy.load_state_dict({"dp_rank_0": pickle.dumps({"epoch": 2, "order": [3, 1]}), "world_size": 1})
    assert inner.loaded == {"dp_rank_0": {"epoch": 2, "order": [3, 1]}, "world_size": 1}
    inner.loaded = None
    with pytest.raises(UnsafeCheckpointError, match=r"item 'dataloader\.dp_rank_0'.*would import (posix|os)\.system"):
        proxy.load_state_dict({"dp_rank_0": pickle.dumps(Evil()), "world_size": 1})
    assert inner.loaded is None  # the dataloader never saw the bytes


PEER_RANKS = '''
import os, shutil, sys, torch, torch.distributed as dist
rank, root, store, phase = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ["DCPDS_NODE"] = f"node{rank // 2}"  # 4 ranks as 2 nodes, a local tier each
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=4)
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from dcp_datastates.integrations.torchtitan import DataStatesCheckpointManager


''' + TRAIN_STATE + '''

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    fully_shard(model)
    opt = default_adamw(lr=1e-2, implementation="for-loop").build(model_parts=[model])
    lrs = LRSchedulersContainer(opt, lambda s: 1.0)
    ts = TS()
    cfg = DataStatesCheckpointManager.Config(
        enable=True, interval=2, async_mode="async", keep_latest_k=2, host_cache_size="64MiB",
        local_tier=os.path.join(root, f"node{rank // 2}"), peer_copies=1)
    mgr = cfg.build(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=lrs,
                    states={"train_state": ts}, sd_adapter=None, base_folder=root)
    return model, opt, lrs, ts, mgr


if phase == "train":
    model, opt, lrs, ts, mgr = build(0)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 5):
        ts.step = step
        model(torch.randn(8, 32, generator=g)).square().mean().backward()
        mgr.maybe_wait_for_staging()
        opt.step(); lrs.step(); opt.zero_grad()
        mgr.save(step)
    mgr.maybe_wait_for_saving()
    snap = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    mgr.close()  # waits for the last checkpoint and for its peer copies
    if rank == 0:
        torch.save(snap, os.path.join(root, "snap.pt"))
else:
    model2, opt2, lrs2, ts2, mgr2 = build(1)
    assert mgr2.load()
    assert ts2.step == 4, ts2.step
    snap = torch.load(os.path.join(root, "snap.pt"))
    for k, v in model2.state_dict().items():
        assert torch.equal(v.full_tensor(), snap[k]), k
    mgr2.close()
dist.barrier()
dist.destroy_process_group()
print("ok")
# Leave without interpreter finalization, as tests/dist_harness.py does (torch 2.13's gloo
# worker thread can abort a finalizing rank: "terminate called without an active exception").
from dcp_datastates import shutdown_engine
shutdown_engine()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
'''


def _run_four(script, root, store, phase):
    procs = [subprocess.Popen([sys.executable, str(script), str(r), root, store, phase], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and out.strip().splitlines()[-1:] == ["ok"], (out[-1000:], err[-3000:])


def test_four_ranks_on_two_nodes_resume_after_losing_one_from_peer_copies(tt, tmp_path):
    """peer_copies through the manager: 4 processes as 2 nodes save with local tiers; node 1's
    tier is wiped; 4 fresh processes' ``load()`` agree on step 4 (prepare_restart), node 1's tier
    gets back from node 0's what it held (its ranks' files and its copies of node 0's), and the
    model is the one saved."""
    script = tmp_path / "peer_ranks.py"
    script.write_text(PEER_RANKS)
    root = str(tmp_path / "out")
    _run_four(script, root, str(tmp_path / "store1"), "train")
    node0 = os.path.join(root, "node0")
    step4 = next(n for n in os.listdir(node0) if n.startswith("step-4-"))
    kept = sorted(n for n in os.listdir(os.path.join(node0, step4)) if n.endswith(".safetensors"))
    assert [n[:4] for n in kept] == ["__0_", "__1_", "__2_", "__3_"], kept  # its own files and node 1's
    shutil.rmtree(os.path.join(root, "node1"))
    _run_four(script, root, str(tmp_path / "store2"), "resume")
    # As before the loss: node 1's own files, and the copies it keeps of node 0's.
    restored = os.path.join(root, "node1", step4)
    assert sorted(n[:4] for n in os.listdir(restored) if n.endswith(".safetensors")) == [n[:4] for n in kept], \
        os.listdir(restored)


# ------------------------------------------------------------ TorchTitan layouts and versions
CURRENT, LEGACY = "torchtitan.components.checkpointer", "torchtitan.components.checkpoint"
THIS_FILE = os.path.abspath(__file__)
MAIN_ENV = "DCPDS_TORCHTITAN_MAIN"
MAIN_PIN = os.path.join(os.path.dirname(THIS_FILE), "torchtitan_main_commit.txt")


def hide(*modules):
    """Code that makes ``import`` of each module fail, as if absent (a None entry in sys.modules)."""
    return "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)


def run_this_file(cwd, tests, *, prelude="", extra=(), env=None, timeout=600):
    """Some of this file's tests (all when ``tests`` is empty) in a fresh pytest process, after
    ``prelude`` ran in it (the layout to test must be in place before anything imports TorchTitan)."""
    code = prelude + "import sys, pytest\nsys.exit(pytest.main(sys.argv[1:]))\n"
    targets = [f"{THIS_FILE}::{t}" for t in tests] or [THIS_FILE]
    return subprocess.run([sys.executable, "-c", code, "-q", "-rs", "-p", "no:cacheprovider", *extra, *targets],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def summary(out):
    """pytest's last line, e.g. "3 passed, 7 warnings in 9.1s"."""
    lines = out.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def test_the_manager_works_where_only_the_new_module_path_exists(tmp_path):
    """TorchTitan main has only ``torchtitan.components.checkpointer`` (pytorch/torchtitan#4184).
    With the legacy path hidden, the integration resolves the new one, and saving, keep_latest_k,
    resuming, TorchTitan's own manager and the config/CLI tests pass (none skipped)."""
    require_torchtitan()
    prelude = hide(LEGACY) + (
        "from dcp_datastates.integrations import torchtitan as tt\n"
        "print('resolved:', getattr(tt, 'TORCHTITAN_CHECKPOINT_MODULE', None), tt.TORCHTITAN_AVAILABLE)\n"
    )
    tests = ["test_async_lazy_save_keep_latest_k_and_resume", "test_resumes_from_a_stock_torchtitan_checkpoint",
             "test_config_options_validation_and_cli_override"]
    out = run_this_file(tmp_path, tests, prelude=prelude)
    report = out.stdout[-4000:] + out.stderr[-3000:]
    assert f"resolved: {CURRENT} True" in out.stdout, report
    assert out.returncode == 0 and summary(out).startswith("3 passed") and "skipped" not in summary(out), report


def test_a_torchtitan_whose_manager_does_not_import_fails_the_tests_instead_of_skipping_them(tmp_path):
    """Installed but with neither module path importable: the TorchTitan tests error out, and
    the error names both paths tried and why each failed."""
    require_torchtitan()
    out = run_this_file(tmp_path, ["test_sizes_in_the_torchtitan_config_follow_the_one_rule"], prelude=hide(CURRENT, LEGACY))
    report = out.stdout[-4000:] + out.stderr[-3000:]
    assert out.returncode == 1 and summary(out).startswith("1 error") and "skipped" not in out.stdout, report
    assert "TorchTitan is installed but unusable here" in out.stdout, report
    assert f"tried {CURRENT} (ModuleNotFoundError" in out.stdout and f"; {LEGACY} (ModuleNotFoundError" in out.stdout, report


def test_falls_back_to_the_legacy_module_path(tmp_path):
    """A TorchTitan with only the legacy ``torchtitan.components.checkpoint`` (the layout before
    ``checkpointer`` existed): the manager comes from there, and the failed first try is kept."""
    require_torchtitan()
    code = (
        "import sys, types\n"
        f"import {CURRENT} as current\n"
        f"legacy = types.ModuleType({LEGACY!r})\n"
        "vars(legacy).update({n: getattr(current, n) for n in ('CheckpointManager', 'AsyncMode', 'DATALOADER', 'MODEL')})\n"
        f"sys.modules[{CURRENT!r}] = None\n"
        f"sys.modules[{LEGACY!r}] = legacy\n"
        "from dcp_datastates.integrations import torchtitan as tt\n"
        f"assert tt.TORCHTITAN_AVAILABLE and tt.TORCHTITAN_CHECKPOINT_MODULE == {LEGACY!r}, tt._TRIED\n"
        f"assert len(tt._TRIED) == 1 and tt._TRIED[0].startswith({CURRENT + ' (ModuleNotFoundError'!r}), tt._TRIED\n"
        "assert issubclass(tt.DataStatesCheckpointManager, current.CheckpointManager)\n"
        "assert tt.DataStatesCheckpointManager.Config(enable=True, host_cache_size='1GB').interval == 500\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.timeout(1500)
def test_torchtitan_main_at_the_pinned_commit(tmp_path):
    """Every other test of this file against TorchTitan main at the commit pinned in
    tests/torchtitan_main_commit.txt: the snapshot ``DCPDS_TORCHTITAN_MAIN`` names goes first on
    PYTHONPATH (TorchTitan is pure Python; the installed one, if any, is shadowed). Skipped,
    saying how to run it, when the variable is unset (CI cannot reach GitHub)."""
    with open(MAIN_PIN) as f:
        pin = f.read().split()[0]
    tree = os.environ.get(MAIN_ENV)
    if not tree:
        pytest.skip(f"{MAIN_ENV} is not set: run `eval \"$(scripts/torchtitan_main.sh)\"` to extract TorchTitan main "
                    f"at {pin[:12]} (tests/torchtitan_main_commit.txt) and set it")
    tree = os.path.realpath(tree)
    assert os.path.isfile(os.path.join(tree, "torchtitan", "__init__.py")), f"{MAIN_ENV}={tree} holds no torchtitan package"
    stamp = os.path.join(tree, "TORCHTITAN_COMMIT")
    found = open(stamp).read().strip() if os.path.isfile(stamp) else "(no TORCHTITAN_COMMIT file)"
    assert found == pin, (f"{MAIN_ENV}={tree} is TorchTitan {found}, the pin is {pin}: extract the pinned commit "
                          "with scripts/torchtitan_main.sh, or move the pin in tests/torchtitan_main_commit.txt")
    env = {k: v for k, v in os.environ.items() if k != MAIN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])])
    probe = subprocess.run(
        [sys.executable, "-c", f"import importlib.util as u, torchtitan; print(torchtitan.__file__, u.find_spec({LEGACY!r}))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    # The snapshot is the TorchTitan imported, and it is main's layout (no legacy path).
    assert probe.stdout.split() == [os.path.join(tree, "torchtitan", "__init__.py"), "None"], probe.stdout + probe.stderr
    out = run_this_file(tmp_path, [], extra=["-k", "not test_torchtitan_main_at_the_pinned_commit"],
                        env=env, timeout=1400)
    report = out.stdout[-6000:] + out.stderr[-3000:]
    last = summary(out)
    assert out.returncode == 0 and " passed" in last and not any(w in last for w in ("failed", "error", "skipped")), report
