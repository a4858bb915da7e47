"""End to end: a training loop with a checkpoint every step and every 10 steps, for every method
of the bench, against the same loop with no checkpoint (issue 26, item 4).

One step: a fixed amount of compute on the training thread (matrix multiplications, the same
count for every method, so a slowed-down core shows as a longer step), then the "optimizer step":
wait until the pending checkpoint allows it (``protect_optimizer`` / the method's own guard:
``_Pending.wait_staged`` of benchmarks/bench.py) and change every tensor of the state in place,
then, every ``--every`` steps, wait for the previous checkpoint to be durable (at most one in
flight, as each method's docs do) and request the next. The loop ends with the last checkpoint
durable; the overhead is the loop's wall time against the no-checkpoint loop. The last
checkpoint is then loaded and compared bitwise with the final state (it was requested after the
last update).

The loop itself is bench_loop.py's ``run_loop``; ``dcp-datastates bench --loop`` runs it with a
real model and optimizer (Linear layers + AdamW), durable and page-cache groups side by side.

    python benchmarks/end_to_end.py [--size 256MiB] [--tensors 1612] [--steps 20] [--every 1,10]
        [--step-ms 200] [--methods datastates,dcp-async-stager,...] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dcp_datastates.config import parse_size  # noqa: E402

import bench  # noqa: E402 - the bench's methods, state and compute

bench_loop = bench._load_sibling("bench_loop")  # the loop (bench.py's sibling, as bench --loop loads it)


def run_loop(method: bench.Method | None, state: dict, compute: bench.Compute, mm_per_step: int, steps: int,
             every: int, root: str) -> tuple[float, str | None]:
    """Seconds of the loop (last checkpoint durable included; deleting older checkpoints, which
    keeps the disk from filling, is not counted) and the last checkpoint's path."""
    tensors = [t for t in bench.flatten(state).values() if hasattr(t, "add_")]

    def train_step(step: int, before_update) -> None:
        for _ in range(mm_per_step):
            compute._mm()
        before_update()
        for t in tensors:  # the optimizer step: every tensor changes in place
            if t.is_floating_point():
                t.add_(1.0)
            else:
                t.add_(1)
        state["extra"]["step"] = step

    out = bench_loop.run_loop(method, train_step, lambda: state, steps, every, root)
    return out["seconds"], out["last"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256MiB")
    p.add_argument("--tensors", type=int, default=1612)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", default="1,10")
    p.add_argument("--step-ms", type=float, default=200.0, help="compute per step on an idle machine")
    p.add_argument("--methods", default=",".join(bench.METHODS))
    p.add_argument("--runs", type=int, default=3, help="loops per (method, every); medians are reported")
    p.add_argument("--dir", default="/tmp/dcpds-e2e")
    p.add_argument("--json", default=None)
    p.add_argument("--engine", default="", help="options of the datastates method, e.g. "
                   "copy_threads=1,flush_threads=1 or direct_writes=false (one set per process: the engine is "
                   "process-wide)")
    args = p.parse_args(argv)
    bench.ENGINE_OPTIONS.update(bench.parse_engine_options(args.engine))
    warnings.filterwarnings("ignore")
    size = parse_size(args.size, name="--size")
    everies = [int(x) for x in args.every.split(",")]
    if any(k < 1 or args.steps % k for k in everies):
        p.error(f"--steps ({args.steps}) must be a multiple of each --every ({args.every}): the last step saves")
    methods = [m for m in args.methods.split(",") if m]
    state, nbytes, ntensors = bench.build_state(bench.StateSpec(size=size, large=min(256, args.tensors // 2),
                                                                tiny=args.tensors - min(256, args.tensors // 2),
                                                                dtypes=["float32"], device="cpu"))
    compute = bench.Compute(50, "cpu")
    mm_per_step = max(1, int(compute.idle_rate * args.step_ms / 1e3))
    host_cache = bench.default_host_cache(size)
    report: dict = {"argv": sys.argv[1:] if argv is None else argv, "engine": dict(bench.ENGINE_OPTIONS),
                    "bytes": nbytes, "tensors": ntensors,
                    "steps": args.steps, "mm_per_step": mm_per_step, "machine": bench._machine_info([args.dir]),
                    "loops": {}}
    print(f"state {bench._human(nbytes)} in {ntensors} tensors; {args.steps} steps of {mm_per_step} matmuls "
          f"(~{args.step_ms:.0f} ms idle)", file=sys.stderr)

    def median_loop(method, every) -> tuple[float, list[float], str | None]:
        times, last = [], None
        for _ in range(args.runs):
            shutil.rmtree(args.dir, ignore_errors=True)
            os.makedirs(args.dir)
            seconds, last = run_loop(method, state, compute, mm_per_step, args.steps, every, args.dir)
            times.append(seconds)
        return statistics.median(times), times, last

    base, base_all, _ = median_loop(None, 1)
    report["loops"]["none"] = {"median_s": base, "all_s": base_all}
    print(f"no checkpoint: {base:.2f} s", file=sys.stderr)
    for name in methods:
        why = bench._peer_unavailable(name) if name in bench.PEERS else None
        if why:
            report["loops"][name] = {"unavailable": why}
            continue
        method = bench.make_method(name, host_cache)
        method.setup(state, args.dir)
        try:
            os.makedirs(args.dir, exist_ok=True)
            run_loop(method, state, compute, mm_per_step, 2, 1, args.dir)  # warm-up: first saves, plan caches
            for every in everies:
                med, all_s, last = median_loop(method, every)
                targets = bench.empty_like_state(state)
                method.load(targets, last)
                equal = bench.states_equal(state, targets, skip=())
                report["loops"][f"{name} every {every}"] = {"median_s": med, "all_s": all_s,
                                                           "overhead": med / base - 1, "last_checkpoint_equal": equal}
                print(f"{name}, every {every}: {med:.2f} s, overhead {100 * (med / base - 1):+.1f} %"
                      f"{'' if equal else '  LAST CHECKPOINT DIFFERS'}", file=sys.stderr)
        finally:
            method.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
