"""Functions run on each of 2 gloo ranks by tests/test_deepspeed.py (importable by forked ranks).

A tiny MLP trained by DeepSpeed (ZeRO 1, 2, 3; fp32 and bf16; with and without an LR scheduler)
checkpoints through ``dcp_datastates.integrations.deepspeed``. Each rank records what it checked
(losses of a run resumed from a checkpoint against the uninterrupted run, the request-time values
of every saved file against what was loaded back, what the folder held while a commit was held
back) in ``summary_<rank>.json``; the tests read those and the checkpoint folders.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import OrderedDict

import torch
import torch.distributed as dist

STEPS_BEFORE, STEPS_AFTER = 2, 3


def setup(rank: int):
    """DeepSpeed on this rank, on the gloo group the harness made."""
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed

    # DeepSpeed builds a shared-memory all-reduce op with ninja the first time a CPU process
    # initializes its communication (a C++ compile); gloo does every collective here without it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def ds_config(stage: int, bf16: bool, sched: bool, datastates: bool = True, **section) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if sched:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}}
    if datastates:  # the seed's keys, as the DataStates-LLM tutorial writes them
        config["datastates_ckpt"] = {"host_cache_size": "64MiB", "parser_threads": 1, "pin_host_cache": True, **section}
    return config


def make_engine(config: dict):
    from dcp_datastates.integrations import deepspeed as integration

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return integration.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def train(engine, steps, rank: int, bf16: bool) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
        out = engine(x.to(torch.bfloat16) if bf16 else x)
        loss = ((out.float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------------------ comparing states
def clone(value):
    """A deep copy of a state dict that keeps every container type (OrderedDict, tuple, Size)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        out = type(value)() if type(value) in (dict, OrderedDict) else {}
        for k, v in value.items():
            out[k] = clone(v)
        return out
    if type(value) is list:
        return [clone(v) for v in value]
    if type(value) is tuple:
        return tuple(clone(v) for v in value)
    return value


def differences(expected, actual, path: str = "", skip: tuple = ()) -> list[str]:
    """Where two states differ: container types, keys, tensors bitwise (dtype, shape, bytes),
    other values by equality or, for objects without __eq__, their attributes."""
    if type(expected) is not type(actual):
        return [f"{path}: {type(expected).__name__} != {type(actual).__name__}"]
    if isinstance(expected, torch.Tensor):
        a, b = expected.detach().contiguous(), actual.detach().contiguous()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
            return [f"{path}: tensors differ"]
        return []
    if isinstance(expected, dict):
        if list(expected) != list(actual):
            return [f"{path}: keys {list(expected)} != {list(actual)}"]
        return [d for k in expected if k not in skip for d in differences(expected[k], actual[k], f"{path}/{k}", skip)]
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            return [f"{path}: lengths differ"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{path}/{i}", skip)]
    if hasattr(expected, "__dict__") and type(expected).__eq__ is object.__eq__:
        return differences(vars(expected), vars(actual), path, skip)
    return [] if expected == actual else [f"{path}: {expected!r} != {actual!r}"]


def capture_requests(engine) -> dict:
    """Record a clone of every state DeepSpeed hands to the engine's ``save`` (the values at
    the request), by file name."""
    ckpt = engine.checkpoint_engine
    captured: dict = {}
    save = ckpt.save

    def save_and_capture(state_dict, path):
        captured[os.path.basename(path)] = clone(state_dict)
        return save(state_dict, path)

    ckpt.save = save_and_capture
    return captured


def staging_seen_by_steps(engine) -> list[int]:
    """Saves still staging, as seen by the inner torch optimizer's step (after DeepSpeed's
    commit and the library's own pre-hook ran): must be 0 at every step."""
    from dcp_datastates.runtime import inflight

    seen: list[int] = []
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    inner.register_step_pre_hook(lambda *_: seen.append(len(inflight.staging())))
    return seen


# ------------------------------------------------------------------------------ the matrix
CONFIGS = [(stage, bf16, sched) for stage in (1, 2, 3) for bf16 in (False, True) for sched in (True, False)]


def name_of(stage: int, bf16: bool, sched: bool) -> str:
    return f"zero{stage}-{'bf16' if bf16 else 'fp32'}-{'sched' if sched else 'nosched'}"


def resume_matrix(rank: int, world: int, root: str) -> None:
    """For every config: train, save lazily and step at once, train on (uninterrupted losses);
    then a new engine loads ``latest`` and trains the same steps (resumed losses). The request
    values of every file are compared with what the checkpoint holds."""
    setup(rank)
    from dcp_datastates.integrations import deepspeed as integration

    summary: dict = {}
    for stage, bf16, sched in CONFIGS:
        name = name_of(stage, bf16, sched)
        save_dir = os.path.join(root, name)
        config = ds_config(stage, bf16, sched)
        engine = make_engine(config)
        seen = staging_seen_by_steps(engine)
        captured = capture_requests(engine)
        before = train(engine, range(STEPS_BEFORE), rank, bf16)
        engine.save_checkpoint(save_dir, tag="t1")
        continued = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank, bf16)  # the step follows at once
        tag = integration.datastates_engine(engine).wait()
        dist.barrier()
        folder = os.path.join(save_dir, "t1")
        request_diffs = {}
        for file in sorted(captured):
            loaded = integration.load_file(folder, file)
            request_diffs[file] = differences(captured[file], loaded)
        # the live state moved on after the request (so a checkpoint of live values would differ)
        live_fp32 = [t.detach().clone() for t in _fp32_partitions(engine)]
        moved = any(not torch.equal(a, b) for a, b in zip(live_fp32, _captured_fp32(captured, rank, stage)))
        engine.destroy()

        resumed_engine = make_engine(config)
        load_path, _ = resumed_engine.load_checkpoint(save_dir)
        resumed = train(resumed_engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank, bf16)
        resumed_engine.destroy()
        summary[name] = {
            "tag": tag,
            "before": before,
            "continued": continued,
            "resumed": resumed,
            "load_path": os.path.relpath(os.path.dirname(load_path), root) if load_path else None,
            "request_diffs": request_diffs,
            "live_moved_after_request": moved,
            "staging_seen_by_steps": seen,
            "files": sorted(os.listdir(folder)),
        }
        dist.barrier()
    with open(os.path.join(root, f"summary_{rank}.json"), "w") as f:
        json.dump(summary, f, indent=1)


def _fp32_partitions(engine) -> list[torch.Tensor]:
    opt = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        if hasattr(opt, attr):
            return list(getattr(opt, attr))
    raise AssertionError(f"no fp32 partitions on {type(opt).__name__}")


def _captured_fp32(captured: dict, rank: int, stage: int) -> list[torch.Tensor]:
    file = next(f for f in captured if f.endswith("optim_states.pt"))
    sd = captured[file]["optimizer_state_dict"]
    return list(sd["fp32_flat_groups"] if stage == 3 else sd["single_partition_of_fp32_groups"])


# ------------------------------------------------------------------------------ DeepSpeed's own files
def against_deepspeed(rank: int, world: int, root: str) -> None:
    """The same training saved by DeepSpeed's default engine (``ref``) and by ours (``ours``):
    our converted files must equal DeepSpeed's, and ours must resume from DeepSpeed's files as from its own."""
    setup(rank)
    from dcp_datastates.integrations import deepspeed as integration

    summary: dict = {}
    for stage, bf16 in ((1, False), (3, True)):
        name = name_of(stage, bf16, True)
        for kind in ("ref", "ours"):
            engine = make_engine(ds_config(stage, bf16, True, datastates=kind == "ours"))
            train(engine, range(STEPS_BEFORE), rank, bf16)
            engine.save_checkpoint(os.path.join(root, kind, name), tag="t1")
            if kind == "ours":
                integration.datastates_engine(engine).wait()
            engine.destroy()
            dist.barrier()
        # a run switching engines: ours resumes from DeepSpeed's torch.save files
        engine = make_engine(ds_config(stage, bf16, True))
        engine.load_checkpoint(os.path.join(root, "ref", name))
        from_ref = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank, bf16)
        engine.destroy()
        engine = make_engine(ds_config(stage, bf16, True))
        engine.load_checkpoint(os.path.join(root, "ours", name))
        from_ours = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank, bf16)
        engine.destroy()
        summary[name] = {"from_ref": from_ref, "from_ours": from_ours}
        dist.barrier()
    with open(os.path.join(root, f"against_{rank}.json"), "w") as f:
        json.dump(summary, f, indent=1)


# ------------------------------------------------------------------------------ commit held back
def hold_commit(root: str, *, fail: bool = False) -> threading.Event:
    """Rank 0's DataStates commit (the coordinator's ``finish``) waits for the returned event
    (or raises when ``fail``); ``<root>/held`` appears when it starts waiting."""
    from dcp_datastates.writer import DataStatesWriter

    release = threading.Event()
    finish = DataStatesWriter.finish

    def held_finish(self, *args, **kwargs):
        with open(os.path.join(root, "held"), "w"):
            pass
        if fail:
            raise OSError(28, "No space left on device (injected by the test)")
        release.wait(120)
        return finish(self, *args, **kwargs)

    DataStatesWriter.finish = held_finish
    return release


def raised(fn, *args, **kwargs) -> str | None:
    """``"<ExceptionType>: <message>"`` of what ``fn(*args, **kwargs)`` raised, None if nothing."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return f"{type(exc).__name__}: {exc}"
    return None


def _wait_for(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


def latest_after_commit(rank: int, world: int, root: str) -> None:
    """``save_checkpoint`` returns and training steps on while the commit is held back;
    ``latest`` names the new tag only once it is committed. Then a save whose commit fails:
    ``latest`` stays, and the next ``save_checkpoint`` raises naming the failed tag."""
    setup(rank)
    from dcp_datastates.integrations import deepspeed as integration

    save_dir = os.path.join(root, "ckpt")
    engine = make_engine(ds_config(1, False, True))
    ckpt = integration.datastates_engine(engine)
    train(engine, range(2), rank, False)
    engine.save_checkpoint(save_dir, tag="first")
    ckpt.wait()
    dist.barrier()
    out: dict = {}
    release = hold_commit(root) if rank == 0 else None
    engine.save_checkpoint(save_dir, tag="second")
    _wait_for(os.path.join(root, "held"))
    out["steps_while_held"] = len(train(engine, range(2, 4), rank, False))  # the step waits for copies only
    out["latest_while_held"] = open(os.path.join(save_dir, "latest")).read()
    out["marker_while_held"] = os.path.exists(os.path.join(save_dir, "second", ".metadata"))
    dist.barrier()
    if release is not None:
        release.set()
    out["wait"] = ckpt.wait()
    dist.barrier()
    out["latest_after"] = open(os.path.join(save_dir, "latest")).read()
    out["marker_after"] = os.path.exists(os.path.join(save_dir, "second", ".metadata"))

    from dcp_datastates.writer import DataStatesWriter

    if rank == 0:
        os.unlink(os.path.join(root, "held"))
    dist.barrier()
    finish = DataStatesWriter.finish
    if rank == 0:
        hold_commit(root, fail=True)
    engine.save_checkpoint(save_dir, tag="third")
    train(engine, range(4, 5), rank, False)
    out["next_save_raised"] = raised(engine.save_checkpoint, save_dir, tag="fourth")
    DataStatesWriter.finish = finish
    dist.barrier()
    out["latest_after_failure"] = open(os.path.join(save_dir, "latest")).read()
    out["fourth_started"] = os.path.exists(os.path.join(save_dir, "fourth"))
    engine.save_checkpoint(save_dir, tag="fifth")  # saving works again
    out["fifth"] = ckpt.wait()
    dist.barrier()
    out["latest_end"] = open(os.path.join(save_dir, "latest")).read()
    engine.destroy()
    with open(os.path.join(root, f"held_{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)


# ------------------------------------------------------------------------------ SIGKILL mid-save
def killed_mid_save(rank: int, world: int, root: str) -> None:
    """Save tag ``good`` (committed), train on (losses recorded), then save ``killed`` and
    SIGKILL every rank while its commit is held back."""
    setup(rank)
    from dcp_datastates.integrations import deepspeed as integration

    save_dir = os.path.join(root, "ckpt")
    engine = make_engine(ds_config(2, False, True))
    train(engine, range(2), rank, False)
    engine.save_checkpoint(save_dir, tag="good")
    integration.datastates_engine(engine).wait()
    dist.barrier()
    after_good = train(engine, range(2, 4), rank, False)
    with open(os.path.join(root, f"after_good_{rank}.json"), "w") as f:
        json.dump(after_good, f)
    dist.barrier()
    if rank == 0:
        hold_commit(root)
    engine.save_checkpoint(save_dir, tag="killed")
    _wait_for(os.path.join(root, "held"))
    os.kill(os.getpid(), signal.SIGKILL)


def resume_after_kill(rank: int, world: int, root: str) -> None:
    """A new job: ``load_checkpoint`` resumes from ``latest`` (the committed tag) and trains the
    same losses as the killed job did; loading the killed tag by name says it is incomplete."""
    setup(rank)
    save_dir = os.path.join(root, "ckpt")
    engine = make_engine(ds_config(2, False, True))
    out: dict = {"latest": open(os.path.join(save_dir, "latest")).read()}
    load_path, _ = engine.load_checkpoint(save_dir)
    out["load_path"] = os.path.basename(os.path.dirname(load_path))
    out["losses"] = train(engine, range(2, 4), rank, False)
    engine.destroy()
    engine = make_engine(ds_config(2, False, True))
    out["killed_tag"] = raised(engine.load_checkpoint, save_dir, tag="killed")
    engine.destroy()
    with open(os.path.join(root, f"resumed_{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)
