"""DeepSpeed checkpoint engines side by side, at durability parity: DeepSpeed's default
``TorchCheckpointEngine``, its ``FastCheckpointEngine`` (``checkpoint.writer`` type python/fast)
and ``DecoupledCheckpointEngine`` (``decoupled: true``), and DataStates (``datastates_ckpt``
through ``dcp_datastates.integrations.deepspeed.initialize``).

    python benchmarks/bench_deepspeed.py [--nproc 2] [--stage 1] [--width 2048] [--layers 6]
        [--repeats 3] [--loop-steps 9] [--ckpt-every 3] [--engines torch,python,fast,decoupled,datastates]
        [--dir /tmp/bench_deepspeed] [--engine-timeout 300] [--json out.json]

Each engine runs in its own torchrun launch (CPU, gloo, ZeRO ``--stage``, fp32, an MLP of
``--layers`` square layers of ``--width``). Per engine, medians over ``--repeats``:

- ``save_call_s``: training-thread time of ``engine.save_checkpoint`` (what the loop pays at the
  call). DeepSpeed's engines do not fsync: for parity their files are fsynced in the engine's
  ``commit`` (synchronous engines: inside ``save_checkpoint``, before DeepSpeed writes ``latest``;
  decoupled: at the commit DeepSpeed runs before the next optimizer step). DataStates fsyncs
  its data files and ``.metadata`` itself (``sync_files``, the default).
- ``durable_s``: from the call to the checkpoint durable and named by ``latest`` (DataStates:
  ``wait()``; decoupled: its commit run at once).
- ``load_s``: ``engine.load_checkpoint`` of that tag (warm page cache: the files were just written).
- loop: ``--loop-steps`` training steps with a checkpoint every ``--ckpt-every`` steps, ended by
  waiting for the last checkpoint to be durable, against the same steps without checkpoints:
  ``loop_overhead_per_ckpt_s`` = (loop - baseline) / checkpoints.

An engine that cannot run here is recorded with its error (a launch that does not end within
``--engine-timeout`` seconds is killed and recorded as hung, with its last output; one that does
not exit 15 s after writing its result is killed, its result kept); a load that
fails is recorded as ``load_error`` and the rest still runs. Rank 0 prints one JSON document (and
writes it to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
ENGINES = ("torch", "python", "fast", "decoupled", "datastates")


def ds_config(engine: str, stage: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "checkpoint": {"tag_validation": "Ignore"},
    }
    # data_parallel is given: without it DeepSpeed 0.19.8's writer factory fails at initialize
    # (AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank').
    if engine in ("python", "fast"):
        config["checkpoint"]["writer"] = {"type": engine, "decoupled": False, "data_parallel": "replica"}
    elif engine == "decoupled":
        config["checkpoint"]["writer"] = {"type": "python", "decoupled": True, "data_parallel": "replica"}
    elif engine == "datastates":
        config["datastates_ckpt"] = {"host_cache_size": "1GiB", "parser_threads": 1, "pin_host_cache": True}
    return config


def fsync_at_commit(ckpt) -> None:
    """Durability parity for DeepSpeed's engines: every file this rank saved is fsynced (and the
    tag's folder) in the engine's commit, before DeepSpeed writes ``latest``."""
    from dcp_datastates.integrations.deepspeed.files import fsync_path

    written: list[str] = []
    save, commit = ckpt.save, ckpt.commit

    def save_and_record(state_dict, path):
        written.append(path)
        return save(state_dict, path)

    def commit_durably(info):
        done = commit(info)
        for path in written:
            if os.path.exists(path):
                fsync_path(path)
        if written:
            fsync_path(os.path.dirname(written[0]))
        written.clear()
        return done

    ckpt.save, ckpt.commit = save_and_record, commit_durably


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of a CPU comm op
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    from dcp_datastates.integrations import deepspeed as ds_datastates

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    out: dict = {"engine": args.engine}
    try:
        engine = ds_datastates.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(args.engine, args.stage))[0]
        out["checkpoint_engine"] = type(engine.checkpoint_engine).__name__
        if args.engine != "datastates":
            fsync_at_commit(engine.checkpoint_engine)
        ours = ds_datastates.datastates_engine(engine) if args.engine == "datastates" else None

        def step(i: int) -> None:
            g = torch.Generator().manual_seed(i * 7 + rank)
            x = torch.randn(8, args.width, generator=g)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()

        def make_durable() -> None:
            if ours is not None:
                ours.wait()
            elif engine.checkpoint_engine.is_decoupled():
                engine._commit_decoupled_checkpoint()  # what DeepSpeed runs before the next step
            dist.barrier()

        for i in range(2):
            step(i)
        calls, durable, loads = [], [], []
        for r in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(args.dir, tag=f"bench{r}")
            calls.append(time.perf_counter() - t0)
            make_durable()
            durable.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            try:
                engine.load_checkpoint(args.dir, tag=f"bench{r}")
            except Exception as exc:  # noqa: BLE001 - recorded; the saves and the loop still run
                out["load_error"] = f"{type(exc).__name__}: {exc}"[:300]
            else:
                loads.append(time.perf_counter() - t0)
            dist.barrier()
            step(10 + r)
        out.update(save_call_s=statistics.median(calls), durable_s=statistics.median(durable),
                   load_s=statistics.median(loads) if loads else None,
                   save_call_all=calls, durable_all=durable, load_all=loads)
        sizes = [os.path.getsize(os.path.join(args.dir, "bench0", f)) for f in os.listdir(os.path.join(args.dir, "bench0"))]
        out["checkpoint_bytes"] = sum(sizes)

        def loop(checkpoint: bool) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.loop_steps):
                step(100 + i)
                if checkpoint and (i + 1) % args.ckpt_every == 0:
                    engine.save_checkpoint(args.dir, tag=f"loop{i + 1}")
            if checkpoint:
                make_durable()
            dist.barrier()
            return time.perf_counter() - t0

        base, with_ckpt = [], []
        for _ in range(args.repeats):
            base.append(loop(False))
            with_ckpt.append(loop(True))
        n_ckpt = args.loop_steps // args.ckpt_every
        out.update(loop_baseline_s=statistics.median(base), loop_with_ckpt_s=statistics.median(with_ckpt),
                   loop_checkpoints=n_ckpt,
                   loop_overhead_per_ckpt_s=(statistics.median(with_ckpt) - statistics.median(base)) / n_ckpt)
        engine.destroy()
    except Exception as exc:  # noqa: BLE001 - an engine that cannot run here is a result too
        out["error"] = f"{type(exc).__name__}: {exc}"[:600]
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a failed engine may have broken the group
        pass


def _wait_launch(proc: subprocess.Popen, result: str, timeout: float, grace: float = 15.0) -> int | None:
    """The launch's exit code; None when it was killed: it ran past ``timeout``, or its result
    was written ``grace`` seconds ago and it has not exited (DecoupledCheckpointEngine's helper
    process can keep the ranks from exiting after a failure)."""
    t0 = time.monotonic()
    written = None
    while proc.poll() is None:
        now = time.monotonic()
        if written is None and os.path.exists(result):
            written = now
        if now - t0 > timeout or (written is not None and now - written > grace):
            os.killpg(proc.pid, signal.SIGKILL)  # its whole process group: torchrun, ranks, helpers
            proc.wait()
            return None
        time.sleep(0.2)
    return proc.returncode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stage", type=int, default=1, choices=(1, 2, 3))
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loop-steps", type=int, default=9)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "bench_deepspeed"),
                   help="DeepSpeed's save_dir (emptied before each engine, removed at the end)")
    p.add_argument("--json", default=None)
    p.add_argument("--engine-timeout", type=float, default=300.0, help="seconds one engine's launch may take")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--engine", default=None)
    p.add_argument("--result", default=None)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    results = []
    work = tempfile.mkdtemp(prefix="bench-ds-")
    try:
        for engine in engines:
            shutil.rmtree(args.dir, ignore_errors=True)
            os.makedirs(args.dir)
            result = os.path.join(work, f"{engine}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", HERE,
                   "--worker", "--engine", engine, "--result", result, "--dir", args.dir, "--stage", str(args.stage),
                   "--width", str(args.width), "--layers", str(args.layers), "--repeats", str(args.repeats),
                   "--loop-steps", str(args.loop_steps), "--ckpt-every", str(args.ckpt_every)]
            # What the deepspeed launcher sets besides torchrun's variables: DeepSpeed's checkpoint
            # writers read the node layout from them.
            env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_SIZE=str(args.nproc), CROSS_SIZE="1", CROSS_RANK="0")
            t0 = time.perf_counter()
            log = os.path.join(work, f"{engine}.log")
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                rc = _wait_launch(proc, result, args.engine_timeout)
            with open(log, errors="replace") as f:
                tail = " | ".join(ln.strip() for ln in f.read().splitlines()[-6:])[-600:]
            if os.path.exists(result):
                with open(result) as f:
                    results.append(json.load(f))
            elif rc is None:
                results.append({"engine": engine, "error": f"did not finish within {args.engine_timeout} s; last output: {tail}"})
            else:
                results.append({"engine": engine, "error": f"the launch failed (exit {rc}): {tail}"})
            results[-1]["launch_s"] = time.perf_counter() - t0
            print(json.dumps(results[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    import deepspeed
    import torch

    doc = {
        "command": "python benchmarks/bench_deepspeed.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "deepspeed": deepspeed.__version__},
        "params": {"nproc": args.nproc, "stage": args.stage, "width": args.width, "layers": args.layers,
                   "repeats": args.repeats, "loop_steps": args.loop_steps, "ckpt_every": args.ckpt_every},
        "results": results,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
