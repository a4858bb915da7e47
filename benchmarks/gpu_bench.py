"""Training-iteration cost of checkpointing every iteration on one GPU.

A stack of large Linear layers whose parameters plus Adam state are 8-16 GB (defaults: 16 x
8192 x 8192 fp32 = 1.07 B parameters, 12.9 GB checkpoint) trains with bf16 autocast and a batch
large enough for forward + backward to hide the device -> host copies. Each mode runs the same
loop, checkpointing after every iteration:

  none        no checkpointing (the baseline iteration time)
  datastates  dcp.async_save(..., storage_writer=DataStatesWriter) + protect_optimizer: copies run
              on the engine's stream during forward/backward; optimizer.step() waits for them on
              the GPU (device-side wait) when they are all queued, else on the host
  dcp-async   dcp.async_save(..., storage_writer=FileSystemWriter, async_stager=DefaultStager(
              StagingOptions(pinned, no shared memory, async staging, non-blocking copies))); the
              step waits for staging_completion
  dcp-save    dcp.save(..., storage_writer=FileSystemWriter)
  torch-checkpointing   torch_checkpointing.CheckpointManager with async save (staging thread +
              writer process); optimizer.step() runs under manager.lock(), its documented guard
  torchsnapshot         torchsnapshot.Snapshot.async_take(app_state={model, optim}): returns once
              the state is staged to host memory, writes in a background thread

Peers that are not installed (or fail on this torch) are reported as skipped with the reason.
The raw bound of the same bytes is measured in the same run: the plain D2H probe below plus one
pwrite + fsync of a host buffer of the checkpoint's size into --ckpt-dir (benchmarks/bench.py's
measure_raw).

At most one checkpoint is in flight: a save first waits for the previous one to be durable
(reported separately as upload wait: storage speed, not staging). Every iteration ends with a
torch.cuda.synchronize(), so each save starts with the GPU idle and iteration times are exact.

Also measured in the same run: plain D2H bandwidth (pinned tensor.copy_, i.e. cudaMemcpyAsync)
and the engine's D2H rate staging one checkpoint with the GPU otherwise idle; the engine's
device-side and host wait counts. Results go to --out as JSON.

    python benchmarks/gpu_bench.py --out gpu_bench.json            # on a GPU machine
    python benchmarks/gpu_bench.py --ckpt-dir /dev/shm/gpu_bench --no-sync --out b.json   # staging, not disk
    python benchmarks/gpu_bench.py --dry-run --out /tmp/dry.json   # tiny, on CPU (plumbing only)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dcp_datastates import DataStatesWriter, engine_stats, protect_optimizer, shutdown_engine, wait_staged  # noqa: E402
from dcp_datastates.compat import default_stager_reusable  # noqa: E402

MODES = ("none", "datastates", "dcp-async", "dcp-save", "torch-checkpointing", "torchsnapshot")
GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=8192, help="Linear layer width (default 8192)")
    p.add_argument("--layers", type=int, default=16, help="number of width x width layers (default 16)")
    p.add_argument("--batch", type=int, default=16384, help="rows per batch (default 16384)")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--no-autocast", action="store_true", help="compute in the parameter dtype")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per mode (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per mode (default 2)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--ckpt-dir", default=None, help="where checkpoints go (default: a temp dir; removed after)")
    p.add_argument("--host-cache", default="16GB", help="DataStates host cache size (default 16GB)")
    p.add_argument("--no-sync", action="store_true", help="do not fsync checkpoint files (all writers)")
    p.add_argument("--dcp-threads", type=int, default=2, help="FileSystemWriter thread_count (default 2, as the engine's flush threads)")
    p.add_argument("--bw-bytes", type=float, default=4.0, help="GB moved by the plain D2H bandwidth probe")
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--no-raw", action="store_true", help="skip the raw pwrite + fsync bound")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: checks the script, measures nothing")
    args = p.parse_args(argv)
    if args.dry_run:
        args.width, args.layers, args.batch, args.iters, args.warmup = 128, 2, 32, 2, 1
        args.host_cache, args.bw_bytes = "8MB", 0.001
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}")
    return args


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args, device):
    torch.manual_seed(0)
    dtype = torch.float32 if args.param_dtype == "fp32" else torch.bfloat16
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width, bias=False), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device=device, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5, foreach=True)
    return model, opt


def train_step(model, opt, x, autocast: bool) -> None:
    """Forward + backward (the phase the copies overlap), then the update."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()  # protect_optimizer's pre-hook waits here in the datastates mode
    opt.zero_grad(set_to_none=False)


def state_bytes(state) -> int:
    total = 0
    for v in state.values() if isinstance(state, dict) else state:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, (dict, list, tuple)):
            total += state_bytes(v)
    return total


def d2h_probe(device, nbytes: int) -> dict:
    """Plain pinned D2H rate: one large tensor.copy_(non_blocking) (cudaMemcpyAsync)."""
    if device.type != "cuda":
        return {"skipped": "no CUDA"}
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # warm-up
    sync(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return {"bytes": nbytes, "best_s": min(times), "gb_per_s": nbytes / min(times) / GB}


PEERS = ("torch-checkpointing", "torchsnapshot")


def peer_unavailable(mode: str) -> str | None:
    """None when the peer library imports, else the reason (reported, not raised)."""
    try:
        if mode == "torch-checkpointing":
            from torch_checkpointing import CheckpointManager  # noqa: F401
        elif mode == "torchsnapshot":
            from torchsnapshot import Snapshot  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not measurable here"
        return f"{mode} unavailable: {type(exc).__name__}: {exc}"
    return None


class _Peer:
    """A peer library's asynchronous save, driven the way its documentation says to."""

    def __init__(self, mode: str, model, opt, state) -> None:
        self.mode = mode
        if mode == "torch-checkpointing":
            from torch_checkpointing import CheckpointManager
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

            cfg = CheckpointManager.Config.with_async_save()
            cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
            self.manager = cfg.build()
            # Its item keys name files: letters, digits, '-' and '_' only.
            self.flat = {
                f"{top}__{k.replace('.', '_')}": v for top in ("model",) for k, v in state["model"].items()
            }
            for pid, st in state["optim"]["state"].items():
                for k, v in st.items():
                    self.flat[f"optim__{pid}__{k}"] = v
        else:
            self.app_state = {"model": model, "optim": opt}

    def save(self, path: str):
        if self.mode == "torch-checkpointing":
            return self.manager.save(path, self.flat)  # a Future
        from torchsnapshot import Snapshot

        pending = Snapshot.async_take(path=path, app_state=self.app_state)  # returns once staged

        class _Done:
            def result(self_inner):
                return pending.wait()

        return _Done()

    def step_guard(self):
        if self.mode == "torch-checkpointing":
            return self.manager.lock()
        import contextlib

        return contextlib.nullcontext()  # async_take staged before returning

    def close(self) -> None:
        if self.mode == "torch-checkpointing":
            self.manager.close()


def raw_bound(ckpt_root: str, nbytes: int) -> dict:
    """The fair raw bound of the checkpoint's bytes (raw_bound.py, as benchmarks/bench.py measures it;
    one round of each configuration: a GPU session's time is short)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import bench
    finally:
        sys.path.pop(0)
    r = bench.measure_raw(os.path.join(ckpt_root, "raw"), nbytes, 1, None)
    return {k: r[k] for k in ("bytes", "write_s", "write_gbps", "write_how", "read_warm_s", "read_warm_gbps", "read_warm_how")}


def run_mode(mode: str, args, device, ckpt_root: str) -> dict:
    model, opt = build(args, device)
    autocast = device.type == "cuda" and not args.no_autocast
    x = torch.randn(args.batch, args.width, device=device, dtype=next(model.parameters()).dtype)
    train_step(model, opt, x, autocast)  # creates the Adam state
    sync(device)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    ckpt_bytes = state_bytes(state)
    sync_files = not args.no_sync

    # protect_optimizer's wait runs first among the step pre-hooks: timed from the step() call to
    # the optimizer's own first pre-hook.
    marks: dict[str, float] = {}
    guard = protect_optimizer(opt) if mode == "datastates" else None
    timers = [opt.register_step_pre_hook(lambda *_: marks.__setitem__("after", time.perf_counter()))]
    stager = None
    if mode == "dcp-async":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"
        stager_options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
        )
        stager = DefaultStager(stager_options)
    peer = _Peer(mode, model, opt, state) if mode in PEERS else None
    writer_options = {"host_cache_size": args.host_cache, "sync_files": sync_files}
    result: dict = {"mode": mode, "checkpoint_bytes": ckpt_bytes}

    if mode == "datastates":
        # Staging rate with the GPU otherwise idle. The first save also creates the engine and
        # pins its host cache (once per process): reported apart.
        probes = []
        for k in range(2):
            path = os.path.join(ckpt_root, mode, f"probe-{k}")
            t0 = time.perf_counter()
            resp = dcp.async_save(state, storage_writer=DataStatesWriter(path, **writer_options))
            wait_staged(device_side=False)
            probes.append(time.perf_counter() - t0)
            resp.upload_completion.result()
            shutil.rmtree(path, ignore_errors=True)
        result["engine_idle_staging"] = {
            "first_s_with_engine_start": probes[0],
            "seconds": probes[1],
            "gb_per_s": ckpt_bytes / probes[1] / GB,
        }
        before = engine_stats()

    iters, stalls, upload_waits, saves, hooks, phases = [], [], [], [], [], []
    pending = None  # upload future of the checkpoint in flight
    previous_path = None
    for it in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        save_s = upload_wait_s = housekeeping_s = 0.0
        if mode != "none":
            path = os.path.join(ckpt_root, mode, f"it-{it}")
            if pending is not None:
                tw = time.perf_counter()
                pending.result()
                upload_wait_s = time.perf_counter() - tw
                pending = None
            if previous_path is not None:
                th = time.perf_counter()
                shutil.rmtree(previous_path, ignore_errors=True)  # keep the disk bounded
                housekeeping_s = time.perf_counter() - th  # the benchmark's own, not a checkpoint's
            ts = time.perf_counter()
            if mode == "datastates":
                pending = dcp.async_save(state, storage_writer=DataStatesWriter(path, **writer_options)).upload_completion
            elif mode == "dcp-async":
                if not default_stager_reusable():  # torch 2.11-2.12 close a DefaultStager after one stage
                    stager.close()
                    stager = DefaultStager(stager_options)
                resp = dcp.async_save(state, storage_writer=FileSystemWriter(path, sync_files=sync_files, thread_count=args.dcp_threads), async_stager=stager)
                pending = resp.upload_completion
                staging = resp.staging_completion
            elif peer is not None:
                pending = peer.save(path)
            else:
                dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=sync_files, thread_count=args.dcp_threads))
            save_s = time.perf_counter() - ts
            previous_path = path
        tc = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        tw = time.perf_counter()
        compute_launch_s = tw - tc  # forward/backward as the host sees it (GIL contention shows here)
        if mode == "dcp-async":
            staging.result()  # DCP's contract: live tensors may change only after staging
        step_wait_s = time.perf_counter() - tw
        marks["before"] = time.perf_counter()
        if peer is not None:
            with peer.step_guard():  # torch-checkpointing: waits here until its staging is done
                marks["before"] = time.perf_counter()
                step_wait_s = marks["before"] - tw
                opt.step()
        else:
            opt.step()  # datastates: the pre-hook's wait (device-side or host) happens in here
        hook_s = marks["after"] - marks["before"]
        opt.zero_grad(set_to_none=False)
        ty = time.perf_counter()
        sync(device)
        sync_s = time.perf_counter() - ty  # the rest of the GPU work (and any copy still queued)
        total = time.perf_counter() - t0 - housekeeping_s
        if it >= args.warmup:
            phases.append({"compute_launch_s": compute_launch_s, "sync_s": sync_s, "housekeeping_s": housekeeping_s})
            iters.append(total)
            upload_waits.append(upload_wait_s)
            saves.append(save_s)
            hooks.append(hook_s)
            stalls.append(save_s + step_wait_s + hook_s)
    if pending is not None:
        pending.result()
    if previous_path is not None:
        shutil.rmtree(previous_path, ignore_errors=True)
    if guard is not None:
        guard.remove()
    for t in timers:
        t.remove()
    if stager is not None:
        stager.close()
    if peer is not None:
        peer.close()

    result.update(
        iteration_s={"median": statistics.median(iters), "mean": statistics.fmean(iters), "all": iters},
        iteration_excl_upload_wait_s={"median": statistics.median(i - u for i, u in zip(iters, upload_waits))},
        protect_optimizer_wait_s={"median": statistics.median(hooks), "all": hooks},
        save_call_s={"median": statistics.median(saves)},
        training_thread_stall_s={"median": statistics.median(stalls), "all": stalls},
        upload_wait_s={"median": statistics.median(upload_waits), "all": upload_waits},
        # iteration_s excludes housekeeping (deleting the previous checkpoint); reported apart
        phases={k: {"median": statistics.median(p[k] for p in phases), "all": [p[k] for p in phases]} for k in phases[0]},
    )
    if mode == "datastates":
        after = engine_stats()
        timed = args.warmup + args.iters
        d2h = after.get("d2h_bytes", 0) - before.get("d2h_bytes", 0)
        result["engine"] = {
            "mode": "cuda" if after.get("cuda") else "cpu",
            "pinned": bool(after.get("pinned")),
            "device_waits": after.get("device_waits", 0) - before.get("device_waits", 0),
            "host_waits": after.get("host_waits", 0) - before.get("host_waits", 0),
            "d2h_bytes": d2h,
            "checkpoints": timed,
            "backpressure_waits": after.get("backpressure_waits", 0) - before.get("backpressure_waits", 0),
        }
        shutdown_engine()  # frees the pinned host cache before the next mode
    del model, opt, state, x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type != "cuda" and not args.dry_run:
        raise SystemExit("gpu_bench needs a CUDA device (use --dry-run to check the script on CPU)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    own_dir = args.ckpt_dir is None
    ckpt_root = tempfile.mkdtemp(prefix="gpu_bench_") if own_dir else args.ckpt_dir
    os.makedirs(ckpt_root, exist_ok=True)
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items()},
        "plain_d2h": d2h_probe(device, int(args.bw_bytes * GB)),
        "modes": {},
    }
    try:
        for mode in args.modes:
            print(f"== {mode}", flush=True)
            reason = peer_unavailable(mode) if mode in PEERS else None
            if reason is None:
                try:
                    r = run_mode(mode, args, device, ckpt_root)
                except Exception as exc:  # noqa: BLE001 - a peer failing on this torch is a result
                    if mode not in PEERS:
                        raise
                    reason = f"{mode} failed: {type(exc).__name__}: {exc}"
            if reason is not None:
                print(f"   skipped: {reason}", flush=True)
                report["modes"][mode] = {"skipped": reason}
                continue
            report["modes"][mode] = r
            print(
                f"   iteration {r['iteration_s']['median'] * 1e3:.1f} ms (median), training-thread stall "
                f"{r['training_thread_stall_s']['median'] * 1e3:.1f} ms, upload wait {r['upload_wait_s']['median'] * 1e3:.1f} ms",
                flush=True,
            )
            ph = r["phases"]
            print(
                "   phases (median ms): "
                + ", ".join(f"{k[:-2]} {v['median'] * 1e3:.1f}" for k, v in ph.items()),
                flush=True,
            )
            if "engine" in r:
                print(f"   engine: {r['engine']}, idle staging {r['engine_idle_staging']['gb_per_s']:.1f} GB/s", flush=True)
        ckpt_bytes = next((r["checkpoint_bytes"] for r in report["modes"].values() if "checkpoint_bytes" in r), 0)
        if ckpt_bytes and not args.no_raw:
            report["raw_write"] = raw_bound(ckpt_root, ckpt_bytes)
            print(f"== raw bound: write+fsync {report['raw_write']['write_s']:.2f} s ({report['raw_write']['write_gbps']:.2f} GB/s)", flush=True)
    finally:
        if own_dir:
            shutil.rmtree(ckpt_root, ignore_errors=True)
    base = report["modes"].get("none", {}).get("iteration_s", {}).get("median")
    if base:
        report["overhead_vs_none"] = {
            m: r["iteration_s"]["median"] / base - 1 for m, r in report["modes"].items() if "iteration_s" in r
        }
    if "datastates" in report["modes"] and isinstance(report["plain_d2h"].get("gb_per_s"), float):
        report["engine_vs_plain_d2h"] = report["modes"]["datastates"]["engine_idle_staging"]["gb_per_s"] / report["plain_d2h"]["gb_per_s"]
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"results: {args.out}")
    return report


if __name__ == "__main__":
    main()
