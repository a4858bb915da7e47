"""FSDP2 (fully_shard) training on CPU ranks, checkpointed with DataStates; used by the tests
and by examples (importable by spawned processes)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from dcp_datastates import DataStatesLoadPlanner, DataStatesReader, DataStatesSavePlanner, DataStatesWriter, protect_optimizer

GLOBAL_BATCH = 16
DIM = 32


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(DIM, DIM) for _ in range(3)])
        self.head = torch.nn.Linear(DIM, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def build(world: int):
    torch.manual_seed(0)
    model = TinyNet()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train_step(model, opt, step, rank, world) -> float:
    x, y = batch(step, rank, world)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def train_and_checkpoint(rank, world, ckpt_dir, ckpt_step, total_steps, losses_file):
    """Uninterrupted run: checkpoint (async, lazy) after ``ckpt_step`` steps, keep training."""
    model, opt = build(world)
    guard = protect_optimizer(opt)
    # DCP's background planning collectives must not share a group with training collectives.
    ckpt_group = dist.new_group(backend="gloo")
    losses, pending = [], None
    for step in range(total_steps):
        if step == ckpt_step:
            msd, osd = get_state_dict(model, opt)
            pending = dcp.async_save(
                {"model": msd, "optim": osd, "step": step},
                storage_writer=DataStatesWriter(ckpt_dir),
                planner=DataStatesSavePlanner(),
                process_group=ckpt_group,
            ).upload_completion
        losses.append(train_step(model, opt, step, rank, world))
    pending.result()
    guard.remove()
    if rank == 0:
        with open(losses_file, "w") as f:
            json.dump(losses, f)


def resume(rank, world, ckpt_dir, total_steps, losses_file):
    model, opt = build(world)
    train_step(model, opt, 0, rank, world)  # materialise optimizer state before loading into it
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": -1}
    dcp.load(state, storage_reader=DataStatesReader(ckpt_dir), planner=DataStatesLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = [train_step(model, opt, step, rank, world) for step in range(state["step"], total_steps)]
    if rank == 0:
        with open(losses_file, "w") as f:
            json.dump({"start": state["step"], "losses": losses}, f)
