"""Train with DeepSpeed (ZeRO) and a ``datastates_ckpt`` config section, checkpoint lazily, crash,
resume, and convert a checkpoint to DeepSpeed's own layout for ``zero_to_fp32``.

    python examples/deepspeed_train.py [--nproc 2] [--stage 1] [--steps 8] [--ckpt-every 2]
                                       [--kill-at-step 7] [--out ckpt_ds]

The DeepSpeed config is the one a DeepSpeed user writes, with the DataStates-LLM tutorial's
section (``"datastates_ckpt": {"host_cache_size": ..., "parser_threads": ..., "pin_host_cache":
...}``); the only change to the training script is
``dcp_datastates.integrations.deepspeed.initialize`` in place of ``deepspeed.initialize``. The
script runs itself with torchrun on CPU (gloo) three times:
  1. uninterrupted, for reference;
  2. ``engine.save_checkpoint(OUT, tag=f"global_step{N}")`` every k steps (it returns once the
     copies are requested), killed with SIGKILL mid-run, a checkpoint maybe still in flight;
  3. ``engine.load_checkpoint(OUT)``: the tag ``latest`` names, always a committed one, then on
     to the end.
It checks that the resumed run's losses equal the reference's exactly, then converts the last
checkpoint with

    python -m dcp_datastates convert OUT/global_stepN OUT/deepspeed/global_stepN --to deepspeed

and reads it with DeepSpeed's ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``).

One rank of one run, as torchrun starts it:

    torchrun --standalone --nproc_per_node 2 examples/deepspeed_train.py --worker --out ckpt_ds --steps 8
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


def ds_config(stage: int) -> dict:
    """A DeepSpeed config as a user writes it, plus the seed's ``datastates_ckpt`` section."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "datastates_ckpt": {"host_cache_size": "256MiB", "parser_threads": 1, "pin_host_cache": True},
    }


def worker(args) -> None:
    import deepspeed
    import torch

    from dcp_datastates.integrations import deepspeed as ds_datastates

    # On CPU DeepSpeed compiles a shared-memory all-reduce op with ninja at its first
    # init_distributed (a minute on 2 cores, once per machine); gloo works without it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    engine, _, _, _ = ds_datastates.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(args.stage))
    start = 0
    if args.resume:
        load_path, _ = engine.load_checkpoint(args.out)  # the tag `latest` names
        start = engine.global_steps
        if rank == 0:
            print(f"resumed from {load_path} at step {start}", flush=True)
    losses = []
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 64, generator=g)
        loss = ((engine(x) - x) ** 2).mean()
        engine.backward(loss)
        engine.step()  # waits only if the last checkpoint's copies are not done
        losses.append(loss.item())
        if (step + 1) % args.ckpt_every == 0 and args.ckpt_every > 0:
            engine.save_checkpoint(args.out, tag=f"global_step{step + 1}")  # returns at once
        if args.kill_at_step is not None and step + 1 == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: the checkpoint in flight is lost
    engine.destroy()  # waits for the checkpoint in flight: `latest` then names the last one
    if args.losses and rank == 0:
        with open(args.losses, "w") as f:
            json.dump({"start": start, "losses": losses}, f)


def torchrun(nproc: int, *args: str, expect_ok: bool = True) -> None:
    sys.path.insert(0, os.path.dirname(HERE))
    from torchrun_launch import torchrun as launch  # noqa: PLC0415 - the examples' shared launcher

    launch(nproc, HERE, "--worker", *args, expect_ok=expect_ok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stage", type=int, default=1, choices=(1, 2, 3), help="ZeRO stage")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--kill-at-step", type=int, default=None, help="driver default: steps - 1")
    p.add_argument("--out", default="ckpt_ds", help="DeepSpeed's save_dir: one folder per tag, and `latest`")
    p.add_argument("--worker", action="store_true", help="one rank of one run (as torchrun starts it)")
    p.add_argument("--resume", action="store_true", help="worker: load_checkpoint(OUT) first")
    p.add_argument("--losses", default=None, help="worker: write rank 0's losses as JSON")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    kill = args.steps - 1 if args.kill_at_step is None else args.kill_at_step
    if not args.ckpt_every < kill < args.steps:
        raise SystemExit("--kill-at-step must lie after the first checkpoint (--ckpt-every) and before --steps")
    shutil.rmtree(args.out, ignore_errors=True)
    work = tempfile.mkdtemp(prefix="deepspeed-")
    common = ["--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every), "--stage", str(args.stage)]
    try:
        print("\n== 1. uninterrupted reference run ==", flush=True)
        torchrun(args.nproc, *common, "--out", os.path.join(work, "reference"), "--losses", os.path.join(work, "ref.json"))
        print(f"\n== 2. checkpointing every {args.ckpt_every} steps, killed at step {kill} ==", flush=True)
        torchrun(args.nproc, *common, "--out", args.out, "--kill-at-step", str(kill), expect_ok=False)
        with open(os.path.join(args.out, "latest")) as f:
            print(f"after the kill, `latest` names {f.read()}", flush=True)
        print("\n== 3. resumed from `latest` ==", flush=True)
        torchrun(args.nproc, *common, "--out", args.out, "--resume", "--losses", os.path.join(work, "resumed.json"))

        with open(os.path.join(work, "ref.json")) as f:
            ref = json.load(f)["losses"]
        with open(os.path.join(work, "resumed.json")) as f:
            resumed = json.load(f)
        tail = ref[resumed["start"]:]
        if resumed["losses"] != tail or not tail:
            raise SystemExit(f"resumed losses differ from the uninterrupted run:\n  {tail}\n  {resumed['losses']}")
        print(f"the resumed run (from step {resumed['start']}) has the uninterrupted run's losses exactly: "
              f"{resumed['losses']}", flush=True)

        with open(os.path.join(args.out, "latest")) as f:
            tag = f.read()
        converted = os.path.join(args.out, "deepspeed")
        print("\n== 4. DeepSpeed's own layout, and zero_to_fp32 ==", flush=True)
        cmd = [sys.executable, "-m", "dcp_datastates", "convert", os.path.join(args.out, tag),
               os.path.join(converted, tag), "--to", "deepspeed", "--no-progress"]
        print("$ python " + " ".join(cmd[1:]), flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit("the conversion failed")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = get_fp32_state_dict_from_zero_checkpoint(converted, tag=tag)
        print(f"zero_to_fp32 of {tag}: {', '.join(f'{k} {tuple(v.shape)}' for k, v in fp32.items())}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
