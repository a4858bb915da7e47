"""``dcp-datastates bench --loop``: checkpoints in a real training loop, ours and the peers side by
side (issue 51, item 3).

The loop: ``--layers`` x ``torch.nn.Linear(--width, --width)`` trained with ``torch.optim.AdamW``
on a small random batch (``--batch`` rows, the same every step): per step ``zero_grad``, forward,
MSE loss, backward, then the wait the pending checkpoint asks for before the tensors may change
(``wait_staged`` of bench.py's ``_Pending``: ours ``wait_staged()``, DCP's staging future,
torch_checkpointing's lock, torchsnapshot's guard), then a real ``opt.step()``. Every ``--every``
steps the previous checkpoint is waited for (at most one in flight per method) and the next one is
requested, of ``get_state_dict(model, opt)`` as users of DCP write it: the live parameters and the
AdamW moments and step counters (by default 16 x Linear(2048, 2048): 768 MiB). The loop ends with its last
checkpoint done; its wall time against the same loop with no checkpoint is the overhead (removing
checkpoints older than the last two, which keeps the disk from filling, is not counted). After each
loop, outside its time, its last checkpoint is loaded back and compared bitwise with the state it
was taken of (the last step saves, and nothing changes after it): any difference fails the run.

Two parity groups: ``durable``, every checkpoint fsync'ed before the next one starts (ours and DCP
fsync themselves; torch_checkpointing and torchsnapshot never do, so the bench fsyncs their files
once they report completion, counted: bench.py's ``_durable_after``); ``page-cache``, nobody fsyncs
(ours ``sync_files=False``, DCP ``FileSystemWriter(sync_files=False)``, the peers as they are).
Every method of every group checkpoints every 1 and every 4 steps (``--every``); the runs are
interleaved (round r runs the no-checkpoint loop, then every method, group and interval once, the
order rotated by one each round) and the medians of ``--runs`` rounds are reported. Methods:
``datastates``, ``dcp-async-stager`` (``dcp.async_save`` + ``DefaultStager``),
``torch-checkpointing`` and ``torchsnapshot`` (skipped, with the reason printed, when not
installed). Each method and group warms up first with a 2-step loop, not counted.

The sustained bound (durable group, ``--raw-checkpoints``): the same bytes written and fsynced
back to back, each checkpoint into new files, in our engine's pattern (one file per flush thread,
early writeback) and in DCP's (one thread, one file, fsync at the end: ``FileSystemWriter``'s
default); the faster is the bound. A durable loop can take no less than its steps without
checkpoints, nor less than its checkpoints written back to back at that bound: the larger of the
two is its bound, and the table gives each durable loop's time against it.

Pacing, so the training thread keeps its core. On CPU, training's intra-op threads and every
method's background work (our copy and flush workers, DCP's staging and writer threads,
torch_checkpointing's writer process, torchsnapshot's threads) share the cores, and a parallel
kernel runs at the pace of its slowest thread: one intra-op thread that loses its core to anything
runnable stalls the whole forward, backward or AdamW step. So the bench gives training
``--torch-threads`` intra-op threads, by default the usable CPUs minus one (at least 1): the
training thread keeps a core of its own and one core is left to the checkpoints' background work.
The same for every method and for the loop without checkpoints. Ours runs with its defaults on
that (one copy worker where the process may use at most 2 CPUs, two flush workers, normal
priority); ``--engine`` changes them (e.g. ``flush_threads=1``) and ``DCP_DATASTATES_WORKER_NICE``
lowers its workers' priority, for such comparisons. Measured before choosing, on a 2-core machine
shared with other work (docs/benchmarks.md, "Training loop", has the figures and commands): with
training on both cores, the loop without checkpoints was fastest when the machine was quiet but
several times slower whenever anything else ran, so overheads came out negative or swung by tens of
percent between rounds; with one intra-op thread the loop was steady and the checkpoints ran beside
it. On top of that, one flush worker instead of two, or nice +10 for ours, made no difference the
noise did not hide, and nice +10 added a wait for staging before steps (the copy worker yields to
every other process too), so ours keeps its defaults.

    python -m dcp_datastates bench --loop [--layers 16] [--width 2048] [--batch 32] [--steps 12] [--every 1,4]
        [--runs 3] [--groups durable,page-cache] [--methods datastates,dcp-async-stager,torch-checkpointing,torchsnapshot]
        [--dir /tmp/dcpds-bench-loop] [--json out.json]
    python -m dcp_datastates bench --loop --from-json out.json   # print a saved run's table again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from typing import Any, Callable

if "bench" not in sys.modules:  # bench.py registers itself as `bench` wherever it was loaded from
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402 - bench.py: the methods, fsync_tree / _durable_after, the comparisons

__all__ = ["main", "run_loop", "check_loaded", "Trainer"]

# The parity groups: name -> whether every checkpoint is fsync'ed (bench.Method.durable).
GROUPS = {"durable": True, "page-cache": False}
METHODS = ("datastates", "dcp-async-stager", "torch-checkpointing", "torchsnapshot")
_names = [0]  # checkpoint names are never reused in a process (a peer may refuse a name it wrote)


def _nothing() -> None:
    pass


# ----------------------------------------------------------------------------------- the loop
def run_loop(method: bench.Method | None, train_step: Callable[[int, Callable[[], None]], None], state_of: Callable[[], dict],
             steps: int, every: int, root: str) -> dict[str, Any]:
    """``steps`` calls of ``train_step(step, before_update)``, which must call ``before_update()``
    right before it changes the state's tensors (the wait for the pending checkpoint's staging);
    after every ``every``-th step, the previous checkpoint is waited for (at most one in flight)
    and ``method.save(state_of(), path)`` requested. Returns the loop's seconds (the last
    checkpoint done included; removing checkpoints older than the last two is not counted), the
    last checkpoint's path and the per-checkpoint times: the call, the waits before the step and at
    the next request, request -> done."""
    pending: bench._Pending | None = None
    last = previous = None
    housekeeping = 0.0
    calls: list[float] = []
    staged_waits: list[float] = []
    done_waits: list[float] = []
    done_s: list[float] = []

    def before_update() -> None:
        if pending is not None:
            t = time.perf_counter()
            pending.wait_staged()
            staged_waits.append(time.perf_counter() - t)

    def wait_done() -> None:
        t = time.perf_counter()
        pending.wait_durable()
        done_waits.append(time.perf_counter() - t)
        done_s.append(pending.durable_s)

    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        train_step(step, before_update)
        if method is not None and step % every == 0:
            if pending is not None:
                wait_done()
                if previous is not None:  # keep the last two (housekeeping: not counted)
                    t_rm = time.perf_counter()
                    shutil.rmtree(previous, ignore_errors=True)
                    housekeeping += time.perf_counter() - t_rm
                previous = last
            _names[0] += 1
            last = os.path.join(root, f"ckpt-{_names[0]:04d}")
            t = time.perf_counter()
            pending = method.save(state_of(), last)
            calls.append(time.perf_counter() - t)
    if pending is not None:
        wait_done()
    return {"seconds": time.perf_counter() - t0 - housekeeping, "last": last, "checkpoints": len(calls),
            "call_s": calls, "staged_wait_s": staged_waits, "done_wait_s": done_waits, "request_to_done_s": done_s}


class Trainer:
    """``layers`` x ``Linear(width, width)`` and AdamW, one fixed random batch; constructed with
    one step taken, so the optimizer's moments exist before the first checkpoint."""

    def __init__(self, layers: int, width: int, batch: int, seed: int = 0) -> None:
        import torch

        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(seed + 1)
        self.x = torch.randn(batch, width, generator=gen)
        self.y = torch.randn(batch, width, generator=gen)
        self.step(0, _nothing)

    def step(self, _step: int, before_update: Callable[[], None]) -> None:
        import torch

        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        before_update()  # the pending checkpoint may still read the parameters and moments
        self.opt.step()

    def state_dict(self) -> dict:
        """What users of DCP checkpoint: ``get_state_dict(model, optimizer)`` (live tensors)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}


def _tensors(state: dict) -> tuple[int, int]:
    """(bytes, count) of the tensors of ``state``."""
    ts = [v for v in bench.flatten(state).values() if hasattr(v, "element_size")]
    return sum(t.numel() * t.element_size() for t in ts), len(ts)


def check_loaded(saved: dict, loaded: dict, what: str) -> None:
    """Raise if ``loaded`` differs from ``saved`` in any byte of any tensor or in any other value
    (bench.states_equal, nothing skipped), naming the first keys that differ."""
    if bench.states_equal(saved, loaded, skip=()):
        return
    fs, fl = bench.flatten(saved), bench.flatten(loaded)
    keys = sorted(fs.keys() ^ fl.keys()) or [k for k in fs if not bench.states_equal({k: fs[k]}, {k: fl[k]}, skip=())]
    raise AssertionError(f"{what}: the checkpoint loaded back differs from the state it was taken of "
                         f"({len(keys)} keys, first {', '.join(keys[:5])})")


# ---------------------------------------------------------------------------------- measuring
def _label(name: str, group: str, every: int) -> str:
    return f"{name} {group} every {every}"


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """Every loop of the run; the report (also filled as it goes: a failure keeps what was measured)."""
    import torch

    report: dict[str, Any] = args.report
    trainer = Trainer(args.layers, args.width, args.batch, args.seed)
    state = trainer.state_dict()
    nbytes, ntensors = _tensors(state)
    host_cache = bench.default_host_cache(nbytes)
    report["config"].update({"state_bytes": nbytes, "tensors": ntensors, "host_cache_request": host_cache})
    log(f"{args.layers} x Linear({args.width}, {args.width}) + AdamW: {bench._human(nbytes)} in {ntensors} tensors; "
        f"{args.steps} steps of batch {args.batch}; torch threads {torch.get_num_threads()}")
    methods: dict[tuple[str, str], bench.Method] = {}
    try:
        for name in args.methods:
            why = bench._peer_unavailable(name) if name in bench.PEERS else None
            if why:
                report["skipped"][name] = why
                print(f"dcp-datastates bench --loop: {name} skipped: {why}", file=sys.stderr)
                continue
            for group in args.groups:
                root = os.path.join(args.dir, f"{name}-{group}")
                shutil.rmtree(root, ignore_errors=True)
                os.makedirs(root)
                method = methods[(name, group)] = bench.make_method(name, host_cache, durable=GROUPS[group])
                method.setup(state, root)
                log(f"warm-up: {name}, {group}")
                run_loop(method, trainer.step, trainer.state_dict, 2, 1, root)
                shutil.rmtree(root, ignore_errors=True)
        configs = [(name, group, every) for (name, group) in methods for every in args.every]
        targets = bench.empty_like_state(state)
        meter = bench._CpuMeter()
        report["loadavg_start"] = os.getloadavg()
        for r in range(args.runs):
            k = r % max(1, len(configs))
            for config in [None, *configs[k:], *configs[:k]]:
                if config is None:
                    out = run_loop(None, trainer.step, trainer.state_dict, args.steps, 1, args.dir)
                    report["baseline"]["runs"].append(out)
                    log(f"round {r + 1}: no checkpoint {out['seconds']:.2f} s")
                    continue
                name, group, every = config
                root = os.path.join(args.dir, f"{name}-{group}")
                os.makedirs(root, exist_ok=True)
                out = run_loop(methods[(name, group)], trainer.step, trainer.state_dict, args.steps, every, root)
                bench.scrub_state(targets)
                methods[(name, group)].load(targets, out["last"])
                check_loaded(trainer.state_dict(), targets, f"{_label(*config)}, round {r + 1}")
                out["last_checkpoint_equal"] = True
                shutil.rmtree(root, ignore_errors=True)
                report["results"].setdefault(name, {}).setdefault(group, {}).setdefault(str(every), {"runs": []})["runs"].append(out)
                log(f"round {r + 1}: {_label(*config)} {out['seconds']:.2f} s")
        report["other_processes_cores"] = meter.other_cores()
        report["loadavg_end"] = os.getloadavg()
        if "durable" in args.groups and args.raw_checkpoints > 0:
            report["sustained"] = measure_sustained(os.path.join(args.dir, "raw"), nbytes, args.raw_checkpoints)
            log(f"sustained bound: {report['sustained']['best_s']:.3f} s per checkpoint ({report['sustained']['best']})")
    finally:
        for (name, group), method in methods.items():
            with contextlib.suppress(Exception):
                method.close()
            shutil.rmtree(os.path.join(args.dir, f"{name}-{group}"), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(args.dir)  # only when empty: the folders of this run are gone
    summarize(report)
    return report


def measure_sustained(root: str, nbytes: int, count: int) -> dict:
    """The sustained bound of a durable checkpoint of ``nbytes``: ``count`` written and fsynced
    back to back, in our engine's pattern (one file per flush thread, early writeback), in DCP's
    (``FileSystemWriter``'s default: one thread, one file, fsync at the end), and past the page
    cache (one thread, one file, O_DIRECT: no kernel copy, no dirty pages to write back)."""
    from dcp_datastates import DataStatesConfig

    flush = int(bench.ENGINE_OPTIONS.get("flush_threads") or DataStatesConfig().flush_threads)
    try:
        return bench.raw_bound.measure_sustained(root, nbytes, count, {"ours": (flush, flush, True), "dcp": (1, 1, False),
                                                                          "direct": (1, 1, False, True)})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarize(report: dict) -> None:
    """Medians, overheads and per-checkpoint seconds from the runs; with the sustained bound, each
    durable loop against the fastest the loop could be: its steps without checkpoints, or its
    checkpoints written back to back, whichever takes longer (compute and writes overlapped)."""
    base = report["baseline"]
    base["runs_s"] = [x["seconds"] for x in base["runs"]]
    base["median_s"] = statistics.median(base["runs_s"])
    sustained = report.get("sustained")
    for groups in report["results"].values():
        for group, intervals in groups.items():
            for cell in intervals.values():
                runs = cell["runs"]
                cell["runs_s"] = [x["seconds"] for x in runs]
                cell["median_s"] = statistics.median(cell["runs_s"])
                cell["checkpoints"] = runs[0]["checkpoints"]
                cell["overhead"] = cell["median_s"] / base["median_s"] - 1
                cell["overhead_s_per_checkpoint"] = (cell["median_s"] - base["median_s"]) / cell["checkpoints"]
                for key in ("call_s", "staged_wait_s", "done_wait_s", "request_to_done_s"):
                    cell[f"median_{key}"] = bench._median([v for x in runs for v in x[key]])
                cell["last_checkpoint_equal"] = all(x.get("last_checkpoint_equal") for x in runs)
                cell["extra_s"] = _where_the_time_goes(runs, base["median_s"])
                if sustained and group == "durable":
                    cell["sustained_bound_s"] = max(base["median_s"], cell["checkpoints"] * sustained["best_s"])
                    cell["vs_sustained_bound"] = cell["median_s"] / cell["sustained_bound_s"]


def _where_the_time_goes(runs: list[dict], base_s: float) -> dict[str, float]:
    """The loop's time over the loop without checkpoints, split (medians over the runs): the
    calls, the waits before steps (staging), the waits for the previous checkpoint at each request
    and for the last one at the end, and what is left, the training's own steps slowed down by
    the checkpoints' background work (CPU, memory bandwidth, the kernel's writeback)."""
    parts: dict[str, list[float]] = {"calls": [], "waits_before_steps": [], "waits_for_done": [], "training_slowed": []}
    for run in runs:
        calls, staged, done = sum(run["call_s"]), sum(run["staged_wait_s"]), sum(run["done_wait_s"])
        for key, value in (("calls", calls), ("waits_before_steps", staged), ("waits_for_done", done),
                           ("training_slowed", run["seconds"] - base_s - calls - staged - done)):
            parts[key].append(value)
    return {key: statistics.median(values) for key, values in parts.items()}


def report_ckpts(report: dict, every: str) -> int:
    return report["config"]["steps"] // int(every)


def format_table(report: dict) -> str:
    c = report["config"]
    base = report["baseline"]
    lines = [
        f"training loop: {c['layers']} x Linear({c['width']}, {c['width']}) + AdamW, {bench._human(c['state_bytes'])} "
        f"checkpointed ({c['tensors']} tensors), {c['steps']} steps of batch {c['batch']}, torch threads {c['torch_threads']}; "
        f"medians of {c['runs']} interleaved runs",
        f"no checkpoint: {base['median_s']:.2f} s (runs {', '.join(f'{s:.2f}' for s in base['runs_s'])})",
    ]
    everies = [str(e) for e in c["every"]]
    block = 26  # one interval's columns: overhead, s/ckpt, done s
    head1 = f"{'':<20} {'':<10}" + "".join(f" | {f'every {e}: {report_ckpts(report, e)} checkpoint(s)':<{block}}" for e in everies)
    head2 = f"{'method':<20} {'group':<10}" + "".join(f" | {'overhead':>9} {'s/ckpt':>7} {'done s':>7} " for _ in everies)
    lines += [head1, head2, "-" * len(head2)]
    for name, groups in report["results"].items():
        for group, intervals in groups.items():
            row = f"{name:<20} {group:<10}"
            for e in everies:
                cell = intervals.get(e)
                row += (f" | {cell['overhead'] * 100:>+8.1f}% {cell['overhead_s_per_checkpoint']:>7.3f} "
                        f"{cell['median_request_to_done_s']:>7.3f} " if cell else f" | {'-':>9} {'-':>7} {'-':>7} ")
            lines.append(row)
    for name, why in report.get("skipped", {}).items():
        lines.append(f"{name:<20} skipped: {why}")
    lines.append("where the extra seconds go (medians): calls + waits before steps + waits for done (the last one's "
                 "included) + training slowed")
    for name, groups in report["results"].items():
        for group, intervals in groups.items():
            for e in everies:
                x = intervals.get(e, {}).get("extra_s")
                if x:
                    lines.append(f"  {name}, {group}, every {e}: {x['calls']:.2f} + {x['waits_before_steps']:.2f} + "
                                 f"{x['waits_for_done']:.2f} + {x['training_slowed']:.2f} s")
    sustained = report.get("sustained")
    if sustained:
        pats = ", ".join(f"{k} ({v['config']}) {v['median_s']:.3f} s" for k, v in sustained["patterns"].items())
        lines.append(f"sustained bound: {sustained['checkpoints']} checkpoints written and fsynced back to back: {pats}")
        for k, why in sustained.get("unsupported", {}).items():
            lines.append(f"  {k}: not measured here ({why})")
        for name, groups in report["results"].items():
            for e, cell in groups.get("durable", {}).items():
                if "vs_sustained_bound" in cell:
                    lines.append(f"  {name}, durable, every {e}: {cell['median_s']:.2f} s = {cell['vs_sustained_bound']:.2f}x "
                                 f"the bound ({cell['sustained_bound_s']:.2f} s: max(no checkpoint, checkpoints x best))")
    busy = report.get("other_processes_cores")
    if busy is not None:
        lines.append(f"other processes kept {busy:.2f} of {report['machine']['cpus']} cores busy during the run"
                     + ("  << shared machine: numbers are noisy" if busy > 0.2 else ""))
    lines.append("overhead = median loop time / median loop time without checkpoints - 1; s/ckpt = the difference of the "
                 "medians / checkpoints per loop; done s = median request -> done (durable: fsync'ed; page-cache: written "
                 "to the page cache); every last checkpoint loaded back and compared bitwise: equal")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dcp-datastates bench --loop",
        description="Checkpoint overhead in a real training loop (Linear layers + AdamW): DataStates, DCP async_save + "
        "DefaultStager, torch_checkpointing and torchsnapshot, durable and page-cache groups, side by side.",
    )
    p.add_argument("--layers", type=int, default=16, help="Linear layers (default 16)")
    p.add_argument("--width", type=int, default=2048, help="in and out features of each layer (default 2048: 768 MiB with AdamW)")
    p.add_argument("--batch", type=int, default=32, help="rows of the random batch (default 32)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per loop, a multiple of each --every (default 12)")
    p.add_argument("--every", default="1,4", help="checkpoint intervals in steps, comma-separated (default 1,4)")
    p.add_argument("--runs", type=int, default=3, help="interleaved rounds; medians are reported (default 3)")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"parity groups, a subset of {','.join(GROUPS)} (default both)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"a subset of {','.join(METHODS)} (default all)")
    p.add_argument("--dir", default="/tmp/dcpds-bench-loop", help="checkpoint folder (default /tmp/dcpds-bench-loop); the run removes what it wrote")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="training's intra-op threads (default: usable CPUs - 1, at least 1: one core for background work)")
    p.add_argument("--engine", default="", help="options of the datastates method's engine, e.g. flush_threads=1 (one set per process)")
    p.add_argument("--seed", type=int, default=0, help="model and batch seed (default 0)")
    p.add_argument("--raw-checkpoints", type=int, default=5,
                   help="with the durable group: checkpoints of the same bytes written and fsynced back to back, in our "
                        "pattern and DCP's, for the sustained bound (default 5; 0: skip)")
    p.add_argument("--json", default=None, help="write every number (per-run times, medians, machine, argv) to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--from-json", default=None, metavar="FILE", help="measure nothing: print the table of an earlier --json")
    return p


def _check(args: argparse.Namespace) -> None:
    args.every = [int(x) for x in args.every.split(",") if x.strip()]
    args.groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.every or any(k < 1 or args.steps % k for k in args.every):
        raise ValueError(f"--steps ({args.steps}) must be a multiple of each --every ({args.every}): the last step saves")
    for what, given, known in (("--groups", args.groups, tuple(GROUPS)), ("--methods", args.methods, METHODS)):
        unknown = [x for x in given if x not in known]
        if unknown or not given:
            raise ValueError(f"{what}: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    if min(args.layers, args.width, args.batch, args.steps, args.runs) < 1:
        raise ValueError("--layers, --width, --batch, --steps and --runs must be at least 1")
    if args.torch_threads is not None and args.torch_threads < 1:
        raise ValueError("--torch-threads must be at least 1")
    args.engine_options = bench.parse_engine_options(args.engine)


def main(argv: list[str] | None = None) -> int:
    """Run the loop benchmark; returns the exit status (0 ok, 1 failure, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.from_json:
        try:
            with open(args.from_json) as f:
                print(format_table(json.load(f)))
        except (OSError, ValueError, KeyError) as exc:
            print(f"dcp-datastates bench --loop: error: --from-json {args.from_json}: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        _check(args)
    except ValueError as exc:
        print(f"dcp-datastates bench --loop: error: {exc}", file=sys.stderr)
        return 2
    import torch

    from dcp_datastates.config import usable_cpus

    log = (lambda *_a: None) if args.quiet else (lambda msg: print(f"[bench --loop] {msg}", file=sys.stderr, flush=True))
    threads_before = torch.get_num_threads()
    threads = args.torch_threads or max(1, usable_cpus() - 1)
    args.report = report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": ["--loop", *argv],
        "machine": bench._machine_info([args.dir]),
        "config": {"layers": args.layers, "width": args.width, "batch": args.batch, "steps": args.steps,
                   "every": args.every, "runs": args.runs, "groups": args.groups, "methods": args.methods,
                   "torch_threads": threads, "engine": args.engine_options,
                   "worker_nice": os.environ.get("DCP_DATASTATES_WORKER_NICE", "0")},
        "groups_help": {"durable": "every checkpoint fsync'ed before the next one starts (the bench fsyncs for the peers, counted)",
                        "page-cache": "nobody fsyncs: ours sync_files=False, DCP FileSystemWriter(sync_files=False), the peers as they are"},
        "methods_help": {m: bench.METHOD_HELP[m] for m in args.methods},
        "skipped": {},
        "baseline": {"runs": []},
        "results": {},
    }
    engine_before = dict(bench.ENGINE_OPTIONS)
    status = 0
    try:
        torch.set_num_threads(threads)
        bench.ENGINE_OPTIONS.update(args.engine_options)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
            measure(args, log)
        print(format_table(report))
    except KeyboardInterrupt:
        report["error"] = "interrupted"
        print("dcp-datastates bench --loop: interrupted", file=sys.stderr)
        status = 130
    except Exception as exc:  # noqa: BLE001 - reported, and the JSON keeps what was measured
        report["error"] = f"{type(exc).__name__}: {exc}"
        print(f"dcp-datastates bench --loop: error: {report['error']}", file=sys.stderr)
        status = 1
    finally:
        torch.set_num_threads(threads_before)
        bench.ENGINE_OPTIONS.clear()
        bench.ENGINE_OPTIONS.update(engine_before)
    if args.json:
        bench._write_json(args.json, report)
        log(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
