"""Train a small transformer with FSDP2 (fully_shard), checkpointing lazily with DataStates.

Run with torchrun (gloo on CPU, NCCL on GPU):

    torchrun --standalone --nproc_per_node 2 examples/fsdp2_train.py --out ckpt_fsdp2 --steps 16 --ckpt-every 4

Options worth knowing:
  --resume          start from the newest complete checkpoint under --out (latest_checkpoint)
  --kill-at-step N  SIGKILL every rank at step N (a crash, with a checkpoint maybe in flight)
  --losses FILE     write the loss of every step (rank 0) as JSON

Each checkpoint is ``dcp.async_save(..., storage_writer=DataStatesWriter(...))`` on a dedicated
gloo group (DCP's background collectives must not share a group with training collectives);
``optimizer.step()`` waits for staging only if it is not finished (every torch.optim optimizer
does while a lazy save stages; ``protect_optimizer`` below only installs that wait early).
The stall printed per checkpoint is the time the training thread spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from dcp_datastates import (
    DataStatesLoadPlanner,
    DataStatesReader,
    DataStatesSavePlanner,
    DataStatesWriter,
    latest_checkpoint,
    protect_optimizer,
    wait_staged,
)

VOCAB, DIM, HEADS, LAYERS, SEQ, GLOBAL_BATCH = 256, 128, 4, 3, 32, 16


class TinyTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True) for _ in range(LAYERS)
        )
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        # Logits as (tokens, vocab) from a 2-D matmul: a fresh tensor, not a view (FSDP2 warns
        # about root outputs that are views: in-place ops on them would skip its hooks).
        return self.head(x.reshape(-1, DIM))


def batch(step: int, rank: int, world: int, device):
    """The same global batch for a step whatever the world size; each rank takes its slice."""
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    mine = tokens[rank * per : (rank + 1) * per].to(device)
    return mine[:, :-1], mine[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="ckpt_fsdp2")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--losses", default=None)
    args = p.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # leave the cores to the other ranks and the engine's threads
    ckpt_group = dist.new_group(backend="gloo")

    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = protect_optimizer(opt)

    start = 0
    if args.resume:
        path = latest_checkpoint(args.out)
        if path is None:
            raise SystemExit(f"--resume: no complete checkpoint under {args.out}")
        # Materialise optimizer state so there are tensors to load into, then load in place.
        for prm in model.parameters():
            prm.grad = torch.zeros_like(prm)
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, storage_reader=DataStatesReader(path), planner=DataStatesLoadPlanner(), process_group=ckpt_group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {path} at step {start}", flush=True)

    losses: dict[int, float] = {}
    pending = None
    for step in range(start, args.steps):
        if args.kill_at_step is not None and step == args.kill_at_step:
            if rank == 0:
                print(f"step {step}: SIGKILL (simulated crash)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        stall = None
        if step > start and step % args.ckpt_every == 0:
            t0 = time.perf_counter()
            if pending is not None:
                pending.result()  # at most one checkpoint in flight
            msd, osd = get_state_dict(model, opt)
            pending = dcp.async_save(
                {"model": msd, "optim": osd, "step": step},
                # the writer consolidates write results on the checkpoint's group too
                storage_writer=DataStatesWriter(os.path.join(args.out, f"step-{step}"), process_group=ckpt_group),
                planner=DataStatesSavePlanner(),
                process_group=ckpt_group,
            ).upload_completion
            stall = time.perf_counter() - t0
        x, y = batch(step, rank, world, device)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if stall is not None:
            t1 = time.perf_counter()
            wait_staged()  # what protect_optimizer does inside opt.step(); timed here to report it
            stall += time.perf_counter() - t1
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step] = float(total) / world
        if rank == 0:
            extra = f"  checkpoint step-{step}: training stalled {stall * 1e3:.1f} ms" if stall is not None else ""
            print(f"step {step:3d}  loss {losses[step]:.5f}{extra}", flush=True)
    if pending is not None:
        pending.result()
    guard.remove()
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
