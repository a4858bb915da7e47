"""Train a Hugging Face transformers model under FSDP2, checkpoint lazily, crash, resume, and
export a folder that ``AutoModelForCausalLM.from_pretrained(folder)`` loads alone.

    python examples/hf_fsdp2_train.py [--nproc 2] [--steps 8] [--ckpt-every 2] [--kill-at-step 7]
                                      [--out ckpt_hf] [--export ckpt_hf/hf]

The model is a tiny Llama built from a ``LlamaConfig`` (nothing is downloaded). The script runs
itself with torchrun on CPU (gloo) three times, as examples/fsdp2_demo.py does:
  1. uninterrupted, for reference;
  2. checkpointing lazily every k steps (``dcp.async_save`` with ``DataStatesWriter``) and killed
     with SIGKILL mid-run, a checkpoint maybe still in flight;
  3. resumed from the newest complete checkpoint (``latest_checkpoint``) to the end, where it
     saves a last checkpoint.
Then it exports that last checkpoint with

    python -m dcp_datastates convert OUT/step-N EXPORT --to hf --prefix model. --hf-config OUT --force

(the run folder holds the ``config.json`` and ``generation_config.json`` that rank 0 wrote with
``save_pretrained``), and checks, bitwise: the resumed run's last checkpoint (model, optimizer
and step) equals the uninterrupted run's, its losses equal the reference's, and the weights of
``AutoModelForCausalLM.from_pretrained(EXPORT)`` equal the checkpoint's.

One rank of one run, as torchrun starts it (``--worker``; gloo on CPU, NCCL on GPUs):

    torchrun --standalone --nproc_per_node 2 examples/hf_fsdp2_train.py --worker --out ckpt_hf --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.abspath(__file__)
# A tiny Llama: 2 layers, hidden size 64, a 256-token vocabulary.
MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
SEQ, GLOBAL_BATCH = 32, 8


# ------------------------------------------------------------------------------ one training run
def batch(step: int, rank: int, world: int, device):
    """The same global batch for a step whatever the world size; each rank takes its slice."""
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)
    per = GLOBAL_BATCH // world
    return tokens[rank * per : (rank + 1) * per].to(device)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from dcp_datastates import DataStatesReader, DataStatesWriter, latest_checkpoint, protect_optimizer

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # leave the cores to the other ranks and the engine's threads
    # DCP's collectives run on a background thread: a group of their own (see fsdp2_train.py).
    ckpt_group = dist.new_group(backend="gloo")

    config = LlamaConfig(**MODEL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    if rank == 0:  # what from_pretrained needs besides the weights: written once, next to the checkpoints
        os.makedirs(args.out, exist_ok=True)
        model.config.architectures = [type(model).__name__]  # as model.save_pretrained records it
        model.config.save_pretrained(args.out)
        model.generation_config.save_pretrained(args.out)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    protect_optimizer(opt)  # opt.step() waits while a lazy save stages (installed early)

    def save(step: int):
        msd, osd = get_state_dict(model, opt)
        return dcp.async_save(
            {"model": msd, "optim": osd, "step": step},
            storage_writer=DataStatesWriter(os.path.join(args.out, f"step-{step}"), process_group=ckpt_group),
            process_group=ckpt_group,
        ).upload_completion

    start = 0
    if args.resume:
        path = latest_checkpoint(args.out)
        if path is None:
            raise SystemExit(f"--resume: no complete checkpoint under {args.out}")
        msd, osd = get_state_dict(model, opt)  # creates the optimizer state to load into
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, storage_reader=DataStatesReader(path), process_group=ckpt_group)
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
        if step > start and step % args.ckpt_every == 0:
            if pending is not None:
                pending.result()  # at most one checkpoint in flight
            pending = save(step)  # returns once the copies are enqueued; training goes on
        tokens = batch(step, rank, world, device)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step] = float(total) / world
        if rank == 0:
            print(f"step {step:3d}  loss {losses[step]:.6f}", flush=True)
    if pending is not None:
        pending.result()
    save(args.steps).result()  # the last state: what the export converts
    if rank == 0:
        print(f"saved {os.path.join(args.out, f'step-{args.steps}')}", flush=True)
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------- driver
def torchrun(nproc: int, *args: str, expect_ok: bool = True) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from torchrun_launch import torchrun as launch  # noqa: PLC0415 - the examples' shared launcher

    launch(nproc, HERE, "--worker", *args, expect_ok=expect_ok)


def bitwise_equal(a, b, path: str = "state") -> list[str]:
    """Where two nested states differ (tensors compared byte for byte); empty when equal."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.detach().contiguous().view(-1).view(torch.uint8),
                                b.detach().contiguous().view(-1).view(torch.uint8)))
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path} (keys {sorted(map(str, set(a) ^ set(b)))})"]
        return [d for k in a for d in bitwise_equal(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in bitwise_equal(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path} ({a!r} != {b!r})"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--kill-at-step", type=int, default=None, help="driver default: steps - 1")
    p.add_argument("--out", default="ckpt_hf", help="the run's folder: step-N checkpoints and config.json")
    p.add_argument("--export", default=None, help="the Hugging Face folder written (default OUT/hf)")
    p.add_argument("--worker", action="store_true", help="one rank of one run (as torchrun starts it)")
    p.add_argument("--resume", action="store_true", help="worker: start from the newest complete checkpoint")
    p.add_argument("--losses", default=None, help="worker: write each step's loss (rank 0) as JSON")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    import warnings

    import torch

    from dcp_datastates.convert import to_torch

    kill = args.steps - 1 if args.kill_at_step is None else args.kill_at_step
    if not args.ckpt_every < kill < args.steps:
        raise SystemExit("--kill-at-step must lie after the first checkpoint (--ckpt-every) and before --steps")
    export = args.export or os.path.join(args.out, "hf")
    shutil.rmtree(args.out, ignore_errors=True)
    work = tempfile.mkdtemp(prefix="hf-fsdp2-")
    common = ["--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every)]
    try:
        print("\n== 1. uninterrupted reference run ==", flush=True)
        reference = os.path.join(work, "reference")
        torchrun(args.nproc, *common, "--out", reference, "--losses", os.path.join(work, "ref.json"))
        print(f"\n== 2. run checkpointing every {args.ckpt_every} steps, killed at step {kill} ==", flush=True)
        torchrun(args.nproc, *common, "--out", args.out, "--kill-at-step", str(kill), expect_ok=False)
        print("\n== 3. resumed from the newest complete checkpoint ==", flush=True)
        torchrun(args.nproc, *common, "--out", args.out, "--resume", "--losses", os.path.join(work, "resumed.json"))

        last = os.path.join(args.out, f"step-{args.steps}")
        print("\n== 4. export to a Hugging Face folder ==", flush=True)
        cmd = [sys.executable, "-m", "dcp_datastates", "convert", last, export, "--to", "hf", "--prefix", "model.",
               "--hf-config", args.out, "--force", "--no-progress"]
        print("$ python " + " ".join(cmd[1:]), flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit("the export failed")

        print("\n== 5. checks ==", flush=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            states = {}
            for name, folder in (("reference", os.path.join(reference, f"step-{args.steps}")), ("resumed", last)):
                to_torch(folder, os.path.join(work, f"{name}.pt"))
                states[name] = torch.load(os.path.join(work, f"{name}.pt"), weights_only=True)
        with open(os.path.join(work, "ref.json")) as f:
            ref_losses = json.load(f)
        with open(os.path.join(work, "resumed.json")) as f:
            resumed_losses = json.load(f)
        diff = bitwise_equal(states["reference"], states["resumed"])
        same_losses = all(ref_losses[k] == v for k, v in resumed_losses.items()) and bool(resumed_losses)
        print(f"resumed losses equal the reference's ({len(resumed_losses)} steps): {same_losses}")
        print(f"resumed run's last checkpoint (model, optimizer, step) bitwise equal to the reference's: {not diff}"
              + (f" (differs: {', '.join(diff[:5])})" if diff else ""))

        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        loaded = AutoModelForCausalLM.from_pretrained(export)  # the folder alone: config.json + safetensors
        export_diff = bitwise_equal(states["resumed"]["model"], loaded.state_dict(), "weights")
        print(f"AutoModelForCausalLM.from_pretrained({export}) is a {type(loaded).__name__}, "
              f"weights bitwise equal to the checkpoint: {not export_diff}"
              + (f" (differs: {', '.join(export_diff[:5])})" if export_diff else ""))
        if diff or export_diff or not same_losses:
            raise SystemExit(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
