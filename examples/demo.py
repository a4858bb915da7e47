"""Train a small model on CPU, checkpoint every step, and print how long training stalled.

Three ways of checkpointing the same training run, each from the same seed:
  datastates  dcp.async_save(..., storage_writer=DataStatesWriter(path)); the next optimizer.step()
              waits for the copies (every torch.optim optimizer does; protect_optimizer installs
              that wait early)
  dcp-async   dcp.async_save(..., storage_writer=FileSystemWriter(path)) (DCP's DefaultStager)
  dcp-save    dcp.save(..., storage_writer=FileSystemWriter(path))

The stall of a checkpoint is the time the training thread spent on it: waiting for the previous
checkpoint to finish uploading (at most one in flight), the save call itself, and the wait
before the next optimizer.step() (lazy staging). The last DataStates checkpoint is then loaded
with DataStatesReader into a fresh model and optimizer and compared bitwise.

    python examples/demo.py [--steps 6] [--width 1024] [--layers 8] [--out ckpt_demo]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_datastates import DataStatesReader, DataStatesWriter, protect_optimizer, wait_staged


def build(width: int, layers: int, seed: int = 0):
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def state_of(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def run(kind: str, args, out: str) -> tuple[list[float], list[float], dict]:
    model, opt = build(args.width, args.layers)
    guard = protect_optimizer(opt) if kind == "datastates" else None
    data = torch.Generator().manual_seed(1)
    stalls, step_times, pending, snapshot = [], [], None, {}
    for step in range(args.steps):
        t_step = time.perf_counter()
        x = torch.randn(args.batch, args.width, generator=data)
        y = torch.randn(args.batch, 16, generator=data)
        if step > 0:  # checkpoint the state produced by the previous step
            path = os.path.join(out, kind, f"step-{step}")
            t0 = time.perf_counter()
            if pending is not None:
                pending.result()  # at most one checkpoint in flight
            state = state_of(model, opt)
            if step == args.steps - 1 and kind == "datastates":
                snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if kind == "datastates":
                pending = dcp.async_save(state, storage_writer=DataStatesWriter(path)).upload_completion
            elif kind == "dcp-async":
                pending = dcp.async_save(state, storage_writer=FileSystemWriter(path))
            else:
                dcp.save(state, storage_writer=FileSystemWriter(path))
            stall = time.perf_counter() - t0
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step > 0:
            t1 = time.perf_counter()
            if kind == "datastates":
                wait_staged()  # what protect_optimizer's hook does inside opt.step()
            stall += time.perf_counter() - t1
            stalls.append(stall)
        opt.step()
        step_times.append(time.perf_counter() - t_step)
    if pending is not None:
        pending.result()
    if guard is not None:
        guard.remove()
    return stalls, step_times, snapshot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--out", default="ckpt_demo")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's start-up line, per-checkpoint lines
    # One process, no process group: DCP warns "torch.distributed is disabled ... single process"
    # on every save and load. Expected here (no collectives run); see docs/troubleshooting.md.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    shutil.rmtree(args.out, ignore_errors=True)

    model, opt = build(args.width, args.layers)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"model: {nparams / 1e6:.1f}M parameters; checkpoint (params + Adam state) ~{3 * nparams * 4 / 2**20:.0f} MiB")
    results = {}
    for kind in ("datastates", "dcp-async", "dcp-save"):
        results[kind] = run(kind, args, args.out)

    print("\nTraining stall per checkpoint (ms): time the training thread spent on checkpointing")
    print(f"{'ckpt':>5} {'datastates':>12} {'dcp-async':>12} {'dcp-save':>12}")
    for i in range(args.steps - 1):
        row = [results[k][0][i] * 1e3 for k in ("datastates", "dcp-async", "dcp-save")]
        print(f"{i + 1:>5} {row[0]:>12.1f} {row[1]:>12.1f} {row[2]:>12.1f}")
    med = {k: statistics.median(results[k][0]) * 1e3 for k in results}
    print(f"{'median':>5} {med['datastates']:>12.1f} {med['dcp-async']:>12.1f} {med['dcp-save']:>12.1f}")
    print(
        f"DataStates stalls {med['datastates'] / med['dcp-save']:.1%} of dcp.save and "
        f"{med['datastates'] / med['dcp-async']:.1%} of DCP async_save (DefaultStager)"
    )

    # Reload the last DataStates checkpoint into a fresh model and optimizer.
    last = os.path.join(args.out, "datastates", f"step-{args.steps - 1}")
    model2, opt2 = build(args.width, args.layers, seed=123)
    for p_ in model2.parameters():  # materialise Adam state so the optimizer has slots to fill
        p_.grad = torch.zeros_like(p_)
    opt2.step()
    state = state_of(model2, opt2)
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=DataStatesReader(last))
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    load_s = time.perf_counter() - t0
    snapshot = results["datastates"][2]
    same = all(torch.equal(snapshot[k], v) for k, v in model2.state_dict().items())
    print(f"\nreloaded {last} with DataStatesReader in {load_s * 1e3:.0f} ms: parameters bitwise equal: {same}")
    if not same:
        raise SystemExit("reloaded parameters differ from the saved ones")


if __name__ == "__main__":
    main()
